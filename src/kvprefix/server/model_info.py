"""What the server knows about the served model and cache: read once from the engine client."""

from __future__ import annotations

from dataclasses import dataclass

from kvprefix.engine.client import EngineClient


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_algo: str
    enable_prefix_caching: bool
    replica_id: str

    @classmethod
    def of(cls, engine: EngineClient, name: str, replica_id: str) -> ModelInfo:
        return cls(name=name, max_model_len=engine.max_sequence_tokens, vocab_size=engine.vocab_size,
                   block_size=engine.hasher.block_size, hash_algo=engine.hasher.algo,
                   enable_prefix_caching=engine.enable_prefix_caching, replica_id=replica_id)
