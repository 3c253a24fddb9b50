"""Request body -> prompt tokens: rendering (completions and chat, tools and template kwargs), the vocabulary and
length checks, and ``truncate_prompt_tokens``. The one place the server builds prompts."""

from __future__ import annotations

import asyncio

from kvprefix.http.errors import bad_request
from kvprefix.prompts import PromptError, RenderedPrompt, render_chat, render_completion, truncate_prompt
from kvprefix.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeChatRequest
from kvprefix.tokenizer import Tokenizer


class Prompter:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def completion_prompts(self, req: CompletionRequest) -> list[RenderedPrompt]:
        out = []
        for p in req.prompts():
            if not isinstance(p, str):
                self.check_vocabulary(p, "prompt")
            out.append(await self._render(render_completion, p, self._char_limit(req), req.add_special_tokens))
        return out

    async def chat_prompt(self, req: ChatCompletionRequest | TokenizeChatRequest) -> RenderedPrompt:
        messages = [m.model_dump(include={"role", "content", "tool_calls", "tool_call_id"}, exclude_none=True)
                    for m in req.messages]
        # As sent (exclude_unset): a template that prints the tools as JSON prints what the router renders too.
        tools = None if req.tools is None else [t.model_dump(exclude_unset=True) for t in req.tools]
        limit = self._char_limit(req) if isinstance(req, ChatCompletionRequest) else self.max_model_len
        return await self._render(render_chat, messages, req.add_generation_prompt, limit, tools=tools,
                                  continue_final_message=req.continue_final_message,
                                  template_kwargs=req.chat_template_kwargs)

    async def text_prompt(self, text: str, add_special_tokens: bool) -> RenderedPrompt:
        """/tokenize's prompt: rendered as completions renders it, never refused for its length."""
        return await self._render(render_completion, text, None, add_special_tokens)

    def check_vocabulary(self, token_ids: list[int], param: str) -> None:
        bad = next((t for t in token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in '{param}' is out of range: the vocabulary has {self.vocab_size} "
                              "tokens", param=param)

    async def _render(self, render, *args, **kwargs) -> RenderedPrompt:
        # In a thread: a long prompt must not stall every other stream on the event loop.
        try:
            return await asyncio.to_thread(render, self.tokenizer, *args, **kwargs)
        except PromptError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None

    def _char_limit(self, req: CompletionRequest | ChatCompletionRequest) -> int | None:
        """The length (in tokens) that refuses a prompt before tokenizing it: none when it is truncated anyway."""
        return None if req.truncate_prompt_tokens is not None else self.max_model_len

    def truncated(self, req: CompletionRequest | ChatCompletionRequest,
                  prompts: list[RenderedPrompt]) -> list[RenderedPrompt]:
        keep = req.truncate_prompt_tokens
        if keep is None:
            return prompts
        if keep > self.max_model_len:
            raise bad_request(f"'truncate_prompt_tokens' ({keep}) is over this model's maximum context length "
                              f"({self.max_model_len})", param="truncate_prompt_tokens")
        return [truncate_prompt(p, self.max_model_len if keep == -1 else keep) for p in prompts]
