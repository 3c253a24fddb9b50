"""Load: 64 concurrent streaming clients, every fourth disconnecting mid-stream. All others complete without
errors, no block stays referenced, and the metrics agree with what the clients saw."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from support.servers import Server

CLIENTS = 64
MAX_TOKENS = 24
LONG = 400  # for clients that disconnect: far from done when they leave
SYSTEM = [random.Random(0).randrange(3, 700) for _ in range(256)]  # a shared 16-block system prompt


async def _client(server: Server, i: int, disconnect: bool) -> dict:
    prompt = SYSTEM + [random.Random(i).randrange(3, 700) for _ in range(20)]  # 276 tokens each
    client = server.async_client()
    stream = await client.completions.create(
        model="default-model-v1", prompt=prompt, max_tokens=LONG if disconnect else MAX_TOKENS, temperature=0.8,
        seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks, usage, finish = 0, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        if disconnect and chunks == 3:
            await stream.close()
            break
    await client.close()
    return {"disconnected": disconnect, "usage": usage, "finish": finish, "chunks": chunks}


@pytest.mark.slow
def test_64_streaming_clients_some_disconnecting(server_process: Server) -> None:
    """On a `kvprefix serve` process: the clients load a server, not the test's own interpreter."""
    server = server_process
    before = server.wait_idle()

    async def run() -> list[dict]:
        return await asyncio.gather(*(_client(server, i, disconnect=i % 4 == 0) for i in range(CLIENTS)))

    results = asyncio.run(run())
    after = server.wait_idle()  # also the leak check: every block free, nothing running

    done = [r for r in results if not r["disconnected"]]
    gone = [r for r in results if r["disconnected"]]
    assert len(done) == 48 and len(gone) == 16
    for r in done:
        assert r["finish"] == "length" and r["usage"].completion_tokens == MAX_TOKENS
        assert r["usage"].prompt_tokens == len(SYSTEM) + 20
    assert sum(r["usage"].prompt_tokens_details.cached_tokens > 0 for r in done) >= 40  # the system prompt is shared

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("kvprefix:request_success_total{length}") == 48
    assert delta("kvprefix:request_success_total{abort}") == 16
    assert delta("kvprefix:prompt_tokens_total") == CLIENTS * (len(SYSTEM) + 20)
    generated = delta("kvprefix:generation_tokens_total")
    assert 48 * MAX_TOKENS + 16 * 3 <= generated < 48 * MAX_TOKENS + 16 * LONG
    assert delta("kvprefix:prefix_cache_hits_total") >= sum(r["usage"].prompt_tokens_details.cached_tokens
                                                            for r in done)
    assert delta("kvprefix:e2e_request_latency_seconds_count") == CLIENTS
    assert delta("kvprefix:server_rejected_requests_total{overloaded}") == 0


def test_non_streaming_client_that_gives_up_is_aborted(server: Server) -> None:
    """4,000 tokens would take many seconds; the client leaves after 0.5 s and the server must notice."""
    before = server.wait_idle()
    with pytest.raises(httpx.TimeoutException):
        server.post("/v1/completions", {"prompt": "never read", "max_tokens": 4000, "ignore_eos": True}, timeout=0.5)
    after = server.wait_idle(timeout=5)
    assert after["kvprefix:request_success_total{abort}"] == before["kvprefix:request_success_total{abort}"] + 1
