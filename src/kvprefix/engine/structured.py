"""Structured outputs with llguidance: a request's schema, regex, choices or grammar becomes a matcher that masks
the logits of each step to the tokens that keep the output in the language. Why llguidance: docs/server.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import llguidance
import torch

from kvprefix.engine.sampling_params import StructuredOutputsParams
from kvprefix.tokenizer.tokenizer import Tokenizer

MAX_SPEC_CHARS = 65536  # a schema (as JSON text) or a grammar
MAX_REGEX_CHARS = 4096
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# Compact JSON: no free whitespace between tokens (an unconstrained model can otherwise emit it without end).
_JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``spec``; ValueError (naming the field) when it is too large or does not compile.

    Kept on ``spec``: the server compiles it to answer a 400 before a stream starts, and the engine reuses it."""
    grammar = spec.__dict__.get("_grammar")
    if grammar is None:
        grammar = _compile(spec)
        object.__setattr__(spec, "_grammar", grammar)  # a frozen dataclass: a cache, not a field
    return grammar


def _compile(spec: StructuredOutputsParams) -> str:
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        text = schema if isinstance(schema, str) else json.dumps(schema)
        _bounded("json", text, MAX_SPEC_CHARS)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"json: not a usable JSON schema: {exc}") from None
    elif spec.regex is not None:
        _bounded("regex", spec.regex, MAX_REGEX_CHARS)
        grammar = llguidance.LLMatcher.grammar_from_regex(spec.regex)
    elif spec.choice is not None:
        if not 0 < len(spec.choice) <= MAX_CHOICES or not all(isinstance(c, str) and c for c in spec.choice):
            raise ValueError(f"choice: give 1 to {MAX_CHOICES} non-empty strings")
        for c in spec.choice:
            _bounded("choice", c, MAX_CHOICE_CHARS)
        # Each choice as a Lark string literal (JSON's escapes are Lark's).
        grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    else:
        _bounded("grammar", spec.grammar, MAX_SPEC_CHARS)
        grammar = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        kind = next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(spec, k))
        raise ValueError(f"{kind}: {error.splitlines()[0]}")
    return grammar


def _bounded(name: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise ValueError(f"{name}: at most {limit} characters, got {len(text)}")


class _SpmVocabView:
    """What llguidance.TokenizerWrapper reads of a vocabulary: each token's bytes, the special ids, and a
    tokenizing of text that continues a run of text (no BOS, no leading space of its own)."""

    def __init__(self, tokenizer: Tokenizer):
        from kvprefix.tokenizer.gguf_spm import CONTROL, UNKNOWN

        self._spm = spm = tokenizer.spm
        self.eos_token_id = spm.special.eos
        self.bos_token_id = spm.special.bos
        self.tokens = [spm.piece(i, special=True) for i in range(len(spm.tokens))]
        self.special_token_ids = [i for i, kind in enumerate(spm.types) if kind in (CONTROL, UNKNOWN)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._spm.encode_continuation(text)


_BIT_INDEX = torch.arange(32, dtype=torch.int32)


class GrammarMasks:
    """The vocabulary as llguidance sees it (built once per engine), matchers over it, and the masking step."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance.hf  # transformers' side of llguidance: loaded with the first structured request

        if tokenizer.hf is not None:
            self.tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=vocab_size)
        else:  # a GGUF SentencePiece vocabulary: llguidance gets its tokens' bytes and its tokenizing
            view = _SpmVocabView(tokenizer)
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=vocab_size)

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, grammar)

    def apply(self, logits: torch.Tensor, matchers: Sequence[llguidance.LLMatcher | None]) -> torch.Tensor:
        """Sets to -inf, in place, each constrained row's logits of tokens its grammar does not allow now.

        Unpacks llguidance's bitmask here (bit t of word t // 32 = token t allowed): llguidance.torch's kernel needs
        torch.compile, slow on the first request and a C++ compiler on CPU."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        words = (self.tokenizer.vocab_size + 31) // 32
        bitmask = torch.empty((len(rows), words), dtype=torch.int32)
        for j, i in enumerate(rows):
            matchers[i].unsafe_compute_mask_ptr(bitmask[j].data_ptr(), words * 4)
        allowed = ((bitmask.unsqueeze(-1) >> _BIT_INDEX) & 1).reshape(len(rows), words * 32).bool()
        vocab = logits.shape[-1]
        if vocab > allowed.shape[1]:  # logits past the grammar's vocabulary: never allowed
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed[:, :vocab].to(logits.device), float("-inf"))
        return logits
