"""Prometheus families of the KV tiers below the pool (``kv_tier_*{tier}``), from the engine's flat metrics
(``kv_<tier>_<counter>``, ``kv_<tier>_{verify_failures,dropped_writes,failures}_<reason>``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

TIERS = ("disk", "shared")
COUNTERS = {
    "lookups": "Lookups of a run of blocks in the tier",
    "hit_tokens": "Prompt tokens loaded from the tier into the pool (counted as cached tokens too)",
    "hit_blocks": "Blocks loaded from the tier and verified",
    "bytes_read": "Bytes of verified objects read from the tier",
    "bytes_written": "Bytes of objects written to the tier",
    "stores": "Blocks written to the tier",
    "evictions": "Objects deleted from the tier to keep its byte budget",
}
BY_REASON = {
    "verify_failures": "Objects that did not verify (a miss, recomputed; never served), by reason",
    "dropped_writes": "Writes dropped (full queue, full disk, over budget, store down or refusing), by reason",
    "failures": "Calls the tier's store failed (unavailable, timeout): answered as misses or dropped writes",
}
GAUGES = {
    "usage_bytes": "Bytes of objects in the tier (this process's view)",
    "num_objects": "Objects in the tier (this process's view)",
    "max_bytes": "The tier's byte budget",
}


def tier_families(values: Mapping[str, float], ns_name, labels: list[str], label_values: list[str]
                  ) -> Iterator[Metric]:
    """One family per tier metric, labelled ``tier`` (and ``reason``); nothing when the engine has no tier.
    ``ns_name(name)`` is the exposed name (ours: vLLM has no tier metrics of these meanings)."""
    tiers = [t for t in TIERS if f"kv_{t}_lookups" in values]
    if not tiers:
        return
    for key, doc in COUNTERS.items():
        c = CounterMetricFamily(ns_name(f"kv_tier_{key}"), doc, labels=[*labels, "tier"])
        for t in tiers:
            c.add_metric([*label_values, t], float(values.get(f"kv_{t}_{key}", 0)))
        yield c
    for key, doc in BY_REASON.items():
        c = CounterMetricFamily(ns_name(f"kv_tier_{key}"), doc, labels=[*labels, "tier", "reason"])
        for t in tiers:
            prefix = f"kv_{t}_{key}_"
            for k, v in values.items():
                if k.startswith(prefix):
                    c.add_metric([*label_values, t, k.removeprefix(prefix)], float(v))
        yield c
    for key, doc in GAUGES.items():
        g = GaugeMetricFamily(ns_name(f"kv_tier_{key}"), doc, labels=[*labels, "tier"])
        for t in tiers:
            g.add_metric([*label_values, t], float(values.get(f"kv_{t}_{key}", 0)))
        yield g
