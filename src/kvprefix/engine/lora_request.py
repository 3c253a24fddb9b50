"""How a caller names a LoRA adapter (vLLM's ``LoRARequest``), and the error for one that is not loaded. Torch-free:
the server builds them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``: an adapter by name, loaded from ``lora_path``
    the first time the name is used."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


class LoraNotFoundError(ValueError):
    """A request names an adapter that is not loaded (never was, or was unloaded)."""


@dataclass(frozen=True)
class LoraInfo:
    """A loaded adapter as a server lists it: where it was loaded from and its content fingerprint (which, with the
    tenant and salt, names its cache namespace: ``cache.identity.namespace_salt``)."""

    name: str
    path: str
    fingerprint: str


@dataclass(frozen=True)
class LoraActivity:
    """vLLM's ``lora_requests_info``: the step limit, and the adapters of running and of waiting requests."""

    max_loras: int
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
