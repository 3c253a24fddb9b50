"""The engine's counters and gauges as one flat dict (what `LLM.get_metrics()` returns and the server exports)."""

from __future__ import annotations

import itertools

from kvprefix.tiers.store import BY_LABEL

# Tokens per engine step, as vLLM's iteration_tokens_total histogram buckets them.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def engine_metrics(manager, scheduler, counters: dict[str, int], iteration_tokens: list[int],
                   iteration_tokens_sum: int, prefill_seconds: float = 0.0, kv_tier=None) -> dict[str, int | float]:
    """Counters since start (prefix_cache_* in tokens at first admission; prefix_cache_preempted_* at
    re-admissions; num_inflight_prefix_waits; prefill_seconds: the prompt tokens' share of model time), gauges
    (num_requests_*, kv_cache_usage, num_free_blocks), and the tokens-per-step histogram (iteration_tokens_le_B:
    steps of at most B tokens; _count, _sum); docs/metrics.md."""
    computed = scheduler.num_prompt_tokens_computed
    prefill_per_block = prefill_seconds_per_block(prefill_seconds, computed, manager.block_size)
    stats = manager.stats
    pool = manager.pool
    return {
        "prefix_cache_queries": stats.queries,
        "prefix_cache_hits": stats.hits,
        "prefix_cache_hit_rate": stats.hit_rate,
        "prefix_cache_admissions": stats.requests,
        "prefix_cache_preempted_queries": stats.preempted_queries,
        "prefix_cache_preempted_hits": stats.preempted_hits,
        "prefix_cache_preempted_admissions": stats.preempted_requests,
        "prefix_cache_evictions": stats.evictions,
        "prefix_cache_resets": stats.resets,
        "num_preemptions": scheduler.num_preemptions,
        "num_inflight_prefix_waits": scheduler.inflight.num_waits if scheduler.inflight else 0,
        "prompt_tokens": counters["prompt_tokens"],
        "prompt_tokens_computed": computed,
        "prefill_seconds": prefill_seconds,
        "generation_tokens": counters["generation_tokens"],
        "requests_finished": counters["requests_finished"],
        "requests_aborted": counters["requests_aborted"],
        "requests_failed": counters["requests_failed"],
        "num_requests_running": len(scheduler.running),
        "num_requests_waiting": len(scheduler.waiting),
        # vLLM's reasons: "deferred" waits behind a running request's in-flight prompt blocks, "capacity" for room.
        "num_requests_waiting_deferred": sum(1 for r in scheduler.waiting if r.inflight_wait is not None),
        "kv_cache_usage": pool.usage,
        "num_blocks": pool.num_blocks,
        "num_free_blocks": pool.num_free_blocks,
        "block_size": manager.block_size,
        **_iteration_token_stats(iteration_tokens, iteration_tokens_sum),
        **(_tier_stats(kv_tier, prefill_per_block) if kv_tier is not None else {}),
    }


def prefill_seconds_per_block(prefill_seconds: float, prompt_tokens_computed: int, block_size: int) -> float | None:
    """Mean seconds of model time to prefill one block (None before any prefill)."""
    return prefill_seconds / prompt_tokens_computed * block_size if prompt_tokens_computed else None


def _tier_stats(kv_tier, prefill_seconds_per_block: float | None) -> dict[str, int | float]:
    """``kv_<tier>_*`` for each tier: its counters (hit_tokens: prompt tokens loaded from it), its usage gauges,
    verification failures, dropped writes and failed calls by reason (``..._verify_failures_<reason>``), waits on
    other replicas' claims by outcome (``..._claim_waits_<outcome>``), and what
    loading a block from it costs in blocks of prefill (``load_cost``: what the replica tells routers)."""
    out: dict[str, int | float] = {}
    costs = kv_tier.load_costs(prefill_seconds_per_block)
    for store in kv_tier.stores:
        stats, name = store.stats, f"kv_{store.name}"
        with stats.lock:
            out |= {f"{name}_{k}": v for k, v in stats.as_dict().items()}
            for key in BY_LABEL:
                out |= {f"{name}_{key}_{r}": n for r, n in getattr(stats, key).items()}
            out |= stats.load_seconds.flat(f"{name}_load_seconds") | stats.store_seconds.flat(f"{name}_store_seconds")
            out[f"{name}_lookup_tokens"] = stats.lookup_blocks * kv_tier.manager.block_size
        out[f"{name}_hit_tokens"] = kv_tier.hit_tokens[store.name]
        out[f"{name}_max_bytes"] = store.max_bytes
        out[f"{name}_load_cost"] = costs[store.name]
    return out


def _iteration_token_stats(iteration_tokens: list[int], iteration_tokens_sum: int) -> dict[str, int]:
    counts = list(iteration_tokens)  # one read: the cumulative buckets and the count agree
    cumulative = itertools.accumulate(counts)
    out = {f"iteration_tokens_le_{b}": n for b, n in zip(ITERATION_TOKEN_BUCKETS, cumulative, strict=False)}
    return out | {"iteration_tokens_count": sum(counts), "iteration_tokens_sum": iteration_tokens_sum}
