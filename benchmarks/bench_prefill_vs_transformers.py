"""Cold prefill, kvprefix against transformers on the same weights, with the same logits work (the last position
only: transformers' ``logits_to_keep=1``, kvprefix's driver projects only the row that samples).

Models: the built-in default (SmolLM2-135M-Instruct, Llama) and the random Qwen2.5-0.5B-shaped checkpoint of
bench_engine.py (qwen2, qkv bias, vocabulary 151,936), or any ``--models`` paths. Both sides hold identical weights
(transformers' Llama/Qwen2 gets ``CausalLM.checkpoint_views()``, the checkpoint's own names). Each repeat runs both,
alternating which goes first, so load on a shared machine falls on both alike; after a warm-up, the table gives
the medians and the median of the per-repeat ratios kvprefix / transformers (< 1.0: kvprefix is faster), in CPU
time of the calling thread (with --threads 1 all of a forward's work runs there; unlike wall time it leaves out the
time other processes hold the core, which on 2 shared cores scattered wall-time ratios from 0.6 to 1.1) and in wall
time.

    python benchmarks/bench_prefill_vs_transformers.py [--models default,qwen2.5-0.5b-shape] [--tokens 512,1024]
        [--dtypes float32,bfloat16] [--threads 1] [--repeats 5] [--out results/bench_prefill_vs_transformers.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from kvprefix.cache.default_model import default_model_path
from kvprefix.model import allocate_kv_cache, load_model
from kvprefix.model.loader import resolve_dtype

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from harness import write_results
from support.paged import Chunk, run_batch  # noqa: E402

BLOCK_SIZE = 16
QWEN_SHAPE = "qwen2.5-0.5b-shape"


def model_path(name: str) -> str:
    if name == "default":
        return default_model_path()
    if name == QWEN_SHAPE:
        from harness import ensure_checkpoint

        return ensure_checkpoint("results/qwen2.5-0.5b-random")
    return name


def transformers_twin(model, dtype: torch.dtype):
    """transformers' Llama or Qwen2 with ``model``'s config and weights."""
    import transformers

    c = model.config
    common = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attn_implementation="sdpa")
    if c.model_type == "llama" and not c.qkv_bias and not c.qk_norm:
        twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=c.head_dim, **common))
    elif c.model_type == "qwen2" and c.head_dim == c.hidden_size // c.num_attention_heads:
        twin = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        raise SystemExit(f"this benchmark builds a transformers Llama or Qwen2; {c.model_type} is not one")
    twin = twin.to(dtype).eval()
    missing, unexpected = twin.load_state_dict(model.checkpoint_views(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise SystemExit(f"weights do not line up: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return twin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=f"default,{QWEN_SHAPE}")
    parser.add_argument("--tokens", default="512,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/bench_prefill_vs_transformers.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{args.threads} thread(s), median of {args.repeats} repeats, order alternating")
    print(f"{'model':20} {'dtype':9} {'tokens':>6} {'kvprefix cpu ms':>15} {'transformers cpu ms':>19} {'ratio':>6}"
          f" {'range':>11} {'wall ratio':>10} {'range':>11}")
    for model_name in args.models.split(","):
        path = model_path(model_name)
        for dtype in map(resolve_dtype, args.dtypes.split(",")):
            ours = load_model(path, dtype)
            theirs = transformers_twin(ours, dtype)
            for n in map(int, args.tokens.split(",")):
                rows.append(measure(model_name, ours, theirs, dtype, n, args.repeats))
            del ours, theirs
            gc.collect()
    write_results(args.out, {"threads": args.threads, "rows": rows})


def measure(model_name: str, ours, theirs, dtype: torch.dtype, n: int, repeats: int) -> dict:
    ids = torch.randint(0, ours.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    kv = allocate_kv_cache(ours.config, n // BLOCK_SIZE + 2, BLOCK_SIZE, dtype, "cpu")
    chunk = Chunk(ids, 0, n, list(range(1, n // BLOCK_SIZE + 2)))
    batch = torch.tensor([ids])
    runs = {"kvprefix": lambda: run_batch(ours, kv, BLOCK_SIZE, [chunk]),
            "transformers": lambda: theirs(batch, use_cache=False, logits_to_keep=1).logits}
    cpu, wall = {name: [] for name in runs}, {name: [] for name in runs}
    for repeat in range(repeats + 1):
        order = list(runs) if repeat % 2 else list(runs)[::-1]
        for name in order:
            start, start_cpu = time.perf_counter(), time.thread_time()
            with torch.inference_mode():
                runs[name]()
            if repeat:  # the first round is a warm-up
                cpu[name].append(time.thread_time() - start_cpu)
                wall[name].append(time.perf_counter() - start)
    row = {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "tokens": n}
    for kind, times in (("cpu", cpu), ("wall", wall)):
        ratios = [a / b for a, b in zip(times["kvprefix"], times["transformers"], strict=True)]
        row[kind] = {"kvprefix_s": statistics.median(times["kvprefix"]),
                     "transformers_s": statistics.median(times["transformers"]),
                     "ratio_median": statistics.median(ratios), "ratios": ratios,
                     "kvprefix_times_s": times["kvprefix"], "transformers_times_s": times["transformers"]}
    c, w = row["cpu"], row["wall"]
    print(f"{model_name:20} {row['dtype']:9} {n:>6} {1000 * c['kvprefix_s']:15.1f} {1000 * c['transformers_s']:19.1f}"
          f" {c['ratio_median']:6.2f} {min(c['ratios']):5.2f}-{max(c['ratios']):<5.2f}"
          f" {w['ratio_median']:10.2f} {min(w['ratios']):5.2f}-{max(w['ratios']):<5.2f}", flush=True)
    return row


if __name__ == "__main__":
    main()
