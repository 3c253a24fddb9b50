"""AsyncLLM: the engine for servers (``EngineClient``). A background thread runs engine steps (torch releases the
GIL); each step's deltas go on the request's asyncio queue, the only queue between the engine thread and the
stream's reader, whose OutputState folds and detokenizes them on the event loop while the next step computes.

Only the engine thread touches engine state: adds, aborts and resets go through a command queue it drains between
steps. A stream closed early (disconnect, cancellation, ``break``) aborts its request, so its blocks are freed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvprefix.cache import KVCacheEvent
from kvprefix.cache.media import POOL, Medium
from kvprefix.engine.args import EngineArgs
from kvprefix.engine.beam_search import BeamSearchParams
from kvprefix.engine.llm_engine import LLMEngine, PromptType
from kvprefix.engine.lora_request import LoraActivity, LoraInfo, LoRARequest
from kvprefix.engine.output_state import OutputState
from kvprefix.engine.outputs import RequestDelta, RequestOutput, RequestOutputKind
from kvprefix.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shut down, or a step failed); no request can be served any more."""


class _Stream:
    """Where one request's outputs go: an asyncio queue on the loop of the task that called generate()."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()

    def put(self, item: RequestDelta | BaseException) -> None:
        """Thread-safe; a closed loop means nobody is listening any more."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass


class AsyncLLM:
    def __init__(self, args: EngineArgs | None = None, **kwargs: Any):
        self.engine = LLMEngine(args or EngineArgs(**kwargs))
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.vocab_size = self.engine.model_config.vocab_size
        self.max_sequence_tokens = self.engine.max_sequence_tokens
        self.uses_default_model = self.engine.uses_default_model
        # Fixed for the engine's lifetime. ``hasher`` is unsalted; a namespace's is ``hasher.for_namespace(...)``.
        self.identity = self.engine.identity  # what names its blocks, as routers learn it (cache.BlockIdentity)
        self.hasher = self.engine.hasher
        self.num_kv_blocks = self.engine.manager.pool.num_blocks
        self.enable_prefix_caching = self.engine.manager.enable_prefix_caching
        self.enable_lora = self.engine.loras is not None
        # Replaced whole on the engine thread (load, unload, each step), so the event loop reads them without locks.
        self.lora_adapters: dict[str, LoraInfo] = self.engine.loras.infos() if self.enable_lora else {}
        self.lora_activity: LoraActivity | None = self.engine.lora_activity()
        self._streams: dict[str, _Stream] = {}
        self._commands: list[tuple[Callable[[], Any], concurrent.futures.Future]] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_loop, name="kvprefix-engine", daemon=True)
        self._thread.start()

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- public API

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams | None,
        request_id: str,
        cache_salt: str | None = None,
        tenant: str | None = None,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs of ``output_kind`` until one has ``finished``. Raises ValueError for an
        invalid request (``LoraNotFoundError`` for an adapter not loaded), EngineDeadError if the engine stops.
        Closing the stream early aborts the request. ``tenant``, ``cache_salt`` and the adapter pick the cache
        namespace (see LLMEngine.add_request)."""
        arrival = time.monotonic()
        stream = _Stream(asyncio.get_running_loop())
        final_only = output_kind is RequestOutputKind.FINAL_ONLY

        def add() -> OutputState:
            # Registered on the engine thread once the engine accepted the id: a previous request with this id has
            # then left the engine (its queued abort ran first), so none of its outputs can reach this stream.
            state = self.engine.add_request(request_id, prompt, sampling_params, cache_salt, arrival, tenant,
                                            lora_request)
            self._streams[request_id] = stream
            return state

        try:
            state = await self._call(add)
        except BaseException:
            # Cancelled after add() started: the request exists but nobody listens; release it like a closed stream.
            self._release(request_id, stream)
            raise
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                # When the consumer is behind, every delta waiting is folded in and it gets one output for them.
                while not isinstance(item, BaseException):
                    state.apply(item)
                    if stream.queue.empty():
                        break
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                state.stamp(time.monotonic())
                finished = state.finished
                if finished or not final_only:
                    yield state.output(output_kind)
        finally:
            self._release(request_id, stream)

    def subscribe_kv_events(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """Calls ``callback`` with every BlockStored / BlockRemoved / AllBlocksCleared event, on the engine thread
        (so it must be thread-safe and quick). Returns a function that unsubscribes."""
        return self.engine.manager.events.subscribe(callback)

    async def subscribe_kv_events_from_snapshot(
        self,
        on_snapshot: Callable[[list[tuple[bytes, bytes | None, str, str]]], None],
        on_event: Callable[[KVCacheEvent], None],
    ) -> Callable[[], None]:
        """Atomically per source: ``on_snapshot`` with the pool's cached (hash, parent hash, namespace id, medium),
        then ``on_event`` subscribed to the pool's events (on the engine thread); the same with the blocks the tiers
        hold and their events (``tiers.presence``: delivered on the tiers' threads). Each change is seen exactly
        once. Returns the function that unsubscribes from both."""

        def start() -> Callable[[], None]:
            on_snapshot([(h, parent, namespace, POOL) for h, parent, namespace in self.engine.manager.pool.snapshot()])
            unsubscribes = [self.engine.manager.events.subscribe(on_event)]
            if self.engine.kv_tier is not None:
                unsubscribes.append(self.engine.kv_tier.presence.subscribe_from_snapshot(on_snapshot, on_event))

            def unsubscribe() -> None:
                for stop in unsubscribes:
                    stop()

            return unsubscribe

        return await self._call(start)

    def kv_media(self) -> list[Medium]:
        """Where the engine holds blocks and what each place costs to load from now (``LLMEngine.kv_media``)."""
        return self.engine.kv_media()

    async def abort(self, request_id: str) -> None:
        """Stops the request and frees its blocks (done when this returns); its stream ends with finish_reason
        "abort". Unknown or finished ids are ignored."""
        await self._call(lambda: self._abort_and_deliver(request_id))

    async def load_lora_adapter(self, name: str, path: str, inplace: bool = False) -> LoraInfo:
        """Loads the PEFT adapter at ``path`` as ``name`` (ValueError, one line, for a bad one or a name in use unless
        ``inplace``, which replaces that name's adapter)."""

        def load() -> LoraInfo:
            if self.engine.loras is None:
                raise ValueError("LoRA is off: start the engine with enable_lora (kvprefix serve --enable-lora)")
            self.engine.loras.load(name, path, inplace)
            self.lora_adapters = self.engine.loras.infos()
            return self.lora_adapters[name]

        return await self._call(load)

    async def unload_lora_adapter(self, name: str) -> None:
        """Forgets ``name`` (``LoraNotFoundError`` if not loaded); requests running with it keep it to their end."""

        def unload() -> None:
            if self.engine.loras is None:
                raise ValueError("LoRA is off: start the engine with enable_lora (kvprefix serve --enable-lora)")
            self.engine.loras.unload(name)
            self.lora_adapters = self.engine.loras.infos()

        await self._call(unload)

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; False (nothing changed) while requests hold blocks."""
        return await self._call(self.engine.reset_prefix_cache)

    def get_metrics(self) -> dict[str, int | float]:
        """Counters and gauges; see LLMEngine.get_metrics. Read without stopping the engine."""
        return self.engine.get_metrics()

    async def shutdown(self) -> None:
        """Aborts every request (their streams end with finish_reason "abort") and stops the engine thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- engine thread

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._error is not None or not self._thread.is_alive() or self._stopping:
                future.set_exception(
                    EngineDeadError("the engine is not running")
                    if self._error is None
                    else EngineDeadError(f"the engine failed: {self._error!r}")
                )
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self._submit(fn))

    def _release(self, request_id: str, stream: _Stream) -> None:
        """Unregisters ``stream`` and aborts its request (a no-op once it finished), on the engine thread. Only if
        the id is still this stream's: after it finished, a new request may reuse the id."""

        def release() -> None:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                self.engine.abort_request(request_id)

        future = self._submit(release)
        if future.done() and isinstance(future.exception(), EngineDeadError):  # refused: no engine thread to do it
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def _abort_and_deliver(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.get(request_id)
        if out is not None and stream is not None:
            stream.put(out)

    def _run_loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # never die silently: fail every stream and refuse new work
            self._fail(e)

    def _serve(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while not self._commands and not self._stopping and not engine.has_unfinished_requests():
                    self._wake.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for fn, future in commands:
                # The caller may have cancelled (wrap_future cancels the future): then skip the command, since
                # setting a result on a cancelled future raises. Once running, it can no longer be cancelled.
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = fn()
                except BaseException as e:  # a bad request fails its caller, not the engine
                    future.set_exception(e)
                else:
                    future.set_result(result)
            if stopping:
                for out in engine.abort_all():
                    if (stream := self._streams.get(out.request_id)) is not None:
                        stream.put(out)
                engine.close()
                return
            if not engine.has_unfinished_requests():
                continue
            outputs = engine.step()
            if self.enable_lora:
                self.lora_activity = engine.lora_activity()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
            for request_id, error in engine.take_failures():  # failed alone: the engine goes on
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.put(error)

    def _fail(self, error: BaseException) -> None:
        """A failed step leaves the engine in an unknown state: fail every stream and refuse new work."""
        with self._wake:
            self._error = error
            pending, self._commands = self._commands, []
        dead = EngineDeadError(f"the engine failed: {error!r}")
        dead.__cause__ = error
        for _, future in pending:
            if future.set_running_or_notify_cancel():  # a cancelled future takes no exception
                future.set_exception(dead)
        for stream in list(self._streams.values()):
            stream.put(dead)
