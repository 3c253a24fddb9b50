"""Tokenizing plain ASCII text word by word: a byte-level BPE tokenizer tokenizes each word of its pre-tokenizer's
regex splits on its own, so text of mostly known words costs a regex pass and a lookup per word.

Exact only where the pre-tokenizer is regex splits plus a byte-level mapping (``WordMemo.of`` gives None otherwise)
and the text is printable ASCII, tabs and newlines, where Python's ``re`` agrees with the tokenizer's engine once
``\\p{L}`` and ``\\p{N}`` are ASCII classes. A word the pre-tokenizer would split turns the memo off for good.
"""

from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

# GPT-2's split, which a ByteLevel pre-tokenizer with use_regex applies (the tokenizers library's own).
_BYTE_LEVEL_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_PLAIN = re.compile(r"[\t\n\r\x20-\x7e]*")
_ASCII_CLASSES = {"L": "a-zA-Z", "N": "0-9"}
_LAST_SPLIT_CHARS = 1 << 22  # a piece and its words take about 11 bytes a character: under 50 MB


class WordMemo:
    def __init__(self, tokenizer: Any, regexes: list[str], capacity: int = 1 << 16):
        """``tokenizer``: a ``kvprefix.prompts.Tokenizer`` over a Hugging Face fast tokenizer; ``regexes``: its
        pre-tokenizer's splits, in order, each spelled for ASCII text."""
        self.tokenizer = tokenizer
        self.capacity = capacity
        # Split around each match (a group keeps the matches): the runs between matches and the matches, in order.
        self._splits = [re.compile(f"({r})") for r in regexes]
        self._memo: dict[str, list[int]] = {}
        # The last split's words of each piece the earlier splits gave, up to _LAST_SPLIT_CHARS characters.
        self._last_split: dict[str, list[str]] = {}
        self._last_split_chars = 0
        self.enabled = True

    @classmethod
    def of(cls, tokenizer: Any) -> WordMemo | None:
        """The memo for ``tokenizer``, or None where its pre-tokenizer is not one this module can replay."""
        hf = getattr(tokenizer, "hf", None)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
            return None
        regexes = _regexes(json.loads(backend.pre_tokenizer.__getstate__()))
        return None if regexes is None else cls(tokenizer, regexes)

    def words(self, text: str) -> list[str]:
        if len(self._splits) <= 1:  # the text is new (the segment memo had it otherwise): nothing to look up
            return [w for w in self._splits[0].split(text) if w] if self._splits else [text]
        pieces = [text]
        for split in self._splits[:-1]:
            pieces = [w for p in pieces for w in split.split(p) if w]
        last, seen = self._splits[-1], self._last_split
        words: list[str] = []
        for p in pieces:
            known = seen.get(p)
            if known is None:
                if len(seen) >= self.capacity or self._last_split_chars > _LAST_SPLIT_CHARS:
                    seen.clear()
                    self._last_split_chars = 0
                known = seen[p] = [w for w in last.split(p) if w]
                self._last_split_chars += len(p)
            words += known
        return words

    def encode_batch(self, texts: list[str]) -> list[list[int] | None]:
        """Each text's token ids (no special tokens added), or None for a text this memo does not tokenize. The
        texts hold no added token (``kvprefix.prompts.SegmentCachedTokenizer`` splits them out first)."""
        if not self.enabled:
            return [None] * len(texts)
        memo = self._memo
        split = [self.words(t) if _PLAIN.fullmatch(t) else None for t in texts]
        new = list(dict.fromkeys(w for words in split if words is not None for w in words if w not in memo))
        if new:
            if len(memo) + len(new) > self.capacity:
                memo.clear()  # every word of this batch is read back below: all of them go in again
                new = list(dict.fromkeys(w for words in split if words is not None for w in words))
            pre_tokenize = self.tokenizer.hf.backend_tokenizer.pre_tokenizer.pre_tokenize_str
            if any(len(pre_tokenize(w)) != 1 for w in new):  # a word the tokenizer would split again
                self.enabled = False
                memo.clear()
                self._last_split.clear()
                return [None] * len(texts)
            memo.update(zip(new, self.tokenizer.encode_batch(new, add_special_tokens=False), strict=True))
        join = chain.from_iterable
        return [None if words is None else list(join(map(memo.__getitem__, words))) for words in split]


def _regexes(config: dict) -> list[str] | None:
    """The splits of a pre-tokenizer made of regex splits (isolated matches) and a byte-level mapping without a
    prefix space, in order and spelled for ASCII text; None for any other pre-tokenizer."""
    steps = config["pretokenizers"] if config.get("type") == "Sequence" else [config]
    out = []
    for step in steps:
        kind = step.get("type")
        if kind == "Split":
            pattern = step.get("pattern", {})
            if "Regex" not in pattern or step.get("behavior") != "Isolated" or step.get("invert"):
                return None
            regex = pattern["Regex"]
        elif kind == "ByteLevel" and not step.get("add_prefix_space"):
            if not step.get("use_regex", True):
                continue
            regex = _BYTE_LEVEL_REGEX
        else:
            return None
        ascii_regex = _ascii(regex)
        if ascii_regex is None:
            return None
        out.append(ascii_regex)
    return out


def _ascii(regex: str) -> str | None:
    """``regex`` with ``\\p{L}`` and ``\\p{N}`` as ASCII classes (inside a class and out); None where it uses any
    other Unicode class, a capturing group, or does not compile (another engine's syntax), or matches nothing."""
    out, k, in_class = [], 0, False
    while k < len(regex):
        c = regex[k]
        if c == "\\" and regex[k + 1:k + 2] in ("p", "P"):
            m = re.match(r"\\p\{(\w+)\}", regex[k:])
            if m is None or m.group(1) not in _ASCII_CLASSES:
                return None
            chars = _ASCII_CLASSES[m.group(1)]
            out.append(chars if in_class else f"[{chars}]")
            k += m.end()
            continue
        if c == "\\":
            out.append(regex[k:k + 2])
            k += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            start = k + 1 + regex.startswith("^", k + 1)
            start += regex.startswith("]", start)  # a "]" first in a class is one of its characters
            out.append(regex[k:start])
            k = start
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        k += 1
    spelled = "".join(out)
    try:
        compiled = re.compile(spelled)
    except re.error:
        return None
    if compiled.groups or compiled.match(""):
        return None
    return spelled
