"""Run and abort: the engine requests of one HTTP request (one per prompt), their outputs as they come, and their
end: every job is booked once (``Books``), and whatever still runs when the caller stops reading is aborted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from kvprefix.engine import (
    BeamSearchParams,
    EngineDeadError,
    LoraNotFoundError,
    RequestFailedError,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
)
from kvprefix.engine.client import EngineClient
from kvprefix.http.errors import APIError, bad_request
from kvprefix.http.tenancy import Caller
from kvprefix.prompts import RenderedPrompt
from kvprefix.server.cache_detail import CacheDetail

if TYPE_CHECKING:
    from kvprefix.server.models import Target
    from kvprefix.server.records import Books


@dataclass
class Job:
    """One prompt of a request: one engine request with n samples, and what its outputs told so far."""

    index: int
    request_id: str
    prompt: RenderedPrompt
    n: int
    arrival: float  # time.monotonic()
    arrival_wall: float  # time.time()
    out: RequestOutput | None = None  # the latest output (cached tokens, block hashes, metrics; the final body's)
    tokens: list[int] = field(default_factory=list)  # per sample: tokens generated
    chars: list[int] = field(default_factory=list)  # per sample: characters of text (DELTA outputs)
    reasons: list[str | None] = field(default_factory=list)  # per sample: its finish reason once it finished
    finished: bool = False  # booked
    detail: CacheDetail | None = None  # the cache diagnosis, made at the first output with a token

    def __post_init__(self) -> None:
        self.tokens, self.chars, self.reasons = [0] * self.n, [0] * self.n, [None] * self.n

    def take(self, out: RequestOutput, kind: RequestOutputKind) -> None:
        self.out = out
        for o in out.outputs:
            if kind is RequestOutputKind.DELTA:
                self.tokens[o.index] += len(o.token_ids)
                self.chars[o.index] += len(o.text)
            else:
                self.tokens[o.index] = len(o.token_ids)
            self.reasons[o.index] = o.finish_reason


class Run:
    """Drives the engine for one HTTP request. A single prompt's stream is read directly (the engine's queue is the
    only one on the way); several prompts are merged through one more queue."""

    def __init__(self, engine: EngineClient, prompts: list[RenderedPrompt], engine_rid: str,
                 params: SamplingParams | BeamSearchParams, n: int, caller: Caller, kind: RequestOutputKind,
                 books: Books, target: Target):
        """``n`` choices per prompt: the samples, or the best ``n`` of a beam search's results."""
        now, wall = time.monotonic(), time.time()  # the request's arrival: before it waits for admission
        self.jobs = [Job(i, f"{engine_rid}-{i}", p, n, now, wall) for i, p in enumerate(prompts)]
        self.engine = engine
        self.params = params
        self.caller = caller
        self.kind = kind
        self.books = books
        self.lora_request = target.lora_request()

    def _generate(self, job: Job) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(job.prompt.token_ids, self.params, job.request_id,
                                    cache_salt=self.caller.client_salt, tenant=self.caller.tenant, output_kind=self.kind,
                                    lora_request=self.lora_request)

    async def outputs(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """Every job's outputs as they come; on exit (finished, closed, cancelled or failed) aborts what runs."""
        streams = [self._generate(job) for job in self.jobs]
        items = _one(self.jobs[0], streams[0]) if len(streams) == 1 else _merged(self.jobs, streams)
        try:
            async for job, out in items:
                if len(out.outputs) > job.n:  # a beam search wider than the choices (best_of): its best n
                    out.outputs = [o for o in out.outputs if o.index < job.n]
                job.take(out, self.kind)
                if job.detail is None and any(o.token_ids for o in out.outputs):
                    job.detail = self.books.diagnose(job)
                if out.finished:
                    self.books.finish(job, aborted=False)
                yield job, out
        finally:
            # Shielded: under a cancelled (disconnected) response every await would be cancelled again.
            with anyio.CancelScope(shield=True):
                await items.aclose()
                await self.abort()
                for job in self.jobs:
                    self.books.finish(job, aborted=True)

    async def abort(self) -> None:
        """Aborts the jobs still running: their streams end in-band (finish_reason "abort") if still read."""
        for job in self.jobs:
            if not job.finished:
                try:
                    await self.engine.abort(job.request_id)
                except EngineDeadError:  # a stopped engine holds no blocks to free
                    pass


async def _one(job: Job, stream) -> AsyncIterator[tuple[Job, RequestOutput]]:
    try:
        async for out in stream:
            yield job, out
    finally:
        await stream.aclose()  # closing it aborts the request


async def _merged(jobs: list[Job], streams: list) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """The streams of several prompts through one queue, in the order their outputs come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((job, out))
        except Exception as exc:  # handed to the reader, which raises it in the request's context
            queue.put_nowait((job, exc))
            return
        queue.put_nowait((job, None))

    pumps = [asyncio.create_task(pump(job, stream)) for job, stream in zip(jobs, streams, strict=True)]
    try:
        remaining = len(pumps)
        while remaining:
            job, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            if out is None:
                remaining -= 1
                continue
            yield job, out
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def engine_error(exc: BaseException) -> APIError:
    # The engine raises ValueError for a request it cannot take (ours are validated first; this is a backstop).
    if isinstance(exc, LoraNotFoundError):  # unloaded between the request's check and its start
        return APIError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", type="server_error", code="engine_dead")
    if isinstance(exc, RequestFailedError):  # this request alone failed; the engine serves the others
        return APIError(500, str(exc), type="server_error", code="request_failed")
    return APIError(500, f"engine error: {type(exc).__name__}: {exc}", type="server_error")
