"""Decode speed through the engine with dense and weight-only quantized weights, on a SmolLM2-135M-shaped model.

Decode on CPU is bound by the bytes of weights read per step. For dense float32, dense bfloat16, int8, int4 and
the layout of the SmolLM2 Q4_1 GGUF (int4 projections, int8 lm_head from its Q8_0 embedding), interleaved over
rounds: single-request decode ms per output token, 8 concurrent requests' output tokens/s, a 512-token prefill,
the bytes read per token, and the fraction of this machine's memory bandwidth (measured here: a sum over a tensor far larger than the
caches) those bytes per token make. Each engine step is split into model forward, lm_head, sampling, scheduling
and the rest, so the non-model time per step shows where it goes; the model parts also in CPU time of the engine's
thread (steady under load from other processes, where wall time is not). Random weights (speed only).

    python benchmarks/bench_decode.py [--rounds 3] [--threads 1] [--out results/bench_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from kvprefix.engine import LLM, SamplingParams
from kvprefix.model import write_random_checkpoint
from kvprefix.model.quantized_linear import Int4Linear, Int8Linear, linear_weight_bytes

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
)
# name -> (model dtype, --quantization, lm_head as int8 whatever the projections are)
VARIANTS = {
    "dense float32": ("float32", None, False),
    "dense bfloat16": ("bfloat16", None, False),
    "int8": ("bfloat16", "int8", False),
    "int4": ("bfloat16", "int4", False),
    "int4 + int8 lm_head (Q4_1 GGUF)": ("bfloat16", "int4", True),
}
PROMPT_TOKENS, OUTPUT_TOKENS, BATCH, PREFILL_TOKENS = 32, 64, 8, 512
MODEL_PARTS = ("forward", "projections", "lm_head", "cpu forward", "cpu projections", "cpu lm_head")


def memory_read_bandwidth(threads: int) -> float:
    """Bytes/s of reading a 512 MiB float32 tensor (torch.sum), best of 5, with the decode's thread count."""
    torch.set_num_threads(threads)
    x = torch.ones(128 * 2**20)
    x.sum()
    best = min(_seconds(x.sum) for _ in range(5))
    return x.numel() * x.element_size() / best


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class StepTimer:
    """Wraps an engine's step parts (a benchmark's instrument, not engine code) and keeps seconds per part for
    every step."""

    def __init__(self, llm: LLM) -> None:
        self.seconds: dict[str, float] = defaultdict(float)  # wall time; "cpu " + part: this thread's CPU time
        self.history: list[dict[str, float]] = []
        engine = llm.llm_engine
        model = engine.runner.model
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_sample", "sample")
        self._wrap(engine.runner, "execute", "runner")
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "lm_head")
        for layer in model.model.layers:  # the projections' matmuls inside the forward
            for module in layer.modules():
                if isinstance(module, (torch.nn.Linear, Int8Linear, Int4Linear)):
                    self._wrap(module, "forward", "projections")
        inner_step = engine.step

        def step():
            self.seconds.clear()
            start = time.perf_counter()
            try:
                return inner_step()
            finally:
                self.history.append({**self.seconds, "step": time.perf_counter() - start})

        engine.step = step

    def _wrap(self, obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
                self.seconds["cpu " + key] += time.thread_time() - start_cpu

        setattr(obj, name, timed)

    def decode_step_ms(self) -> dict[str, float]:
        """Mean ms per part over the steps recorded, leaving out the first (the prefill); clears the record."""
        steps, self.history = self.history[1:], []

        def mean(key: str) -> float:
            return sum(h.get(key, 0.0) for h in steps) / len(steps) * 1000

        return {
            "forward": mean("forward"),
            "projections": mean("projections"),
            "lm_head": mean("lm_head"),
            "runner other": mean("runner") - mean("forward") - mean("lm_head"),  # metadata, input tensors
            "sample": mean("sample"),
            "schedule": mean("schedule"),
            "step other": mean("step") - mean("runner") - mean("sample") - mean("schedule"),  # outputs
            "step": mean("step"),
            # CPU time of the engine's thread (LLM.generate steps in the caller's thread, and with one torch thread
            # the ops run there too): unlike wall time it leaves out the time other processes hold the core.
            "cpu forward": mean("cpu forward"),
            "cpu projections": mean("cpu projections"),
            "cpu lm_head": mean("cpu lm_head"),
        }


def build(path: str, dtype: str, quantization: str | None, int8_head: bool) -> LLM:
    llm = LLM(path, dtype=dtype, quantization=quantization, kv_cache_memory=64 * 2**20)
    model = llm.llm_engine.runner.model
    if int8_head:  # the Q4_1 GGUF's layout: its tied lm_head is the Q8_0 embedding, packed as per-channel int8
        model.lm_head = Int8Linear.from_float(model.model.embed_tokens.weight)
    return llm


def bytes_per_token(llm: LLM, context: int) -> int:
    """Weights of every projection and the lm_head, one embedding row, and the KV of ``context`` tokens."""
    model = llm.llm_engine.runner.model
    config = model.config
    elem = model.model.embed_tokens.weight.element_size()
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem * context
    return linear_weight_bytes(model) + config.hidden_size * elem + kv


def run_round(llm: LLM, timer: StepTimer, prompts: list[list[int]]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    timer.history = []
    out = llm.generate(prompts[0], params)[0]
    m = out.metrics
    single_ms = (m.finished_time - m.first_token_time) / (OUTPUT_TOKENS - 1) * 1000
    steps = timer.decode_step_ms()
    steps["outside step"] = single_ms - steps.pop("step")  # LLM.generate's own loop
    start = time.perf_counter()
    outs = llm.generate(prompts[1:-1], params)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in outs)
    # Prefill too: the quantized ops are matrix-vector kernels, so a long prompt shows what they cost at M = 512.
    long = llm.generate(prompts[-1], SamplingParams(max_tokens=1))[0]
    return {"single_ms_per_token": single_ms, "batch_tokens_per_s": BATCH * OUTPUT_TOKENS / wall, "steps": steps,
            "prefill_s": long.metrics.ttft}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "kvprefix-bench-smollm2-shape"))
    parser.add_argument("--out", default="results/bench_decode.json")
    args = parser.parse_args()
    names = args.variants.split(",")
    if not os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        write_random_checkpoint(args.checkpoint, "llama", seed=0, dtype=torch.bfloat16, **SMOLLM2_135M)
    bandwidth = memory_read_bandwidth(args.threads)
    print(f"memory read bandwidth ({args.threads} thread): {bandwidth / 1e9:.1f} GB/s")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)

    def fresh_prompts() -> list[list[int]]:  # new ones every round: no round hits the last one's cached blocks
        return [torch.randint(0, SMOLLM2_135M["vocab_size"], (n,), generator=gen).tolist()
                for n in [PROMPT_TOKENS] * (1 + BATCH) + [PREFILL_TOKENS]]

    prompts = fresh_prompts()
    llms = {n: build(args.checkpoint, *VARIANTS[n]) for n in names}
    timers = {n: StepTimer(llm) for n, llm in llms.items()}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rounds = defaultdict(list)
    for _ in range(args.rounds):  # interleaved: every variant once per round
        prompts = fresh_prompts()
        for n in names:
            rounds[n].append(run_round(llms[n], timers[n], prompts))
    results = []
    print(f"\n{'weights':32} {'MB/token':>8} {'ms/token':>8} {'GB/s':>5} {'of bw':>6} {'8-req tok/s':>11}"
          f" {'proj ms':>7} {'other fwd':>9} {'lm_head':>7} {'non-model':>9} {'prefill 512 s':>13}"
          f" {'cpu: proj':>9} {'other fwd':>9} {'lm_head':>7}")
    for n in names:
        single = statistics.median(r["single_ms_per_token"] for r in rounds[n])
        batch = statistics.median(r["batch_tokens_per_s"] for r in rounds[n])
        steps = {k: statistics.median(r["steps"][k] for r in rounds[n]) for k in rounds[n][0]["steps"]}
        prefill = statistics.median(r["prefill_s"] for r in rounds[n])
        nbytes = bytes_per_token(llms[n], PROMPT_TOKENS + OUTPUT_TOKENS // 2)
        achieved = nbytes / (single / 1000)
        row = dict(weights=n, bytes_per_token=nbytes, single_ms_per_token=single, batch_tokens_per_s=batch,
                   prefill_512_s=prefill,
                   achieved_bytes_per_s=achieved, bandwidth_fraction=achieved / bandwidth, step_ms=steps,
                   rounds=rounds[n])
        results.append(row)
        non_model = sum(v for k, v in steps.items() if k not in MODEL_PARTS)
        print(f"{n:32} {nbytes / 1e6:8.1f} {single:8.1f} {achieved / 1e9:5.1f} {achieved / bandwidth:6.0%} "
              f"{batch:11.1f} {steps['projections']:7.1f} {steps['forward'] - steps['projections']:9.1f} "
              f"{steps['lm_head']:7.1f} {non_model:9.2f} {prefill:13.2f} {steps['cpu projections']:9.1f} "
              f"{steps['cpu forward'] - steps['cpu projections']:9.1f} {steps['cpu lm_head']:7.1f}")
    print("\nnon-model time per step (ms, single request, median of rounds):")
    for row in results:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in row["step_ms"].items() if k not in MODEL_PARTS)
        print(f"  {row['weights']:32} {parts}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(bandwidth_bytes_per_s=bandwidth, threads=args.threads,
                                              prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS,
                                              results=results), indent=2))


if __name__ == "__main__":
    main()
