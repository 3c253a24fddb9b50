"""Decode speed of the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF) through the engine, with dense and with
compact weights; with --against, side by side with another source tree of kvprefix (e.g. a worktree of main).

For each variant (model dtype, --quantization), interleaved over rounds: single-request decode ms per output token
(wall) and CPU ms per decode step; 8 (--batch) concurrent requests' output tokens/s and CPU ms per decode step; a 512-token
prefill; the bytes read per token and the share of this machine's memory read bandwidth (measured here: a sum over a
tensor far larger than the caches) those bytes per token make. A single request's decode step is split into model
forward, projections, lm_head and the engine's parts, in wall and in CPU time. CPU time is that of the engine's
thread (LLM.generate steps in the caller's thread, and with one torch thread the ops run there too): unlike wall
time it leaves out the time other processes hold the core, so it is the figure that compares on a loaded machine.

Every variant runs in its own process (one per variant and tree), all started before the first round; a round asks
each in turn (the order alternating between rounds) for one single-request run, one 8-request run and one prefill.

    python benchmarks/bench_decode.py [--rounds 3] [--threads 1] [--variants int4,gguf] [--against OTHER/src]
                                      [--prefill-tokens 512 (0: none)] [--batch 8]
                                      [--shared-prefix 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
from harness import dense_quantization, write_results

# name -> (model dtype, --quantization)
VARIANTS = {
    "dense float32": ("float32", "none"),  # "none": harness.dense_quantization() of the tree run
    "dense bfloat16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "gguf": ("bfloat16", "gguf"),  # the file's own Q4_1 blocks as int4; its Q8_0 embedding as an int8 lm_head
    "int4 (float32 activations)": ("float32", "int4"),
    "gguf (float32 activations)": ("float32", "gguf"),
}
PROMPT_TOKENS, OUTPUT_TOKENS, BATCH, PREFILL_TOKENS = 32, 64, 8, 512  # BATCH: --batch's default
MODEL_PARTS = ("forward", "projections", "lm_head", "cpu forward", "cpu projections", "cpu lm_head", "cpu step")


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


# ---- the worker: one variant on the kvprefix it imports --------------------------------------------------------


class StepTimer:
    """Wraps an engine's step parts (a benchmark's instrument, not engine code) and keeps seconds per part for
    every step."""

    def __init__(self, llm) -> None:
        from kvprefix.model.quantized_linear import Int4Linear, Int8Linear

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
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return inner_step()
            finally:
                self.history.append({**self.seconds, "step": time.perf_counter() - start,
                                     "cpu step": time.thread_time() - start_cpu})

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

    def decode_steps(self) -> list[dict[str, float]]:
        """The steps recorded since the last call, leaving out the first (the prefill); clears the record."""
        steps, self.history = self.history[1:], []
        return steps

    @staticmethod
    def mean_ms(steps: list[dict[str, float]]) -> dict[str, float]:
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
            "cpu forward": mean("cpu forward"),
            "cpu projections": mean("cpu projections"),
            "cpu lm_head": mean("cpu lm_head"),
            "cpu step": mean("cpu step"),
        }


def bytes_per_token(model, context: int) -> int:
    """Weights of every projection and the lm_head, one embedding row, and the KV of ``context`` tokens."""
    from kvprefix.model.quantized_linear import linear_weight_bytes

    config = model.config
    elem = model.model.embed_tokens.weight.element_size()
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * elem * context
    return linear_weight_bytes(model) + config.hidden_size * elem + kv


def run_round(llm, timer: StepTimer, seed: int, prefill_tokens: int, batch: int, shared_prefix: int) -> dict:
    from kvprefix.engine import SamplingParams

    vocab = llm.llm_engine.runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)  # fresh prompts every round: no round hits the last one's blocks
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist()
               for n in [PROMPT_TOKENS] * (1 + batch) + [prefill_tokens]]
    shared = torch.randint(0, vocab, (shared_prefix,), generator=gen).tolist()
    prompts[1:-1] = [shared + p for p in prompts[1:-1]]  # the batch's prompts open alike (a system prompt)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    timer.history = []
    out = llm.generate(prompts[0], params)[0]
    m = out.metrics
    single_ms = (m.finished_time - m.first_token_time) / (OUTPUT_TOKENS - 1) * 1000
    single = timer.decode_steps()
    steps = StepTimer.mean_ms(single)
    steps["outside step"] = single_ms - steps.pop("step")  # LLM.generate's own loop
    start = time.perf_counter()
    outs = llm.generate(prompts[1:-1], params)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == OUTPUT_TOKENS for o in outs)
    batch_steps = [h for h in timer.decode_steps() if h["cpu step"] > 0]
    # Prefill too: the quantized ops are matrix-vector kernels, so a long prompt shows what they cost at M = 512.
    prefill_s = llm.generate(prompts[-1], SamplingParams(max_tokens=1))[0].metrics.ttft if prefill_tokens else None
    timer.history = []
    return {"single_ms_per_token": single_ms, "batch_tokens_per_s": batch * OUTPUT_TOKENS / wall, "steps": steps,
            "single_cpu_ms_per_step": statistics.median(h["cpu step"] for h in single) * 1000,
            "batch_cpu_ms_per_step": statistics.median(h["cpu step"] for h in batch_steps) * 1000,
            "prefill_s": prefill_s}


def serve_variant(name: str, threads: int, prefill_tokens: int, batch: int, shared_prefix: int) -> None:
    """Worker: builds the variant on the kvprefix this process imports, then answers each "round SEED" line on
    stdin with one JSON line."""
    from kvprefix.cache.default_model import default_model_path
    from kvprefix.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    dtype, quantization = VARIANTS[name]
    quantization = dense_quantization() if quantization == "none" else quantization
    llm = LLM(default_model_path(), dtype=dtype, quantization=quantization, kv_cache_memory=256 * 2**20)
    timer = StepTimer(llm)
    llm.generate([1] * PROMPT_TOKENS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    model = llm.llm_engine.runner.model
    print(json.dumps({"bytes_per_token": bytes_per_token(model, PROMPT_TOKENS + OUTPUT_TOKENS // 2)}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_round(llm, timer, int(line.split()[1]), prefill_tokens, batch, shared_prefix)), flush=True)


# ---- the driver --------------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, name: str, tree: str, threads: int, prefill_tokens: int, batch: int, shared_prefix: int,
                 src: str | None) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(src), env.get("PYTHONPATH")) if p)
        self.name, self.tree = name, tree
        command = [sys.executable, __file__, "--serve-variant", name, "--threads", str(threads),
                   "--prefill-tokens", str(prefill_tokens), "--batch", str(batch),
                   "--shared-prefix", str(shared_prefix)]
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.bytes_per_token = self._reply()["bytes_per_token"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.tree} worker for {self.name!r} exited (exit status {self.proc.wait()})")
        return json.loads(line)

    def round(self, seed: int) -> dict:
        self.proc.stdin.write(f"round {seed}\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def summarize(rounds: list[dict], nbytes: int, bandwidth: float) -> dict:
    def median(key: str) -> float | None:
        values = [r[key] for r in rounds if r[key] is not None]
        return statistics.median(values) if values else None

    single = median("single_ms_per_token")
    achieved = nbytes / (single / 1000)
    return dict(bytes_per_token=nbytes, single_ms_per_token=single, batch_tokens_per_s=median("batch_tokens_per_s"),
                single_cpu_ms_per_step=median("single_cpu_ms_per_step"),
                batch_cpu_ms_per_step=median("batch_cpu_ms_per_step"), prefill_s=median("prefill_s"),
                achieved_bytes_per_s=achieved, bandwidth_fraction=achieved / bandwidth,
                step_ms={k: statistics.median(r["steps"][k] for r in rounds) for k in rounds[0]["steps"]},
                rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--against", metavar="SRC", help="another tree's src/ directory, run side by side")
    parser.add_argument("--batch", type=int, default=BATCH, help="concurrent requests of the batch run")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt of the batch run opens with (a shared system prompt)")
    parser.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS, help="one prefill per round; 0: none")
    parser.add_argument("--out", default="results/bench_decode.json")
    parser.add_argument("--serve-variant", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_variant:
        return serve_variant(args.serve_variant, args.threads, args.prefill_tokens, args.batch, args.shared_prefix)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    bandwidth = memory_read_bandwidth(args.threads)
    print(f"memory read bandwidth ({args.threads} thread): {bandwidth / 1e9:.1f} GB/s")
    trees = {"this": None} if args.against is None else {"this": None, "against": args.against}
    workers = {(n, t): Worker(n, t, args.threads, args.prefill_tokens, args.batch, args.shared_prefix, src) for n in names for t, src in trees.items()}
    rounds, loads = defaultdict(list), []

    def summaries() -> dict:
        return {key: dict(weights=key[0], tree=key[1], **summarize(rounds[key], w.bytes_per_token, bandwidth))
                for key, w in workers.items()}

    def write(results: dict, rounds_done: int) -> None:  # after every round: a long run's rounds so far survive
        write_results(args.out, dict(bandwidth_bytes_per_s=bandwidth, threads=args.threads,
                                     prompt_tokens=PROMPT_TOKENS, output_tokens=OUTPUT_TOKENS, batch=args.batch,
                                     shared_prefix=args.shared_prefix,
                                     prefill_tokens=args.prefill_tokens, against=args.against,
                                     rounds_done=rounds_done, load_averages=loads, results=list(results.values())))

    try:
        for r in range(args.rounds):
            order = list(workers) if r % 2 == 0 else list(workers)[::-1]
            for key in order:
                rounds[key].append(workers[key].round(seed=r))
            loads.append(os.getloadavg()[0])
            write(summaries(), r + 1)
            print(f"round {r + 1}/{args.rounds} done (load average {loads[-1]:.1f})", flush=True)
    finally:
        for w in workers.values():
            w.close()
    results = summaries()
    print(f"\n{'weights':27} {'tree':7} {'MB/token':>8} {'ms/token':>8} {'of bw':>6} {'cpu ms/step':>11}"
          f" {f'{args.batch}-req tok/s':>11} {f'{args.batch}-req cpu ms/step':>17} {'prefill s':>9}"
          f" {'cpu: proj':>9} {'other fwd':>9} {'lm_head':>7} {'non-model':>9}")
    for row in results.values():
        steps = row["step_ms"]
        print(f"{row['weights']:27} {row['tree']:7} {row['bytes_per_token'] / 1e6:8.1f} "
              f"{row['single_ms_per_token']:8.1f} {row['bandwidth_fraction']:6.0%} "
              f"{row['single_cpu_ms_per_step']:11.1f} {row['batch_tokens_per_s']:11.1f} "
              f"{row['batch_cpu_ms_per_step']:17.1f} {row['prefill_s'] or float('nan'):9.2f} {steps['cpu projections']:9.1f} "
              f"{steps['cpu forward'] - steps['cpu projections']:9.1f} {steps['cpu lm_head']:7.1f} "
              f"{steps['cpu step'] - steps['cpu forward'] - steps['cpu lm_head']:9.2f}")
    if args.against:
        print("\nthis tree / the other, CPU ms per decode step (median of the per-round ratios; min - max):")
        for n in names:
            parts = []
            for key in ("single_cpu_ms_per_step", "batch_cpu_ms_per_step"):
                ratios = [a[key] / b[key] for a, b in zip(rounds[(n, "this")], rounds[(n, "against")], strict=True)]
                parts.append(f"{'1 request' if key.startswith('single') else f'{args.batch} requests'} "
                             f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f})")
            print(f"  {n:27} " + ", ".join(parts))
    print(f"\nload average during the rounds: {min(loads):.1f} - {max(loads):.1f}")


if __name__ == "__main__":
    main()
