"""Per-token cost of constraining sampling to a JSON schema on CPU: xgrammar vs llguidance, the two grammar
engines the issue allows, to choose one for structured outputs.

For each tokenizer (the built-in default model's, and a 32,000-token byte-level BPE trained here on Python's own
sources, a real model's vocabulary size) and each engine: compile the schema, then walk a valid document token by
token, timing for each token the mask computation plus applying it to a [1, vocab] float32 logits row, and the
token's acceptance. Engines alternate within each repeat (the machine is shared: compare the ratio).

    python benchmarks/bench_structured.py [--repeats 5] [--out results/bench_structured.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from harness import percentile, write_results

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "role": "editor",
                       "tags": ["math", "engines", "poetry", "notes"],
                       "address": {"city": "London", "zip": "W1 4AB"}})


def bpe_tokenizer(vocab_size: int):
    """A byte-level BPE trained on the standard library's sources: deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:400]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def walk(self, compiled, tokens: list[int], logits: torch.Tensor) -> list[float]:
        xgr = self.xgr
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.info.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            ok = matcher.accept_token(t)
            times.append(time.perf_counter() - start)
            assert ok, f"xgrammar refused token {t}"
        return times


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)

    def compile(self, schema: str):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema)
        return grammar, self.ll.LLMatcher(self.tok, grammar)  # the matcher builds the lexer: compile time

    def walk(self, compiled, tokens: list[int], logits: torch.Tensor) -> list[float]:
        lt = self.ll.torch
        matcher = self.ll.LLMatcher(self.tok, compiled[0])
        bitmask = lt.allocate_token_bitmask(1, self.tok.vocab_size)
        times = []
        for t in tokens:
            start = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            lt.apply_token_bitmask_inplace(logits, bitmask)
            ok = matcher.consume_token(t)
            times.append(time.perf_counter() - start)
            assert ok and not matcher.is_error(), matcher.get_error()
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from kvprefix.cache.default_model import default_model_path
    from kvprefix.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as cache:
        import os

        os.environ.setdefault("KVPREFIX_CACHE_DIR", cache)
        tokenizers = {"default model": Tokenizer(default_model_path()).hf, "BPE 32k": bpe_tokenizer(32000)}
        rows = []
        for label, hf in tokenizers.items():
            vocab = len(hf)
            tokens = hf.encode(DOCUMENT, add_special_tokens=False)
            engines = [XGrammar(hf, vocab), LLGuidance(hf, vocab)]
            per_token = {e.name: [] for e in engines}
            compile_s = {e.name: [] for e in engines}
            for _ in range(args.repeats):
                for e in engines:  # interleaved
                    start = time.perf_counter()
                    compiled = e.compile(json.dumps(SCHEMA))
                    compile_s[e.name].append(time.perf_counter() - start)
                    per_token[e.name] += e.walk(compiled, tokens, torch.zeros(1, vocab))
            for e in engines:
                rows.append({"tokenizer": label, "vocab": vocab, "engine": e.name, "tokens": len(tokens),
                             "compile_ms": 1000 * statistics.median(compile_s[e.name]),
                             "per_token_us_median": 1e6 * statistics.median(per_token[e.name]),
                             "per_token_us_p90": 1e6 * percentile(per_token[e.name], 90)})
    print(f"{'tokenizer':14} {'vocab':>6} {'engine':11} {'compile ms':>10} {'µs/token p50':>12} {'p90':>8}")
    for r in rows:
        print(f"{r['tokenizer']:14} {r['vocab']:6d} {r['engine']:11} {r['compile_ms']:10.1f} "
              f"{r['per_token_us_median']:12.1f} {r['per_token_us_p90']:8.1f}")
    for label in tokenizers:
        x, ll = (next(r for r in rows if r["tokenizer"] == label and r["engine"] == n)
                 for n in ("xgrammar", "llguidance"))
        print(f"{label}: llguidance / xgrammar per-token time = "
              f"{ll['per_token_us_median'] / x['per_token_us_median']:.2f}")
    if args.out:
        write_results(args.out, {"python": sys.version, "rows": rows})


if __name__ == "__main__":
    main()
