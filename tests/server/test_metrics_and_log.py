"""/metrics parses with the Prometheus text parser and its counters move exactly as the responses say; the
request log holds what the planner reads, and the planner's reader accepts it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.servers import LONG_PREFIX, Server, start_server, stop_server

from kvprefix.sim.request_log import read_request_log


def test_metrics_parse_and_counters_move(server: Server) -> None:
    before = server.wait_idle()
    client = server.client()
    usages = []
    for i in range(3):
        r = client.completions.create(model="default-model-v1", prompt=LONG_PREFIX + f" metrics {i}", max_tokens=4,
                                      temperature=0, extra_body={"ignore_eos": True})
        usages.append(r.usage)
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt = sum(u.prompt_tokens for u in usages)
    assert delta("kvprefix:prompt_tokens_total") == prompt
    assert delta("kvprefix:prefix_cache_queries_total") == prompt
    assert delta("kvprefix:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert delta("kvprefix:prefix_cache_hits_total") > 0
    assert delta("kvprefix:generation_tokens_total") == 12
    assert delta("kvprefix:request_success_total{length}") == 3
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
              "request_prefix_cache_hit_fraction", "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_params_max_tokens",
              "request_num_preemptions"):
        assert delta(f"kvprefix:{h}_count") == 3, h
    assert delta("kvprefix:request_prompt_tokens_sum") == prompt
    assert delta("kvprefix:request_prefill_kv_computed_tokens_sum") == prompt - delta("kvprefix:prefix_cache_hits_total")
    assert delta("kvprefix:request_params_max_tokens_sum") == 12
    assert delta("kvprefix:inter_token_latency_seconds_count") >= 3  # tokens read together share one gap
    assert delta("kvprefix:request_num_preemptions_sum") == 0  # a pool with room for all
    # As vLLM counts them: each uncached prompt token once, and every generated token (the first with the prefill
    # step that samples it, each later one with the decode step that samples it).
    hits = delta("kvprefix:prefix_cache_hits_total")
    assert delta("kvprefix:iteration_tokens_total_sum") == prompt - hits + 12
    assert delta("kvprefix:iteration_tokens_total_count") >= 4 * 3
    assert after["kvprefix:kv_cache_usage_perc"] == 0.0


def test_request_log_records_and_planner_reads_it(server: Server) -> None:
    client = server.client()
    r1 = client.chat.completions.create(model="default-model-v1", messages=[{"role": "user", "content": LONG_PREFIX}],
                                        max_tokens=3, user="someone@example.com", extra_body={"prompt_cache_key": "k1"})
    r2 = client.chat.completions.create(model="default-model-v1", messages=[{"role": "user", "content": LONG_PREFIX}],
                                        max_tokens=3)
    server.wait_idle()
    rows = [json.loads(line) for line in server.request_log.read_text().splitlines()]
    a, b = rows[-2:]
    assert a["request_id"].startswith(r1.id) and b["request_id"].startswith(r2.id)
    assert a["prompt_tokens"] == r1.usage.prompt_tokens and a["output_tokens"] == r1.usage.completion_tokens
    assert b["cached_tokens"] == r2.usage.prompt_tokens_details.cached_tokens > 0
    assert a["block_size"] == 16 and len(a["block_hashes"]) == a["prompt_tokens"] // 16
    assert a["block_hashes"] == b["block_hashes"]  # same prompt, same chained hashes
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in a["block_hashes"])  # sha256, hex
    assert a["prompt"] is None  # raw prompts only with --request-log-prompts
    assert a["user"] != "someone@example.com" and a["prompt_cache_key"] == "k1"
    assert a["tenant"] == b["tenant"] and len(a["tenant"]) == 16
    assert a["timestamp"] <= b["timestamp"] and a["timings"]["e2e_s"] > 0
    trace = read_request_log(server.request_log, 16)
    assert len(trace.requests) == len(rows)


def test_openapi_lists_the_request_bodies(server: Server) -> None:
    schema = server.get("/openapi.json").json()
    assert "CompletionRequest" in schema["components"]["schemas"]
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")


def test_cli_module_is_light() -> None:
    """`kvprefix --help` must not pay for torch or the web stack: serve's CLI module imports them only in run()."""
    code = ("import sys, kvprefix.cli as c; c.build_parser(); "
            "assert not {'torch', 'fastapi', 'uvicorn'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_request_log_on_a_full_disk_never_fails_a_request(server_tmp) -> None:
    """/dev/full fails every write with ENOSPC: requests still succeed, each lost line is counted, and the
    server warns once, not once per request."""
    server = start_server(server_tmp, "--num-gpu-blocks", "256", "--request-log", "/dev/full")
    try:
        for i in range(3):
            r = server.client().completions.create(model="default-model-v1", prompt=f"full disk {i}", max_tokens=2)
            assert r.usage.completion_tokens == 2
        m = server.wait_idle()
        assert m["kvprefix:request_log_errors_total"] == 3
    finally:
        assert stop_server(server) in (0, -15)
    log = server.log_path.read_text()
    assert log.count("request log") == 1 and "No space left on device" in log and "Traceback" not in log, log
