"""Beam search: forking beams on the block pool (kvprefix's engine) against vLLM's way of expanding every beam into
a new request per step whose prompt (prefix + beam tokens) hits the prefix cache.

Both drive the same search (``kvprefix.engine.beam_search.BeamSearch``) on the same engine, so they return the same
beams (checked); what differs is what the model computes. A fork shares the parent's full blocks and copies its
partial last block, so each beam computes one token per step. A new request per step hits only full blocks: the
tokens of the partial last block (block_size / 2 on average) are computed again, and every beam's prompt is
hashed and looked up again.

Model: random weights with SmolLM2-135M's shape (--layers of its 30), float32 on CPU. Searches: --prompts prompts
of --prompt-tokens fresh tokens, width --width, --max-tokens steps, searched together. Each way runs --rounds
times, interleaved (fork, per step, fork, ...), on one engine with its cache reset between runs; the median wall
time is reported with the tokens the model ran (prompt and beams) and the forward steps.

    python benchmarks/bench_beam.py [--layers 8] [--prompts 4] [--prompt-tokens 500] [--width 4] [--max-tokens 32]
                                    [--rounds 3] [--out results/bench_beam.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch
from harness import SMOLLM2_135M, ensure_smollm2_checkpoint, write_results

from kvprefix import LLM, BeamSearchParams, SamplingParams
from kvprefix.engine.beam_search import BeamSearch, Finished

VOCAB = SMOLLM2_135M["vocab_size"] - 1000  # random prompt tokens stay clear of the special tokens at the top



def forked(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[list[list[int]]]:
    """kvprefix's: ``LLM.beam_search``, the beams forked on the pool."""
    return [[s.tokens for s in out.sequences] for out in llm.beam_search(prompts, params)]


def per_step(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[list[list[int]]]:
    """vLLM's: each step, one request per live beam (prompt + its tokens, one token, 2 x width logprobs)."""
    engine = llm.llm_engine
    searches = [BeamSearch(params, len(p), engine.eos_token_ids, params.max_tokens) for p in prompts]
    step = SamplingParams(temperature=params.temperature, max_tokens=1, logprobs=params.num_candidates)
    while any(not s.done for s in searches):
        batch = [(s, p + b.token_ids()) for s, p in zip(searches, prompts, strict=True) if not s.done for b in s.live]
        outs = iter(llm.generate([tokens for _, tokens in batch], step))
        for s in searches:
            if not s.done:
                s.step([next(outs).outputs[0].logprobs[0] for _ in s.live])

    def tokens(prompt: list[int], f: Finished) -> list[int]:
        return prompt + f.beam.token_ids()

    return [[tokens(p, f) for f in s.results()] for s, p in zip(searches, prompts, strict=True)]


def measure(llm: LLM, way, prompts, params) -> tuple[float, int, int, list]:
    """Seconds, tokens the model ran, forward steps, and the result, of one run on a cold cache."""
    runner = llm.llm_engine.runner
    execute = runner.execute
    counted = {"tokens": 0, "steps": 0}

    def counting(sched, *args):
        counted["tokens"] += sched.num_tokens
        counted["steps"] += 1
        return execute(sched, *args)

    assert llm.reset_prefix_cache()
    runner.execute = counting
    try:
        start = time.perf_counter()
        result = way(llm, prompts, params)
        elapsed = time.perf_counter() - start
    finally:
        runner.execute = execute
    return elapsed, counted["tokens"], counted["steps"], result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default=os.path.expanduser("~/.cache/kvprefix-bench"))
    ap.add_argument("--out", default="results/bench_beam.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    llm = LLM(ensure_smollm2_checkpoint(args.root, args.layers), dtype="float32", num_gpu_blocks=2048, block_size=args.block_size)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    params = BeamSearchParams(beam_width=args.width, max_tokens=args.max_tokens, ignore_eos=True)
    ways = {"fork on the pool (kvprefix)": forked, "a request per beam and step (vLLM's)": per_step}
    runs: dict[str, list] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():
            runs[name].append(measure(llm, way, prompts, params))
    results = {name: [r[3] for r in rs] for name, rs in runs.items()}
    same = all(r == results[next(iter(ways))][0] for rs in results.values() for r in rs)
    rows = []
    for name, rs in runs.items():
        seconds = [r[0] for r in rs]
        rows.append({"way": name, "seconds (median)": statistics.median(seconds), "min": min(seconds),
                     "max": max(seconds), "model tokens": rs[0][1], "forward steps": rs[0][2]})
    base = rows[0]["seconds (median)"]
    for row in rows:
        row["time / fork"] = row["seconds (median)"] / base
    print(f"same beams both ways: {same}")
    write_results(args.out, {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                             "args": vars(args), "same_beams": same, "rows": rows}, rows,
                  formats={"seconds (median)": ".2f", "min": ".2f", "max": ".2f", "time / fork": ".2f"})
    if not same:
        raise SystemExit("the two ways returned different beams")


if __name__ == "__main__":
    main()
