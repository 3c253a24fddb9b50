"""`--metrics-names vllm`: every series that vLLM's Grafana dashboard and the Gateway API Inference Extension query
(tests/data/vllm_metric_queries.txt) is there, under vLLM's name with its model_name and engine labels, and moves."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.servers import LONG_PREFIX, start_server, stop_server

QUERIES = Path(__file__).parents[1] / "data" / "vllm_metric_queries.txt"


def queried_names() -> set[str]:
    lines = [ln for ln in QUERIES.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return {name for ln in lines for name in re.findall(r"vllm:[a-z0-9_:]+", ln)}


@pytest.mark.slow
def test_every_queried_vllm_series_exists_and_moves(server_tmp) -> None:
    s = start_server(server_tmp, "--num-gpu-blocks", "512", "--metrics-names", "vllm")
    try:
        client = s.client()
        computed = 0  # prompt tokens not served from the cache, as the responses say
        for i in range(2):
            u = client.completions.create(model="default-model-v1", prompt=LONG_PREFIX + f" {i}", max_tokens=5, n=2,
                                          temperature=0, extra_body={"ignore_eos": True}).usage
            computed += u.prompt_tokens - u.prompt_tokens_details.cached_tokens
        chunks = list(client.chat.completions.create(
            model="default-model-v1", messages=[{"role": "user", "content": "m"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        computed += chunks[-1].usage.prompt_tokens - chunks[-1].usage.prompt_tokens_details.cached_tokens
        text = httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        assert stop_server(s) in (0, -15)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    names = queried_names()
    assert len(names) >= 30, names
    missing = sorted(n for n in names if n not in samples)
    assert not missing, f"queried but not exposed: {missing}"
    for name in names - {"vllm:lora_requests_info"}:
        for sample in samples[name]:
            assert sample.labels["model_name"] == "default-model-v1" and sample.labels["engine"] == "0", sample
    assert samples["vllm:lora_requests_info"][0].labels["max_lora"] == "0"

    def value(name: str, **labels) -> float:
        return sum(x.value for x in samples[name] if all(x.labels.get(k) == v for k, v in labels.items()))

    # Panels have data: every queried histogram observed the three requests (5 choices), counters moved.
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds", "request_params_n",
                 "request_params_max_tokens", "request_prefill_kv_computed_tokens",
                 "request_max_num_generation_tokens"):
        assert value(f"vllm:{hist}_count") == 3, hist
    assert value("vllm:request_generation_tokens_sum") == value("vllm:generation_tokens_total") == 24
    assert value("vllm:request_params_n_sum") == 5 and value("vllm:request_params_max_tokens_sum") == 14
    assert value("vllm:request_prompt_tokens_sum") == value("vllm:prompt_tokens_total")
    assert value("vllm:request_prefill_kv_computed_tokens_sum") == computed
    assert value("vllm:iteration_tokens_total_count") >= 4 and value("vllm:inter_token_latency_seconds_count") >= 8
    assert value("vllm:request_success_total", finished_reason="length") == 5
    assert value("vllm:cache_config_info") == 1 and samples["vllm:cache_config_info"][0].labels["block_size"] == "16"
    assert value("vllm:kv_cache_usage_perc") == value("vllm:gpu_cache_usage_perc")
    # One name per series: what vLLM has is not also under kvprefix:, what it lacks stays ours.
    assert "kvprefix:prompt_tokens_total" not in samples and "kvprefix:server_requests_in_flight" in samples
