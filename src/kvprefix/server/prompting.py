"""Request body -> prompt tokens through the one body adapter (``kvprefix.prompts.render_body``: every field that
changes the prompt, ``truncate_prompt_tokens`` included), plus the vocabulary check of token ids. The one place the
server builds prompts, so it runs what the router, the planner and the doctor hash."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from kvprefix.http.errors import bad_request
from kvprefix.prompts import PromptError, RenderedPrompt, render_body
from kvprefix.server.protocol import CompletionRequest
from kvprefix.tokenizer import Tokenizer


class Prompter:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def prompts(self, req: BaseModel, refuse_long: bool = True) -> list[RenderedPrompt]:
        """The request's prompts, rendered from its fields as sent (``exclude_unset``: a template that prints the
        tools as JSON prints what the router renders too). ``refuse_long``: a text too long for the context is
        refused before tokenizing, unless the body truncates."""
        if isinstance(req, CompletionRequest):
            for p in req.prompts():
                if not isinstance(p, str):
                    self.check_vocabulary(p, "prompt")

        def render() -> list[RenderedPrompt]:
            body = req.model_dump(exclude_unset=True, by_alias=True)
            return render_body(self.tokenizer, body, self.max_model_len, refuse_long=refuse_long)

        try:  # in a thread: a long prompt must not stall every other stream on the event loop
            return await asyncio.to_thread(render)
        except PromptError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None

    def check_vocabulary(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in '{param}' is out of vocabulary (the vocabulary has "
                              f"{self.vocab_size} tokens)", param=param)
