"""Tokenizing a log fast: the same system prompt, tools and history come back on every request, so the text
between two added tokens (the pieces a Hugging Face tokenizer tokenizes independently) is tokenized once.

``SegmentMemoTokenizer`` is a drop-in for ``kvprefix.prompts.Tokenizer`` inside ``render_body``: the renderer stays
the one renderer, only its ``encode`` is memoized. Its first encodings are checked against the plain tokenizer,
and any disagreement (a tokenizer whose pieces interact) turns the memo off for good.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvprefix.prompts import Tokenizer

_CHECKED = 64  # encodings compared with the plain tokenizer before the memo is trusted
_MAX_PIECES = 1 << 16  # memo entries (least recently used dropped): bounded by distinct content, then by this


class SegmentMemoTokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.inner = tokenizer
        added = {t.content: i for i, t in tokenizer.hf.added_tokens_decoder.items()}
        self._added_ids = added
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None
        self._memo: OrderedDict[str, list[int]] = OrderedDict()
        self._checks_left = _CHECKED
        self.enabled = self._split is not None

    # What render_chat / render_completion use of a tokenizer, delegated.
    @property
    def special_tokens(self) -> tuple[str, ...]:
        return self.inner.special_tokens

    @property
    def max_chars_per_token(self) -> int:
        return self.inner.max_chars_per_token

    @property
    def chat_template(self) -> str | None:
        return self.inner.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any):
        return self.inner.apply_chat_template(messages, **kwargs)

    def encode_literal(self, text: str) -> list[int]:
        return self.inner.encode_literal(text)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or not self.enabled:  # a BOS or post-processor would sit between pieces
            return self.inner.encode(text, add_special_tokens=add_special_tokens)
        ids = self._encode_pieces(text)
        if self._checks_left:
            self._checks_left -= 1
            if ids != self.inner.encode(text, add_special_tokens=False):
                self.enabled = False
                self._memo.clear()
                return self.inner.encode(text, add_special_tokens=False)
        return ids

    def _encode_pieces(self, text: str) -> list[int]:
        out: list[int] = []
        memo, added = self._memo, self._added_ids
        for piece in self._split.split(text):
            if not piece:
                continue
            special = added.get(piece)
            if special is not None:
                out.append(special)
                continue
            ids = memo.get(piece)
            if ids is None:
                ids = memo[piece] = self.inner.encode(piece, add_special_tokens=False)
                if len(memo) > _MAX_PIECES:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(piece)
            out += ids
        return out
