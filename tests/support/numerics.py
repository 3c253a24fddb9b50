"""Records what a run computed, to compare two runs bit for bit: the KV bytes written at every position (keyed by
the tokens up to it, so a position computed once and then reused from the cache is still found) and the logits at
every sampled position (per prompt, in order). ``NumericsRecorder(llm)`` wraps its model runner; ``differences``
says what two recordings disagree on."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from kvprefix import LLM


def context_key(tokens: list[int]) -> str:
    """Names a position by its context: the tokens up to and including it."""
    return hashlib.sha256(repr(tokens).encode()).hexdigest()


@dataclass
class NumericsRecorder:
    """Every forward of ``llm`` records the K/V its new tokens wrote (all layers, at the cache's dtype) and the
    float32 logits it sampled from."""

    llm: LLM
    kv: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: dict[tuple[int, ...], list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        runner = self.llm.llm_engine.runner
        execute = runner.execute

        def recording_execute(sched, sample_rows, score_rows=()):
            result = execute(sched, sample_rows, score_rows)
            self._record(runner, sched, sample_rows, result[0])
            return result

        runner.execute = recording_execute

    def _record(self, runner, sched, sample_rows, logits) -> None:
        block_size = runner.block_size
        for s in sched.scheduled:
            req = s.request
            blocks = runner.manager.get_block_ids(req.request_id)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens):
                slot = blocks[pos // block_size] * block_size + pos % block_size
                key = context_key(req.token_ids[: pos + 1])
                self.kv[key] = torch.stack([layer.kv.flatten(0, 1)[slot] for layer in runner.kv_caches]).clone()
        for row, i in enumerate(sample_rows):
            req = sched.scheduled[i].request
            self.logits.setdefault(tuple(req.token_ids[: req.num_prompt_tokens]), []).append(logits[row].clone())

    def prefix_kv(self, tokens: list[int]) -> list[torch.Tensor]:
        """The recorded K/V of each position of ``tokens`` (KeyError for one this run never computed)."""
        return [self.kv[context_key(tokens[: i + 1])] for i in range(len(tokens))]


def differences(a: NumericsRecorder, b: NumericsRecorder, prefix: list[int]) -> dict[str, float]:
    """How far two recordings are apart: positions of ``prefix`` whose KV bytes differ, sampled positions whose
    logits differ (prompts both recorded), and the largest absolute logit difference; all 0 when bitwise equal."""
    kv_diff = sum(not torch.equal(x, y) for x, y in zip(a.prefix_kv(prefix), b.prefix_kv(prefix), strict=True))
    shared = a.logits.keys() & b.logits.keys()
    assert shared, "the recordings share no prompt"
    unequal, largest = 0, 0.0
    for prompt in shared:
        for x, y in zip(a.logits[prompt], b.logits[prompt], strict=False):
            if not torch.equal(x, y):
                unequal += 1
                largest = max(largest, (x - y).abs().max().item())
    return {"prefix_kv_positions": kv_diff, "logit_positions": unequal, "max_logit_diff": largest}
