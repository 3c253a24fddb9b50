"""What the engine tier tests read of an `LLM`: greedy tokens and cached tokens of a batch, and a cached block's KV."""

from __future__ import annotations

import torch

from kvprefix import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def run(llm, prompts) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy token ids (12) and its cached prompt tokens."""
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def block_kv(llm, block_hash) -> torch.Tensor:
    """The KV of the pool block cached under ``block_hash``, every layer's, stacked."""
    engine = llm.llm_engine
    block = engine.manager.pool.cached_blocks[block_hash]
    return torch.stack([layer.kv[block.block_id] for layer in engine.runner.kv_caches])
