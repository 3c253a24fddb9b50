"""The KV event publisher on a real AsyncLLM (tiny model), with small limits: a subscriber that stops reading is
dropped with a goodbye and resumes; one whose resume point left the buffer gets a snapshot; idle streams beat."""

from __future__ import annotations

import asyncio

from kvprefix import SamplingParams
from kvprefix.cache.event_index import StreamMirror
from kvprefix.cache.event_wire import Event, Goodbye, Heartbeat, loads
from kvprefix.engine import AsyncLLM, EngineArgs
from kvprefix.server.kv_events import KVEventPublisher

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def engine(path: str) -> AsyncLLM:
    return AsyncLLM(EngineArgs(model=path, dtype="float32", device="cpu", num_gpu_blocks=24, block_size=4))


async def generate(llm: AsyncLLM, bases: range) -> None:
    for base in bases:
        async for _ in llm.generate([base, *range(1, 30)], PARAMS, f"r{base}"):
            pass


class Reader:
    """Reads a publisher stream (chunks of NDJSON lines) message by message into a mirror."""

    def __init__(self, stream, mirror: StreamMirror | None = None):
        self.stream = stream
        self.mirror = mirror or StreamMirror()
        self.pending: list[bytes] = []
        self.received: list = []

    async def next(self):
        while not self.pending:
            self.pending = (await anext(self.stream)).splitlines()
        msg = loads(self.pending.pop(0))
        self.mirror.apply(msg)
        self.received.append(msg)
        return msg

    async def until(self, seq: int) -> None:
        while not self.mirror.ready or self.mirror.since < seq:
            await self.next()


def test_a_subscriber_that_stops_reading_is_dropped_then_resumes(tiny_llama_path: str):
    async def main():
        llm = engine(tiny_llama_path)
        publisher = KVEventPublisher("r", llm, buffer_bytes=2**20, queue_bytes=2048, heartbeat_s=30)
        try:
            slow = Reader(await publisher.stream(None, None))
            await slow.until(0)
            await generate(llm, range(100, 112))  # far more than 2 KiB of events; the engine never waits
            while not isinstance(msg := await slow.next(), Goodbye):
                assert isinstance(msg, Event)
            assert msg.reason == "overflow" and msg.seq == slow.mirror.since < publisher.last_seq
            back = Reader(await publisher.stream(msg.seq, publisher.epoch), slow.mirror)
            assert (await back.next()).resume
            await back.until(publisher.last_seq)
            assert set(back.mirror.index.blocks()) == set(llm.engine.manager.pool.cached_blocks)  # the truth
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_a_resume_point_that_left_the_buffer_gets_a_snapshot(tiny_llama_path: str):
    async def main():
        llm = engine(tiny_llama_path)
        publisher = KVEventPublisher("r", llm, buffer_bytes=1, heartbeat_s=30)  # keeps only the newest
        try:
            steady, gone = Reader(await publisher.stream(None, None)), Reader(await publisher.stream(None, None))
            await gone.until(0)
            await gone.stream.aclose()
            await generate(llm, range(200, 206))
            back = Reader(await publisher.stream(gone.mirror.since, gone.mirror.epoch), gone.mirror)
            hello = await back.next()
            assert not hello.resume
            await back.until(hello.seq)
            await steady.until(hello.seq)
            assert back.mirror.index.blocks() == steady.mirror.index.blocks() and len(steady.mirror.index) > 0
            await back.stream.aclose()
            assert not publisher._subscribers[1:]  # closed streams unsubscribed; only `steady` is left
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_an_idle_stream_sends_heartbeats_with_its_last_event(tiny_llama_path: str):
    async def main():
        llm = engine(tiny_llama_path)
        publisher = KVEventPublisher("r", llm, heartbeat_s=0.05)
        try:
            reader = Reader(await publisher.stream(None, None))
            await generate(llm, range(300, 302))
            await reader.until(publisher.last_seq)
            beat = await reader.next()
            assert beat == Heartbeat(publisher.last_seq)
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_nothing_listens_until_the_first_stream_whose_snapshot_is_the_pool(tiny_llama_path: str):
    """No cost while nobody listens: the engine builds no events until a stream opens; that stream's snapshot is
    the pool's cached set at that moment, and events continue from it."""

    async def main():
        llm = engine(tiny_llama_path)
        publisher = KVEventPublisher("r", llm, heartbeat_s=30)
        try:
            await generate(llm, range(400, 404))
            assert not llm.engine.manager.events.active
            reader = Reader(await publisher.stream(None, None))
            await reader.until(0)
            assert llm.engine.manager.events.active
            pool = llm.engine.manager.pool
            assert set(reader.mirror.index.blocks()) == set(pool.cached_blocks) and len(pool.cached_blocks) > 0
            await generate(llm, range(404, 410))
            await reader.until(publisher.last_seq)
            assert set(reader.mirror.index.blocks()) == set(pool.cached_blocks)
        finally:
            await llm.shutdown()

    asyncio.run(main())
