"""Which LoRA adapter a logged request names, and the block extra keys it is hashed with, for every reader of logs
(the planner and the doctor). The first ``model`` a log names is the base model (as is a request naming none); any
other names an adapter of it.
Without the adapter's files its content fingerprint (the engine's key) is unknown, so a log keys it by name: one
adapter's requests share blocks with each other, never with the base model or another adapter, as in the engine."""

from __future__ import annotations

from functools import lru_cache

from kvprefix.cache import BlockExtras, LoraKey


class AdapterNames:
    """Learns the base model from the first model it is asked about."""

    def __init__(self) -> None:
        self.base_model: str | None = None

    def adapter(self, model: str) -> str:
        """The adapter a request of ``model`` runs under; "" for the base model."""
        if self.base_model is None and model:
            self.base_model = model
        return "" if model in ("", self.base_model) else model


@lru_cache(maxsize=1024)
def adapter_extras(adapter: str) -> BlockExtras | None:
    """The extra keys of every block of ``adapter`` ("" = the base model: none)."""
    return BlockExtras(LoraKey(adapter, "")) if adapter else None
