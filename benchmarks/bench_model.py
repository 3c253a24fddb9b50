"""Forward-pass speed of a model over the paged KV cache (no scheduler, no sampling), dtypes side by side.

Prefill of a whole prompt, prefill of a 64-token suffix after a cached 1,024-token prefix, and batched decode.
The dtypes are interleaved (each timed repeat runs every dtype once, in turn), so load from other processes on a
shared machine falls on all of them alike; each figure is the median of the repeats after a warm-up, and the table
gives each dtype's time relative to the first. Default model: the built-in default (SmolLM2-135M-Instruct).

    python benchmarks/bench_model.py [--model PATH] [--dtypes float32,bfloat16] [--threads 1] [--repeats 5]
        [--out results/bench_model.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import allocate_kv_cache, load_model
from kvprefix.model.loader import resolve_dtype

# The reference driver the model tests use: builds AttentionMetadata for a list of sequence chunks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from harness import write_results
from support.paged import Chunk, run_batch  # noqa: E402

BLOCK_SIZE = 16
MAX_CONTEXT_BLOCKS = 2048 // BLOCK_SIZE + 2


def cases(vocab: int) -> list[tuple[str, int, list]]:
    """(name, tokens computed, batches to run in order: all but the last set up the cache, once; the last is timed,
    rewriting the same slots every repeat)."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    def blocks(seq: int) -> list[int]:
        return list(range(1 + seq * MAX_CONTEXT_BLOCKS, 1 + (seq + 1) * MAX_CONTEXT_BLOCKS))

    out = []
    for n in (512, 1024, 2048):
        out.append((f"prefill {n}", n, [[Chunk(tokens(n), 0, n, blocks(0))]]))
    prompt = tokens(1024 + 64)
    out.append(("suffix 64 after cached 1024", 64,
                [[Chunk(prompt, 0, 1024, blocks(0))], [Chunk(prompt, 1024, 64, blocks(0))]]))
    for batch in (1, 8, 32):
        seqs = [tokens(512) for _ in range(batch)]
        fill = [[Chunk(s, 0, 511, blocks(i))] for i, s in enumerate(seqs)]
        out.append((f"decode batch {batch}, context 512", batch,
                    fill + [[Chunk(s, 511, 1, blocks(i)) for i, s in enumerate(seqs)]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in default model)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", default=None, help="comma-separated name prefixes to run (default: all)")
    parser.add_argument("--out", default="results/bench_model.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    dtypes = [resolve_dtype(d) for d in args.dtypes.split(",")]
    models = {d: load_model(path, dtype=d) for d in dtypes}
    config = models[dtypes[0]].config
    kv = {d: allocate_kv_cache(config, 1 + 32 * MAX_CONTEXT_BLOCKS, BLOCK_SIZE, d, "cpu") for d in dtypes}
    names = [str(d).removeprefix("torch.") for d in dtypes]
    print(f"model {path}, {args.threads} thread(s), median of {args.repeats} interleaved repeats")
    print(f"{'case':32} " + " ".join(f"{n + ' ms':>14}" for n in names) + " " +
          " ".join(f"{n + '/' + names[0]:>20}" for n in names[1:]))
    results = []
    selected = args.cases.split(",") if args.cases else None
    for name, num_tokens, batches in cases(config.vocab_size):
        if selected and not any(name.startswith(s) for s in selected):
            continue
        times: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
        for repeat in range(args.repeats + 1):
            for d in dtypes:
                for setup in batches[:-1] if repeat == 0 else ():
                    run_batch(models[d], kv[d], BLOCK_SIZE, setup)
                start = time.perf_counter()
                run_batch(models[d], kv[d], BLOCK_SIZE, batches[-1])
                if repeat:  # the first round is the warm-up
                    times[d].append(time.perf_counter() - start)
        medians = [statistics.median(times[d]) for d in dtypes]
        for n, s in zip(names, medians, strict=True):
            results.append({"case": name, "dtype": n, "threads": args.threads, "tokens": num_tokens, "seconds": s,
                            "tokens_per_s": num_tokens / s, "relative": s / medians[0]})
        print(f"{name:32} " + " ".join(f"{1000 * s:14.1f}" for s in medians) + " " +
              " ".join(f"{s / medians[0]:20.2f}" for s in medians[1:]), flush=True)
    write_results(args.out, {"model": path, "results": results})


if __name__ == "__main__":
    main()
