"""The OpenAI completions and chat endpoints, and vLLM's /tokenize and /detokenize: each request is checked and
turned into an engine call (``prompting``, ``engine_call``), run (``run``), answered whole (``responses``) or
streamed (``chunks``), and booked (``records``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvprefix.engine import RequestOutputKind
from kvprefix.engine.client import EngineClient
from kvprefix.http.tenancy import Caller
from kvprefix.logs import RequestLogWriter
from kvprefix.prompts import RenderedPrompt
from kvprefix.server.admission import Admission, Ticket
from kvprefix.server.cache_detail import CacheTracker
from kvprefix.server.chunks import Chunks, sse
from kvprefix.server.engine_call import engine_call
from kvprefix.server.metrics import ServerMetrics
from kvprefix.server.model_info import ModelInfo
from kvprefix.server.models import ServedModels, Target
from kvprefix.server.prompting import Prompter
from kvprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvprefix.server.records import Books
from kvprefix.server.responses import Shape, body
from kvprefix.server.run import Run, engine_error
from kvprefix.server.supported import check_supported
from kvprefix.server.tools import ToolPlan, plan_tools


class Serving:
    def __init__(self, engine: EngineClient, info: ModelInfo, admission: Admission, metrics: ServerMetrics,
                 tracker: CacheTracker | None, request_log: RequestLogWriter | None, models: ServedModels):
        self.engine = engine
        self.info = info
        self.admission = admission
        self.metrics = metrics
        self.tracker = tracker  # None: cache detail is off, and nothing mirrors the cache
        self.request_log = request_log
        self.models = models
        self.prompter = Prompter(engine.tokenizer, info.max_model_len, info.vocab_size)

    async def completions(self, req: CompletionRequest, caller: Caller, raw: Request):
        target = self.models.resolve(req.model)
        self._check(req)
        prompts = await self.prompter.prompts(req)
        return await self._serve(req, caller, raw, prompts, "prompt", None, target)

    async def chat(self, req: ChatCompletionRequest, caller: Caller, raw: Request):
        target = self.models.resolve(req.model)
        self._check(req)
        # Compiles a required/named grammar: off the loop; a request without tools needs no thread hop.
        tools = None if req.tools is None and req.tool_choice in (None, "none") else await asyncio.to_thread(
            plan_tools, req)
        prompts = await self.prompter.prompts(req)
        return await self._serve(req, caller, raw, prompts, "messages", tools, target)

    def _check(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        check_supported(req)
        self.prompter.check_vocabulary(req.stop_token_ids or [], "stop_token_ids")
        self.prompter.check_vocabulary(req.logprob_token_ids or [], "logprob_token_ids")

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
        """vLLM's /tokenize: the token ids a completions or chat request with these fields would run."""
        self.models.resolve(req.model)
        # A completions text of any length is tokenized; messages too long for the context are refused.
        (prompt,) = await self.prompter.prompts(req, refuse_long=isinstance(req, TokenizeChatRequest))
        ids = prompt.token_ids
        strs = self.engine.tokenizer.token_strings(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.info.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.models.resolve(req.model)
        self.prompter.check_vocabulary(req.tokens, "tokens")
        # Special tokens kept, as vLLM's /detokenize does: the caller wants the text these ids stand for.
        text = await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    def _decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], False)

    async def _serve(self, req: CompletionRequest | ChatCompletionRequest, caller: Caller, raw: Request,
                     prompts: list[RenderedPrompt], param: str, tools: ToolPlan | None, target: Target):
        call = await engine_call(req, caller, raw, self.info, prompts, param, tools)
        chat = isinstance(req, ChatCompletionRequest)
        books = Books(self.info, self.metrics, self.tracker, self.request_log, self.engine.hasher, req, caller, chat,
                      call.params.max_tokens or 0, target)
        # vLLM's: a completions beam search is answered whole even when a stream is asked for (chat streams the
        # search's one output, each choice's whole text in one chunk).
        stream = req.stream and (chat or not req.use_beam_search)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        run = Run(self.engine, call.prompts, call.engine_rid, call.params, call.n, caller, kind, books, target)
        shape = Shape(req, call.rid, chat, target.name, run.jobs, tools, self._decode_one, self.info.tokens_as_ids)
        # Admission happens before the response starts, so overload is a plain 503 even for streams.
        ticket = await self.admission.acquire(len(run.jobs), caller.tenant)
        if stream:
            # The background task releases the slots should the stream be cancelled before it ever started.
            return StreamingResponse(_stream(run, Chunks(shape), ticket), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(ticket.release))
        try:
            return await _respond(run, shape, raw)
        finally:
            ticket.release()


async def _respond(run: Run, shape: Shape, raw: Request) -> JSONResponse:
    """Non-streamed: waits for each job's final output; a client that goes away aborts (booked as they stood)."""

    async def collect() -> None:
        async for _ in run.outputs():
            pass

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_disconnected(raw))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        left = not work.done()
        if left:
            await run.abort()
            await asyncio.wait({work})
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if left:
        return JSONResponse({}, status_code=499)  # nobody reads it; the engine requests were aborted
    exc = work.exception()
    if exc is not None:
        raise engine_error(exc)
    return JSONResponse(body(shape))


async def _stream(run: Run, chunks: Chunks, ticket: Ticket) -> AsyncIterator[str]:
    outputs = run.outputs()
    try:
        if (first := chunks.first()) is not None:
            yield first
        try:
            async for job, out in outputs:
                if (chunk := chunks.of(job, out)) is not None:
                    yield chunk
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            yield sse(engine_error(exc).body())
            return
        for chunk in chunks.last():
            yield chunk
    finally:
        await outputs.aclose()
        ticket.release()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass

