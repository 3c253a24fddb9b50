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

Live part (``--live``): 4 real `kvprefix serve` replicas of the built-in model behind one real `kvprefix route` per
policy, open-loop shared-prefix chat at rates relative to round robin's estimated capacity (docs/benchmarks.md).

    python benchmarks/bench_router.py [--skip-planner] [--skip-proxy] [--out results/bench_router.json]
    taskset -c 0 python benchmarks/bench_router.py --skip-planner --skip-proxy --live   # --rates 0.8x,1.25x
    python benchmarks/bench_router.py --skip-planner --baseline-src ../main-worktree --rounds 6   # A/B, interleaved
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from harness import Process, counters, free_port, percentile, start_route, start_serve, wait_healthy, write_results

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


def _event_loop():
    """uvloop when installed (as the router runs), else asyncio's own."""
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def null_backend(port: int, model: str) -> None:
    """A replica that answers at once: a raw asyncio HTTP/1.1 server (httptools parser, keep-alive) with canned
    answers to /health, /v1/chat/completions and /v1/kv_events (hello and an empty snapshot, so kv-events syncs).
    As lean as an HTTP server gets in Python, so what the benchmark measures is the router."""
    import httptools

    from kvprefix.cache import block_identity
    from kvprefix.cache.event_wire import Hello, SnapshotEnd, SnapshotStart, dumps
    from kvprefix.tokenizer import Tokenizer

    identity = block_identity(model, "float32", None, Tokenizer(model).chat_template)
    root = identity.hasher().root
    # Wire version 1 (a pool, no tiers): what routers of either side of the version-2 change read (--baseline-src).
    hello = Hello("null", "0" * 16, 16, "sha256", root, 0, False, version=1, identity=identity)
    events = b"".join(dumps(m) for m in (hello, SnapshotStart(0, 0), SnapshotEnd(0)))
    answer = json.dumps({"id": "cmpl-null", "object": "chat.completion", "model": "null", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                  "prompt_tokens_details": {"cached_tokens": 0}}}).encode()

    def response(body: bytes, media: bytes) -> bytes:
        return (b"HTTP/1.1 200 OK\r\ncontent-type: " + media + b"\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n" + body)

    canned = {b"/health": response(b"", b"text/plain"), b"/v1/chat/completions": response(answer, b"application/json")}
    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = stream_head + f"{len(events):x}\r\n".encode() + events + b"\r\n"  # then held open, as a replica does
    not_found = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    class Backend(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.parser, self.path = transport, httptools.HttpRequestParser(self), b""

        def data_received(self, data):
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError:
                self.transport.close()

        def on_url(self, url):
            self.path = url.split(b"?", 1)[0]

        def on_message_complete(self):
            if self.path == b"/v1/kv_events":
                self.transport.write(stream)
            else:
                self.transport.write(canned.get(self.path, not_found))

    loop = _event_loop()
    server = loop.run_until_complete(loop.create_server(Backend, "127.0.0.1", port, backlog=1024))
    with contextlib.suppress(KeyboardInterrupt):
        loop.run_until_complete(server.serve_forever())


def _pinned(core: int | None) -> list[str]:
    """taskset for ``core``; nothing for None (--no-pin: a machine whose cores someone else pins)."""
    usable = core is not None and os.path.exists("/usr/bin/taskset") and (os.cpu_count() or 1) > 1
    return ["taskset", "-c", str(core)] if usable else []


# One system prompt, a new question each time (cycled): the shape a prefix router is for. Every request renders,
# tokenizes and hashes its whole prompt; only what it shares with earlier ones may come from a memo.
BODIES = [{"model": "null", "max_tokens": 1, "messages": [
    {"role": "system", "content": PROMPT}, {"role": "user", "content": f"Question {i}: what does rule {i} say?"}]}
    for i in range(256)]


def load(port: int, concurrency: int, seconds: float) -> dict:
    """Closed-loop load: ``concurrency`` keep-alive connections, each sending the chat body again as soon as the
    previous answer is complete, for ``seconds``. Raw asyncio + httptools, so it costs far less per request than
    an HTTP client library (its own ceiling, against the null backend directly, is in the table)."""
    import httptools

    requests = []
    for body in map(str.encode, map(json.dumps, BODIES)):
        requests.append(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                        b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    sent = itertools.count()

    class Client(asyncio.Protocol):
        def __init__(self):
            self.parser, self.done = httptools.HttpResponseParser(self), None

        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            self.parser.feed_data(data)

        def on_message_complete(self):
            self.done.set_result(self.parser.get_status_code())

        def connection_lost(self, exc):
            if self.done is not None and not self.done.done():
                self.done.set_exception(ConnectionError("connection lost"))

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        stop = time.perf_counter() + seconds

        async def worker():
            _, conn = await loop.create_connection(Client, "127.0.0.1", port)
            while time.perf_counter() < stop:
                conn.done = loop.create_future()
                t = time.perf_counter()
                conn.transport.write(requests[next(sent) % len(requests)])
                status = await conn.done
                if status != 200:
                    raise RuntimeError(f"status {status}")
                latencies.append(time.perf_counter() - t)
            conn.transport.close()

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
        return {"requests_per_s": len(latencies) / elapsed, "p50_ms": 1000 * percentile(latencies, 50),
                "requests": len(latencies)}

    loop = _event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def _load_in(core: int | None, port: int, concurrency: int, seconds: float, model: str) -> dict:
    """The load generator in its own process, pinned to ``core``."""
    out = subprocess.run([*_pinned(core), sys.executable, __file__, "--model", model, "--load", str(port),
                          str(concurrency), str(seconds)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


PROXY_POLICIES = ("round-robin", "prefix", "kv-events")
BASELINE = " (baseline)"  # the name suffix of --baseline-src's routers


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc): what a request costs the router, whatever share
    of its core a loaded machine left it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proxy(model: str, seconds: float = 5.0, concurrency: int = 32, rounds: int = 2,
          baseline_src: str | None = None, pin: bool = True) -> list[dict]:
    """Null backend on core 1, router on core 0, load generator on core 1 (with the backend: the router is the
    only process on its core). Sequential p50 (one connection) and closed-loop throughput, direct and routed,
    interleaved over ``rounds``; medians reported. ``baseline_src``: a source tree (its ``src``, e.g. a worktree of
    main) whose routers run beside these, each policy's two measured one after the other in every round (which
    goes first alternates), for a ratio that holds on a busy machine. ``pin=False``: no process pinned."""
    router_core, other_core = (0, 1) if pin else (None, None)
    backend_port = free_port()
    backend = subprocess.Popen([*_pinned(other_core), sys.executable, __file__, "--null-backend", str(backend_port),
                                "--model", model])
    backend_url = f"http://127.0.0.1:{backend_port}"
    trees = {"": None, **({BASELINE: str(Path(baseline_src).resolve() / "src")} if baseline_src else {})}
    names = [p + suffix for p in PROXY_POLICIES for suffix in trees]
    routers: dict[str, Process] = {}
    samples: dict[str, list[dict]] = {"direct": [], **{name: [] for name in names}}
    try:
        wait_healthy(backend_url, backend)
        for policy in PROXY_POLICIES:
            for suffix, src in trees.items():
                env = None if src is None else {**os.environ, "PYTHONPATH": src}
                routers[policy + suffix] = start_route(["--replica", backend_url, "--policy", policy, "--model", model],
                                                       prefix=_pinned(router_core), env=env, wait=False)
        for router in routers.values():
            wait_healthy(router.url, router.proc, timeout_s=300)  # loading the tokenizer, on a busy core
            _load_in(other_core, router.port, 4, 3.0, model)  # warm: the tokenizer cache checks its first encodings
        for k in range(rounds):
            order = [n for p in PROXY_POLICIES for n in [p + suffix for suffix in trees][:: -1 if k % 2 else 1]]
            for name, port in [("direct", backend_port), *((n, routers[n].port) for n in order)]:
                pid = backend.pid if name == "direct" else routers[name].proc.pid
                seq = _load_in(other_core, port, 1, seconds / 2, model)
                cpu = _cpu_seconds(pid)
                par = _load_in(other_core, port, concurrency, seconds, model)
                cpu_ms = 1000 * (_cpu_seconds(pid) - cpu) / par["requests"]
                samples[name].append({"p50_ms": seq["p50_ms"], "requests_per_s": par["requests_per_s"],
                                      "cpu_ms_per_request": cpu_ms})
    finally:
        for router in routers.values():
            router.stop(30)
        Process(backend, backend_url, backend_port).stop(30)

    def med(name: str, key: str) -> float:
        return statistics.median(s[key] for s in samples[name])

    direct_p50, ceiling = med("direct", "p50_ms"), med("direct", "requests_per_s")
    print(f"\nload generator alone against the null backend: {ceiling:.0f} requests/s, p50 {direct_p50:.3f} ms")
    # router CPU per request: the one-core capacity (1000 / it) on a machine the router has to itself
    print(f"{'policy':23} {'direct p50 ms':>13} {'routed p50 ms':>13} {'added ms':>9} {'routed req/s':>12} "
          f"{'CPU ms/req':>10} {'req/CPU-s':>9}")
    rows = [{"policy": "direct", "p50_ms": direct_p50, "requests_per_s": ceiling}]
    for name in names:
        routed, rps, cpu = med(name, "p50_ms"), med(name, "requests_per_s"), med(name, "cpu_ms_per_request")
        print(f"{name:23} {direct_p50:13.3f} {routed:13.3f} {routed - direct_p50:9.3f} {rps:12.0f} {cpu:10.3f} "
              f"{1000 / cpu:9.0f}")
        rows.append({"policy": name, "direct_p50_ms": direct_p50, "routed_p50_ms": routed,
                     "added_p50_ms": routed - direct_p50, "routed_requests_per_s": rps, "cpu_ms_per_request": cpu,
                     "requests_per_cpu_second": 1000 / cpu, "load_average": os.getloadavg()[0]})
    if baseline_src:
        # per round, the baseline's CPU per request over this tree's (the two ran back to back): > 1 is faster here
        for policy in PROXY_POLICIES:
            ratios = [b["cpu_ms_per_request"] / a["cpu_ms_per_request"]
                      for a, b in zip(samples[policy], samples[policy + BASELINE], strict=True)]
            print(f"{policy}: baseline / this CPU per request, per round {' '.join(f'{r:.2f}' for r in ratios)}; "
                  f"median {statistics.median(ratios):.2f}")
            rows.append({"policy": policy, "cpu_ratio_baseline_over_this": statistics.median(ratios),
                         "cpu_ratio_per_round": ratios})
    return rows


LIVE_POLICIES = ("round-robin", "prefix", "kv-events")
# Five system prompts of about 1,000 tokens (the built-in model's tokenizer), distinct from their first block on,
# asked with skew (prompt k about 1/(k+1) of the time): a replica's pool (--live-blocks) holds two or three, the
# four pools together all of them, so round robin keeps evicting what the prefix policies keep.
LIVE_PROMPTS = [f"Policy {k}: you are assistant number {k}. " + f"Rule {k} says: answer briefly and cite the rule. " * 80
                for k in range(5)]
LIVE_BLOCKS = 160  # per replica, 16-token blocks: about 2.5 of the prompts
LIVE_MAX_TOKENS = 2  # TTFT is what is measured; decode past the first token is load, not signal


def _live_traffic(n: int, seed: int) -> list[list[dict]]:
    """Shared-prefix chat: each request one of the system prompts (skewed: the first ones are asked more) and a
    new question."""
    import random

    rng = random.Random(seed)
    weights = [1 / (k + 1) for k in range(len(LIVE_PROMPTS))]
    return [[{"role": "system", "content": rng.choices(LIVE_PROMPTS, weights)[0]},
             {"role": "user", "content": f"Question {i}: what does rule {rng.randrange(100)} mean?"}]
            for i in range(n)]


async def _open_loop(url: str, model_id: str, traffic: list[list[dict]], rate: float, seed: int,
                     label: str) -> dict:
    """Poisson arrivals at ``rate``; streamed chats, TTFT to the first content chunk; the hit rate from the
    replicas' own ``cached_tokens``; achieved = requests / (first sent to last answered): below the offered rate
    when the replicas cannot keep up. Prints progress every quarter of the requests."""
    import random

    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
    ttft: list[float] = []
    prompt = cached = 0
    started = time.perf_counter()

    async def one(messages: list[dict]) -> None:
        nonlocal prompt, cached
        start = time.perf_counter()
        first = None
        stream = await client.chat.completions.create(model=model_id, messages=messages, max_tokens=LIVE_MAX_TOKENS,
                                                      stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - start
            if chunk.usage is not None:
                prompt += chunk.usage.prompt_tokens
                cached += chunk.usage.prompt_tokens_details.cached_tokens
        ttft.append(first if first is not None else time.perf_counter() - start)
        if len(ttft) % max(len(traffic) // 4, 1) == 0:
            print(f"  {label}: {len(ttft)}/{len(traffic)} answered, {time.perf_counter() - started:.0f} s", flush=True)

    tasks = []
    async with client:
        for messages in traffic:
            tasks.append(asyncio.create_task(one(messages)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - started
    ttft.sort()
    return {"ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
            "hit_rate": cached / prompt if prompt else 0.0, "achieved_rps": len(traffic) / elapsed,
            "seconds": elapsed}


def _live_hasher(replica_url: str, model: str):
    """The replicas' request hasher (their block size, hash and root, from a replica's KV event hello)."""
    from kvprefix.cache.event_wire import loads
    from kvprefix.router.hashing import RequestHasher

    with httpx.stream("GET", replica_url + "/v1/kv_events", timeout=10) as r:
        hello = loads(next(r.iter_lines()))
    return RequestHasher.for_replica(hello, model)


def _replayed_hit_rate(hasher, traffic: list[list[dict]], blocks: int, replicas: int, routing: str) -> float:
    """The planner's replay of the same requests (the same hashes), in order: ``routing`` over ``replicas`` pools
    of ``blocks``; ``SHARED`` is one pool of all of them, the bound for any router."""
    from kvprefix.cache import cdiv
    from kvprefix.sim.trace import Trace, TraceRequest

    block_size = hasher.hasher.block_size
    requests = []
    for messages in traffic:
        hashes, num_blocks = hasher.hash_prompt({"messages": messages}, None)
        length = len(hasher.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        requests.append(TraceRequest(0.0, length, LIVE_MAX_TOKENS, hashes, cdiv(length, block_size)))
    trace = Trace("live", block_size, requests)
    cfg = ReplayConfig(blocks, replicas=replicas, routing=routing, mode="order")
    return summarize(trace, cfg, replay(trace, cfg)).token_hit_rate


def _request_seconds(url: str, model_id: str) -> tuple[float, float]:
    """Seconds of one request whose system prompt is not cached, then of one that hits it, alone on the replicas
    (one at a time, straight to one replica); the prompt is the live prompts' length, not one of them."""
    prompt = "Calibration: " + LIVE_PROMPTS[0]
    seconds = []
    for question in ("What is rule 1?", "What is rule 2?"):
        start = time.perf_counter()
        httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model_id, "max_tokens": LIVE_MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "system", "content": prompt}, {"role": "user", "content": question}]},
        ).raise_for_status()
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1]


def _requests_per_replica(url: str) -> list[float]:
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvprefix:router_requests_total":
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0.0) + sample.value
    return list(counts.values())


def _cpu_seconds(replicas: list[Process]) -> list[float]:
    """Each replica process's CPU seconds so far (user + system, all its threads)."""
    return [sum(psutil.Process(r.proc.pid).cpu_times()[:2]) for r in replicas]


def _live_rates(rates: list[str], rr_capacity: float) -> list[float]:
    """``0.5x`` is half round robin's estimated capacity; a plain number is requests per second."""
    return [float(r[:-1]) * rr_capacity if r.endswith("x") else float(r) for r in rates]


def live(model: str | None, rates: list[str], requests: int, replicas: int = 4, blocks: int = LIVE_BLOCKS) -> list[dict]:
    """``replicas`` real `kvprefix serve` processes (``--model``, default: the built-in model) behind one real
    `kvprefix route` per policy; the same open-loop traffic through each, the replicas' caches reset between
    runs. Imbalance: the busiest replica's share of the requests x N; work imbalance the same of their CPU seconds
    (what each replica computed: cached requests are cheap, so a replica can take many and little work).

    Round robin's capacity (requests/s the replicas can answer under round robin) is estimated from one cold and
    one cached request alone and the planner's round-robin hit rate on the traffic: 1 / (hit seconds + miss share
    x (cold - hit) seconds). On one core (the whole run under ``taskset -c 0``) that is where round robin
    saturates; rates given as ``Nx`` are multiples of it."""
    tokenizer_dir = model
    if tokenizer_dir is None:
        from kvprefix.cache.default_model import default_model_path

        tokenizer_dir = default_model_path()
    procs: list[Process] = []
    urls = []
    rows = []
    began = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - began:6.0f} s] {text}", flush=True)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run stops its replicas and routers too
    try:
        for _ in range(replicas):
            procs.append(start_serve(["--num-gpu-blocks", str(blocks), "--max-num-seqs", "16",
                                      *(["--model", model] if model else [])], wait=False))
            urls.append(procs[-1].url)
        for replica in procs:
            wait_healthy(replica.url, replica.proc, timeout_s=900)  # four engines loading on one core
        say(f"{replicas} replicas up")
        model_id = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        routers = {}
        for policy in LIVE_POLICIES:
            procs.append(start_route(["--policy", policy, "--model", tokenizer_dir,
                                      *[a for u in urls for a in ("--replica", u)]], timeout_s=300))
            routers[policy] = procs[-1].url
        time.sleep(2)  # kv-events: every replica's stream synced
        hasher = _live_hasher(urls[0], tokenizer_dir)
        cold, hit = _request_seconds(urls[0], model_id)
        rr_hit = _replayed_hit_rate(hasher, _live_traffic(requests, seed=0), blocks, replicas, "round-robin")
        rr_capacity = 1 / (hit + (1 - rr_hit) * (cold - hit))
        offered = _live_rates(rates, rr_capacity)
        # every run lasts its arrivals; round robin's, past its capacity, as long as the work it was given
        eta = sum((len(routers) - 1) * requests / r + requests / min(r, rr_capacity) for r in offered)
        say(f"routers up; one request alone: {cold:.2f} s cold, {hit:.2f} s cached; planner round-robin hit rate "
            f"{rr_hit:.3f}: round robin's capacity ~{rr_capacity:.3f} req/s; rates {[round(r, 3) for r in offered]}; "
            f"about {eta / 60:.1f} min to go")
        results = []
        for k, rate in enumerate(offered):
            traffic = _live_traffic(requests, seed=k)
            bound = _replayed_hit_rate(hasher, traffic, blocks, replicas, SHARED)
            for policy, url in routers.items():
                # through the router: it reaches every replica, and `prefix` forgets where it routed
                httpx.post(url + "/reset_prefix_cache", params={"wait": "true"}, timeout=60).raise_for_status()
                before, cpu_before = _requests_per_replica(url), _cpu_seconds(procs[:replicas])
                say(f"rate {rate:.3f} req/s, {policy}: {requests} requests")
                result = asyncio.run(_open_loop(url, model_id, traffic, rate, k, f"{rate:.3f} {policy}"))
                counts = [a - b for a, b in zip(_requests_per_replica(url), before, strict=True)]
                imbalance = max(counts) * len(counts) / sum(counts)
                work = [a - b for a, b in zip(_cpu_seconds(procs[:replicas]), cpu_before, strict=True)]
                work_imbalance = max(work) * len(work) / sum(work)
                ratio = result["hit_rate"] / bound if bound else 1.0
                results.append((rate, policy, result, ratio, imbalance, work_imbalance))
                say(f"rate {rate:.3f} req/s, {policy}: done in {result['seconds']:.0f} s")
                rows.append({"rate": rate, "policy": policy, **result, "shared_pool_hit_rate": bound,
                             "vs_shared": ratio, "imbalance": imbalance, "work_imbalance": work_imbalance,
                             "requests": requests,
                             "rr_capacity_rps": rr_capacity, "cold_s": cold, "cached_s": hit})
        print(f"\n{'rate':>6} {'policy':12} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'achieved':>8} {'hit rate':>8} "
              f"{'/shared':>7} {'imbal':>6} {'work imbal':>10}")
        for rate, policy, result, ratio, imbalance, work_imbalance in results:
            print(f"{rate:6.3f} {policy:12} {result['ttft_p50_ms']:11.0f} {result['ttft_p99_ms']:11.0f} "
                  f"{result['achieved_rps']:8.3f} {result['hit_rate']:8.3f} {ratio:7.2f} {imbalance:6.2f} "
                  f"{work_imbalance:10.2f}")
    finally:
        for proc in procs:
            proc.proc.terminate()
        for proc in procs:
            proc.stop(60)
    return rows


SUPPORT_AGENTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "support_agents.jsonl"
SUPPORT_AGENTS_KV_BYTES = 256 << 20  # per replica, as in issue 27


def support_agents(model: str | None, tokenizer_dir: str, replicas: int = 3) -> list[dict]:
    """Issue 27's workload live: ``replicas`` real `kvprefix serve` replicas with 256 MiB of KV each behind one
    real `kvprefix route` per policy, the bodies of tests/data/support_agents.jsonl (benchmarks/
    make_support_agents.py) sent one at a time; each policy's hit rate (the replicas' own ``cached_tokens``)
    against the planner's replay of the same requests on one shared pool of all the replicas' blocks."""
    import openai

    bodies = [json.loads(line) for line in SUPPORT_AGENTS.read_text().splitlines()]
    procs: list[Process] = []
    rows = []
    try:
        for _ in range(replicas):
            procs.append(start_serve(["--kv-cache-memory", str(SUPPORT_AGENTS_KV_BYTES),
                                      *(["--model", model] if model else [])], wait=False))
        for replica in procs:
            wait_healthy(replica.url, replica.proc, timeout_s=900)
        urls = [p.url for p in procs]
        listing = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]
        num_blocks = int(counters(urls[0])["kvprefix:kv_cache_blocks"])
        hasher = _live_hasher(urls[0], tokenizer_dir)
        traffic = [b["messages"] for b in bodies]
        bound = _replayed_hit_rate(hasher, traffic, num_blocks, replicas, SHARED)
        for policy in LIVE_POLICIES:
            router = start_route(["--policy", policy, "--model", tokenizer_dir,
                                  *[a for u in urls for a in ("--replica", u)]], timeout_s=300)
            procs.append(router)
            time.sleep(2)  # kv-events: every replica's stream synced
            httpx.post(router.url + "/reset_prefix_cache", params={"wait": "true"}, timeout=60).raise_for_status()
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=600)
            prompt = cached = 0
            for body in bodies:
                usage = client.chat.completions.create(model=listing["id"], messages=body["messages"],
                                                       max_tokens=LIVE_MAX_TOKENS).usage
                prompt += usage.prompt_tokens
                cached += usage.prompt_tokens_details.cached_tokens
            counts = _requests_per_replica(router.url)
            rows.append({"workload": "support-agents", "policy": policy, "hit_rate": cached / prompt,
                         "shared_pool_hit_rate": bound, "vs_shared": cached / prompt / bound,
                         "requests_per_replica": counts, "replica_blocks": num_blocks})
            router.stop(30)
        print(f"\nsupport agents, {replicas} replicas x {num_blocks} blocks, one request at a time; "
              f"one shared pool: {bound:.3f}")
        print(f"{'policy':12} {'hit rate':>8} {'/shared':>7} requests per replica")
        for row in rows:
            print(f"{row['policy']:12} {row['hit_rate']:8.3f} {row['vs_shared']:7.2f} {row['requests_per_replica']}")
    finally:
        for proc in procs:
            proc.stop(60)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-planner", action="store_true")
    parser.add_argument("--skip-proxy", action="store_true")
    parser.add_argument("--live", action="store_true", help="also the live loopback run: real replicas, per policy")
    parser.add_argument("--support-agents", action="store_true",
                        help="also issue 27's support-agents workload live: 3 replicas, one request at a time")
    parser.add_argument("--rates", default="0.8x,1.25x",
                        help="live: request rates, comma-separated: req/s, or Nx = N x round robin's estimated "
                             "capacity (default 0.8x,1.25x)")
    parser.add_argument("--requests", type=int, default=60, help="live: requests per rate and policy")
    parser.add_argument("--live-model", default=None,
                        help="live: the replicas' --model (default: the built-in model)")
    parser.add_argument("--live-blocks", type=int, default=LIVE_BLOCKS, help="live: KV blocks per replica")
    parser.add_argument("--cpus", default=None,
                        help="run on these cores only, e.g. 0 or 0,1 (this process and every one it starts)")
    parser.add_argument("--model", default=None, help="tokenizer checkpoint (default: the built-in default model)")
    parser.add_argument("--seconds", type=float, default=5.0, help="proxy: seconds of closed-loop load per run")
    parser.add_argument("--rounds", type=int, default=2, help="proxy: interleaved rounds (medians over them)")
    parser.add_argument("--no-pin", action="store_true", help="proxy: pin no process to a core")
    parser.add_argument("--baseline-src", default=None, metavar="DIR",
                        help="proxy: also the routers of this source tree (e.g. a worktree of main), interleaved")
    parser.add_argument("--null-backend", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results/bench_router.json")
    args = parser.parse_args()
    if args.cpus is not None:  # the replicas and routers started later inherit it
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.model is None:
        from kvprefix.cache.default_model import default_model_path

        args.model = default_model_path()
    if args.null_backend is not None:
        null_backend(args.null_backend, args.model)
        return
    if args.load is not None:
        print(json.dumps(load(int(args.load[0]), int(args.load[1]), float(args.load[2]))))
        return
    out = {"planner": [] if args.skip_planner else planner(),
           "proxy": [] if args.skip_proxy else proxy(args.model, args.seconds, rounds=args.rounds,
                                                     baseline_src=args.baseline_src, pin=not args.no_pin),
           "live": live(args.live_model, args.rates.split(","), args.requests, blocks=args.live_blocks)
           if args.live else [],
           "support_agents": support_agents(args.live_model, args.model) if args.support_agents else []}
    write_results(args.out, out)


if __name__ == "__main__":
    main()
