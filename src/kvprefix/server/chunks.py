"""Stream chunks: each engine delta output becomes at most one SSE chunk per choice, as it comes (no re-diffing: the
engine's outputs already hold only what is new). One choice per chunk, as OpenAI and vLLM send them: clients read
``choices[0]``."""

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
        self.echo_chars: dict[int, int] = {}  # per job echoed (completions): characters of its prompt's text
        options = self.req.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far (guidellm and aiperf ask for it).
        self.continuous_usage = self.include_usage and options.continuous_usage_stats

    def first(self) -> str | None:
        """Chat's opening chunks: each choice's role (and the echoed last message, with ``echo``)."""
        if not self.shape.chat:
            return None
        chunks = []
        for i in range(self.req.n):
            first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            if self.req.return_token_ids:
                first["prompt_token_ids"] = self.shape.jobs[0].prompt.token_ids
            chunks.append(sse(first))
        if self.shape.chat_echo:
            chunks += [sse(self._chunk([{"index": i, "delta": {"content": self.shape.chat_echo}, "logprobs": None,
                                         "finish_reason": None}])) for i in range(self.req.n)]
        return "".join(chunks)

    def of(self, job: Job, out: RequestOutput) -> str | None:
        """The chunks of one delta output, one per choice (None when it holds nothing to tell yet)."""
        chunks = [sse(self._chunk([c])) for o in out.outputs if (c := self._choice(job, o)) is not None]
        return "".join(chunks) or None

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
        # With a completions echo the first tokens always make a chunk: it carries the prompt.
        wants_tokens = shape.num_logprobs is not None or req.return_token_ids or (req.echo and not chat)
        if chat:
            message = {"content": text}  # "" in a chunk that adds no text (the last one, say), as vLLM sends it
            if shape.tools is not None:
                message, reason = self._tool_delta(index, text, o.finish_reason)
        shows = (message.get("content") or message.get("tool_calls")) if chat else text
        if not shows and o.finish_reason is None and not (o.token_ids and wants_tokens):
            return None
        # job counts this output already: where its text and tokens start in the choice's whole output
        text_start, token_start = job.chars[o.index] - len(text), job.tokens[o.index] - len(o.token_ids)
        echoed = shape.echo_of(job) if token_start == 0 else None  # the prompt goes before the first tokens
        if shape.echo_only and not echoed:
            return None
        if not chat and req.echo:
            text_start += self.echo_chars.setdefault(job.index, len(echoed[0]) if echoed else 0)
        c = {"index": index, "logprobs": shape.logprobs(o, 0 if echoed else text_start, echoed) if o.token_ids
             else None, "finish_reason": reason}
        if chat:
            c["delta"] = message
        else:
            shown = "" if shape.echo_only else text
            c["text"] = shown if echoed is None else echoed[0] + shown
        if req.return_token_ids:
            c["token_ids"] = [] if shape.echo_only else o.token_ids
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
