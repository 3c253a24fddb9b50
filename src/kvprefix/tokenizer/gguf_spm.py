"""The SentencePiece vocabulary of a GGUF file (``tokenizer.ggml.model`` "llama": Llama 2, Mistral v0.1, ...),
tokenized and detokenized as llama.cpp does (written from src/llama-vocab.cpp's rules; no code shared). Torch-free.

Tokenizing: special tokens written in the text are split out first (user-defined ones always, control and unknown
ones only when specials are parsed), longest spelling first. Each remaining run gets a leading space at the start or
after a split-out token, U+2581 for spaces, and is merged from its characters by highest-scoring pair (leftmost on
ties). A character not in the vocabulary becomes ``<0xXX>`` byte tokens (or the unknown token without them).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from kvprefix.tokenizer.gguf_file import GGUFFile

# gguf.TokenType
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_SPACE = "\u2581"


@dataclass(frozen=True)
class SpecialIds:
    bos: int | None
    eos: int | None
    unk: int | None


class SpmVocab:
    """A GGUF SentencePiece vocabulary: ``encode`` and ``decode`` with llama.cpp's results."""

    def __init__(self, gguf: GGUFFile) -> None:
        tokens = list(gguf.require("tokenizer.ggml.tokens"))
        n = len(tokens)
        # llama.cpp renames an empty entry (it could never be matched) rather than refusing the file.
        self.tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.scores = [float(s) for s in gguf.get("tokenizer.ggml.scores") or [0.0] * n]
        self.types = [int(t) for t in gguf.get("tokenizer.ggml.token_type") or [NORMAL] * n]
        if len(self.scores) != n or len(self.types) != n:
            raise ValueError(f"{gguf.path}: tokenizer.ggml.scores/token_type do not have one entry per token ({n})")
        self.ids = {t: i for i, t in enumerate(self.tokens)}  # a repeated spelling: the last id, as in llama.cpp
        self._rank = [-s for s in self.scores]  # heap order: the highest score first
        # llama.cpp's defaults for SentencePiece vocabularies; an id outside the vocabulary keeps the default.
        self.special = SpecialIds(*(self._id(gguf, key, default, n) for key, default in
                                    (("bos", 1), ("eos", 2), ("unknown", 0))))
        self.add_bos = bool(gguf.get("tokenizer.ggml.add_bos_token", True)) and self.special.bos is not None
        self.add_eos = bool(gguf.get("tokenizer.ggml.add_eos_token", False)) and self.special.eos is not None
        self.add_space_prefix = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
        by_length = sorted((i for i, t in enumerate(self.types) if t in (CONTROL, USER_DEFINED, UNKNOWN)),
                           key=lambda i: len(self.tokens[i].encode()), reverse=True)
        self._always_split = [i for i in by_length if self.types[i] == USER_DEFINED]
        self._split_when_parsing = by_length
        self._bytes = [self._byte_token(b) for b in range(256)]

    @staticmethod
    def _id(gguf: GGUFFile, key: str, default: int, n: int) -> int | None:
        value = gguf.get(f"tokenizer.ggml.{key}_token_id")
        index = default if value is None or not 0 <= int(value) < n else int(value)
        return index if index < n else None

    def _byte_token(self, byte: int) -> int | None:
        found = self.ids.get(f"<0x{byte:02X}>")
        if found is None and byte < 0x80:  # llama.cpp's second choice: the byte as a one-character token
            found = self.ids.get(chr(byte))
        return found

    # --- tokenizing

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.encode_parts([(text, parse_special)], add_special)

    def encode_parts(self, parts: list[tuple[str, bool]], add_special: bool = False) -> list[int]:
        """One text in parts, each with whether special tokens in it are parsed (template text) or not (content)."""
        fragments: list[str | int] = []
        for text, parse_special in parts:
            for fragment in self.partition(text, parse_special):
                if isinstance(fragment, str) and fragments and isinstance(fragments[-1], str):
                    fragments[-1] += fragment  # text runs on across the parts
                else:
                    fragments.append(fragment)
        out: list[int] = []
        if add_special and self.add_bos:
            out.append(self.special.bos)
        after_special = True  # the text's start counts as following a special token
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                after_special = True
                continue
            prefix = " " if self.add_space_prefix and after_special else ""
            out += self._merge((prefix + fragment).replace(" ", _SPACE))
            after_special = False
        if add_special and self.add_eos:
            out.append(self.special.eos)
        return out

    def encode_continuation(self, text: str) -> list[int]:
        """``text`` as it tokenizes in the middle of a run of text: no space in front, no special tokens parsed."""
        return self._merge(text.replace(" ", _SPACE)) if text else []

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        """The text as runs of plain text (str) and the special tokens written in it (their ids)."""
        fragments: list[str | int] = [text] if text else []
        for token_id in self._split_when_parsing if parse_special else self._always_split:
            spelling = self.tokens[token_id]
            if not any(isinstance(f, str) and spelling in f for f in fragments):
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or spelling not in fragment:
                    split.append(fragment)
                    continue
                for k, piece in enumerate(fragment.split(spelling)):
                    if k:
                        split.append(token_id)
                    if piece:
                        split.append(piece)
            fragments = split
        return fragments

    def _merge(self, text: str) -> list[int]:
        """The bigram merge of one escaped run of text, from its characters, highest-scoring token first."""
        get, rank = self.ids.get, self._rank
        n = len(text)
        size = [1] * n  # characters in the symbol starting at each position; 0 once merged into its left neighbour
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        # (minus the merged token's score, left position, merged width): the best pair first, the leftmost on ties.
        queue = [(rank[t], i, 2) for i in range(n - 1) if (t := get(text[i:i + 2])) is not None]
        heapq.heapify(queue)
        push, pop = heapq.heappush, heapq.heappop
        while queue:
            _, left, width = pop(queue)
            right = nxt[left] if size[left] else -1
            if right < 0 or size[left] + size[right] != width:
                continue  # a side was merged into something else since this pair was offered
            size[left] = width
            size[right] = 0
            after = nxt[left] = nxt[right]
            if after >= 0:
                prev[after] = left
                wider = width + size[after]
                if (t := get(text[left:left + wider])) is not None:
                    push(queue, (rank[t], left, wider))
            before = prev[left]
            if before >= 0:
                wider = size[before] + width
                if (t := get(text[before:before + wider])) is not None:
                    push(queue, (rank[t], before, wider))
        out: list[int] = []
        i = 0
        while i >= 0:
            piece = text[i:i + size[i]]
            token = get(piece)
            # A merged symbol is always a token; only a single character can be missing from the vocabulary.
            out += [token] if token is not None else self._byte_fallback(piece)
            i = nxt[i]
        return out

    def _byte_fallback(self, char: str) -> list[int]:
        ids = [self._bytes[b] for b in char.encode()]
        if None not in ids:
            return ids
        # A vocabulary without byte tokens: llama.cpp fails here; SentencePiece's answer is the unknown token.
        if self.special.unk is None:
            raise ValueError(f"the vocabulary has no token for {char!r}, no byte tokens and no unknown token")
        return [self.special.unk]

    # --- detokenizing

    def piece(self, token_id: int, special: bool) -> bytes:
        """One token's bytes: a normal token's text with U+2581 as space, a byte token's byte, a control or unknown
        token's spelling only when ``special``; unused tokens are empty."""
        kind = self.types[token_id]
        if kind in (CONTROL, UNKNOWN):
            return self.tokens[token_id].encode() if special else b""
        if kind == USER_DEFINED:
            return self.tokens[token_id].encode()
        if kind == NORMAL:
            return self.tokens[token_id].replace(_SPACE, " ").encode()
        if kind == BYTE:
            return bytes([int(self.tokens[token_id][3:5], 16)])
        return b""

    def decode(self, token_ids: list[int], special: bool = False) -> str:
        """The text of ``token_ids``: the pieces joined, the one space that ``add_space_prefix`` put in front of the
        first token taken off, then read as UTF-8 (an incomplete sequence becomes U+FFFD)."""
        pieces = [self.piece(t, special) for t in token_ids]
        if pieces and self.add_space_prefix and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")
