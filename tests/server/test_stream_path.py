"""The path of a streamed token, in process (the real engine on the tiny model, the app over an ASGI transport, the
official client): the stream reads the engine's DELTA outputs through one queue (two only to merge a batch of
prompts), each becomes at most one chunk, and every logprob token is decoded once, by the engine's reader."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import httpx
import openai
import pytest

from kvprefix.engine import AsyncLLM, EngineArgs, RequestOutputKind
from kvprefix.server.app import ServerConfig, create_app


class _Watch:
    """Spies on real parts (each call still goes through): the engine's outputs and kinds, the tokenizer's decoding
    and the asyncio queues kvprefix makes, each by the module that made the call."""

    def __init__(self, engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch):
        self.kinds: list[RequestOutputKind] = []
        self.outputs: list = []
        self.decodes: Counter[str] = Counter()
        self.queues: Counter[str] = Counter()
        generate, decode, watch = engine.generate, engine.tokenizer.decode, self

        async def generate_spy(*args, **kwargs):
            self.kinds.append(kwargs.get("output_kind", RequestOutputKind.CUMULATIVE))
            async for out in generate(*args, **kwargs):
                self.outputs.append(out)
                yield out

        def decode_spy(ids, *args, **kwargs):
            if len(ids) == 1:
                self.decodes[sys._getframe(1).f_globals["__name__"]] += 1
            return decode(ids, *args, **kwargs)

        class Queue(asyncio.Queue):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                caller = sys._getframe(1).f_globals["__name__"]
                if caller.startswith("kvprefix"):
                    watch.queues[caller] += 1

        monkeypatch.setattr(engine, "generate", generate_spy)
        monkeypatch.setattr(engine.tokenizer, "decode", decode_spy)
        monkeypatch.setattr(asyncio, "Queue", Queue)

    def reset(self) -> None:
        self.kinds.clear()
        self.outputs.clear()
        self.decodes.clear()
        self.queues.clear()


def _serve(tiny_llama_path: str, monkeypatch: pytest.MonkeyPatch, body) -> None:
    """Runs ``body(client, model, watch)`` against an in-process app over a fresh engine, then shuts it down."""

    async def main() -> None:
        engine = AsyncLLM(EngineArgs(model=tiny_llama_path, dtype="float32", device="cpu", num_gpu_blocks=128))
        app = create_app(engine, ServerConfig(request_log=None))
        watch = _Watch(engine, monkeypatch)
        async with app.router.lifespan_context(app):
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http)
            await body(client, engine.model_name, watch)
            await http.aclose()

    asyncio.run(main())


def test_a_streamed_chat_reads_engine_deltas_through_one_queue(tiny_llama_path, monkeypatch) -> None:
    async def body(client: openai.AsyncOpenAI, model: str, watch: _Watch) -> None:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=12, temperature=0,
            stream=True, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert watch.kinds == [RequestOutputKind.DELTA]
        # One asyncio queue between the engine thread and the response: the engine's own, per request.
        assert watch.queues == {"kvprefix.engine.async_llm": 1}
        deltas = [o for out in watch.outputs for o in out.outputs]
        tokens = [t for o in deltas for t in o.token_ids]
        assert len(tokens) == 12 and sum(len(o.token_ids) for o in watch.outputs[-1].outputs) <= 12  # deltas only
        content = [c for c in chunks[1:] if c.choices and (c.choices[0].delta.content or c.choices[0].logprobs)]
        # Each engine delta became one chunk, its text and logprobs unchanged.
        assert len(content) == len(deltas)
        assert [c.choices[0].delta.content or "" for c in content] == [o.text for o in deltas]
        streamed = [lp.token for c in content for lp in c.choices[0].logprobs.content]
        assert streamed == [o.logprobs[i][t].decoded_token for o in deltas for i, t in enumerate(o.token_ids)]
        # Every logprob token (sampled and alternatives) decoded once, where the engine's outputs are read.
        entries = sum(len(entry) for o in deltas for entry in o.logprobs)
        assert watch.decodes["kvprefix.engine.output_state"] == entries
        assert not [m for m in watch.decodes if m.startswith("kvprefix.server")]

    _serve(tiny_llama_path, monkeypatch, body)


def test_a_batch_stream_merges_through_a_second_queue_and_whole_bodies_get_the_final_output(
        tiny_llama_path, monkeypatch) -> None:
    async def body(client: openai.AsyncOpenAI, model: str, watch: _Watch) -> None:
        stream = await client.completions.create(model=model, prompt=["One", "Two"], max_tokens=5, stream=True,
                                                 temperature=0, extra_body={"ignore_eos": True})
        texts = ["", ""]
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert watch.kinds == [RequestOutputKind.DELTA] * 2
        assert watch.queues == {"kvprefix.engine.async_llm": 2, "kvprefix.server.run": 1}
        watch.reset()
        whole = await client.completions.create(model=model, prompt=["One", "Two"], max_tokens=5, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert watch.kinds == [RequestOutputKind.FINAL_ONLY] * 2
        assert len(watch.outputs) == 2 and all(out.finished for out in watch.outputs)
        assert [c.text for c in whole.choices] == texts

    _serve(tiny_llama_path, monkeypatch, body)
