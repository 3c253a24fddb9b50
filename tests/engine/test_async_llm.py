"""AsyncLLM: concurrent streams, abort and disconnects free blocks, shutdown ends streams, errors reach callers."""

import asyncio

import pytest

from kvprefix import LLM, SamplingParams
from kvprefix.engine import AsyncLLM, EngineArgs, RequestOutputKind
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
        idle = not metrics["num_requests_running"] and not metrics["num_requests_waiting"]
        if idle and metrics["num_free_blocks"] == metrics["num_blocks"]:
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


# ---- regressions: cancellation, id reuse -----------------------------------------------------------------------


async def wait_for_no_streams(engine: AsyncLLM, timeout: float = 5.0) -> None:
    """A closed stream is unregistered on the engine thread; poll until it has been."""
    for _ in range(int(timeout / 0.01)):
        if not engine._streams:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"streams still registered: {list(engine._streams)}")


def test_cancelling_generate_while_its_request_is_queued_keeps_the_engine_alive(tiny_llama_path):
    """Regression: the engine thread ran the cancelled add_request, set_result raised InvalidStateError and the
    thread died silently (errored False, other streams hung, blocks leaked)."""
    import threading

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            gate = threading.Event()
            engine._submit(gate.wait)  # holds the engine thread, so the next command stays queued
            task = asyncio.create_task(collect(engine, PROMPTS[0], LONG, "cancelled"))
            await asyncio.sleep(0.05)  # generate() has submitted its add_request
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            outputs = await asyncio.wait_for(collect(engine, PROMPTS[1], GREEDY, "after"), 10)
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 12
            assert engine._thread.is_alive() and not engine.errored
            await wait_for_no_streams(engine)
            return await wait_until_idle(engine)
        finally:
            await engine.shutdown()

    metrics = asyncio.run(main())
    assert metrics["requests_finished"] == 1 and metrics["requests_aborted"] == 0  # the cancelled one never ran


def test_cancelling_generate_while_its_request_is_being_added_aborts_it(tiny_llama_path):
    """Regression: a cancel that lands once add_request is running left the request orphaned (it ran to the end
    with nobody listening)."""
    import threading

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            started, gate = threading.Event(), threading.Event()
            add_request = engine.engine.add_request

            def slow_add_request(*args):
                add_request(*args)
                started.set()
                gate.wait()

            engine.engine.add_request = slow_add_request
            task = asyncio.create_task(collect(engine, PROMPTS[0], LONG, "orphan"))
            await asyncio.to_thread(started.wait, 5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            metrics = await wait_until_idle(engine)
            await wait_for_no_streams(engine)
            assert not engine.errored
            return metrics
        finally:
            await engine.shutdown()

    metrics = asyncio.run(main())
    assert metrics["requests_aborted"] == 1 and metrics["requests_finished"] == 0
    assert metrics["generation_tokens"] < 400


def test_a_reused_id_never_gets_the_previous_requests_outputs(tiny_llama_path):
    """Regression: streams were registered on the loop thread while the closed stream's abort was still queued,
    so the engine's next output of the old request went to the new stream."""
    import queue
    import threading

    new_prompt = list(range(200, 230))

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            holds: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
            paused = threading.Semaphore(0)
            step = engine.engine.step

            def held_step():  # a queued hold makes the next step wait until it is set
                try:
                    release = holds.get_nowait()
                except queue.Empty:
                    pass
                else:
                    paused.release()
                    release.wait()
                return step()

            engine.engine.step = held_step
            old = engine.generate(PROMPTS[0], LONG, "X")
            async for out in old:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            first, second = threading.Event(), threading.Event()
            holds.put(first)
            await asyncio.to_thread(paused.acquire, timeout=5)  # the engine is about to step the old "X"
            await old.aclose()  # queues the abort of the old "X"
            new = asyncio.create_task(collect(engine, new_prompt, GREEDY, "X"))
            await asyncio.sleep(0.05)  # the new generate() has submitted its add_request
            holds.put(second)
            first.set()  # the step yields an output of the old "X"; then the abort and the add run
            await asyncio.to_thread(paused.acquire, timeout=5)  # ... and the next step waits
            await asyncio.sleep(0.1)  # the new stream's consumer reads whatever reached it: only a stale output
            second.set()
            outputs = await asyncio.wait_for(new, 10)
            await wait_for_no_streams(engine)
            await wait_until_idle(engine)
            return outputs
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    assert all(out.prompt_token_ids == new_prompt for out in outputs)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_closing_a_stale_stream_does_not_abort_a_new_request_with_its_id(tiny_llama_path):
    """Once a request finished, its id may be reused even before its stream is closed; closing the old stream
    afterwards must not abort (or unregister) the new request."""

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            old = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "Y")
            await old.__anext__()
            while engine.get_metrics()["requests_finished"] < 1:  # finished in the engine, not yet read
                await asyncio.sleep(0.01)
            new = engine.generate(PROMPTS[1], GREEDY, "Y")
            outputs = [await new.__anext__()]
            await old.aclose()  # the old consumer walks away without having seen its final output
            outputs += [out async for out in new]
            await wait_for_no_streams(engine)
            await wait_until_idle(engine)
            return outputs
        finally:
            await engine.shutdown()

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert len(outputs[-1].outputs[0].token_ids) == 12


def test_a_request_the_sampler_cannot_serve_fails_alone(tiny_llama_path):
    """Should a value the engine cannot honour slip past validation, that request fails; the batch it shared a
    step with, and every later request, are served, and the engine stays up."""
    from kvprefix.engine import RequestFailedError

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            bad = SamplingParams(temperature=0.8, logprobs=2, max_tokens=8, ignore_eos=True)
            bad.logprobs = -1  # past validation: the sampler's top-k of the logprobs cannot take it
            good = [asyncio.create_task(collect(engine, p, GREEDY, f"good-{i}")) for i, p in enumerate(PROMPTS)]
            with pytest.raises(RequestFailedError, match="'bad' failed in the engine: RuntimeError"):
                await collect(engine, PROMPTS[0], bad, "bad")
            outs = await asyncio.gather(*good)
            assert all(len(o[-1].outputs[0].token_ids) == 12 for o in outs)
            assert not engine.errored and engine.is_running
            after = await collect(engine, PROMPTS[1], GREEDY, "after")
            assert after[-1].finished
            metrics = await wait_until_idle(engine)
            assert metrics["requests_failed"] == 1
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_output_kinds(tiny_llama_path):
    """DELTA streams only what is new, FINAL_ONLY only the final output; both end where CUMULATIVE ends."""

    async def main():
        engine = AsyncLLM(engine_args(tiny_llama_path))
        try:
            runs = {}
            for kind in RequestOutputKind:
                runs[kind] = [out async for out in engine.generate(PROMPTS[0], GREEDY, kind.name,
                                                                    output_kind=kind)]
            return runs
        finally:
            await engine.shutdown()

    runs = asyncio.run(main())
    full = runs[RequestOutputKind.CUMULATIVE][-1].outputs[0]
    final = runs[RequestOutputKind.FINAL_ONLY]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == full.token_ids
    deltas = [o for out in runs[RequestOutputKind.DELTA] for o in out.outputs]
    assert [t for o in deltas for t in o.token_ids] == full.token_ids
    assert "".join(o.text for o in deltas) == full.text and deltas[-1].finish_reason == full.finish_reason
    # Measured by the reader in every kind: a gap per token after the first batch the reader saw (tokens that
    # arrive together share the time since the previous ones), so at most one per token after the first.
    gaps = final[0].metrics.token_gaps
    assert len(gaps) <= len(full.token_ids) - 1 and all(g >= 0 for g in gaps)
