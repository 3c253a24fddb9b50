"""The kv-events router and LoRA adapters: a request for an adapter hashes in that adapter's namespace (learned
from the replicas' model lists), so its repeat goes to the replica holding the adapter's blocks, not to the one
holding the base model's blocks of the same prompt. Real `kvprefix serve` replicas and a real `kvprefix route`."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from support.routers import per_replica, start_router
from support.servers import Server, start_server, stop_server

from kvprefix.model import write_random_lora_adapter

MODEL = "default-model-v1"


@pytest.fixture(scope="module")
def lora_fleet(router_tmp: Path, default_model_dir: str) -> Iterator[tuple[list[Server], Server]]:
    adapter = write_random_lora_adapter(default_model_dir, str(router_tmp / "route-adapter"), rank=8, seed=4, scale=0.1)
    replicas = [start_server(router_tmp, "--num-gpu-blocks", "256", "--enable-lora", "--lora-modules",
                             f"ad={adapter}") for _ in range(2)]
    router = start_router(router_tmp, [s.url for s in replicas], "kv-events", None)
    yield replicas, router
    codes = [stop_server(s) for s in [router, *replicas]]
    assert all(code in (0, -15) for code in codes), codes


def _complete(url: str, model: str, prompt: list[int]):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)


@pytest.mark.slow
def test_an_adapters_repeat_goes_to_the_replica_holding_its_blocks(lora_fleet) -> None:
    (base_home, adapter_home), router = lora_fleet
    prompt = [random.Random(8).randrange(3, 700) for _ in range(160)]  # 9 full blocks
    # The same prompt computed directly on each replica: the base model's blocks on one, the adapter's on the other.
    assert _complete(base_home.url, MODEL, prompt).usage.prompt_tokens_details.cached_tokens == 0
    assert _complete(adapter_home.url, "ad", prompt).usage.prompt_tokens_details.cached_tokens == 0
    time.sleep(1.0)  # the router's event streams and its model-list refresh (every 0.2 s) catch up
    before = per_replica(router.metrics(), "requests_total")
    for model in ("ad", MODEL, "ad", MODEL):
        assert _complete(router.url, model, prompt).usage.prompt_tokens_details.cached_tokens == 144, model
    after = per_replica(router.metrics(), "requests_total")
    assert {u: after[u] - before.get(u, 0) for u in after} == {base_home.url: 2, adapter_home.url: 2}
