"""Prometheus metrics under vLLM's names with a ``kvprefix:`` prefix (all listed in docs/metrics.md).

Two sources: the engine's own counters and gauges (prefix-cache queries and hits in tokens, preemptions,
evictions, KV usage, running and waiting), read from the engine at scrape time so they are never a stale copy;
and per-request observations the server makes as responses finish (tokens, finish reasons, latencies).
Hit rate is a PromQL ratio of two counters, never a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

P = "kvprefix:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

# Engine metric key -> (exposed name without prefix, help). Counters are exposed with a _total suffix.
ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admission)"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache (first admission)"),
    "prefix_cache_preempted_queries": ("prefix_cache_preempted_queries",
                                       "Tokens looked up again when preempted requests were re-admitted"),
    "prefix_cache_preempted_hits": ("prefix_cache_preempted_hits",
                                    "Tokens of re-admitted preempted requests served from the prefix cache"),
    "num_preemptions": ("num_preemptions", "Requests preempted (by recompute) because KV blocks ran out"),
    "prefix_cache_evictions": ("prefix_cache_evictions", "Cached blocks evicted to make room for new ones"),
}
ENGINE_GAUGES = {
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV blocks referenced by requests (1 = full)"),
    "num_requests_running": ("num_requests_running", "Sequences in the engine's running batch"),
    "num_requests_waiting": ("num_requests_waiting", "Sequences waiting in the engine for admission"),
    "num_free_blocks": ("kv_cache_free_blocks", "KV blocks referenced by no request (cached or empty)"),
    "num_blocks": ("kv_cache_blocks", "KV blocks in the pool"),
}


class _EngineCollector:
    def __init__(self, model_name: str, read: Callable[[], Mapping[str, float]]):
        self._model = model_name
        self._read = read

    def collect(self) -> Iterator[Metric]:
        values = self._read()
        for key, (name, doc) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric([self._model], float(values.get(key, 0)))
            yield c
        for key, (name, doc) in ENGINE_GAUGES.items():
            g = GaugeMetricFamily(P + name, doc, labels=["model_name"])
            g.add_metric([self._model], float(values.get(key, 0)))
            yield g


@dataclass
class FinishedSequence:
    """What the server saw of one prompt's request when it ended (all its n choices)."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: list[int]  # per choice
    finish_reasons: list[str]  # per choice: stop, length or abort
    ttft_s: float | None  # None when no token was produced
    e2e_s: float


class ServerMetrics:
    """One registry per server (no global state), so tests can run several servers in one process."""

    def __init__(self, model_name: str, read_engine: Callable[[], Mapping[str, float]]):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]
        self.registry.register(_EngineCollector(model_name, read_engine))
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens", labels, registry=r)
        self.request_success = Counter(
            P + "request_success", "Finished sequences (one per choice) by finish reason",
            labels + ["finished_reason"], registry=r,
        )
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "Mean time between output tokens, per request",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.cached_fraction = Histogram(
            P + "request_prefix_cache_hit_fraction", "Per request: cached prompt tokens / prompt tokens",
            labels, buckets=_FRACTION_BUCKETS, registry=r,
        )
        self.rejected = Counter(P + "server_rejected_requests", "Requests refused before reaching the engine",
                                labels + ["reason"], registry=r)
        self.in_flight = Gauge(P + "server_requests_in_flight", "Engine requests admitted by the server (held at "
                               "an admin drain or in the engine) and not yet finished", labels, registry=r)
        self.request_log_errors = Counter(P + "request_log_errors", "Request-log records lost to a failed write "
                                          "(the requests themselves were served)", labels, registry=r)
        self.request_log_errors.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        for reason in ("overloaded", "tenant_limit", "shutting_down"):
            self.rejected.labels(model_name, reason)

    def observe(self, seq: FinishedSequence) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(seq.prompt_tokens)
        self.generation_tokens.labels(m).inc(sum(seq.output_tokens))
        for reason in seq.finish_reasons:
            self.request_success.labels(m, reason).inc()
        self.e2e.labels(m).observe(seq.e2e_s)
        if seq.prompt_tokens:
            self.cached_fraction.labels(m).observe(seq.cached_tokens / seq.prompt_tokens)
        if seq.ttft_s is not None:
            self.ttft.labels(m).observe(seq.ttft_s)
            longest = max(seq.output_tokens, default=0)
            if longest > 1:
                self.tpot.labels(m).observe((seq.e2e_s - seq.ttft_s) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
