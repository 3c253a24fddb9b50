"""A tokenizer that tokenizes repeated text once: a fast tokenizer tokenizes the text between two added tokens on
its own, so those pieces (system prompt, tools, history) are memoized, LRU past ``capacity``.

``SegmentCachedTokenizer`` wraps a Tokenizer and stands in for it (only ``encode`` is memoized); the router and
the doctor use it. Used only where ``Tokenizer.tokenizes_between_added_tokens``; the first encodings are checked
against the plain tokenizer and any disagreement turns the memo off for good. New pieces go word by word
(``word_memo``) where the tokenizer allows.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

from kvprefix.tokenizer.tokenizer import Tokenizer
from kvprefix.tokenizer.word_memo import WordMemo

_CHECKED = 64  # encodings compared with the plain tokenizer before the memo is trusted


class SegmentCachedTokenizer:
    def __init__(self, tokenizer: Tokenizer, capacity: int = 1 << 16):
        self.inner = tokenizer
        self.capacity = capacity
        added = tokenizer.added_tokens
        self._added_ids = added
        pattern = "|".join(re.escape(t) for t in sorted(added, key=len, reverse=True))
        self._split = re.compile(f"({pattern})") if pattern else None
        first = {t[0] for t in added}
        self._first = first.pop() if len(first) == 1 else None  # what every added token starts with ("<", mostly)
        self._memo: OrderedDict[str, list[int]] = OrderedDict()
        self._checks_left = _CHECKED
        self.enabled = self._split is not None and tokenizer.tokenizes_between_added_tokens
        self._words = WordMemo.of(tokenizer) if self.enabled else None  # new pieces, word by word where it can

    def __getattr__(self, name: str) -> Any:  # everything but encode is the plain tokenizer's
        return getattr(self.inner, name)

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

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``[encode(t) for t in texts]``, with the pieces none of them has seen before tokenized in one call."""
        if add_special_tokens or not self.enabled or self._checks_left:  # checked one by one until trusted
            return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        memo, added = self._memo, self._added_ids
        split = [self._pieces(t) for t in texts]  # once per text: the split costs about as much as the lookups
        new = list(dict.fromkeys(p for pieces in split for p in pieces if p and p not in added and p not in memo))
        for piece, ids in zip(new, self._encode_new(new), strict=True):
            memo[piece] = ids
        while len(memo) > self.capacity:
            memo.popitem(last=False)
        return [self._encode_pieces(t, pieces) for t, pieces in zip(texts, split, strict=True)]

    def _encode_pieces(self, text: str, pieces: list[str] | None = None) -> list[int]:
        out: list[int] = []
        memo, added = self._memo, self._added_ids
        for piece in self._pieces(text) if pieces is None else pieces:
            if not piece:
                continue
            special = added.get(piece)
            if special is not None:
                out.append(special)
                continue
            ids = memo.get(piece)
            if ids is None:
                ids = memo[piece] = self._encode_new([piece])[0]
                if len(memo) > self.capacity:
                    memo.popitem(last=False)
            else:
                memo.move_to_end(piece)
            out += ids
        return out

    def _pieces(self, text: str) -> list[str]:
        """``self._split.split(text)``: the texts between added tokens and the tokens, alternately. Where the added
        tokens all start with one character, ``str.find`` jumps between its occurrences and tries the tokens only
        there (the regex alternation reads every character)."""
        first = self._first
        if first is None:
            return self._split.split(text)
        match, out, start = self._split.match, [], 0
        at = text.find(first)
        while at >= 0:
            m = match(text, at)
            if m is None:
                at = text.find(first, at + 1)
                continue
            out += (text[start:at], m.group())
            start = m.end()
            at = text.find(first, start)
        out.append(text[start:])
        return out

    def _encode_new(self, pieces: list[str]) -> list[list[int]]:
        """Pieces the memo does not hold: word by word (``WordMemo``) where it can, the rest in one call."""
        out = [None] * len(pieces) if self._words is None else self._words.encode_batch(pieces)
        rest = [k for k, ids in enumerate(out) if ids is None]
        for k, ids in zip(rest, self.inner.encode_batch([pieces[k] for k in rest], add_special_tokens=False),
                          strict=True):
            out[k] = ids
        return out  # type: ignore[return-value]
