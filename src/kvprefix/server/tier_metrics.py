"""Prometheus families of the KV tiers below the pool (``kv_tier_*{tier}``), from the engine's flat metrics
(``kv_<tier>_<counter>``, ``kv_<tier>_{verify_failures,dropped_writes,failures}_<reason>``,
``kv_<tier>_claim_waits_<outcome>``,
``kv_<tier>_{load,store}_seconds_le_<bucket>``), and vLLM's ``external_prefix_cache_{queries,hits}_total`` over
all tiers (vLLM counts the tokens its KV connector is asked for and loads under these names)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvprefix.tiers.store import BY_LABEL

TIERS = ("disk", "shared")
COUNTERS = {
    "lookups": "Lookups of a run of blocks in the tier",
    "hit_tokens": "Prompt tokens loaded from the tier into the pool (counted as cached tokens too)",
    "hit_blocks": "Blocks loaded from the tier and verified",
    "bytes_read": "Bytes of verified objects read from the tier",
    "bytes_written": "Bytes of objects written to the tier",
    "stores": "Blocks written to the tier",
    "evictions": "Objects deleted from the tier to keep its byte budget",
    "claims": "Blocks this replica claimed in the shared tier before computing them (others wait for them)",
}
BY_LABEL_DOCS = {  # each counted by the label tiers.store.BY_LABEL names
    "verify_failures": "Objects that did not verify (a miss, recomputed; never served), by reason",
    "dropped_writes": "Writes dropped (full queue, full disk, over budget, store down or refusing), by reason",
    "failures": "Calls the tier's store failed (unavailable, timeout): answered as misses or dropped writes",
    "claim_waits": "Requests that waited for blocks another replica had claimed, by outcome (loaded: they arrived; "
                   "unclaimed: the claim went away without them; gave_up: past the wait's deadline; aborted)",
}
HISTOGRAMS = {
    "load_seconds": "Seconds to load one request's run of blocks from the tier into the pool (read and verify)",
    "store_seconds": "Seconds to write one block to the tier (in the write-behind thread)",
}
EXTERNAL = {  # vLLM's names, summed over the tiers: what a router or dashboard reading vLLM's finds
    "external_prefix_cache_queries_total": ("lookup_tokens", "Prompt tokens looked up in the tiers below the pool"),
    "external_prefix_cache_hits_total": ("hit_tokens", "Prompt tokens loaded from the tiers below the pool"),
}
GAUGES = {
    "usage_bytes": "Bytes of objects in the tier (this process's view)",
    "num_objects": "Objects in the tier (this process's view)",
    "max_bytes": "The tier's byte budget",
    "load_cost": "Blocks of prefill one block loaded from the tier costs (mean load over mean prefill time of a "
                 "block; 0.1 until measured): what the KV event stream tells routers",
}


def tier_families(values: Mapping[str, float], ns_name, labels: list[str], label_values: list[str]
                  ) -> Iterator[Metric]:
    """One family per tier metric, labelled ``tier`` (and ``reason``); nothing when the engine has no tier.
    ``ns_name(name, in_vllm)`` is the exposed name (vLLM's for ``EXTERNAL``, ours for the rest: vLLM has no tier
    metrics of their meanings)."""
    tiers = [t for t in TIERS if f"kv_{t}_lookups" in values]
    if not tiers:
        return
    for name, (key, doc) in EXTERNAL.items():
        c = CounterMetricFamily(ns_name(name.removesuffix("_total"), True), doc, labels=labels)
        c.add_metric(label_values, float(sum(values.get(f"kv_{t}_{key}", 0) for t in tiers)))
        yield c
    for key, doc in HISTOGRAMS.items():
        h = HistogramMetricFamily(ns_name(f"kv_tier_{key}", False), doc, labels=[*labels, "tier"])
        for t in tiers:
            prefix = f"kv_{t}_{key}"
            buckets = [(k.removeprefix(f"{prefix}_le_"), float(v)) for k, v in values.items()
                       if k.startswith(f"{prefix}_le_")]
            h.add_metric([*label_values, t], [*buckets, ("+Inf", float(values.get(f"{prefix}_count", 0)))],
                         float(values.get(f"{prefix}_sum", 0)))
        yield h
    for key, doc in COUNTERS.items():
        c = CounterMetricFamily(ns_name(f"kv_tier_{key}", False), doc, labels=[*labels, "tier"])
        for t in tiers:
            c.add_metric([*label_values, t], float(values.get(f"kv_{t}_{key}", 0)))
        yield c
    for key, doc in BY_LABEL_DOCS.items():
        c = CounterMetricFamily(ns_name(f"kv_tier_{key}", False), doc, labels=[*labels, "tier", BY_LABEL[key]])
        for t in tiers:
            prefix = f"kv_{t}_{key}_"
            for k, v in values.items():
                if k.startswith(prefix):
                    c.add_metric([*label_values, t, k.removeprefix(prefix)], float(v))
        yield c
    for key, doc in GAUGES.items():
        g = GaugeMetricFamily(ns_name(f"kv_tier_{key}", False), doc, labels=[*labels, "tier"])
        for t in tiers:
            g.add_metric([*label_values, t], float(values.get(f"kv_{t}_{key}", 0)))
        yield g
