"""AsyncLLM: concurrent streams, abort and disconnects free blocks, shutdown ends streams, errors reach callers."""

import asyncio

import pytest

from kvprefix import LLM, SamplingParams
from kvprefix.engine import AsyncLLM, EngineArgs
from kvprefix.engine.async_llm import EngineDeadError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(10, 50)) + [i] for i in range(6)]
LONG = SamplingParams(max_tokens=400, ignore_eos=True)


def engine_args(path: str) -> EngineArgs:
    return EngineArgs(model=path, dtype="float32", device="cpu", num_gpu_blocks=64)


async def collect(engine: AsyncLLM, prompt, params, request_id: str):
    outputs = [out async for out in engine.generate(prompt, params, request_id)]
    return outputs


async def wait_until_idle(engine: AsyncLLM, timeout: float = 5.0) -> dict:
    """The abort of a closed stream is queued; poll until the engine has applied it."""
    for _ in range(int(timeout / 0.01)):
        metrics = engine.get_metrics()
        if metrics["num_free_blocks"] == metrics["num_blocks"] and not metrics["num_requests_running"]:
            return metrics
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still in use: {engine.get_metrics()}")


def test_concurrent_streams_match_the_offline_api(tiny_llama_path):
    expected = [o.outputs[0].token_ids for o in LLM(**vars(engine_args(tiny_llama_path))).generate(PROMPTS, GREEDY)]

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            await collect(engine, PROMPTS[0], GREEDY, "warm-up")  # registers the shared prefix's blocks
            streams = await asyncio.gather(*(collect(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS)))
            await wait_until_idle(engine)
            return streams, engine.get_metrics()
        finally:
            await engine.shutdown()

    streams, metrics = asyncio.run(main())
    for stream, tokens in zip(streams, expected, strict=True):
        assert stream[-1].finished and stream[-1].outputs[0].token_ids == tokens
        assert not any(out.finished for out in stream[:-1])
        lengths = [len(out.outputs[0].token_ids) for out in stream]
        assert lengths == sorted(lengths)  # cumulative
    assert metrics["prefix_cache_hits"] == 6 * 32  # each stream reused the shared prefix's two full blocks


def test_abort_mid_stream_frees_blocks(tiny_llama_path):
    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            seen = []
            async for out in engine.generate(PROMPTS[0], LONG, "long"):
                seen.append(out)
                if len(seen) == 3:
                    await engine.abort("long")
                    # abort returns once the blocks are freed
                    assert engine.get_metrics()["num_free_blocks"] == engine.get_metrics()["num_blocks"]
            return seen
        finally:
            await engine.shutdown()

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 400


def test_client_disconnect_and_cancel_free_blocks(tiny_llama_path):
    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            async for out in engine.generate(PROMPTS[0], LONG, "gone"):
                if len(out.outputs[0].token_ids) >= 2:
                    break  # the consumer walks away; closing the stream aborts the request
            await wait_until_idle(engine)
            task = asyncio.create_task(collect(engine, PROMPTS[1], LONG, "cancelled"))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await wait_until_idle(engine)
        finally:
            await engine.shutdown()

    metrics = asyncio.run(main())
    assert metrics["requests_aborted"] == 2


def test_errors_reset_and_shutdown(tiny_llama_path):
    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        with pytest.raises(ValueError, match="empty prompt"):
            await collect(engine, [], GREEDY, "bad")
        await collect(engine, PROMPTS[0], GREEDY, "a")
        assert await engine.reset_prefix_cache() is True
        assert engine.tokenizer.decode(engine.tokenizer.encode("hello")) == "hello"
        pending = asyncio.create_task(collect(engine, PROMPTS[1], LONG, "pending"))
        await asyncio.sleep(0.2)
        await engine.shutdown()
        outputs = await pending
        assert outputs[-1].outputs[0].finish_reason == "abort"
        assert engine.get_metrics()["num_free_blocks"] == engine.get_metrics()["num_blocks"]
        with pytest.raises(EngineDeadError):
            await collect(engine, PROMPTS[2], GREEDY, "late")

    asyncio.run(main())


def test_a_failing_step_fails_streams_not_the_process(tiny_llama_path):
    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))

        def broken_step():
            raise RuntimeError("kernel exploded")

        engine.engine.step = broken_step
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            await collect(engine, PROMPTS[0], GREEDY, "x")
        assert engine.errored
        await engine.shutdown()

    asyncio.run(main())


def test_streamed_text_only_grows_even_with_stop_strings(tiny_llama_path):
    full = LLM(**vars(engine_args(tiny_llama_path))).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24))
    text = full[0].outputs[0].text
    stop = text[8:11]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, stop=[stop])

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            return await collect(engine, PROMPTS[0], params, "s")
        finally:
            await engine.shutdown()

    stream = asyncio.run(main())
    final = stream[-1]
    assert [c.text for c in final.outputs] == [text[: text.find(stop)]] * 2
    assert all(c.finish_reason == "stop" and c.stop_reason == stop for c in final.outputs)
    for earlier in stream:
        for c, f in zip(earlier.outputs, final.outputs, strict=True):
            assert f.text.startswith(c.text)  # never a character that a later stop string takes back
