"""The models a server serves: its base model and the LoRA adapters loaded on it (``--enable-lora``). A request's
``"model"`` picks one (``ServedModels.resolve``); ``/v1/models`` lists them, each adapter with its ``parent``, as
vLLM does."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvprefix.engine import LoRARequest
from kvprefix.engine.client import EngineClient
from kvprefix.engine.lora_request import LoraInfo
from kvprefix.http.errors import APIError


@dataclass(frozen=True)
class Target:
    """What a request runs on: the base model (``lora`` None) or one loaded adapter, as it was when resolved."""

    name: str
    lora: LoraInfo | None = None

    @property
    def lora_fingerprint(self) -> str | None:
        """The adapter's part of the cache namespace (``cache.identity.namespace_salt``); None for the base."""
        return None if self.lora is None else self.lora.fingerprint

    def lora_request(self) -> LoRARequest | None:
        """The engine's form: the adapter by name (already loaded, so no path)."""
        return None if self.lora is None else LoRARequest(self.lora.name, 0)


class ServedModels:
    """The base model under ``name`` and the engine's adapters (read live: they load and unload at run time)."""

    def __init__(self, engine: EngineClient, name: str, max_model_len: int):
        self.engine = engine
        self.name = name
        # Tenants see the identity without the checkpoint's path on this machine (the admin-only event hello has it).
        identity = {**engine.identity.to_dict(), "checkpoint": ""}
        self._created = int(time.time())
        self._base_card = {"id": name, "object": "model", "created": self._created, "owned_by": "kvprefix",
                           "root": name, "parent": None, "max_model_len": max_model_len,
                           "kvprefix": {"block_identity": identity}}

    def resolve(self, model: str | None) -> Target:
        """The target of a request's ``model`` (None: the base); 404 ``model_not_found`` for any other name."""
        if model is None or model == self.name:
            return Target(self.name)
        lora = self.engine.lora_adapters.get(model)
        if lora is None:
            served = ", ".join(f"'{n}'" for n in [self.name, *self.engine.lora_adapters])
            raise APIError(404, f"the model '{model}' does not exist; this server serves {served}", param="model",
                           code="model_not_found")
        return Target(model, lora)

    def cards(self) -> list[dict]:
        """vLLM's model list: the base, then each adapter with its ``parent`` (the base) and, in ``kvprefix``, its
        content fingerprint (what a router needs to hash its namespace). The adapter's path is not shown."""
        return [self._base_card, *(self._lora_card(lora) for lora in self.engine.lora_adapters.values())]

    def card(self, model_id: str) -> dict:
        target = self.resolve(model_id)
        return self._base_card if target.lora is None else self._lora_card(target.lora)

    def _lora_card(self, lora: LoraInfo) -> dict:
        return {"id": lora.name, "object": "model", "created": self._created, "owned_by": "kvprefix",
                "root": lora.name, "parent": self.name, "max_model_len": self._base_card["max_model_len"],
                "kvprefix": {"lora_fingerprint": lora.fingerprint}}
