"""How often the built-in model's serving paths give the same greedy answer as a reference, and how far their
log-probabilities are apart: 100 chat prompts x 64 greedy tokens (ignore_eos), the same token ids on every path.

Paths: ``float32`` (the GGUF file dequantized, float32: the path the transformers parity tests hold), ``auto`` (the
file dequantized, dtype auto: ``--quantization none``), ``gguf`` (``--quantization gguf``, dtype auto: the file's own
Q4_1 blocks, the default where the CPU runs them natively) and, with ``--peer``, ``llama.cpp`` (its llama-server
on the same file, built by ``peers/llama_server.py``, one thread, greedy). kvprefix paths run in this process,
``--max-num-seqs`` requests at a time.
For every pair of paths (the earlier one as the reference): prompts whose 64 tokens are identical, mean tokens
equal before the first difference, and, over the positions before the first difference (same context, same
token), the mean |log p - log p_reference| of that token and the mean signed difference.

    python benchmarks/bench_agreement.py [--paths float32,auto,gguf] [--peer] [--prompts 100] [--tokens 64]
        [--threads 1] [--max-num-seqs 8] [--reuse EARLIER.json --reuse-paths float32,auto]
        [--out results/bench_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from harness import dense_quantization, free_port, write_results

SUBJECTS = ("photosynthesis", "the French Revolution", "black holes", "compound interest", "the water cycle",
            "vaccines", "the printing press", "volcanoes", "machine learning", "the Roman Empire", "honeybees",
            "electric cars", "the human heart", "climate change", "the internet", "chess", "coffee", "earthquakes",
            "the Moon landing", "recycling")
TEMPLATES = ("Explain {} to a ten-year-old.", "Give three facts about {}.", "Write a short poem about {}.",
             "What are the pros and cons of {}?", "Summarize the history of {} in two sentences.")
KVPREFIX_PATHS = {"float32": ("float32", "none"), "auto": ("auto", "none"), "gguf": ("auto", "gguf")}


def conversations(n: int) -> list[list[dict]]:
    prompts = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
    if n > len(prompts):
        raise SystemExit(f"--prompts {n}: at most {len(prompts)}")
    return [[{"role": "user", "content": p}] for p in prompts[:n]]


def prompt_ids(convs: list[list[dict]]) -> list[list[int]]:
    """The chat template rendered and tokenized once (the server's renderer), for every path."""
    from kvprefix.cache.default_model import default_model_path
    from kvprefix.prompts import render_chat
    from kvprefix.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_path())
    return [render_chat(tokenizer, c, add_generation_prompt=True).token_ids for c in convs]


def run_kvprefix(name: str, prompts: list[list[int]], tokens: int, max_num_seqs: int) -> list[dict]:
    """[{"tokens": [...], "logprobs": [...]}] per prompt."""
    from kvprefix.engine import LLM, SamplingParams

    dtype, quantization = KVPREFIX_PATHS[name]
    quantization = dense_quantization() if quantization == "none" else quantization
    llm = LLM(dtype=dtype, quantization=quantization, max_num_seqs=max_num_seqs, kv_cache_memory=256 << 20)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = []
    for out in outs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        result.append({"tokens": ids, "logprobs": [lp[t].logprob for t, lp in zip(ids, sample.logprobs, strict=True)]})
    return result


def run_llama_cpp(prompts: list[list[int]], tokens: int, threads: int) -> list[dict]:
    """llama-server's greedy tokens and their log-probabilities (before sampling) for the same token ids."""
    from bench_peer import find_gguf
    from peers.llama_server import LlamaServer, build_server

    gguf = find_gguf(None)
    server = LlamaServer(build_server(), gguf, free_port(), ["--threads", str(threads), "--threads-batch",
                                                             str(threads), "--parallel", "1", "--ctx-size", "4096"],
                         _log_path())
    try:
        server.wait_ready()
        result = []
        with httpx.Client(timeout=600) as client:
            for p in prompts:
                body = {"prompt": p, "n_predict": tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                        "n_probs": 1, "cache_prompt": False, "return_tokens": True}
                data = client.post(server.url + "/completion", json=body).json()
                probs = data["completion_probabilities"]
                result.append({"tokens": [int(t) for t in data["tokens"]],
                               "logprobs": [float(c["logprob"]) for c in probs]})
        return result
    finally:
        server.stop()


def _log_path():
    path = Path("results/bench_agreement.llama-server.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def compare(ref: list[dict], got: list[dict]) -> dict:
    """Agreement of ``got`` with ``ref``, prompt by prompt (see the module docstring)."""
    identical, agreed, abs_diffs, diffs = 0, [], [], []
    for r, g in zip(ref, got, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(r["tokens"], g["tokens"], strict=True)) if a != b),
                 len(r["tokens"]))
        identical += n == len(r["tokens"])
        agreed.append(n)
        for i in range(n):
            d = g["logprobs"][i] - r["logprobs"][i]
            diffs.append(d)
            abs_diffs.append(abs(d))
    return {"identical": identical, "prompts": len(ref), "mean_agreed_tokens": statistics.mean(agreed),
            "median_agreed_tokens": statistics.median(agreed), "mean_abs_logprob_diff": statistics.mean(abs_diffs),
            "mean_logprob_diff": statistics.mean(diffs), "positions_compared": len(diffs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="float32,auto,gguf")
    parser.add_argument("--peer", action="store_true", help="add llama.cpp's llama-server as a path")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--reuse", metavar="JSON", help="an earlier run's results: its paths listed here in --reuse-paths "
                        "are taken from it (same prompts and tokens) instead of run again")
    parser.add_argument("--reuse-paths", default="", help="comma-separated paths to take from --reuse")
    parser.add_argument("--out", default="results/bench_agreement.json")
    args = parser.parse_args()
    names = args.paths.split(",")
    unknown = [n for n in names if n not in KVPREFIX_PATHS]
    if unknown:
        parser.error(f"unknown paths {unknown}; known: {list(KVPREFIX_PATHS)} (and --peer)")
    torch.set_num_threads(args.threads)
    convs = conversations(args.prompts)
    prompts = prompt_ids(convs)
    results, seconds = {}, {}
    reused = [n for n in args.reuse_paths.split(",") if n]
    if reused:
        earlier = json.loads(Path(args.reuse).read_text())
        if earlier["prompts"] != [c[0]["content"] for c in convs] or earlier["config"]["tokens"] != args.tokens:
            parser.error(f"{args.reuse} ran other prompts or token counts")
        for name in reused:
            results[name], seconds[name] = earlier["results"][name], earlier["seconds"][name]
    for name in names:
        if name in results:
            continue
        start = time.perf_counter()
        results[name] = run_kvprefix(name, prompts, args.tokens, args.max_num_seqs)
        seconds[name] = time.perf_counter() - start
        print(f"{name}: {seconds[name]:.0f} s", file=sys.stderr, flush=True)
    if args.peer:
        start = time.perf_counter()
        results["llama.cpp"] = run_llama_cpp(prompts, args.tokens, args.threads)
        seconds["llama.cpp"] = time.perf_counter() - start
    rows = []
    order = list(results)
    for i, reference in enumerate(order):
        for name in order[i + 1:]:
            c = compare(results[reference], results[name])
            rows.append({"path": name, "against": reference, "identical answers": f"{c['identical']} of {c['prompts']}",
                         "mean tokens before first difference": c["mean_agreed_tokens"],
                         "mean |dlogprob|": c["mean_abs_logprob_diff"], "mean dlogprob": c["mean_logprob_diff"],
                         "positions": c["positions_compared"]})
    write_results(args.out, {"config": vars(args), "prompts": [c[0]["content"] for c in convs],
                             "seconds": seconds, "rows": rows, "results": results},
                  rows, formats={"mean tokens before first difference": ".1f", "mean |dlogprob|": ".4f",
                                 "mean dlogprob": "+.4f"})


if __name__ == "__main__":
    main()
