"""LoRA adapters in the engine: what does serving adapters cost, and does each adapter's prefix cache hit?

Model: random weights with SmolLM2-135M's shape (the built-in default model's: hidden 576, 30 layers, 9 heads, 3 KV
heads, intermediate 1,536, vocabulary 49,152), float32 on CPU. Adapters: random PEFT adapters on every projection
(q/k/v/o/gate/up/down), written by peft.

  - Throughput: a batch of 20 requests (64-token prompts, all fresh, 32 greedy output tokens each) on the base model
    alone, and mixed: 4 on the base and 4 on each of 4 adapters (rank 8, then rank 16), all in the same steps
    (--max-loras 4). Output tokens per second over the whole batch (prefill included), each configuration run
    --rounds times, interleaved (base, rank 8, rank 16, base, ...), on one engine; the median round is reported,
    and the base model on an engine without LoRA too (what the hooks cost when no adapter is in the batch).
  - Hit rate: a 512-token system prompt shared by 8 requests each of the base model and 4 adapters (each with a
    unique 16-48-token question), sent adapter by adapter in a mixed order: the prefix-cache hit rate per adapter
    (cached prompt tokens / prompt tokens). Each adapter's first request misses (its namespace is its own); the
    rest hit its own copy of the system prompt.

    python benchmarks/bench_lora.py [--rounds 5] [--layers 30] [--out results/bench_lora.json]
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

from kvprefix import LLM, LoRARequest, SamplingParams
from kvprefix.model import write_random_lora_adapter

VOCAB = SMOLLM2_135M["vocab_size"] - 1000  # random prompt tokens stay clear of the special tokens at the top
ADAPTERS = 4
PER_MODEL = 4  # requests of the base model and of each adapter in the mixed batch
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32



def adapters(root: str, base: str, rank: int) -> list[LoRARequest]:
    out = []
    for k in range(ADAPTERS):
        path = os.path.join(root, f"adapter-r{rank}-{k}")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            write_random_lora_adapter(base, path, rank=rank, seed=100 * rank + k, scale=0.02)
        out.append(LoRARequest(f"r{rank}-{k}", 100 * rank + k, path))
    return out


def run_batch(llm: LLM, rng: random.Random, loras: list[LoRARequest | None]) -> float:
    """Output tokens per second of one batch, one fresh prompt per entry of ``loras``."""
    prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in loras]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def throughput(base: str, root: str, rounds: int) -> tuple[list[dict], dict]:
    lora_llm = LLM(base, dtype="float32", enable_lora=True, max_loras=ADAPTERS, max_lora_rank=16,
                   max_num_seqs=64, num_gpu_blocks=1024)
    plain_llm = LLM(base, dtype="float32", max_num_seqs=64, num_gpu_blocks=1024)
    batch = PER_MODEL * (ADAPTERS + 1)
    configs = {
        "base, LoRA off": (plain_llm, [None] * batch),
        "base, LoRA on": (lora_llm, [None] * batch),
        **{f"mixed, rank {r}": (lora_llm, [None] * PER_MODEL + [a for a in adapters(root, base, r)
                                                                for _ in range(PER_MODEL)])
           for r in (8, 16)},
    }
    rng = random.Random(0)
    for llm, loras in configs.values():  # warm-up: adapters loaded, first allocations made
        run_batch(llm, rng, loras)
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, (llm, loras) in configs.items():
            samples[name].append(run_batch(llm, rng, loras))
    base_tps = statistics.median(samples["base, LoRA on"])
    rows = [{"batch": name, "tokens/s (median)": statistics.median(s), "vs base": statistics.median(s) / base_tps,
             "min": min(s), "max": max(s)} for name, s in samples.items()]
    return rows, samples


def hit_rates(base: str, root: str) -> list[dict]:
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=ADAPTERS, max_lora_rank=16, num_gpu_blocks=2048)
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(512)]
    models: list[LoRARequest | None] = [None, *adapters(root, base, 8)]
    order = [m for _ in range(8) for m in models]
    rng.shuffle(order)
    params = SamplingParams(temperature=0, max_tokens=1)
    stats: dict[str, list[int]] = {}
    for lora in order:
        prompt = system + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 48))]
        out = llm.generate([prompt], params, lora_request=lora)[0]
        name = "base" if lora is None else lora.lora_name
        counts = stats.setdefault(name, [0, 0, 0])
        counts[0] += len(prompt)
        counts[1] += out.num_cached_tokens
        counts[2] += out.num_cached_tokens == 0
    return [{"model": name, "requests": 8, "prompt tokens": p, "cached tokens": c, "hit rate": c / p,
             "requests that missed": misses} for name, (p, c, misses) in stats.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    parser.add_argument("--root", default="/tmp/kvprefix-bench-lora", help="where checkpoint and adapters are kept")
    parser.add_argument("--out", default="results/bench_lora.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    base = ensure_smollm2_checkpoint(args.root, args.layers)
    rows, samples = throughput(base, args.root, args.rounds)
    hits = hit_rates(base, args.root)
    from harness import table

    print(table(rows, formats={"tokens/s (median)": ".1f", "vs base": ".2f", "min": ".1f", "max": ".1f"}))
    print()
    write_results(args.out, {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                             "layers": args.layers, "rounds": args.rounds, "throughput": rows,
                             "samples": samples, "hit_rates": hits},
                  hits, formats={"hit rate": ".3f"})


if __name__ == "__main__":
    main()
