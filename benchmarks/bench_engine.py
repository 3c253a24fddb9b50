"""The engine with prefix caching on vs off vs Hugging Face transformers' generate, on the same weights.

Model: random weights with Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4,864, vocab 151,936, tied embeddings, qkv bias), bfloat16, CPU. Workload: requests sharing a 1,024-token system
prompt, each with a unique 32-64-token suffix, 16 greedy output tokens each.

Two phases, each system after a short warm-up request:
  - TTFT, one request at a time (so a TTFT is that request's own prefill, no queueing): with caching on, the system
    prompt is cached and each request hits it; "suffix alone" runs each suffix as the whole prompt, the physical
    limit of a hit; with caching off every request computes its whole prompt. kvprefix probes stop after the
    first token; transformers runs the full 16 tokens one request at a time (its total is reported too).
  - Burst: all requests arrive at once, 16 tokens each (caching on: only the system prompt is cached, as in steady
    state). Total time, output throughput, prompt tokens actually computed, hit rate. Best of --repeats runs.
Every repeat uses fresh suffixes (their first token changes), so no probe hits blocks of an earlier one.

    python benchmarks/bench_engine.py [--requests 8] [--repeats 2] [--out results/bench_engine.json]

Issue 12's scenarios run with --scenario (each writes its own JSON, results/bench_engine_<scenario>.json), the
feature on and off side by side, interleaved run by run on two engines that live at the same time:
  - burst: cold bursts of 8 and 32 requests sharing a 1,024-token prefix (each with a unique 32-64-token rest, 16
    output tokens), token budgets 2,048 and 8,192, in-flight prefix sharing on vs off: prompt tokens computed
    against the ideal (the prefix's full blocks once plus every request's rest), TTFT p50, total time.
  - mixed: 32 requests over 4 prefixes, 2 of them cached, FCFS vs cache-aware admission: TTFT mean and p99.
  - decode: 64 requests decoding 1,000 tokens on a tiny model: the engine thread's own (non-model) time per step;
    the same script measures another checkout with PYTHONPATH=<checkout>/src.

    python benchmarks/bench_engine.py --scenario burst|mixed|decode [--repeats 2]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import time

import torch
from harness import QWEN25_05B, ensure_checkpoint, percentile, write_results

from kvprefix import LLM, SamplingParams

SYSTEM_TOKENS = 1024
OUTPUT_TOKENS = 16
BLOCK_SIZE = 16
VOCAB = QWEN25_05B["vocab_size"] - 1000  # random prompt tokens stay clear of the special tokens at the top


class Workload:
    """The shared system prompt and one 32-64-token suffix per request; ``variant`` k changes every suffix's first
    token, giving a fresh set of requests with the same lengths."""

    def __init__(self, num_requests: int, seed: int = 0):
        rng = random.Random(seed)
        self.system = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
        self.suffixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(32, 64))] for _ in range(num_requests)]

    def suffixes_for(self, variant: int) -> list[list[int]]:
        return [[(s[0] + variant) % VOCAB] + s[1:] for s in self.suffixes]

    def prompts(self, variant: int) -> list[list[int]]:
        return [self.system + s for s in self.suffixes_for(variant)]


def ttft_summary(ttfts: list[float]) -> dict:
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90), "ttfts_s": ttfts}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many requests produced identical greedy tokens, and the mean length of their common prefix."""
    common = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
        for p, q in zip(a, b, strict=True)
    ]
    return {
        "identical": sum(c == len(p) for c, p in zip(common, a, strict=True)),
        "of": len(a),
        "mean_common_prefix": statistics.mean(common),
    }


# ---- kvprefix ---------------------------------------------------------------------------------------------------


def run_kvprefix(path: str, caching: bool, work: Workload, repeats: int) -> dict:
    n = len(work.suffixes)
    num_blocks = (n + 4) * ((SYSTEM_TOKENS + 64 + OUTPUT_TOKENS) // BLOCK_SIZE + 2)
    llm = LLM(path, dtype="bfloat16", device="cpu", enable_prefix_caching=caching, num_gpu_blocks=num_blocks)
    first_token = SamplingParams(temperature=0, max_tokens=1)
    full = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(work.suffixes[0][:8], first_token)  # warm-up: one-time allocations and kernel selection

    def ttft(prompt: list[int]) -> float:
        return llm.generate(prompt, first_token)[0].metrics.ttft

    result: dict = {}
    if caching:
        llm.generate(work.system, first_token)  # the system prompt is cached from here on
        hits, alone, cached = [], [], []
        for variant in range(repeats):
            for suffix, prompt in zip(work.suffixes_for(variant), work.prompts(variant), strict=True):
                alone.append(ttft(suffix))
                out = llm.generate(prompt, first_token)[0]
                hits.append(out.metrics.ttft)
                cached.append(out.num_cached_tokens)
        result["ttft_hit"] = {**ttft_summary(hits), "num_cached_tokens": cached}
        result["ttft_suffix_alone"] = ttft_summary(alone)
    else:
        result["ttft_cold"] = ttft_summary([ttft(p) for v in range(repeats) for p in work.prompts(v)])

    bursts = []
    for k in range(repeats):
        prompts = work.prompts(repeats + k)
        before = llm.get_metrics()
        start = time.perf_counter()
        outs = llm.generate(prompts, full)
        total = time.perf_counter() - start
        after = llm.get_metrics()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        bursts.append(
            {
                **ttft_summary([o.metrics.ttft for o in outs]),
                "total_s": total,
                "output_tokens_per_s": n * OUTPUT_TOKENS / total,
                "prefill_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
                "hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries,
                "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
            }
        )
        if k == 0:
            result["token_ids"] = [o.outputs[0].token_ids for o in outs]
    # The fastest burst is the least disturbed by other work on these shared machines.
    result["burst"] = {**min(bursts, key=lambda b: b["total_s"]), "all_totals_s": [b["total_s"] for b in bursts]}
    return result


# ---- transformers -----------------------------------------------------------------------------------------------


class FirstTokenTimer:
    """A generate() streamer: put() gets the prompt, then each new token; the second call is the first token."""

    def __init__(self):
        self.calls = 0
        self.first_token_time: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def run_transformers(path: str, work: Workload, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    gen = dict(max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS, do_sample=False, pad_token_id=0)
    n = len(work.suffixes)
    result: dict = {}
    with torch.inference_mode():
        model.generate(torch.tensor([work.suffixes[0][:8]]), **gen)  # warm-up
        ttfts = []
        start = time.perf_counter()
        for prompt in work.prompts(0):
            timer = FirstTokenTimer()
            t0 = time.perf_counter()
            model.generate(torch.tensor([prompt]), streamer=timer, **gen)
            ttfts.append(timer.first_token_time - t0)
        result["one_at_a_time"] = {**ttft_summary(ttfts), "total_s": time.perf_counter() - start}

        runs = []
        for k in range(repeats):
            prompts = work.prompts(repeats + k)  # the same requests as the kvprefix bursts
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            timer = FirstTokenTimer()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, streamer=timer, **gen)
            runs.append((time.perf_counter() - start, timer.first_token_time - start))
            if k == 0:
                result["token_ids"] = out[:, width:].tolist()
    total, ttft = min(runs)
    result["batched"] = {
        **ttft_summary([ttft] * n),
        "total_s": total,
        "all_totals_s": [t for t, _ in runs],
        "output_tokens_per_s": n * OUTPUT_TOKENS / total,
        "prefill_tokens_computed": width * n,  # padding is computed too
        "hit_rate": 0.0,
    }
    return result


# ---- report -----------------------------------------------------------------------------------------------------


def report(r: dict) -> list[str]:
    on, off, hf = r["kvprefix_on"], r["kvprefix_off"], r["transformers"]
    cfg = r["config"]
    lines = [
        f"{cfg['requests']} requests: {SYSTEM_TOKENS}-token shared system prompt + 32-64-token suffix, "
        f"{OUTPUT_TOKENS} output tokens, bf16, {cfg['threads']} threads, {cfg['repeats']} repeats",
        "",
        "TTFT, one request at a time:",
        "| system | TTFT p50 (s) | TTFT p90 (s) |",
        "|---|---|---|",
    ]
    for name, t in (
        ("kvprefix, caching on (system prompt hit)", on["ttft_hit"]),
        ("kvprefix, caching off", off["ttft_cold"]),
        ("kvprefix, suffix alone (the limit)", on["ttft_suffix_alone"]),
        (f"transformers generate, one at a time (total {hf['one_at_a_time']['total_s']:.1f} s)", hf["one_at_a_time"]),
    ):
        lines.append(f"| {name} | {t['ttft_p50_s']:.3f} | {t['ttft_p90_s']:.3f} |")
    lines += [
        "",
        "All requests at once:",
        "| system | TTFT p50 (s) | TTFT p90 (s) | total (s) | output tok/s | prompt tokens computed | hit rate |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, b in (
        ("kvprefix, caching on", on["burst"]),
        ("kvprefix, caching off", off["burst"]),
        ("transformers generate, batched", hf["batched"]),
    ):
        lines.append(
            f"| {name} | {b['ttft_p50_s']:.3f} | {b['ttft_p90_s']:.3f} | {b['total_s']:.2f} | "
            f"{b['output_tokens_per_s']:.2f} | {b['prefill_tokens_computed']} | {b['hit_rate']:.3f} |"
        )
    t = r["targets"]
    lines += [
        "",
        "Targets:",
        f"- hit TTFT / suffix-alone TTFT (p50) = {t['hit_vs_suffix_alone']:.2f} (target <= 1.3: "
        f"{'met' if t['hit_vs_suffix_alone'] <= 1.3 else 'NOT met'})",
        f"- caching-off TTFT / hit TTFT (p50) = {t['off_vs_hit']:.1f}x (target >= 8: "
        f"{'met' if t['off_vs_hit'] >= 8 else 'NOT met'})",
        f"- caching-off burst throughput / transformers batched = {t['off_vs_hf_batched_throughput']:.2f} "
        f"(target >= 1: {'met' if t['off_vs_hf_batched_throughput'] >= 1 else 'NOT met'})",
        "",
        "Greedy outputs of the first burst (bf16: kernels for different shapes round differently, and random "
        "weights leave near-ties):",
    ]
    for label, c in r["checks"].items():
        lines.append(
            f"- {label}: {c['identical']}/{c['of']} requests identical, "
            f"mean common prefix {c['mean_common_prefix']:.1f} of {OUTPUT_TOKENS} tokens"
        )
    return lines


# ---- issue 12: in-flight prefix sharing ---------------------------------------------------------------------------


def cold_burst(num: int, rng: random.Random) -> tuple[list[int], list[list[int]]]:
    """A fresh 1,024-token prefix (cold in every engine) and ``num`` prompts of it with unique 32-64-token rests."""
    prefix = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    return prefix, [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 64))] for _ in range(num)]


def ideal_prompt_tokens(prefix: list[int], prompts: list[list[int]]) -> int:
    shared = len(prefix) // BLOCK_SIZE * BLOCK_SIZE
    return sum(map(len, prompts)) - (len(prompts) - 1) * shared


def counting_llm(path: str, **kwargs) -> LLM:
    """A warmed-up LLM whose model runs are logged as (time.monotonic(), tokens run so far): a load-independent
    clock, since on a CPU the time of a step is about proportional to its tokens."""
    llm = LLM(path, dtype="bfloat16", device="cpu", **kwargs)
    llm.generate([1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=2))
    runner = llm.llm_engine.runner
    execute = runner.execute
    llm.token_clock = [(0.0, 0)]

    def counted(sched, *args):
        out = execute(sched, *args)
        llm.token_clock.append((time.monotonic(), llm.token_clock[-1][1] + sched.num_tokens))
        return out

    runner.execute = counted
    return llm


def engine_pair(path: str, num_blocks: int, flag: str, **kwargs) -> dict[bool, LLM]:
    """Two engines on one checkpoint that differ only in the boolean EngineArgs field ``flag``."""
    return {on: counting_llm(path, num_gpu_blocks=num_blocks, **{flag: on}, **kwargs) for on in (True, False)}


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One burst: every prompt at once. TTFTs (seconds, and tokens the model ran before the first token), total
    time, prompt tokens computed, and the greedy tokens."""
    before = llm.get_metrics()
    clock_start = llm.token_clock[-1][1]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - start
    after = llm.get_metrics()
    ttfts = [o.metrics.ttft for o in outs]
    # The first token comes out of the step whose model run is the last one logged before it.
    ttft_tokens = [max(n for t, n in llm.token_clock if t <= o.metrics.first_token_time) - clock_start for o in outs]
    return {
        "total_s": total,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_mean_s": statistics.mean(ttfts),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttfts_s": ttfts,
        "ttft_tokens_p50": percentile(ttft_tokens, 50),
        "ttft_tokens_mean": statistics.mean(ttft_tokens),
        "ttft_tokens_p99": percentile(ttft_tokens, 99),
        "ttft_tokens": ttft_tokens,
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def run_burst(path: str, repeats: int) -> dict:
    full = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    rng = random.Random(12)
    rows = []
    for budget in (2048, 8192):
        num_blocks = 34 * ((SYSTEM_TOKENS + 64 + OUTPUT_TOKENS) // BLOCK_SIZE + 2)
        pair = engine_pair(path, num_blocks, "share_inflight_prefixes", max_num_batched_tokens=budget)
        for num in (8, 32):
            runs: dict[bool, list[dict]] = {True: [], False: []}
            for k in range(repeats):
                prefix, prompts = cold_burst(num, rng)
                for on in ((True, False) if k % 2 == 0 else (False, True)):  # interleaved, order alternating
                    r = timed_generate(pair[on], prompts, full)
                    r["ideal_prompt_tokens"] = ideal_prompt_tokens(prefix, prompts)
                    runs[on].append(r)
                    pair[on].reset_prefix_cache()
            rows.append({"budget": budget, "requests": num, "on": runs[True], "off": runs[False]})
        del pair
        gc.collect()
    return {"rows": rows}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report_burst(r: dict) -> list[str]:
    lines = [
        f"Cold bursts sharing a {SYSTEM_TOKENS}-token prefix (+ 32-64 unique tokens, {OUTPUT_TOKENS} output tokens), "
        f"in-flight prefix sharing on vs off, medians of {len(r['rows'][0]['on'])} interleaved runs:",
        "",
        "| budget | requests | sharing | prompt tokens computed | / ideal | TTFT p50 (s) | TTFT p50 (model tokens) | "
        "total (s) | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(row["on"], row["off"], strict=True))
        for label, runs in (("on", row["on"]), ("off", row["off"])):
            computed = median_of(runs, "prompt_tokens_computed")
            ideal = median_of(runs, "ideal_prompt_tokens")
            lines.append(
                f"| {row['budget']:,} | {row['requests']} | {label} | {computed:,.0f} | {computed / ideal:.2f}x | "
                f"{median_of(runs, 'ttft_p50_s'):.2f} | {median_of(runs, 'ttft_tokens_p50'):,.0f} | "
                f"{median_of(runs, 'total_s'):.2f} | {same}/{len(runs)} runs |"
            )
    lines.append("")
    for row in r["rows"]:
        on, off = row["on"], row["off"]
        lines.append(
            f"- budget {row['budget']:,}, {row['requests']} requests: off/on prompt tokens "
            f"{median_of(off, 'prompt_tokens_computed') / median_of(on, 'prompt_tokens_computed'):.2f}x, "
            f"TTFT p50 {median_of(off, 'ttft_p50_s') / median_of(on, 'ttft_p50_s'):.2f}x "
            f"(in model tokens {median_of(off, 'ttft_tokens_p50') / median_of(on, 'ttft_tokens_p50'):.2f}x), "
            f"total {median_of(off, 'total_s') / median_of(on, 'total_s'):.2f}x"
        )
    return lines


# ---- issue 12: cache-aware admission ------------------------------------------------------------------------------

MIXED_PREFIXES = 4  # half of them cached before each burst
MIXED_REQUESTS = 32


def run_mixed(path: str, repeats: int) -> dict:
    """Bursts over 4 prefixes of 1,024 tokens, 2 of them cached (warmed before the burst), 32 requests in random
    order; FCFS vs cache-aware admission (in-flight sharing on in both), budget 2,048."""
    full = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=1)
    rng = random.Random(13)
    num_blocks = (MIXED_REQUESTS + 8) * ((SYSTEM_TOKENS + 64 + OUTPUT_TOKENS) // BLOCK_SIZE + 2)
    pair = {p: counting_llm(path, num_gpu_blocks=num_blocks, scheduling_policy=p) for p in ("cache_aware", "fcfs")}
    runs: dict[str, list[dict]] = {"cache_aware": [], "fcfs": []}
    for k in range(repeats):
        prefixes = [[rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)] for _ in range(MIXED_PREFIXES)]
        cached = prefixes[: MIXED_PREFIXES // 2]
        prompts = [rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 64))]
                   for _ in range(MIXED_REQUESTS)]
        hot = [any(p[:SYSTEM_TOKENS] == c for c in cached) for p in prompts]
        for policy in (("cache_aware", "fcfs") if k % 2 == 0 else ("fcfs", "cache_aware")):
            llm = pair[policy]
            llm.generate([c + [7] for c in cached], warm)
            r = timed_generate(llm, prompts, full)
            r["hot"] = hot
            runs[policy].append(r)
            llm.reset_prefix_cache()
    return {"runs": runs}


def report_mixed(r: dict) -> list[str]:
    runs = r["runs"]
    lines = [
        f"Mixed bursts: {MIXED_REQUESTS} requests over {MIXED_PREFIXES} prefixes of {SYSTEM_TOKENS} tokens, half "
        f"of them cached; budget 2,048; medians of {len(runs['fcfs'])} interleaved runs:",
        "",
        "TTFT in seconds, and in model tokens (the tokens the engine ran before the request's first token: the "
        "load-independent clock):",
        "",
        "| admission | TTFT mean (s) | TTFT p99 (s) | TTFT mean (tokens) | TTFT p99 (tokens) | cached-prefix mean "
        "(tokens) | cold-prefix mean (tokens) | total (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def group_mean(run: dict, hot: bool) -> float:
        return statistics.mean(t for t, h in zip(run["ttft_tokens"], run["hot"], strict=True) if h == hot)

    for policy in ("fcfs", "cache_aware"):
        rs = runs[policy]
        lines.append(
            f"| {policy} | {median_of(rs, 'ttft_mean_s'):.2f} | {median_of(rs, 'ttft_p99_s'):.2f} | "
            f"{median_of(rs, 'ttft_tokens_mean'):,.0f} | {median_of(rs, 'ttft_tokens_p99'):,.0f} | "
            f"{statistics.median(group_mean(x, True) for x in rs):,.0f} | "
            f"{statistics.median(group_mean(x, False) for x in rs):,.0f} | {median_of(rs, 'total_s'):.2f} |"
        )
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(runs["fcfs"], runs["cache_aware"], strict=True))
    keys = ("ttft_mean_s", "ttft_p99_s", "ttft_tokens_mean", "ttft_tokens_p99")
    ratio = {k: median_of(runs["fcfs"], k) / median_of(runs["cache_aware"], k) for k in keys}
    lines += ["", f"- FCFS / cache-aware: TTFT mean {ratio['ttft_mean_s']:.2f}x, p99 {ratio['ttft_p99_s']:.2f}x "
              f"(in model tokens: mean {ratio['ttft_tokens_mean']:.2f}x, p99 {ratio['ttft_tokens_p99']:.2f}x); "
              f"greedy outputs identical in {same}/{len(runs['fcfs'])} runs (bfloat16: a different batch rounds "
              f"differently)"]
    return lines


# ---- issue 12: engine-thread work per decode step -----------------------------------------------------------------


def run_decode(path: str, repeats: int) -> dict:
    """64 requests decoding 1,000 tokens each (logprobs=1, so the old per-step copies include logprobs), on a tiny
    random model (2 layers, hidden 64) so that everything but the model shows. Times per engine step: the whole
    step, the model (runner.execute) and the sampler; the rest is the engine's own work. The reader's work (folding
    deltas into outputs, detokenizing, as an AsyncLLM stream does on the event loop) is timed apart, when the
    installed kvprefix has OutputState. Runs with whichever kvprefix is on the path, so that the same script
    measures an older checkout (PYTHONPATH=<checkout>/src)."""
    import tempfile

    from kvprefix.model import write_random_checkpoint

    tiny = write_random_checkpoint(tempfile.mkdtemp(prefix="bench-decode-"), "llama", seed=0)
    llm = LLM(tiny, dtype="float32", device="cpu", num_gpu_blocks=64 * 66, max_num_seqs=64)
    engine = llm.llm_engine
    timers = {"model": 0.0, "sampler": 0.0}

    def timed(name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t0
        return wrapper

    engine.runner.execute = timed("model", engine.runner.execute)
    engine._sample = timed("sampler", engine._sample)
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True, logprobs=1)
    rng = random.Random(14)
    runs = []
    for k in range(repeats):
        states = {}
        for i in range(64):
            states[f"{k}-{i}"] = engine.add_request(f"{k}-{i}", [rng.randrange(3, 500) for _ in range(32)], params)
        steps, reader = [], []
        while engine.has_unfinished_requests():
            before = dict(timers)
            t0 = time.perf_counter()
            outs = engine.step()
            total = time.perf_counter() - t0
            steps.append((total, timers["model"] - before["model"], timers["sampler"] - before["sampler"]))
            t0 = time.perf_counter()
            for out in outs:
                state = states.get(out.request_id)
                if state is not None and hasattr(state, "apply"):
                    state.apply(out)
                    state.output()
            reader.append(time.perf_counter() - t0)
        runs.append({"steps": steps, "reader_s": reader})
    return {"runs": runs}


def report_decode(r: dict) -> list[str]:
    lines = [
        "Decode at batch 64, 1,000 output tokens each (logprobs=1), tiny model; per engine step, medians over the "
        "steps of each window, last run:",
        "",
        "| output tokens so far | step (ms) | model (ms) | sampler (ms) | engine's own work (ms) | share of step | "
        "reader (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    run = r["runs"][-1]
    steps, reader = run["steps"], run["reader_s"]
    decode = steps[1:]  # step 0 is the prefill
    for lo, hi in ((1, 100), (400, 500), (900, 1000)):
        window = decode[lo - 1 : hi - 1]
        own = [t - m - s for t, m, s in window]
        total = statistics.median(t for t, _, _ in window)
        lines.append(
            f"| {lo}-{hi} | {total * 1e3:.2f} | {statistics.median(m for _, m, _ in window) * 1e3:.2f} | "
            f"{statistics.median(s for _, _, s in window) * 1e3:.2f} | {statistics.median(own) * 1e3:.2f} | "
            f"{statistics.median(own) / total:.1%} | {statistics.median(reader[lo:hi]) * 1e3:.2f} |"
        )
    return lines


SCENARIOS = {"burst": (run_burst, report_burst), "mixed": (run_mixed, report_mixed),
             "decode": (run_decode, report_decode)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8, help="requests sharing the system prompt")
    parser.add_argument("--repeats", type=int, default=2, help="TTFT probe rounds and bursts per system")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch CPU threads")
    parser.add_argument("--layers", type=int, default=QWEN25_05B["num_hidden_layers"],
                        help="issue-12 scenarios: a shallower copy of the model (same token counts, faster)")
    parser.add_argument("--model-dir", default="results/qwen2.5-0.5b-random", help="where the checkpoint is cached")
    parser.add_argument("--out", default=None, help="default results/bench_engine.json (or _<scenario>.json)")
    parser.add_argument("--scenario", default="baseline", choices=["baseline", *SCENARIOS],
                        help="baseline: caching on/off vs transformers (issue 3); the others: issue 12")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_checkpoint(args.model_dir, args.layers if args.scenario != "baseline" else 24)
    if args.scenario != "baseline":
        return run_scenario(args, path)
    args.out = args.out or "results/bench_engine.json"
    work = Workload(args.requests)
    r: dict = {
        "config": {
            "requests": args.requests,
            "repeats": args.repeats,
            "system_tokens": SYSTEM_TOKENS,
            "suffix_tokens": [len(s) for s in work.suffixes],
            "output_tokens": OUTPUT_TOKENS,
            "dtype": "bfloat16",
            "threads": args.threads,
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        }
    }
    start = time.perf_counter()
    r["kvprefix_on"] = run_kvprefix(path, True, work, args.repeats)
    gc.collect()  # one model in memory at a time
    r["kvprefix_off"] = run_kvprefix(path, False, work, args.repeats)
    gc.collect()
    r["transformers"] = run_transformers(path, work, args.repeats)
    r["wall_s"] = time.perf_counter() - start
    on, off, hf = r["kvprefix_on"], r["kvprefix_off"], r["transformers"]
    r["targets"] = {
        "hit_vs_suffix_alone": on["ttft_hit"]["ttft_p50_s"] / on["ttft_suffix_alone"]["ttft_p50_s"],
        "off_vs_hit": off["ttft_cold"]["ttft_p50_s"] / on["ttft_hit"]["ttft_p50_s"],
        "off_vs_hf_batched_throughput": off["burst"]["output_tokens_per_s"] / hf["batched"]["output_tokens_per_s"],
    }
    r["checks"] = {
        "kvprefix caching on vs off": agreement(on["token_ids"], off["token_ids"]),
        "kvprefix (caching off) vs transformers batched": agreement(off["token_ids"], hf["token_ids"]),
    }
    print("\n".join(report(r)))
    write_results(args.out, r)
    print(f"wall time {r['wall_s']:.0f} s")
    return 0


def run_scenario(args: argparse.Namespace, path: str) -> int:
    run, report_fn = SCENARIOS[args.scenario]
    start = time.perf_counter()
    r = run(path, args.repeats)
    r["config"] = {"scenario": args.scenario, "repeats": args.repeats, "threads": args.threads, "layers": args.layers,
                   "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    r["wall_s"] = time.perf_counter() - start
    print("\n".join(report_fn(r)))
    write_results(args.out or f"results/bench_engine_{args.scenario}.json", r)
    print(f"wall time {r['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
