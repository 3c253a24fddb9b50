"""The OpenAI completions and chat endpoints over the engine: prompt building, limits, sampling parameters,
streaming and non-streaming responses, and the bookkeeping each finished prompt feeds (usage, metrics, request
log, cache detail)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvprefix.engine import CompletionOutput, EngineDeadError, RequestFailedError, RequestOutput, SamplingParams
from kvprefix.engine.structured import grammar_for
from kvprefix.http.errors import APIError, bad_request
from kvprefix.http.request_ids import MAX_REQUEST_ID_LEN, request_id_of, valid_request_id
from kvprefix.http.tenancy import Caller, pseudonym, validate_client_salt
from kvprefix.logs import RequestLogWriter, RequestRecord
from kvprefix.prompts import PromptError, RenderedPrompt, render_body
from kvprefix.server.admission import Admission, Ticket
from kvprefix.server.cache_detail import CacheDetail, CacheTracker
from kvprefix.server.logprobs import chat_logprobs, completion_logprobs
from kvprefix.server.metrics import FinishedSequence, ServerMetrics
from kvprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_supported,
)
from kvprefix.server.tool_parser import ToolCallParser, parse_tool_calls
from kvprefix.server.tools import ToolPlan, plan_tools


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the served model and cache, read once from the engine."""

    name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    hash_algo: str
    enable_prefix_caching: bool
    replica_id: str


@dataclass
class _Job:
    """One prompt of a request: one engine request with n samples."""

    index: int
    request_id: str
    prompt: RenderedPrompt
    arrival: float  # time.monotonic()
    arrival_wall: float  # time.time()
    n: int
    first_token: float | None = None
    last: RequestOutput | None = None  # the latest cumulative output
    finished: bool = False
    detail: CacheDetail | None = None  # the cache diagnosis, made at the first token
    sent_text: list[int] = field(default_factory=list)  # streaming, per sample: characters already sent
    sent_tokens: list[int] = field(default_factory=list)  # streaming, per sample: tokens whose logprobs went out
    sent_finish: set[int] = field(default_factory=set)  # streaming: samples whose finish_reason went out
    seen_tokens: dict[int, int] = field(default_factory=dict)  # per sample: tokens seen so far
    last_token_at: dict[int, float] = field(default_factory=dict)  # per sample: when its latest tokens came
    token_gaps: list[float] = field(default_factory=list)  # seconds between consecutive tokens (all samples)


class Serving:
    def __init__(
        self,
        engine,
        info: ModelInfo,
        admission: Admission,
        metrics: ServerMetrics,
        tracker: CacheTracker | None,
        request_log: RequestLogWriter | None,
    ):
        self.engine = engine
        self.info = info
        self.admission = admission
        self.metrics = metrics
        self.tracker = tracker  # None: cache detail is off, and nothing mirrors the cache
        self.request_log = request_log

    # -- request -> prompts ------------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.info.name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.info.name}'",
                           param="model", code="model_not_found")

    async def _prompts(self, req, refuse_long: bool = True) -> list[RenderedPrompt]:
        """The request's prompts through the one body adapter (``kvprefix.prompts.render_body``: every field that
        changes the prompt, truncation included; the fields as sent), in a thread: a long prompt must not stall
        every other stream on the event loop."""
        def render() -> list[RenderedPrompt]:
            body = req.model_dump(exclude_unset=True, by_alias=True)
            return render_body(self.engine.tokenizer, body, self.info.max_model_len, refuse_long=refuse_long)

        try:
            return await asyncio.to_thread(render)
        except PromptError as exc:
            raise bad_request(str(exc), param=exc.param, code=exc.code) from None

    def _check_token_ids(self, req: CompletionRequest) -> None:
        for p in req.prompts():
            if not isinstance(p, str):
                bad = next((t for t in p if t >= self.info.vocab_size), None)
                if bad is not None:
                    raise bad_request(f"token id {bad} in 'prompt' is out of range: the vocabulary has "
                                      f"{self.info.vocab_size} tokens", param="prompt")

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        limit = self.info.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise bad_request(f"this model's maximum context length is {limit} tokens, but the prompt has "
                                  f"{prompt_len} tokens", param=param, code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but you requested {prompt_len + requested} "
                f"tokens ({prompt_len} in the prompt, {requested} for the completion); reduce the prompt or "
                f"'max_tokens'", param=param, code="context_length_exceeded")
        return requested

    def _sampling(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        kwargs = {
            name: getattr(req, name)
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty", "seed")
            if getattr(req, name) is not None
        }
        try:
            return SamplingParams(n=req.n, max_tokens=max_tokens, stop=req.stop_list() or None,
                                  stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                                  logprobs=req.num_logprobs(), min_tokens=req.min_tokens,
                                  include_stop_str_in_output=req.include_stop_str_in_output,
                                  skip_special_tokens=req.skip_special_tokens, prompt_logprobs=req.prompt_logprobs,
                                  **kwargs)
        except ValueError as exc:  # the engine's own range checks, should ours ever be looser
            raise bad_request(str(exc)) from None

    # -- endpoints ---------------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, caller: Caller, raw: Request):
        self._check_model(req.model)
        check_supported(req)
        self._check_token_ids(req)
        prompts = await self._prompts(req)
        return await self._serve(req, caller, raw, prompts, req.max_tokens, "prompt", chat=False)

    async def chat(self, req: ChatCompletionRequest, caller: Caller, raw: Request):
        self._check_model(req.model)
        check_supported(req)
        # Compiles a required/named grammar: off the loop; a request without tools needs no thread hop.
        tools = None if req.tools is None and req.tool_choice in (None, "none") else await asyncio.to_thread(
            plan_tools, req)
        prompts = await self._prompts(req)
        return await self._serve(req, caller, raw, prompts, req.max_new_tokens(), "messages", chat=True,
                                 tools=tools)

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: the token ids a completions or chat request with these fields would run."""
        self._check_model(req.model)
        # /tokenize answers for a completions text of any length; messages too long for the context are refused
        (prompt,) = await self._prompts(req, refuse_long=isinstance(req, TokenizeChatRequest))
        ids = prompt.token_ids
        out = {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = self.engine.tokenizer.token_strings(ids)
        return out

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self._check_model(req.model)
        bad = next((t for t in req.tokens if t >= self.info.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in 'tokens' is out of range: the vocabulary has "
                              f"{self.info.vocab_size} tokens", param="tokens")
        # Special tokens kept, as vLLM's /detokenize does: the caller wants the text these ids stand for.
        text = await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    async def _serve(self, req, caller: Caller, raw: Request, prompts, requested_max: int | None, param: str,
                     chat: bool, tools: ToolPlan | None = None):
        validate_client_salt(caller.client_salt)
        if not all(p.token_ids for p in prompts):
            raise bad_request(f"'{param}' is empty after tokenization", param=param)
        max_tokens = min(self._max_tokens(len(p.token_ids), requested_max, param) for p in prompts)
        if req.min_tokens > max_tokens:
            raise bad_request(f"'min_tokens' ({req.min_tokens}) is more than the {max_tokens} tokens this request may "
                              "generate", param="min_tokens")
        structured, field_name = req.structured()
        if tools is not None and structured is not None:
            raise bad_request(f"'{field_name}' cannot be combined with tools unless 'tool_choice' is \"none\": both "
                              "would decide the same output", param=field_name)
        if tools is not None and tools.structured is not None:  # required or named: compiled in plan_tools
            structured = tools.structured
        elif structured is not None:  # compiled here first, so that a bad one is a 400 before any stream starts
            try:
                await asyncio.to_thread(grammar_for, structured)
            except ValueError as exc:
                raise bad_request(f"invalid '{field_name}': {exc}", param=field_name) from None
        params = self._sampling(req, max_tokens)
        params.structured_outputs = structured
        rid, engine_rid = _response_id(req, raw, "chatcmpl" if chat else "cmpl")
        now, wall = time.monotonic(), time.time()
        jobs = [_Job(i, f"{engine_rid}-{i}", p, now, wall, req.n, sent_text=[0] * req.n, sent_tokens=[0] * req.n)
                for i, p in enumerate(prompts)]
        ctx = _Context(self, req, caller, rid, jobs, params, chat, tools)
        # Admission happens before the response starts, so overload is a plain 503 even for streams.
        ticket = await self.admission.acquire(len(jobs), caller.tenant)
        if req.stream:
            # The background task releases the slots should the stream be cancelled before it ever started.
            return StreamingResponse(ctx.stream(ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(ticket.release))
        try:
            return await ctx.respond(raw)
        finally:
            ticket.release()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Context:
    """One HTTP request in flight: its jobs, and how their outputs turn into response bodies or SSE chunks."""

    def __init__(self, serving: Serving, req, caller: Caller, rid: str, jobs: list[_Job], params, chat: bool,
                 tools: ToolPlan | None = None):
        self.serving = serving
        self.tools = tools  # None: the output is plain content
        self.parsers: dict[int, ToolCallParser] = {}  # streaming, per choice: its tool-call parser
        self.req = req
        self.caller = caller
        self.rid = rid
        self.jobs = jobs
        self.params = params
        self.chat = chat
        self.created = int(time.time())
        self.num_logprobs = req.num_logprobs()

    # -- driving the engine ------------------------------------------------------------------------------

    async def _pump(self, job: _Job, queue: asyncio.Queue) -> None:
        try:
            async for out in self.serving.engine.generate(job.prompt.token_ids, self.params, job.request_id,
                                                          cache_salt=self.caller.client_salt,
                                                          tenant=self.caller.tenant):
                queue.put_nowait((job, out))
        except Exception as exc:  # handed to the consumer, which raises it in the request's context
            queue.put_nowait((job, exc))
            return
        queue.put_nowait((job, None))

    async def _outputs(self) -> AsyncIterator[tuple[_Job, RequestOutput]]:
        """Outputs of all jobs as they come; on exit (finished, cancelled or failed) aborts what still runs."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(job, queue)) for job in self.jobs]
        try:
            remaining = len(pumps)
            while remaining:
                job, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out is None:
                    remaining -= 1
                    continue
                self._update(job, out)
                yield job, out
        finally:
            for p in pumps:
                p.cancel()
            # Shielded: under a cancelled (disconnected) response every await would be cancelled again.
            with anyio.CancelScope(shield=True):
                for job in self.jobs:
                    if not job.finished:
                        try:
                            await self.serving.engine.abort(job.request_id)
                        except EngineDeadError:  # a stopped engine holds no blocks to free
                            pass
                        self._finish(job, aborted=True)

    def _update(self, job: _Job, out: RequestOutput) -> None:
        job.last = out
        now = time.monotonic()
        for o in out.outputs:
            new = len(o.token_ids) - job.seen_tokens.get(o.index, 0)
            if new > 0:
                if o.index in job.last_token_at:  # tokens that arrive together share the time since the last
                    job.token_gaps += [(now - job.last_token_at[o.index]) / new] * new
                job.seen_tokens[o.index], job.last_token_at[o.index] = len(o.token_ids), now
        if job.first_token is None and any(o.token_ids for o in out.outputs):
            job.first_token = time.monotonic()
            # Diagnosed now, while the cache still looks as it did at admission; the request log keeps the reason.
            tracker = self.serving.tracker
            if tracker is not None and (self.req.cache_detail or self.serving.request_log is not None):
                job.detail = tracker.diagnose(job.index, job.prompt.token_ids, out.prompt_block_hashes,
                                              out.num_cached_tokens, self.caller.tenant, self.caller.client_salt)
        if out.finished:
            self._finish(job, aborted=False)

    def _finish(self, job: _Job, aborted: bool) -> None:
        """Feeds metrics and the request log once per job, whether it finished or was aborted."""
        if job.finished:
            return
        job.finished = True
        out = job.last
        cached = out.num_cached_tokens if out is not None else 0
        outputs = out.outputs if out is not None else []
        n_out = [len(o.token_ids) for o in outputs] or [0] * job.n
        reasons = [o.finish_reason or "abort" for o in outputs] or ["abort"] * job.n
        e2e = time.monotonic() - job.arrival
        ttft = None if job.first_token is None else job.first_token - job.arrival
        self.serving.metrics.observe(FinishedSequence(
            len(job.prompt.token_ids), cached, n_out, reasons, ttft, e2e, self.params.max_tokens or 0,
            *_phases(out), token_gaps_s=job.token_gaps))
        log = self.serving.request_log
        if log is not None:
            log.write(self._record(job, cached, n_out, reasons, ttft, e2e, aborted))

    def _record(self, job: _Job, cached: int, n_out: list[int], reasons: list[str], ttft: float | None, e2e: float,
                aborted: bool) -> RequestRecord:
        info = self.serving.info
        out = job.last
        if out is not None:
            hashes, namespace = out.prompt_block_hashes, out.namespace_id
        else:  # aborted before the engine's first output: hash as the engine does
            hasher = self.serving.engine.hasher.for_namespace(self.caller.tenant, self.caller.client_salt)
            hashes, namespace = hasher.hash_blocks(job.prompt.token_ids), hasher.namespace_id
        spans = job.prompt.message_spans
        return RequestRecord(
            timestamp=round(job.arrival_wall, 6),
            finish_time=round(job.arrival_wall + e2e, 6),
            request_id=job.request_id,
            endpoint="chat" if self.chat else "completions",
            model=info.name,
            replica=info.replica_id,
            tenant=pseudonym(self.caller.tenant_label),
            namespace=namespace,
            prompt_tokens=len(job.prompt.token_ids),
            block_size=info.block_size,
            hash_algo=info.hash_algo,
            block_hashes=[h.hex() for h in hashes],
            cached_tokens=cached,
            miss_reason=job.detail.reason if job.detail is not None else None,
            output_tokens=sum(n_out),
            n=job.n,
            finish_reasons=reasons,
            timings={"ttft_s": None if ttft is None else round(ttft, 6), "e2e_s": round(e2e, 6)},
            status="aborted" if aborted or "abort" in reasons else "ok",
            salted=self.caller.tenant is not None or self.caller.client_salt is not None,
            prompt_cache_key=self.req.prompt_cache_key,
            user=None if self.req.user is None else pseudonym(self.req.user),
            prompt=job.prompt.text,
            message_spans=[list(sp) if sp else None for sp in spans] if spans else None,
        )

    # -- bodies ------------------------------------------------------------------------------------------

    def _usage(self) -> dict:
        prompt = sum(len(j.prompt.token_ids) for j in self.jobs)
        completion = sum(len(o.token_ids) for j in self.jobs if j.last for o in j.last.outputs)
        cached = sum(j.last.num_cached_tokens for j in self.jobs if j.last)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if self.req.cache_detail:
            usage["cache_detail"] = [j.detail.to_dict() for j in self.jobs if j.detail is not None]
        return usage

    def _logprobs(self, o: CompletionOutput, start: int, text_start: int) -> dict | None:
        """OpenAI logprobs of the sample's tokens from ``start`` on, whose text begins at character ``text_start``
        (None unless the request asked for logprobs)."""
        if self.num_logprobs is None or o.logprobs is None:
            return None
        decode = self._decode_one
        ids, entries = o.token_ids[start:], o.logprobs[start:]
        if self.chat:
            return chat_logprobs(decode, ids, entries, self.num_logprobs)
        return completion_logprobs(decode, ids, entries, self.num_logprobs, text_start)

    def _decode_one(self, token_id: int) -> str:
        if self.req.return_tokens_as_token_ids:  # vLLM's: tokens that do not decode alone stay identifiable
            return f"token_id:{token_id}"
        return self.serving.engine.tokenizer.decode([token_id])

    def _choice_index(self, job: _Job, sample: int) -> int:
        return job.index * self.req.n + sample

    def _body(self) -> dict:
        choices = []
        for job in self.jobs:
            for o in job.last.outputs:
                c = {"index": self._choice_index(job, o.index), "logprobs": self._logprobs(o, 0, 0),
                     "finish_reason": o.finish_reason}
                if self.chat:
                    c["message"] = self._message(o, c)
                else:
                    c["text"] = o.text
                    if self.req.prompt_logprobs is not None:
                        c["prompt_logprobs"] = self._prompt_logprobs(job)
                    if self.req.return_token_ids:
                        c["prompt_token_ids"] = job.prompt.token_ids
                if self.req.return_token_ids:
                    c["token_ids"] = o.token_ids
                choices.append(c)
        choices.sort(key=lambda c: c["index"])
        body = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.serving.info.name, "choices": choices, "usage": self._usage()}
        if self.chat and self.req.prompt_logprobs is not None:  # vLLM's places: per choice, per response in chat
            body["prompt_logprobs"] = self._prompt_logprobs(self.jobs[0])
        if self.chat and self.req.return_token_ids:
            body["prompt_token_ids"] = self.jobs[0].prompt.token_ids
        return body

    def _message(self, o: CompletionOutput, choice: dict) -> dict:
        if self.tools is None:
            return {"role": "assistant", "content": o.text}
        content, calls = parse_tool_calls(o.text, self.tools.names, self.tools.max_calls)
        if not calls:
            return {"role": "assistant", "content": content or ""}
        choice["finish_reason"] = _finish_reason(o.finish_reason, calls=True)
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def _prompt_logprobs(self, job: _Job) -> list[dict | None]:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        return [None if entry is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._decode_one(t)}
            for t, lp in entry.items()} for entry in job.last.prompt_logprobs]

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.serving.info.name, "choices": choices}
        if self._include_usage:
            chunk["usage"] = usage if usage is not None or not self._continuous_usage else self._usage()
        return chunk

    @property
    def _include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    @property
    def _continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk carries the usage so far (guidellm and aiperf ask for it)."""
        return self._include_usage and self.req.stream_options.continuous_usage_stats

    # -- responses ---------------------------------------------------------------------------------------

    async def respond(self, raw: Request) -> JSONResponse:
        """Non-streaming: collects the final outputs; a client that goes away aborts its requests."""

        async def collect() -> None:
            async for _ in self._outputs():
                pass

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(_disconnected(raw))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            return JSONResponse({}, status_code=499)  # nobody reads it; the engine requests were aborted
        exc = work.exception()
        if exc is not None:
            raise _engine_error(exc)
        return JSONResponse(self._body())

    async def stream(self, ticket: Ticket) -> AsyncIterator[str]:
        try:
            if self.chat:
                first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None} for i in range(self.req.n)])
                if self.req.return_token_ids:
                    first["prompt_token_ids"] = self.jobs[0].prompt.token_ids
                yield _sse(first)
            try:
                async for job, out in self._outputs():
                    choices = [c for o in out.outputs if (c := self._delta(job, o)) is not None]
                    if choices:
                        yield _sse(self._chunk(choices))
            except Exception as exc:  # headers are gone: report in-band, as OpenAI does
                yield _sse(_engine_error(exc).body())
                return
            if self._include_usage:
                yield _sse(self._chunk([], self._usage()))
            yield "data: [DONE]\n\n"
        finally:
            ticket.release()

    def _delta(self, job: _Job, o: CompletionOutput) -> dict | None:
        if o.index in job.sent_finish:  # its last chunk went out; later outputs repeat it for the other samples
            return None
        sent, sent_tokens = job.sent_text[o.index], job.sent_tokens[o.index]
        delta = o.text[sent:]
        new_tokens = len(o.token_ids) > sent_tokens
        job.sent_text[o.index], job.sent_tokens[o.index] = len(o.text), len(o.token_ids)
        wants_tokens = self.num_logprobs is not None or self.req.return_token_ids
        index, finish_reason = self._choice_index(job, o.index), o.finish_reason
        if self.chat:
            message = {"content": delta} if delta else {}
            if self.tools is not None:
                message, finish_reason = self._tool_delta(index, delta, o.finish_reason)
        if not (message if self.chat else delta) and o.finish_reason is None and not (new_tokens and wants_tokens):
            return None
        logprobs = self._logprobs(o, sent_tokens, sent) if new_tokens else None
        if o.finish_reason is not None:
            job.sent_finish.add(o.index)
        c = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.chat:
            c["delta"] = message
        else:
            c["text"] = delta
        if self.req.return_token_ids:
            c["token_ids"] = o.token_ids[sent_tokens:]
            if not self.chat and sent_tokens == 0:
                c["prompt_token_ids"] = job.prompt.token_ids
        return c

    def _tool_delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta of a choice whose calls are parsed: content and OpenAI tool-call deltas."""
        parser = self.parsers.setdefault(index, self.tools.parser())
        parsed = parser.feed(text)
        if finish_reason is not None:
            parsed.extend(parser.finish())
        message: dict = {"content": parsed.content} if parsed.content else {}
        if parsed.tool_calls:
            message["tool_calls"] = [d.to_dict() for d in parsed.tool_calls]
        return message, _finish_reason(finish_reason, calls=parser.num_calls > 0)


def _finish_reason(reason: str | None, calls: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended on its own with calls; a cut one stays "length"."""
    return "tool_calls" if calls and reason == "stop" else reason


def _phases(out: RequestOutput | None) -> tuple[float | None, ...]:
    """The engine's queue, prefill, decode and inference times of a request (None for phases it never reached)."""
    m = out.metrics if out is not None else None
    if m is None or m.first_scheduled_time is None:
        return None, None, None, None
    queue = m.first_scheduled_time - m.arrival_time
    prefill = None if m.first_token_time is None else m.first_token_time - m.first_scheduled_time
    done = m.finished_time is not None and m.first_token_time is not None
    decode = m.finished_time - m.first_token_time if done else None
    inference = m.finished_time - m.first_scheduled_time if m.finished_time is not None else None
    return queue, prefill, decode, inference


def _response_id(req, raw: Request, kind: str) -> tuple[str, str]:
    """(the response's id, the base of its engine request ids). The id is the client's x-request-id header, else
    the body's request_id (vLLM's order), else the id the middleware made. A client's id may repeat, an engine's
    may not: then the engine ids get a unique suffix."""
    header_id, chosen = request_id_of(raw)
    base = header_id if chosen or req.request_id is None else req.request_id
    if not valid_request_id(base):
        raise bad_request(f"'request_id' must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII characters without "
                          "spaces", param="request_id")
    rid = f"{kind}-{base}"
    return rid, (f"{rid}-{uuid.uuid4().hex[:12]}" if chosen or req.request_id is not None else rid)


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def _engine_error(exc: BaseException) -> APIError:
    # The engine raises ValueError for a request it cannot take (ours are validated first; this is a backstop).
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):  # this request alone failed; the engine serves the others
        return APIError(500, str(exc), type="server_error", code="request_failed")
    return APIError(500, f"engine error: {type(exc).__name__}: {exc}", type="server_error")
