"""A log entry's prompt as token ids, text and field spans, through the one body adapter (``kvprefix.prompts``), and
the hashers of its blocks, from one ``BlockIdentity``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvprefix.cache import BlockHasher, BlockIdentity, ExecutionContext
from kvprefix.doctor.divergence import Rendered
from kvprefix.logs import LogEntry, LogError
from kvprefix.prompts import PromptError, render_bodies, render_body
from kvprefix.sim.openai_bodies import ReplicaModel
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer

# A tokenizer given alone (no checkpoint, no replica) hashes under an empty context with the fast algorithm: the
# doctor then only compares its own hashes with each other.
_BARE = BlockIdentity(16, "xxhash", ExecutionContext())
_MAX_HEADS = 1024

Loaded = Tokenizer | tuple[Tokenizer, ReplicaModel]


class Renderer:
    """Renders with the tokenizer ``load`` gives, and hashes under the replicas' identity it gives with it (else
    ``_BARE``); loaded when first needed (a hashes-only log needs neither)."""

    def __init__(self, load: Callable[[], Loaded], path: str):
        self._load = load
        self.path = path
        self._hashers: dict[int, BlockHasher] = {}
        self._heads: dict[str, list[int]] = {}  # the template's text before the first message, tokenized

    @functools.cached_property
    def _loaded(self) -> tuple[Tokenizer, ReplicaModel]:
        loaded = self._load()
        return loaded if isinstance(loaded, tuple) else (loaded, ReplicaModel(_BARE))

    @functools.cached_property
    def tokenizer(self) -> SegmentCachedTokenizer:
        return SegmentCachedTokenizer(self._loaded[0])

    @property
    def model(self) -> ReplicaModel:
        """The blocks' identity and the replicas' context length (``truncate_prompt_tokens`` -1)."""
        return self._loaded[1]

    def hasher(self, block_size: int) -> BlockHasher:
        """The hasher of the identity's blocks at ``block_size`` (the doctor also replays at other sizes)."""
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = replace(self.model.identity, block_size=block_size).hasher()
        return hasher

    def head_tokens(self, rendered: Rendered) -> int:
        """How many of the rendering's tokens are the template's text before its first field (a message's content;
        none before a completions prompt)."""
        if not rendered.fields or rendered.fields[0][1] == 0:
            return 0
        head = rendered.text[: rendered.fields[0][1]]
        ids = self._heads.get(head)
        if ids is None:
            ids = self.tokenizer.encode(head, add_special_tokens=False)
            if len(self._heads) < _MAX_HEADS:
                self._heads[head] = ids
        n = len(ids)
        if rendered.token_ids[:n] == ids:
            return n
        return next((k for k, (a, b) in enumerate(zip(ids, rendered.token_ids, strict=False)) if a != b),
                    min(n, len(rendered.token_ids)))

    def body(self, body: dict[str, Any], line: int) -> Rendered:
        try:
            prompt = render_body(self.tokenizer, body, self.model.max_model_len)[0]  # one prompt per entry
        except PromptError as exc:
            raise LogError(self.path, line, str(exc)) from None
        return self._rendered(body, prompt, line)

    def _rendered(self, body: dict[str, Any], prompt, line: int) -> Rendered:
        if not prompt.token_ids:
            raise LogError(self.path, line, "the prompt renders to zero tokens")
        if "messages" in body:
            fields = [(f"messages[{i}].content", *span) for i, span in enumerate(prompt.message_spans) if span]
        else:
            fields = [("prompt", 0, len(prompt.text))] if prompt.text is not None else []
        return Rendered(prompt.token_ids, prompt.text, fields)

    def text(self, text: str, add_special_tokens: bool, message_spans: list | None) -> Rendered:
        return self._text(text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens), message_spans)

    @staticmethod
    def _text(text: str, ids: list[int], message_spans: list | None) -> Rendered:
        fields = [(f"messages[{i}].content", span[0], span[1]) for i, span in enumerate(message_spans or [])
                  if isinstance(span, list) and len(span) == 2]
        return Rendered(ids, text, fields or [("prompt", 0, len(text))])

    def entry(self, entry: LogEntry) -> Rendered:
        """The entry's ``body`` (else its ``text``) as it renders."""
        if entry.body is not None:
            return self.body(entry.body, entry.line)
        return self.text(entry.text, entry.add_special_tokens, entry.message_spans)

    def entries(self, entries: list[LogEntry]) -> list[Rendered | None]:
        """Each entry's ``body`` or ``text`` rendered, in batches (None for neither). Where any body fails, all are
        None: rendered one by one, the first failure names its line."""
        out: list[Rendered | None] = [None] * len(entries)
        with_body = [k for k, e in enumerate(entries) if e.body is not None]
        try:
            prompts = render_bodies(self.tokenizer, [entries[k].body for k in with_body], self.model.max_model_len)
            for k, prompt in zip(with_body, prompts, strict=True):
                out[k] = self._rendered(entries[k].body, prompt[0], entries[k].line)
        except (PromptError, LogError):
            return [None] * len(entries)
        for special in (False, True):
            with_text = [k for k, e in enumerate(entries)
                         if e.body is None and e.text is not None and e.add_special_tokens is special]
            ids = self.tokenizer.encode_batch([entries[k].text for k in with_text], add_special_tokens=special)
            for k, token_ids in zip(with_text, ids, strict=True):
                out[k] = self._text(entries[k].text, token_ids, entries[k].message_spans)
        return out
