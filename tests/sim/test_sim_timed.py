"""Timed replay: requests hold blocks while they run, prefill is serial per replica, and the pool's limits show
up as waiting and rejections."""

import pytest

from kvprefix.sim.trace import Trace, TraceRequest

BS = 16


def trace_of(*requests: tuple[float, int, int, list]) -> Trace:
    """(timestamp s, prompt tokens, output tokens, full-block ids) per request."""
    return Trace("t", BS, [TraceRequest(t, n, out, ids, -(-n // BS)) for t, n, out, ids in requests])


def test_a_request_hits_only_after_the_shared_prefix_is_prefilled(run):
    prefix = list(range(8))  # 128 tokens
    # Same prefix at t=0 and t=0 (queued behind the first's prefill: hits) and on another replica (misses).
    t = trace_of((0.0, 144, 4, prefix + [100]), (0.0, 144, 4, prefix + [101]))
    s = run(t, mode="timed", prefill_tps=1000.0)
    assert s.cached_blocks == 8 and s.waited == 1 and s.max_wait_s == pytest.approx(0.144)
    two = run(t, mode="timed", replicas=2, routing="round-robin")
    assert two.cached_blocks == 0 and two.per_replica[0].load_share == 0.5


def test_running_requests_keep_their_blocks(run):
    # 9 blocks of prompt + 1 of output each, pool of 12: the second must wait for the first to finish decoding.
    t = trace_of((0.0, 144, 16, list(range(9))), (0.0, 144, 16, list(range(50, 59))))
    s = run(t, mode="timed", capacity_blocks=12, prefill_tps=1000.0, decode_tps=16.0)
    assert s.admitted == 2 and s.waited == 1
    assert s.max_wait_s == pytest.approx(0.144 + 1.0)  # prefill, then 16 tokens at 16 tokens/s
    assert run(t, mode="order", capacity_blocks=12).waited == 0


def test_a_request_larger_than_the_pool_is_rejected_and_reported(run):
    t = trace_of((0.0, 160, 0, list(range(10))), (1.0, 32, 0, [1, 2]))
    s = run(t, mode="timed", capacity_blocks=4)
    assert (s.admitted, s.rejected) == (1, 1)
    assert s.prefill_tokens_without_cache == 32  # hit rates cover admitted requests only


def test_shared_pool_prefills_as_fast_as_all_replicas(run):
    t = trace_of(*[(0.0, 160, 0, list(range(i * 10, i * 10 + 10))) for i in range(4)])
    rr = run(t, mode="timed", replicas=4, routing="round-robin", prefill_tps=1000.0)
    shared = run(t, mode="timed", replicas=4, routing="shared", prefill_tps=1000.0)
    assert rr.max_wait_s == 0 and shared.max_wait_s == pytest.approx(3 * 0.16 / 4)


def test_ttft_estimate_uses_the_stated_prefill_throughput(run):
    t = trace_of((0.0, 160, 0, list(range(10))), (5.0, 160, 0, list(range(10))))
    s = run(t, mode="timed", prefill_tps=100.0)
    assert s.mean_ttft_without_cache_s == pytest.approx(1.6)
    assert s.mean_ttft_with_cache_s == pytest.approx((1.6 + 0.16) / 2)  # the second recomputes its last block
    assert s.ttft_gain == pytest.approx(1 - 0.88 / 1.6)
