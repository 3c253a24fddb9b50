"""Response bodies: what a completions or chat response says, whole (non-streamed) or in parts (``chunks``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvprefix.engine import CompletionOutput, Logprob
from kvprefix.server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from kvprefix.server.run import Job
from kvprefix.server.tool_parser import parse_tool_calls
from kvprefix.server.tools import ToolPlan


class Shape:
    """What every body of one response shares: its id, kind, model, choice numbering, logprobs and usage."""

    def __init__(self, req, rid: str, chat: bool, model: str, jobs: list[Job], tools: ToolPlan | None,
                 decode: Callable[[int], str], tokens_as_ids: bool):
        self.req = req
        self.rid = rid
        self.chat = chat
        self.model = model
        self.jobs = jobs
        self.tools = tools  # None: the output is plain content
        self.decode = decode  # one token's text: an echoed prompt's first token, which has no logprob entry
        self.created = int(time.time())
        self.num_logprobs = req.num_logprobs()
        # The request's return_tokens_as_token_ids, else the server's --return-tokens-as-token-ids.
        self.as_ids = tokens_as_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids
        # Completions echo without generation (max_tokens 0): the prompt alone; its one run token is not shown.
        self.echo_only = not chat and req.echo and req.max_tokens == 0
        self.chat_echo = _chat_echo(req) if chat and req.echo else ""

    def choice_index(self, job: Job, sample: int) -> int:
        return job.index * self.req.n + sample

    def logprobs(self, o: CompletionOutput, text_offset: int, echoed: tuple | None = None) -> dict | None:
        """OpenAI logprobs of the output's tokens, whose text begins at character ``text_offset`` (None unless the
        request asked for logprobs), after the ``echoed`` prompt's (``echo_of``)."""
        if self.num_logprobs is None or o.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(o.token_ids, o.logprobs, self.num_logprobs, self.as_ids,
                                 in_order=self.req.logprob_token_ids is not None)
        token_ids, entries = ([], []) if self.echo_only else (o.token_ids, o.logprobs)
        if echoed is not None:
            token_ids, entries = [*echoed[1], *token_ids], [*echoed[2], *entries]
        return completion_logprobs(token_ids, entries, self.num_logprobs, self.as_ids, text_offset, self.decode)

    def echo_of(self, job: Job) -> tuple[str, list[int], list[dict[int, Logprob] | None]] | None:
        """A completions echo's prompt part: its text, token ids and logprob entries (None when not echoed)."""
        if self.chat or not self.req.echo:
            return None
        prompt = job.prompt
        text = prompt.text if prompt.text is not None else self.decode_all(prompt.token_ids)
        entries = (job.out.prompt_logprobs if job.out is not None else None) or [None] * len(prompt.token_ids)
        return text, prompt.token_ids, entries

    def decode_all(self, token_ids: list[int]) -> str:
        return "".join(self.decode(t) for t in token_ids)

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
    """The non-streamed response, from each job's final (cumulative) output. The fields vLLM always returns are
    always here (null when not asked for): clients read them as attributes."""
    req, chat = shape.req, shape.chat
    choices = []
    for job in shape.jobs:
        for o in job.out.outputs:
            c = {"index": shape.choice_index(job, o.index)}
            if chat:
                c["message"] = _message(shape, o, c)
                c["logprobs"] = shape.logprobs(o, 0)
            else:
                echoed = shape.echo_of(job)
                text = "" if shape.echo_only else o.text
                c["text"] = text if echoed is None else echoed[0] + text
                c["logprobs"] = shape.logprobs(o, 0, echoed)
            c.setdefault("finish_reason", o.finish_reason)
            c["stop_reason"] = o.stop_reason
            c["token_ids"] = (o.token_ids if not shape.echo_only else []) if req.return_token_ids else None
            if not chat:
                c["prompt_logprobs"] = _prompt_logprobs(shape, job)
                c["prompt_token_ids"] = job.prompt.token_ids if req.return_token_ids else None
            choices.append(c)
    choices.sort(key=lambda c: c["index"])
    out = {"id": shape.rid, "object": "chat.completion" if chat else "text_completion", "created": shape.created,
           "model": shape.model, "choices": choices, "usage": shape.usage(),
           "system_fingerprint": None}  # as vLLM always returns it (and OpenAI's types declare it)
    if chat:
        out["service_tier"] = None
    if chat:  # vLLM's places: per choice in completions, per response in chat
        first = shape.jobs[0]
        out["prompt_logprobs"] = _prompt_logprobs(shape, first)
        out["prompt_token_ids"] = first.prompt.token_ids if req.return_token_ids else None
    return out


def _prompt_logprobs(shape: Shape, job: Job) -> list[dict | None] | None:
    if shape.req.prompt_logprobs is None:
        return None
    return prompt_logprobs(job.out.prompt_logprobs, shape.as_ids)


def _chat_echo(req) -> str:
    """vLLM's chat echo: the last message's text, when it has the reply's role (the assistant's, or the last
    message's own without a generation prompt), goes before the reply."""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    if last.role != role or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else "".join(p.text for p in last.content)


def _message(shape: Shape, o: CompletionOutput, choice: dict) -> dict:
    tools, echo = shape.tools, shape.chat_echo
    if tools is None:
        return {"role": "assistant", "content": echo + o.text}
    content, calls = parse_tool_calls(o.text, tools.names, tools.max_calls)
    if not calls:
        return {"role": "assistant", "content": echo + (content or "")}
    choice["finish_reason"] = finish_reason(o.finish_reason, calls=True)
    return {"role": "assistant", "content": echo + (content or "") if echo else content, "tool_calls": calls}


def finish_reason(reason: str | None, calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended on its own with calls; a cut one stays "length"."""
    return "tool_calls" if calls and reason == "stop" else reason
