"""Streaming detokenization: token ids as they are sampled -> text deltas."""

from __future__ import annotations

from kvprefix.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming.

    Decodes a short window of recent tokens before and after the new ones and emits the difference (spacing that
    depends on neighbours stays right); holds back text ending in an incomplete UTF-8 sequence.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens = list(prompt_token_ids or [])
        # A few prompt tokens of left context (a word-start space may depend on them); their text is never emitted.
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - 5, 0)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Appends new tokens and returns the newly completed text (possibly empty)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the output: the text held back, an incomplete UTF-8 sequence shown as U+FFFD (as vLLM
        shows a character cut by max_tokens), instead of vanishing."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
