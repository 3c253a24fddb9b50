"""Response bodies: what a completions or chat response says, whole (non-streamed) or in parts (``chunks``)."""

from __future__ import annotations

import time

from kvprefix.engine import CompletionOutput
from kvprefix.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from kvprefix.server.run import Job
from kvprefix.server.tool_parser import parse_tool_calls
from kvprefix.server.tools import ToolPlan


class Shape:
    """What every body of one response shares: its id, kind, model, choice numbering, logprobs and usage."""

    def __init__(self, req, rid: str, chat: bool, model: str, jobs: list[Job], tools: ToolPlan | None):
        self.req = req
        self.rid = rid
        self.chat = chat
        self.model = model
        self.jobs = jobs
        self.tools = tools  # None: the output is plain content
        self.created = int(time.time())
        self.num_logprobs = req.num_logprobs()

    def choice_index(self, job: Job, sample: int) -> int:
        return job.index * self.req.n + sample

    def logprobs(self, o: CompletionOutput, text_offset: int) -> dict | None:
        """OpenAI logprobs of the output's tokens, whose text begins at character ``text_offset`` (None unless the
        request asked for logprobs)."""
        if self.num_logprobs is None or o.logprobs is None:
            return None
        as_ids = self.req.return_tokens_as_token_ids
        if self.chat:
            return chat_logprobs(o.token_ids, o.logprobs, self.num_logprobs, as_ids)
        return completion_logprobs(o.token_ids, o.logprobs, self.num_logprobs, as_ids, text_offset)

    def usage(self) -> dict:
        prompt = sum(len(j.prompt.token_ids) for j in self.jobs)
        completion = sum(sum(j.tokens) for j in self.jobs)
        cached = sum(j.out.num_cached_tokens for j in self.jobs if j.out)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.req.cache_detail:
            usage["cache_detail"] = [j.detail.to_dict() for j in self.jobs if j.detail is not None]
        return usage


def body(shape: Shape) -> dict:
    """The non-streamed response, from each job's final (cumulative) output."""
    req, chat = shape.req, shape.chat
    choices = []
    for job in shape.jobs:
        for o in job.out.outputs:
            c = {"index": shape.choice_index(job, o.index), "logprobs": shape.logprobs(o, 0),
                 "finish_reason": o.finish_reason}
            if chat:
                c["message"] = _message(shape.tools, o, c)
            else:
                c["text"] = o.text
                if req.prompt_logprobs is not None:
                    c["prompt_logprobs"] = prompt_logprobs(job.out.prompt_logprobs, req.return_tokens_as_token_ids)
                if req.return_token_ids:
                    c["prompt_token_ids"] = job.prompt.token_ids
            if req.return_token_ids:
                c["token_ids"] = o.token_ids
            choices.append(c)
    choices.sort(key=lambda c: c["index"])
    out = {"id": shape.rid, "object": "chat.completion" if chat else "text_completion", "created": shape.created,
           "model": shape.model, "choices": choices, "usage": shape.usage()}
    first = shape.jobs[0]
    if chat and req.prompt_logprobs is not None:  # vLLM's places: per choice, per response in chat
        out["prompt_logprobs"] = prompt_logprobs(first.out.prompt_logprobs, req.return_tokens_as_token_ids)
    if chat and req.return_token_ids:
        out["prompt_token_ids"] = first.prompt.token_ids
    return out


def _message(tools: ToolPlan | None, o: CompletionOutput, choice: dict) -> dict:
    if tools is None:
        return {"role": "assistant", "content": o.text}
    content, calls = parse_tool_calls(o.text, tools.names, tools.max_calls)
    if not calls:
        return {"role": "assistant", "content": content or ""}
    choice["finish_reason"] = finish_reason(o.finish_reason, calls=True)
    return {"role": "assistant", "content": content, "tool_calls": calls}


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended on its own with calls; a cut one stays "length"."""
    return "tool_calls" if calls and reason == "stop" else reason
