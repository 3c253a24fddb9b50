"""A log entry's prompt as token ids, text and field spans, through the one renderer (``kvprefix.prompts``)."""

from __future__ import annotations

from typing import Any

from kvprefix.doctor.divergence import Rendered
from kvprefix.doctor.readers import DoctorInputError
from kvprefix.doctor.tokens import SegmentMemoTokenizer
from kvprefix.prompts import PromptError, Tokenizer, render_body


class Renderer:
    def __init__(self, tokenizer: Tokenizer, path: str):
        self.tokenizer = SegmentMemoTokenizer(tokenizer)
        self.path = path

    def body(self, body: dict[str, Any], line: int) -> Rendered:
        try:
            prompt = render_body(self.tokenizer, body)[0]  # the readers give one prompt per entry
        except PromptError as exc:
            raise DoctorInputError(f"{self.path}:{line}: {exc}") from None
        if not prompt.token_ids:
            raise DoctorInputError(f"{self.path}:{line}: the prompt renders to zero tokens")
        if "messages" in body:
            fields = [(f"messages[{i}].content", *span) for i, span in enumerate(prompt.message_spans) if span]
        else:
            fields = [("prompt", 0, len(prompt.text))] if prompt.text is not None else []
        return Rendered(prompt.token_ids, prompt.text, fields)

    def text(self, text: str, add_special_tokens: bool, message_spans: list | None) -> Rendered:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        fields = [(f"messages[{i}].content", span[0], span[1]) for i, span in enumerate(message_spans or [])
                  if isinstance(span, list) and len(span) == 2]
        return Rendered(ids, text, fields or [("prompt", 0, len(text))])
