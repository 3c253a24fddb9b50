"""What the server knows about the served model and cache (read once from the engine client), and the limits it
serves it under."""

from __future__ import annotations

from dataclasses import dataclass

from kvprefix.engine.client import EngineClient
from kvprefix.engine.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_algo: str
    enable_prefix_caching: bool
    replica_id: str
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs: alternatives per token a request may ask for; -1: any
    tokens_as_ids: bool = False  # vLLM's --return-tokens-as-token-ids: logprob tokens as "token_id:N" by default

    @classmethod
    def of(cls, engine: EngineClient, name: str, replica_id: str, max_logprobs: int = MAX_LOGPROBS,
           tokens_as_ids: bool = False) -> ModelInfo:
        return cls(name=name, max_model_len=engine.max_sequence_tokens, vocab_size=engine.vocab_size,
                   block_size=engine.hasher.block_size, hash_algo=engine.hasher.algo,
                   enable_prefix_caching=engine.enable_prefix_caching, replica_id=replica_id,
                   max_logprobs=max_logprobs, tokens_as_ids=tokens_as_ids)
