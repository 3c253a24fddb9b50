"""A minimal driver for the model over the paged KV cache: what the engine's runner does, without a scheduler
(both build their metadata with ``AttentionMetadata.for_chunks``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvprefix.model import AttentionMetadata, CausalLM, KVCache


@dataclass
class Chunk:
    """The next `num_new` tokens of `token_ids`, after `num_computed` already in the cache at `block_ids`."""

    token_ids: list[int]
    num_computed: int
    num_new: int
    block_ids: list[int]


def run_batch(model: CausalLM, kv_caches: KVCache, block_size: int, chunks: list[Chunk]) -> torch.Tensor:
    """One forward over the chunks flattened into a batch; float32 logits [len(chunks), vocab]."""
    meta, positions = AttentionMetadata.for_chunks(
        [(c.num_computed, c.num_new, c.block_ids) for c in chunks], block_size
    )
    input_ids = [c.token_ids[p] for c in chunks for p in range(c.num_computed, c.num_computed + c.num_new)]
    hidden = model(torch.tensor(input_ids), positions, meta, kv_caches)
    return model.compute_logits(hidden[meta.logits_indices])


def greedy_generate(
    model: CausalLM, kv_caches: KVCache, block_size: int, prompt: list[int], max_new_tokens: int, block_ids: list[int]
) -> list[int]:
    """Prefill the whole prompt, then decode one token at a time; `block_ids` must cover prompt + output."""
    tokens = list(prompt)
    logits = run_batch(model, kv_caches, block_size, [Chunk(tokens, 0, len(tokens), block_ids)])
    for _ in range(max_new_tokens):
        tokens.append(int(logits[0].argmax()))
        if len(tokens) == len(prompt) + max_new_tokens:
            break
        logits = run_batch(model, kv_caches, block_size, [Chunk(tokens, len(tokens) - 1, 1, block_ids)])
    return tokens[len(prompt) :]
