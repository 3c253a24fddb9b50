"""Forward-pass speed of the built-in default model over the paged KV cache (no scheduler, no sampling).

Prefill of a whole prompt, prefill of a 64-token suffix after a cached 2,048-token prefix, and batched decode,
for float32 and bfloat16, with 1 and 2 CPU threads. Each figure is the median of a few timed runs after a warm-up.

    python benchmarks/bench_model.py [--dtypes float32,bfloat16] [--threads 1,2] [--out results/bench_model.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvprefix.model import allocate_kv_cache, default_model_path, load_model
from kvprefix.model.loader import resolve_dtype

# The reference driver the model tests use: builds AttentionMetadata for a list of sequence chunks.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from paged import Chunk, run_batch  # noqa: E402

BLOCK_SIZE = 16


def median_seconds(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model, dtype: torch.dtype) -> list[dict]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rows = []
    kv = allocate_kv_cache(model.config, 1 + 64 * 33, BLOCK_SIZE, dtype, "cpu")
    for n in (512, 2048, 4096):
        chunk = Chunk(tokens(n), 0, n, list(range(1, n // BLOCK_SIZE + 2)))
        s = median_seconds(lambda c=chunk: run_batch(model, kv, BLOCK_SIZE, [c]), repeats=3)
        rows.append({"case": f"prefill {n}", "tokens": n, "seconds": s})
    prompt = tokens(2048 + 64)
    blocks = list(range(1, 2048 // BLOCK_SIZE + 6))
    run_batch(model, kv, BLOCK_SIZE, [Chunk(prompt, 0, 2048, blocks)])
    s = median_seconds(lambda: run_batch(model, kv, BLOCK_SIZE, [Chunk(prompt, 2048, 64, blocks)]))
    rows.append({"case": "suffix 64 after cached 2048", "tokens": 64, "seconds": s})
    for batch in (1, 16, 64):
        chunks = [Chunk(tokens(512), 511, 1, list(range(1 + i * 33, 1 + (i + 1) * 33))) for i in range(batch)]
        s = median_seconds(lambda c=chunks: run_batch(model, kv, BLOCK_SIZE, c))
        rows.append({"case": f"decode batch {batch}, context 512", "tokens": batch, "seconds": s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--out", default="results/bench_model.json")
    args = parser.parse_args()
    path = default_model_path()
    results = []
    print(f"{'dtype':9} {'threads':>7}  {'case':32} {'ms':>8} {'tokens/s':>9}")
    for dtype_name in args.dtypes.split(","):
        dtype = resolve_dtype(dtype_name)
        model = load_model(path, dtype=dtype)
        for threads in map(int, args.threads.split(",")):
            torch.set_num_threads(threads)
            for row in measure(model, dtype):
                row.update(dtype=str(dtype).removeprefix("torch."), threads=threads)
                row["tokens_per_s"] = row["tokens"] / row["seconds"]
                results.append(row)
                print(
                    f"{row['dtype']:9} {threads:>7}  {row['case']:32} {row['seconds'] * 1000:8.1f} "
                    f"{row['tokens_per_s']:9.0f}"
                )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
