"""The opt-in per-request cache diagnosis (usage.cache_detail): each miss reason, on token-id prompts so that
block boundaries are exact (block size 16)."""

from __future__ import annotations

import random

import pytest
from support.servers import ADMIN, Server


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def _detail(server: Server, prompt: list[int], key: str = "none", max_tokens: int = 1, **extra) -> dict:
    r = server.client(key).completions.create(model="default-model-v1", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body={"cache_detail": True, **extra})
    (detail,) = r.usage.model_extra["cache_detail"]
    assert detail["cached_tokens"] == r.usage.prompt_tokens_details.cached_tokens
    assert detail["prompt_tokens"] == r.usage.prompt_tokens and detail["block_size"] == 16
    return detail


def test_shorter_than_one_block(server: Server) -> None:
    d = _detail(server, _ids(1, 10))
    assert d["reason"] == "prompt_shorter_than_block" and d["cached_tokens"] == 0
    assert d["message"] == "prompt shorter than one block"


def test_full_hit_then_divergence_at_the_exact_token(server: Server) -> None:
    base = _ids(2, 100)
    assert _detail(server, base)["reason"] == "not_cached"
    d = _detail(server, base)
    assert d["reason"] == "full_hit" and d["cached_tokens"] == 96  # 6 full blocks; the 7th is partial
    changed = base[:37] + [(base[37] + 1) % 700 or 5] + base[38:]
    d = _detail(server, changed)
    assert d["cached_tokens"] == 32 and d["first_uncached_token"] == 32
    assert d["reason"] == "diverged" and d["message"] == "diverged at token 37 from the nearest cached prefix"


def test_prefix_ended(server: Server) -> None:
    base = _ids(3, 48)
    _detail(server, base)  # caches 3 full blocks (48 tokens), nothing after them
    d = _detail(server, base + _ids(4, 40))
    assert d["cached_tokens"] == 48 and d["reason"] == "prefix_ended"
    assert "ends at token 48" in d["message"]


def test_different_salt_only_points_at_the_unsalted_namespace(server: Server) -> None:
    prompt = _ids(5, 64)
    _detail(server, prompt)
    d = _detail(server, prompt, cache_salt="team-a")
    assert d["cached_tokens"] == 0 and d["reason"] == "different_salt"
    # Cached under another salt it stays silent: another cache_salt may be someone else's secret.
    other = _ids(11, 64)
    _detail(server, other, cache_salt="team-b")
    d = _detail(server, other, cache_salt="team-c")
    assert d["cached_tokens"] == 0 and d["reason"] == "not_cached", d


@pytest.mark.slow  # fills a 256-block pool several times over: ~6 s
def test_evicted(tenant_server: Server) -> None:
    """The tenant server has 256 blocks: three 90-block prompts push the first prompt's blocks out (LRU)."""
    victim = _ids(6, 20 * 16 + 5)
    _detail(tenant_server, victim, key="key-bob")
    for seed in (7, 8, 9):
        _detail(tenant_server, _ids(seed, 90 * 16), key="key-bob")
    d = _detail(tenant_server, victim, key="key-bob")
    assert d["reason"] == "evicted" and d["cached_tokens"] == 0, d
    assert tenant_server.metrics(ADMIN)["kvprefix:prefix_cache_evictions_total"] > 0


def test_detail_rides_in_the_final_streamed_usage_chunk(server: Server) -> None:
    prompt = _ids(10, 70)
    _detail(server, prompt)
    chunks = list(server.client().chat.completions.create(
        model="default-model-v1", messages=[{"role": "user", "content": "detail in a stream"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"cache_detail": True}))
    usage = chunks[-1].usage
    (detail,) = usage.model_extra["cache_detail"]
    assert detail["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
