"""`kvprefix serve --deterministic` under concurrent load (issue 29): 8 streams sharing a prefix, arriving at random
moments into small chunks, return exactly the greedy tokens and log-probabilities of a cold serial run."""

from __future__ import annotations

import asyncio
import random

import pytest
from support.servers import start_server, stop_server

pytestmark = pytest.mark.slow
rng = random.Random(29)
PREFIX = [rng.randrange(3, 500) for _ in range(100)]
PROMPTS = [PREFIX + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))] for _ in range(8)]
BODY = dict(model="default-model-v1", max_tokens=12, temperature=0, logprobs=2)


def answer(choice) -> tuple[list[str], list[float], list[dict]]:
    return choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.logprobs.top_logprobs


async def concurrently(server) -> list[tuple]:
    client = server.async_client()
    arrival = random.Random(3)

    async def one(prompt: list[int]):
        await asyncio.sleep(arrival.uniform(0, 0.5))
        return answer((await client.completions.create(prompt=prompt, **BODY)).choices[0])

    return await asyncio.gather(*(one(p) for p in PROMPTS))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_concurrent_streams_equal_a_cold_serial_run_exactly(server_tmp, dtype):
    serial = start_server(server_tmp, "--deterministic", "--dtype", dtype, "--no-enable-prefix-caching",
                          "--max-num-seqs", "1", "--num-gpu-blocks", "256")
    try:
        cold = [answer(serial.client().completions.create(prompt=p, **BODY).choices[0]) for p in PROMPTS]
    finally:
        stop_server(serial)
    loaded = start_server(server_tmp, "--deterministic", "--dtype", dtype, "--max-num-batched-tokens", "40",
                          "--num-gpu-blocks", "256")
    try:
        warm = asyncio.run(concurrently(loaded))
        hits = loaded.metrics()["kvprefix:prefix_cache_hits_total"]
    finally:
        stop_server(loaded)
    assert hits > 0  # some streams found the prefix cached
    assert warm == cold
