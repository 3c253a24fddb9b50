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
