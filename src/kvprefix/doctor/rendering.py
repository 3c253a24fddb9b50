"""A log entry's prompt as token ids, text and field spans, through the one renderer (``kvprefix.prompts``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvprefix.doctor.divergence import Rendered
from kvprefix.logs import LogEntry, LogError
from kvprefix.prompts import PromptError, render_bodies, render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer


class Renderer:
    """Renders with the tokenizer ``load_tokenizer`` gives, loaded when first needed (a hashes-only log never
    needs it)."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], path: str):
        self._load_tokenizer = load_tokenizer
        self.path = path

    @functools.cached_property
    def tokenizer(self) -> SegmentCachedTokenizer:
        return SegmentCachedTokenizer(self._load_tokenizer())

    def body(self, body: dict[str, Any], line: int) -> Rendered:
        try:
            prompt = render_body(self.tokenizer, body)[0]  # the readers give one prompt per entry
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
            prompts = render_bodies(self.tokenizer, [entries[k].body for k in with_body])
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
