"""Stream chunks: each engine delta output becomes at most one SSE chunk, as it comes (no re-diffing: the engine's
outputs already hold only what is new)."""

from __future__ import annotations

import json

from kvprefix.engine import CompletionOutput, RequestOutput
from kvprefix.server.responses import Shape, finish_reason
from kvprefix.server.run import Job
from kvprefix.server.tool_parser import ToolCallParser


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


class Chunks:
    def __init__(self, shape: Shape):
        self.shape = shape
        self.req = shape.req
        self.parsers: dict[int, ToolCallParser] = {}  # per choice whose calls are parsed
        options = self.req.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far (guidellm and aiperf ask for it).
        self.continuous_usage = self.include_usage and options.continuous_usage_stats

    def first(self) -> str | None:
        """Chat's opening chunk: each choice's role."""
        if not self.shape.chat:
            return None
        first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(self.req.n)])
        if self.req.return_token_ids:
            first["prompt_token_ids"] = self.shape.jobs[0].prompt.token_ids
        return sse(first)

    def of(self, job: Job, out: RequestOutput) -> str | None:
        """The chunk of one delta output (None when it holds nothing to tell yet)."""
        choices = [c for o in out.outputs if (c := self._choice(job, o)) is not None]
        return sse(self._chunk(choices)) if choices else None

    def last(self) -> list[str]:
        return [sse(self._chunk([], self.shape.usage())), DONE] if self.include_usage else [DONE]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        shape = self.shape
        chunk = {"id": shape.rid, "object": "chat.completion.chunk" if shape.chat else "text_completion",
                 "created": shape.created, "model": shape.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = usage if usage is not None or not self.continuous_usage else shape.usage()
        return chunk

    def _choice(self, job: Job, o: CompletionOutput) -> dict | None:
        shape, req, chat, text = self.shape, self.req, self.shape.chat, o.text
        index, reason = shape.choice_index(job, o.index), o.finish_reason
        wants_tokens = shape.num_logprobs is not None or req.return_token_ids
        if chat:
            message = {"content": text} if text else {}
            if shape.tools is not None:
                message, reason = self._tool_delta(index, text, o.finish_reason)
        if not (message if chat else text) and o.finish_reason is None and not (o.token_ids and wants_tokens):
            return None
        # job counts this output already: where its text and tokens start in the choice's whole output
        text_start, token_start = job.chars[o.index] - len(text), job.tokens[o.index] - len(o.token_ids)
        c = {"index": index, "logprobs": shape.logprobs(o, text_start) if o.token_ids else None,
             "finish_reason": reason}
        if chat:
            c["delta"] = message
        else:
            c["text"] = text
        if req.return_token_ids:
            c["token_ids"] = o.token_ids
            if not chat and token_start == 0:
                c["prompt_token_ids"] = job.prompt.token_ids
        return c

    def _tool_delta(self, index: int, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The delta of a choice whose calls are parsed: content and OpenAI tool-call deltas."""
        parser = self.parsers.setdefault(index, self.shape.tools.parser())
        parsed = parser.feed(text)
        if reason is not None:
            parsed.extend(parser.finish())
        message: dict = {"content": parsed.content} if parsed.content else {}
        if parsed.tool_calls:
            message["tool_calls"] = [d.to_dict() for d in parsed.tool_calls]
        return message, finish_reason(reason, calls=parser.num_calls > 0)
