"""Routing: what each policy gets on the repository's traces (planner), and what `kvprefix route` costs (proxy).

Planner part: every trace of tests/data/traces over 4 and 8 replicas, every policy of ``kvprefix.router`` plus the
one-shared-pool bound, replayed in timed mode on the real cache code. The capacity per replica is chosen so that
the replicas together hold half of the trace's distinct blocks (and at least its largest request): routing
matters only when one replica cannot hold everything. Columns: token-weighted hit rate, its ratio to the shared
pool, load imbalance, requests that waited and the mean wait.

Proxy part: a null backend (a real tiny HTTP server that answers at once, with the replicas' KV event hello so the
prefix policy can start) and `kvprefix route` in front of it, each a process pinned to its own core. Added p50
latency = p50 through the router - p50 direct, sequential requests; routed requests/s = completions per second
through the router with 32 concurrent clients (the router runs on one core).

    python benchmarks/bench_router.py [--skip-planner] [--skip-proxy] [--out results/bench_router.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvprefix.router.policies import POLICIES
from kvprefix.sim.formats import load_trace
from kvprefix.sim.metrics import summarize
from kvprefix.sim.replay import SHARED, ReplayConfig, replay

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"
ROUTINGS = (*POLICIES, SHARED)
# About 2,000 tokens of chat: the prefix policy renders, tokenizes and hashes it on every request.
PROMPT = "You are a careful assistant. Follow the policy below to the letter. " * 140


def planner(replica_counts=(4, 8)) -> list[dict]:
    rows = []
    print(f"{'trace':44} {'N':>2} {'routing':12} {'hit(tok)':>8} {'/shared':>7} {'imbal':>6} {'waited':>6} "
          f"{'wait(s)':>8}")
    for path in sorted(TRACES.glob("*.jsonl")):
        trace = load_trace(path)
        distinct = len({h for r in trace.requests for h in r.block_hashes})
        largest = max(r.num_blocks for r in trace.requests) + max(
            -(-r.output_length // trace.block_size) for r in trace.requests)
        for n in replica_counts:
            capacity = max(largest, distinct // (2 * n))
            results = {}
            for routing in ROUTINGS:
                cfg = ReplayConfig(capacity, replicas=n, routing=routing, mode="timed")
                results[routing] = summarize(trace, cfg, replay(trace, cfg))
            bound = results[SHARED].token_hit_rate
            for routing, s in results.items():
                ratio = s.token_hit_rate / bound if bound else 1.0
                print(f"{trace.name:44} {n:>2} {routing:12} {s.token_hit_rate:8.3f} {ratio:7.2f} "
                      f"{s.load_imbalance:6.2f} {s.waited:6d} {s.mean_wait_s:8.2f}")
                rows.append({"trace": trace.name, "replicas": n, "capacity_blocks": capacity, "routing": routing,
                             "token_hit_rate": s.token_hit_rate, "vs_shared": ratio,
                             "load_imbalance": s.load_imbalance, "waited": s.waited, "mean_wait_s": s.mean_wait_s})
    return rows


def null_backend(port: int, model: str) -> None:
    """A replica that answers at once: /health, the KV event hello (for the prefix policy), completions."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from kvprefix.cache import BlockHasher, context_for_checkpoint
    from kvprefix.cache.event_wire import Hello, dumps
    from kvprefix.prompts import Tokenizer

    context = context_for_checkpoint(model, "float32", Tokenizer(model).chat_template)
    hello = dumps(Hello("null", "0" * 16, 16, "sha256", BlockHasher(16, "sha256", context).root, 0, False))
    answer = json.dumps({"id": "cmpl-null", "object": "chat.completion", "model": "null", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 0}}}).encode()

    async def health(_):
        return Response(status_code=200)

    async def events(_):
        return Response(hello, media_type="application/x-ndjson")

    async def complete(_):
        return Response(answer, media_type="application/json")

    app = Starlette(routes=[Route("/health", health), Route("/v1/kv_events", events),
                            Route("/v1/chat/completions", complete, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not start")


def _pinned(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if os.path.exists("/usr/bin/taskset") and (os.cpu_count() or 1) > 1 else []


BODY = {"model": "null", "max_tokens": 1, "messages": [{"role": "system", "content": PROMPT},
                                                       {"role": "user", "content": "hi"}]}


def _p50_ms(url: str, n: int) -> float:
    times = []
    with httpx.Client(timeout=30) as c:
        for _ in range(n):
            t = time.perf_counter()
            c.post(url + "/v1/chat/completions", json=BODY).raise_for_status()
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


async def _throughput(url: str, seconds: float, concurrency: int = 32) -> float:
    done, stop = 0, time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker():
            nonlocal done
            while time.perf_counter() < stop:
                (await c.post(url + "/v1/chat/completions", json=BODY)).raise_for_status()
                done += 1
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - start)


def proxy(model: str, n: int = 300, seconds: float = 5.0) -> list[dict]:
    backend_port = _free_port()
    backend = subprocess.Popen([*_pinned(1), sys.executable, __file__, "--null-backend", str(backend_port),
                                "--model", model])
    backend_url = f"http://127.0.0.1:{backend_port}"
    rows = []
    try:
        _wait(backend_url, backend)
        direct = _p50_ms(backend_url, n)
        print(f"\n{'policy':12} {'direct p50 ms':>13} {'routed p50 ms':>13} {'added ms':>9} {'routed req/s':>12}")
        for policy in ("round-robin", "prefix"):
            port = _free_port()
            router = subprocess.Popen([*_pinned(0), sys.executable, "-m", "kvprefix.cli", "route", "--replica",
                                       backend_url, "--policy", policy, "--model", model, "--port", str(port),
                                       "--log-level", "warning"])
            url = f"http://127.0.0.1:{port}"
            try:
                _wait(url, router)
                routed = _p50_ms(url, n)
                rps = asyncio.run(_throughput(url, seconds))
            finally:
                router.terminate()
                router.wait(timeout=30)
            print(f"{policy:12} {direct:13.2f} {routed:13.2f} {routed - direct:9.2f} {rps:12.0f}")
            rows.append({"policy": policy, "direct_p50_ms": direct, "routed_p50_ms": routed,
                         "added_p50_ms": routed - direct, "routed_requests_per_s": rps})
    finally:
        backend.terminate()
        backend.wait(timeout=30)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-planner", action="store_true")
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--model", default=None, help="tokenizer checkpoint (default: the built-in default model)")
    parser.add_argument("--null-backend", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/bench_router.json")
    args = parser.parse_args()
    if args.model is None:
        from kvprefix.model import default_model_path

        args.model = default_model_path()
    if args.null_backend is not None:
        null_backend(args.null_backend, args.model)
        return
    out = {"planner": [] if args.skip_planner else planner(), "proxy": [] if args.skip_proxy else proxy(args.model)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
