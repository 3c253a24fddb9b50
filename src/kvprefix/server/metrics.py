"""Prometheus metrics under vLLM's names with a ``kvprefix:`` prefix, or with ``--metrics-names vllm`` vLLM's exact
names, so its dashboards and the Gateway API Inference Extension read them unchanged (docs/metrics.md).

Engine counters and gauges are read at scrape time (never a stale copy); per-request observations are made as
responses finish. Hit rate is a PromQL ratio of two counters, never a gauge.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvprefix.engine.lora_request import LoraActivity
from kvprefix.server.tier_metrics import tier_families

NAMESPACES = ("kvprefix", "vllm")
ENGINE_INDEX = "0"  # vLLM's `engine` label: one engine core per server
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0, 160.0)
_FRACTION_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                         240.0, 480.0, 960.0, 1920.0, 7680.0)  # vLLM's, for queue/prefill/decode/inference time
_N_BUCKETS = (1, 2, 5, 10, 20)
_PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50)

# Engine metric key -> (exposed name without prefix, help, whether vLLM has it). Counters get a _total suffix.
ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (first admission)",
                             True),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served from the prefix cache (first admission)", True),
    "prefix_cache_preempted_queries": ("prefix_cache_preempted_queries",
                                       "Tokens looked up again when preempted requests were re-admitted", False),
    "prefix_cache_preempted_hits": ("prefix_cache_preempted_hits",
                                    "Tokens of re-admitted preempted requests served from the prefix cache", False),
    "num_preemptions": ("num_preemptions", "Requests preempted (by recompute) because KV blocks ran out", True),
    "prefix_cache_evictions": ("prefix_cache_evictions", "Cached blocks evicted to make room for new ones", False),
}
ENGINE_GAUGES = {
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV blocks referenced by requests (1 = full)", True),
    "num_requests_running": ("num_requests_running", "Sequences in the engine's running batch", True),
    "num_requests_waiting": ("num_requests_waiting", "Sequences waiting in the engine for admission", True),
    "num_free_blocks": ("kv_cache_free_blocks", "KV blocks referenced by no request (cached or empty)", False),
    "num_blocks": ("kv_cache_blocks", "KV blocks in the pool", False),
}


def metric_name(namespace: str, name: str, in_vllm: bool = True) -> str:
    """The exposed name: vLLM's own under the vllm namespace when vLLM has the metric, else ours."""
    return ("vllm:" if namespace == "vllm" and in_vllm else "kvprefix:") + name


def _one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector:
    def __init__(self, model_name: str, read: Callable[[], Mapping[str, float]], namespace: str,
                 cache_config: Mapping[str, str], read_lora: Callable[[], LoraActivity | None]):
        self._labels = [model_name, ENGINE_INDEX]
        self._read = read
        self._read_lora = read_lora
        self._ns = namespace
        self._cache_config = dict(cache_config)

    def collect(self) -> Iterator[Metric]:
        values = self._read()
        labels, ns = ["model_name", "engine"], self._ns
        for key, (name, doc, in_vllm) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(metric_name(ns, name, in_vllm), doc, labels=labels)
            c.add_metric(self._labels, float(values.get(key, 0)))
            yield c
        gauges = dict(ENGINE_GAUGES)
        if ns == "vllm":  # the name vLLM's dashboard (and older vLLM) reads for the same gauge
            gauges["gpu_cache_usage"] = ("gpu_cache_usage_perc", ENGINE_GAUGES["kv_cache_usage"][1], True)
        for key, (name, doc, in_vllm) in gauges.items():
            g = GaugeMetricFamily(metric_name(ns, name, in_vllm), doc, labels=labels)
            g.add_metric(self._labels, float(values.get("kv_cache_usage" if key == "gpu_cache_usage" else key, 0)))
            yield g
        waiting = GaugeMetricFamily(metric_name(ns, "num_requests_waiting_by_reason"), "Sequences waiting in the "
                                    "engine, by reason: for room (capacity) or behind a running request's in-flight "
                                    "prompt blocks (deferred)", labels=[*labels, "reason"])
        deferred = float(values.get("num_requests_waiting_deferred", 0))
        waiting.add_metric([*self._labels, "capacity"], float(values.get("num_requests_waiting", 0)) - deferred)
        waiting.add_metric([*self._labels, "deferred"], deferred)
        yield waiting
        h = HistogramMetricFamily(metric_name(ns, "iteration_tokens_total"), "Tokens per engine step: computed, "
                                  "plus the token sampled at the end of a prefill", labels=labels)
        buckets = [(k.removeprefix("iteration_tokens_le_"), float(v)) for k, v in values.items()
                   if k.startswith("iteration_tokens_le_")]
        h.add_metric(self._labels, [*buckets, ("+Inf", float(values.get("iteration_tokens_count", 0)))],
                     float(values.get("iteration_tokens_sum", 0)))
        yield h
        info = GaugeMetricFamily(metric_name(ns, "cache_config_info"), "Information of the KV cache configuration",
                                 labels=[*labels, *self._cache_config])
        info.add_metric([*self._labels, *self._cache_config.values()], 1.0)
        yield info
        yield from tier_families(values, lambda n, in_vllm: metric_name(ns, n, in_vllm), labels, self._labels)
        # The inference extension's endpoint picker reads this for LoRA affinity: the adapters of the requests running
        # and waiting in the engine (comma-separated names), and the step's limit ("0" when LoRA is off).
        activity = self._read_lora()
        lora = GaugeMetricFamily(metric_name(ns, "lora_requests_info"), "Running and waiting LoRA adapters",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric(["0", "", ""] if activity is None else
                        [str(activity.max_loras), ",".join(activity.running), ",".join(activity.waiting)],
                        time.time())  # vLLM's value: when the adapter sets were read
        yield lora


@dataclass
class FinishedSequence:
    """What the server saw of one prompt's request when it ended (all its n choices)."""

    prompt_tokens: int
    cached_tokens: int
    output_tokens: list[int]  # per choice
    finish_reasons: list[str]  # per choice: stop, length or abort
    ttft_s: float | None  # None when no token was produced
    e2e_s: float
    max_tokens: int = 0  # the request's max_tokens after defaults
    # The engine's phases (None when the request never reached them): waiting, prefill, decode, scheduled to end.
    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None
    token_gaps_s: list[float] = field(default_factory=list)  # seconds between a choice's consecutive tokens
    lora_name: str | None = None  # the LoRA adapter it ran on (None: the base model)
    num_preemptions: int = 0  # times its choices lost their blocks and were queued again


class ServerMetrics:
    """One registry per server (no global state). ``namespace`` "vllm": vLLM's names; ``cache_config``: the labels
    of cache_config_info; ``max_model_len`` bounds the token-count buckets."""

    def __init__(self, model_name: str, read_engine: Callable[[], Mapping[str, float]], namespace: str = "kvprefix",
                 cache_config: Mapping[str, str] | None = None, max_model_len: int = 8192,
                 read_lora: Callable[[], LoraActivity | None] = lambda: None):
        if namespace not in NAMESPACES:
            raise ValueError(f"metric names must be one of {', '.join(NAMESPACES)}, got {namespace!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.namespace = namespace
        r, labels = self.registry, ["model_name", "engine"]
        self.registry.register(_EngineCollector(model_name, read_engine, namespace, cache_config or {}, read_lora))

        def name(metric: str, in_vllm: bool = True) -> str:
            return metric_name(namespace, metric, in_vllm)

        def histogram(metric: str, doc: str, buckets, in_vllm: bool = True) -> Histogram:
            return Histogram(name(metric, in_vllm), doc, labels, buckets=buckets, registry=r)

        tokens = _one_two_five(max_model_len)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Generated tokens", labels, registry=r)
        self.request_success = Counter(
            name("request_success"), "Finished sequences (one per choice) by finish reason",
            labels + ["finished_reason"], registry=r,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean time between output tokens, per request",
                              _LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "Mean time between output tokens, per request (vLLM's newer name)",
                                      _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a choice",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self._add_request_histograms(histogram, tokens)
        self.rejected = Counter(name("server_rejected_requests", False), "Requests refused before reaching the "
                                "engine", labels + ["reason"], registry=r)
        self.in_flight = Gauge(name("server_requests_in_flight", False), "Engine requests admitted by the server "
                               "(held at an admin drain or in the engine) and not yet finished", labels, registry=r)
        self.request_log_errors = Counter(name("request_log_errors", False), "Request-log records lost to a failed "
                                          "write (the requests themselves were served)", labels, registry=r)
        # Per LoRA adapter (by the name requests used): its prompt tokens and those served from its prefix cache.
        lora_labels = labels + ["lora_name"]
        self.lora_prompt_tokens = Counter(name("lora_prompt_tokens", False), "Prompt tokens of finished requests "
                                          "per LoRA adapter", lora_labels, registry=r)
        self.lora_cached_tokens = Counter(name("lora_prefix_cache_hits", False), "Prompt tokens served from the "
                                          "prefix cache per LoRA adapter (its own namespace)", lora_labels, registry=r)
        m = self._labels = (model_name, ENGINE_INDEX)
        self.request_log_errors.labels(*m)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(*m, reason)
        for reason in ("overloaded", "tenant_limit", "shutting_down"):
            self.rejected.labels(*m, reason)

    def _add_request_histograms(self, histogram: Callable[..., Histogram], tokens: tuple[int, ...]) -> None:
        """Per request: the engine's phases, token counts and parameters, and its prefix-cache hit fraction."""
        self.queue_time = histogram("request_queue_time_seconds", "Time waiting in the engine before scheduling",
                                    _REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token",
                                      _REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token",
                                     _REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to last token",
                                        _REQUEST_TIME_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request "
                                                   "(all choices)", tokens)
        self.request_max_generation = histogram("request_max_num_generation_tokens", "Tokens of a request's "
                                                "longest choice", tokens)
        self.params_n = histogram("request_params_n", "The n request parameter", _N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "The max_tokens request parameter "
                                           "(after defaults)", tokens)
        self.prefill_computed = histogram("request_prefill_kv_computed_tokens", "Prompt tokens computed, not "
                                          "served from the prefix cache, per request", tokens)
        self.preemptions = histogram("request_num_preemptions", "Times a request was preempted (its blocks taken "
                                     "back, its tokens recomputed later)", _PREEMPTION_BUCKETS)
        self.cached_fraction = histogram("request_prefix_cache_hit_fraction", "Per request: cached prompt tokens / "
                                         "prompt tokens", _FRACTION_BUCKETS, in_vllm=False)

    def labels(self) -> tuple[str, str]:
        """The model_name and engine label values, in that order."""
        return self._labels

    def observe(self, seq: FinishedSequence) -> None:
        m = self._labels
        total_out = sum(seq.output_tokens)
        longest = max(seq.output_tokens, default=0)
        self.prompt_tokens.labels(*m).inc(seq.prompt_tokens)
        self.generation_tokens.labels(*m).inc(total_out)
        for reason in seq.finish_reasons:
            self.request_success.labels(*m, reason).inc()
        self.e2e.labels(*m).observe(seq.e2e_s)
        self.request_prompt_tokens.labels(*m).observe(seq.prompt_tokens)
        self.request_generation_tokens.labels(*m).observe(total_out)
        self.request_max_generation.labels(*m).observe(longest)
        self.params_n.labels(*m).observe(len(seq.output_tokens))
        self.params_max_tokens.labels(*m).observe(seq.max_tokens)
        self.prefill_computed.labels(*m).observe(seq.prompt_tokens - seq.cached_tokens)
        self.preemptions.labels(*m).observe(seq.num_preemptions)
        for hist, value in ((self.queue_time, seq.queue_s), (self.prefill_time, seq.prefill_s),
                            (self.decode_time, seq.decode_s), (self.inference_time, seq.inference_s)):
            if value is not None:
                hist.labels(*m).observe(value)
        for gap in seq.token_gaps_s:
            self.itl.labels(*m).observe(gap)
        if seq.lora_name is not None:
            self.lora_prompt_tokens.labels(*m, seq.lora_name).inc(seq.prompt_tokens)
            self.lora_cached_tokens.labels(*m, seq.lora_name).inc(seq.cached_tokens)
        if seq.prompt_tokens:
            self.cached_fraction.labels(*m).observe(seq.cached_tokens / seq.prompt_tokens)
        if seq.ttft_s is not None:
            self.ttft.labels(*m).observe(seq.ttft_s)
            if longest > 1:
                tpot = (seq.e2e_s - seq.ttft_s) / (longest - 1)
                self.tpot.labels(*m).observe(tpot)
                self.request_tpot.labels(*m).observe(tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)
