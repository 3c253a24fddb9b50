"""Cold prefill, kvprefix against transformers on the same weights, with the same logits work (the last position
only: transformers' ``logits_to_keep=1``, kvprefix's runner projects only rows that sample).

Both models hold identical weights (transformers' LlamaForCausalLM gets kvprefix's state dict: the parameter names
are Hugging Face's). Each repeat runs kvprefix then transformers, so load on a shared machine falls on both alike;
figures are medians after a warm-up, and the ratio is kvprefix / transformers (<= 1.0: kvprefix is as fast).

    python benchmarks/bench_prefill_vs_transformers.py [--model PATH] [--tokens 512,1024] [--dtypes float32,bfloat16]
        [--threads 1] [--repeats 5] [--out results/bench_prefill_vs_transformers.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from paged import Chunk, run_batch  # noqa: E402

BLOCK_SIZE = 16


def transformers_twin(model, dtype: torch.dtype):
    """transformers' Llama with ``model``'s config and weights."""
    import transformers

    c = model.config
    if c.model_type != "llama" or c.qkv_bias or c.qk_norm:
        raise SystemExit(f"this benchmark builds a transformers Llama; {c.model_type} is not one")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings, attn_implementation="sdpa")
    twin = transformers.LlamaForCausalLM(config).to(dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=False)
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", default="512,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/bench_prefill_vs_transformers.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    rows = []
    print(f"model {path}, {args.threads} thread(s), median of {args.repeats} interleaved repeats")
    print(f"{'dtype':9} {'tokens':>6} {'kvprefix ms':>12} {'transformers ms':>16} {'ratio':>6}")
    for dtype in map(resolve_dtype, args.dtypes.split(",")):
        ours = load_model(path, dtype)
        theirs = transformers_twin(ours, dtype)
        for n in map(int, args.tokens.split(",")):
            ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
            kv = allocate_kv_cache(ours.config, n // BLOCK_SIZE + 2, BLOCK_SIZE, dtype, "cpu")
            chunk = Chunk(ids, 0, n, list(range(1, n // BLOCK_SIZE + 2)))
            batch = torch.tensor([ids])
            runs = {"kvprefix": lambda: run_batch(ours, kv, BLOCK_SIZE, [chunk]),  # noqa: B023 (called at once)
                    "transformers": lambda: theirs(batch, use_cache=False, logits_to_keep=1)}  # noqa: B023
            times = {name: [] for name in runs}
            for repeat in range(args.repeats + 1):
                for name, run in runs.items():
                    start = time.perf_counter()
                    with torch.inference_mode():
                        run()
                    if repeat:
                        times[name].append(time.perf_counter() - start)
            a, b = statistics.median(times["kvprefix"]), statistics.median(times["transformers"])
            name = str(dtype).removeprefix("torch.")
            rows.append({"dtype": name, "tokens": n, "kvprefix_s": a, "transformers_s": b, "ratio": a / b})
            print(f"{name:9} {n:>6} {1000 * a:12.1f} {1000 * b:16.1f} {a / b:6.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": path, "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
