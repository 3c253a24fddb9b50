"""Turns a batch of logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeded sampling, logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprefix.engine.outputs import Logprob
from kvprefix.engine.request import Request


class Sampler:
    """Samples one token per row: argmax when greedy, else argmax of p / Exp(1) with one draw per row from its own
    generator when seeded, so a seeded sample does not depend on the rest of the batch."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.grammar_masks = None  # a GrammarMasks, set by the engine at its first structured request

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[list[int], list]:
        """``logits``: float32 [len(requests), vocab]. Returns token ids and, per row, a logprobs dict or None (its
        ``decoded_token``s are filled in where the outputs are read, off the engine thread)."""
        raw = logits
        if any(r.params.has_penalties for r in requests):
            logits = self._apply_penalties(logits.clone(), requests)
        if any(r.params.logit_bias for r in requests):
            logits = _add_logit_bias(logits if logits is not raw else logits.clone(), requests)
        if any(r.under_minimum() for r in requests):
            logits = _ban_stop_tokens(logits if logits is not raw else logits.clone(), requests)
        if any(r.matcher is not None for r in requests):
            logits = self.grammar_masks.apply(logits if logits is not raw else logits.clone(),
                                              [r.matcher for r in requests])
        if all(r.params.greedy for r in requests):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw, requests, token_list)

    def _apply_penalties(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        vocab = logits.shape[-1]
        for i, req in enumerate(requests):
            p = req.params
            if not p.has_penalties:
                continue
            out_ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
            row = logits[i]
            if p.repetition_penalty != 1:
                prompt_ids = torch.tensor(req.token_ids[: req.num_prompt_tokens], dtype=torch.long, device=row.device)
                seen = torch.bincount(prompt_ids, minlength=vocab)[:vocab].bool() | (counts > 0)
                penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row.copy_(torch.where(seen, penalized, row))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in requests], device=logits.device)
        scaled = logits / temps.unsqueeze(1)
        scaled = _top_k_top_p(scaled, requests)
        min_ps = [r.params.min_p for r in requests]
        probs = scaled.softmax(dim=-1)
        if any(min_ps):
            min_p = torch.tensor(min_ps, device=logits.device, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        race = torch.ones_like(probs)
        for i, req in enumerate(requests):
            if not req.params.greedy:
                race[i].exponential_(generator=self._generator_for(req))
        sampled = (probs / race).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        if req.generator is None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return req.generator

    def _logprobs(self, raw: torch.Tensor, requests: Sequence[Request], tokens: list[int]) -> list:
        out: list = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        logprobs = torch.log_softmax(raw[rows].float(), dim=-1)
        for row, i in zip(logprobs, rows, strict=True):
            params = requests[i].params
            out[i] = self._entry(row, tokens[i], params.logprobs, params.logprob_token_ids)
        return out

    def prompt_logprobs(self, logits: torch.Tensor, targets: Sequence[int], k: int) -> list[dict[int, Logprob]]:
        """``logits`` [len(targets), vocab] of the positions before each target prompt token: the raw logprob of
        each target and the k most likely tokens there, in the shape of sampled logprobs."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return [self._entry(row, t, k) for row, t in zip(logprobs, targets, strict=True)]

    def _entry(self, row: torch.Tensor, token: int, k: int, chosen_ids: list[int] | None = None) -> dict[int, Logprob]:
        """{token: its logprob and rank, then the top k, or ``chosen_ids`` with theirs}; ``decoded_token``s are
        filled by the reader."""
        k = min(k, row.shape[-1])
        chosen = row[token]
        entry = {token: Logprob(chosen.item(), int((row > chosen).sum().item()) + 1)}
        ids = [t for t in chosen_ids or () if t < row.shape[-1]]
        if ids:
            values = row[ids]
            ranks = (row.unsqueeze(0) > values.unsqueeze(1)).sum(dim=1) + 1
            for t, v, rank in zip(ids, values.tolist(), ranks.tolist(), strict=True):
                entry.setdefault(t, Logprob(v, rank))
        elif k:
            values, ids = row.topk(k)
            for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
                entry.setdefault(t, Logprob(v, rank))
        return entry


def _add_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """OpenAI's logit_bias: each row's biases added to its logits (ids beyond the model's logits are skipped: the
    server refuses them against the tokenizer's vocabulary)."""
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        bias = {t: b for t, b in (req.params.logit_bias or {}).items() if t < vocab}
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)
            logits[i, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def _ban_stop_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """min_tokens, min_characters: rows still under them cannot sample EOS (unless ignored) or a stop token (vLLM's
    meaning)."""
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        if req.under_minimum():
            banned = set(req.params.stop_token_set) | (set() if req.params.ignore_eos else set(req.eos_token_ids))
            ids = [t for t in banned if t < vocab]
            if ids:
                logits[i, ids] = float("-inf")
    return logits


def _top_k_top_p(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Masks tokens outside each row's top-k and top-p nucleus with -inf (rows without them are untouched)."""
    top_ks = [r.params.top_k for r in requests]
    top_ps = [r.params.top_p for r in requests]
    if not any(top_ks) and all(p >= 1.0 for p in top_ps):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([min(k, vocab) if k else vocab for k in top_ks], device=logits.device).unsqueeze(1)
    mask = positions >= k
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already cover top_p; the most likely token always stays.
    mask = (probs.cumsum(dim=-1) - probs) >= p
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
