"""The seed's work-savings example, run through the real KV cache manager.

Eight requests share a 512-token prefix and have suffixes of [24, 40, 8, 32, 16, 48, 12, 20] tokens; with block
size 16 they prefill 4296 tokens without caching and 712 with it. Two variants show where the win goes: a prefix
that is not block-aligned (its partial last block is recomputed) and a prefix that differs in one early token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvprefix.cache import BlockHasher, CacheRequest, KVCacheManager

SEED_PREFIX_TOKENS = 512
SEED_SUFFIXES = (24, 40, 8, 32, 16, 48, 12, 20)
SEED_BLOCK_SIZE = 16


@dataclass
class PrefillCount:
    name: str
    prefill_tokens: int
    cached_tokens: int
    prompt_tokens: int


def run_sequential(prompts: list[list[int]], block_size: int, enable_prefix_caching: bool) -> PrefillCount:
    """Admits, computes and frees each prompt in turn, returning how many prompt tokens had to be prefilled."""
    hasher = BlockHasher(block_size)
    total_blocks = sum(len(p) // block_size + 1 for p in prompts)
    manager = KVCacheManager(total_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    prefill = cached = 0
    for i, prompt in enumerate(prompts):
        request = CacheRequest(f"req-{i}", prompt, hasher)
        hits, num_hit_tokens = manager.get_computed_blocks(request)
        to_compute = request.num_tokens - num_hit_tokens
        if manager.allocate_slots(request, to_compute, hits) is None:
            raise RuntimeError("pool too small for the example")
        request.num_computed_tokens = request.num_tokens
        manager.cache_blocks(request, request.num_tokens)
        manager.free(request)
        prefill += to_compute
        cached += num_hit_tokens
    label = "with prefix caching" if enable_prefix_caching else "without prefix caching"
    return PrefillCount(label, prefill, cached, sum(len(p) for p in prompts))


def seed_prompts(prefix_tokens: int = SEED_PREFIX_TOKENS, vary_token: int | None = None) -> list[list[int]]:
    """The example's prompts; ``vary_token`` gives the second request a different token at that position."""
    prefix = list(range(1000, 1000 + prefix_tokens))
    prompts = []
    next_id = 50_000
    for i, n in enumerate(SEED_SUFFIXES):
        p = list(prefix)
        if vary_token is not None and i == 1:
            p[vary_token] = 7
        prompts.append(p + list(range(next_id, next_id + n)))
        next_id += n
    return prompts


def seed_report() -> list[str]:
    bs = SEED_BLOCK_SIZE
    off = run_sequential(seed_prompts(), bs, enable_prefix_caching=False)
    on = run_sequential(seed_prompts(), bs, enable_prefix_caching=True)
    lines = [
        f"without prefix caching: {off.prefill_tokens} prefill tokens",
        f"with prefix caching:    {on.prefill_tokens} prefill tokens "
        f"({100 * (1 - on.prefill_tokens / off.prefill_tokens):.1f}% fewer)",
    ]
    unaligned = run_sequential(seed_prompts(prefix_tokens=500), bs, enable_prefix_caching=True)
    base = run_sequential(seed_prompts(prefix_tokens=500), bs, enable_prefix_caching=False)
    lines.append(
        f"prefix of 500 tokens (not block-aligned): {base.prefill_tokens} -> {unaligned.prefill_tokens} "
        f"(each hit reuses {500 // bs * bs} tokens; the partial block's {500 % bs} are recomputed)"
    )
    early = run_sequential(seed_prompts(vary_token=5), bs, enable_prefix_caching=True)
    lines.append(
        f"request 2's prefix differs at token 5: {on.prefill_tokens} -> {early.prefill_tokens} "
        "(nothing after a changed token can hit, so that request recomputes its whole prompt)"
    )
    return lines
