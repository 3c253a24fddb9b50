"""The engine's LoRA adapters: vLLM's ``LoRARequest`` and the registry of adapters loaded by name.

An adapter is loaded once per content: two names for one adapter directory share one ``LoraAdapter`` (and so one
cache namespace, its fingerprint's). A request holds its adapter object, so unloading a name never disturbs the
requests already running with it; later requests for that name are refused.
"""

from __future__ import annotations

import os

from kvprefix.engine.lora_request import LoraInfo, LoraNotFoundError, LoRARequest
from kvprefix.model.llama import CausalLM
from kvprefix.model.lora import LoraAdapter, load_lora_adapter


class LoraAdapters:
    """Loaded adapters by name, at most ``max_loras`` of them running in one step (the scheduler's limit), each of
    rank at most ``max_lora_rank``."""

    def __init__(self, model: CausalLM, max_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_lora_rank}")
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str, inplace: bool = False) -> LoraAdapter:
        """Loads the adapter at ``path`` as ``name`` (ValueError for a bad adapter or a name already loaded, unless
        ``inplace``: vLLM's ``load_inplace`` replaces it; running requests keep the adapter they started with)."""
        if not name:
            raise ValueError("a LoRA adapter needs a non-empty name")
        if name in self._by_name and not inplace:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        real = os.path.realpath(os.path.expanduser(path))
        same = next((a for a in self._by_name.values() if a.path == real), None)
        adapter = load_lora_adapter(real, self.model, self.max_lora_rank)
        if same is not None and same.fingerprint == adapter.fingerprint:
            adapter = same  # one copy of the weights per content
        self._by_name[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        if self._by_name.pop(name, None) is None:
            raise LoraNotFoundError(f"The lora adapter '{name}' cannot be found.")

    def get(self, name: str) -> LoraAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise LoraNotFoundError(f"The model `{name}` does not exist.")
        return adapter

    def resolve(self, request: LoRARequest) -> LoraAdapter:
        """``LLM``'s way: the adapter of ``request.lora_name``, loaded from its path at first use."""
        if request.lora_name not in self._by_name:
            return self.load(request.lora_name, request.lora_path)
        return self._by_name[request.lora_name]

    def infos(self) -> dict[str, LoraInfo]:
        """Every loaded adapter by name."""
        return {name: LoraInfo(name, a.path, a.fingerprint) for name, a in self._by_name.items()}
