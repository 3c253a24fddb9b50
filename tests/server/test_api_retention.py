"""Retention through the API, on a real `kvprefix serve --kv-disk` with the official client: a 24h prompt
(`prompt_cache_retention`) survives pool and disk LRU pressure that evicts a default one and comes back from disk;
an in_memory prompt never reaches the disk; a text part's `cache_control.ttl` retains a chat prompt; a retention
past the tenant's budget is a 400 in OpenAI's shape that leaves the next request unharmed."""

from __future__ import annotations

import random
import time
from pathlib import Path

import openai
import pytest
from support.servers import start_server, stop_server

from kvprefix.cache import BlockIdentity
from kvprefix.tiers import disk_layout as layout

pytestmark = pytest.mark.slow
rng = random.Random(24)
OBJECT = 66_000  # a little over one object of the tests' model (4 layers x 16 tokens x 2 x 2 heads x 64 x 4 B + header)
PROMPTS = {name: [rng.randrange(3, 700) for _ in range(10 * 16 + 5)] for name in ("kept", "plain", "memory", "p1",
                                                                                  "p2", "p3", "big")}
PROMPTS["big"] = [rng.randrange(3, 700) for _ in range(20 * 16 + 5)]


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    tmp = tmp_path_factory.mktemp("retention")
    s = start_server(tmp, "--kv-disk", str(tmp / "tier"), "--kv-disk-size", str(30 * OBJECT),
                     "--kv-retention-budget", str(15 * OBJECT), "--num-gpu-blocks", "24")
    s.tier = tmp / "tier"
    try:
        yield s
    finally:
        stop_server(s)


def complete(server, name: str, retention: str | None = None) -> tuple[int, dict | None]:
    """(cached tokens, where they came from: None when none came from a lower tier)."""
    body = {"cache_detail": True} | ({"prompt_cache_retention": retention} if retention else {})
    r = server.client().completions.create(model="default-model-v1", prompt=PROMPTS[name], max_tokens=1,
                                           temperature=0, extra_body=body)
    return r.usage.prompt_tokens_details.cached_tokens, r.usage.model_extra["cache_detail"][0].get("cached_tokens_from")


def on_disk(server, name: str) -> list[bool]:
    identity = BlockIdentity.from_dict(server.get("/v1/models").json()["data"][0]["kvprefix"]["block_identity"])
    prompt = PROMPTS[name]
    hashes = identity.hasher().hash_blocks(prompt[: len(prompt) // 16 * 16])
    return [Path(layout.object_path(str(server.tier), h)).exists() for h in hashes]


def wait_written(server, stores: int) -> None:
    """Until the server has written ``stores`` objects in all (the writer is behind the responses)."""
    deadline = time.monotonic() + 30
    while server.metrics().get("kvprefix:kv_tier_stores_total{disk}", 0) < stores:
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)


def test_a_24h_prompt_outlives_the_pressure_that_evicts_others_and_in_memory_never_reaches_disk(server) -> None:
    complete(server, "kept", "24h")
    complete(server, "plain")
    complete(server, "memory", "in_memory")
    wait_written(server, 20)
    assert all(on_disk(server, "kept")) and all(on_disk(server, "plain")) and not any(on_disk(server, "memory"))
    for i, name in enumerate(("p1", "p2", "p3")):  # 30 more blocks through a 24-block pool and a 30-block disk
        complete(server, name)
        wait_written(server, 30 + 10 * i)
    assert all(on_disk(server, "kept")) and not any(on_disk(server, "plain"))
    assert not any(on_disk(server, "memory"))
    assert complete(server, "kept") == (160, {"pool": 0, "disk": 160})  # gone from the pool, loaded from disk
    assert complete(server, "plain") == (0, None)
    m = server.metrics()
    assert m["kvprefix:kv_tier_evictions_total{disk}"] >= 10
    assert m.get("kvprefix:kv_tier_dropped_writes_total{disk,retained}", 0) == 0
    # Seen in the metrics: one load (the kept prompt's run) and a store per object, timed; vLLM's external-cache
    # counters in tokens.
    assert m["kvprefix:kv_tier_load_seconds_count{disk}"] == 1 and m["kvprefix:kv_tier_load_seconds_sum{disk}"] > 0
    assert m["kvprefix:kv_tier_store_seconds_count{disk}"] == m["kvprefix:kv_tier_stores_total{disk}"]
    assert m["kvprefix:external_prefix_cache_hits_total"] == 160
    assert m["kvprefix:external_prefix_cache_queries_total"] >= 6 * 160


def test_a_cache_control_ttl_retains_a_chat_prompt(server) -> None:
    notes = set(server.tier.glob("objects/*/*.ret"))
    text = " ".join(f"word{rng.randrange(1000)}" for _ in range(10))
    server.client().chat.completions.create(
        model="default-model-v1", max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": text,
                                                 "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}])
    deadline = time.monotonic() + 30
    while not (new := set(server.tier.glob("objects/*/*.ret")) - notes):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for note in new:  # kept for an hour from now (the note's mtime), not a day
        assert 3000 < note.stat().st_mtime - time.time() <= 3600


def test_a_retention_past_the_tenant_budget_is_a_400_and_hurts_no_one(server) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        complete(server, "big", "24h")  # 20 blocks: past a 15-block budget whatever is held
    assert err.value.status_code == 400 and "--kv-retention-budget" in err.value.message
    assert err.value.body["type"] == "invalid_request_error"
    assert complete(server, "big")[0] == 0  # the same prompt without retention: served
    with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
        server.client().completions.create(model="default-model-v1", prompt=[5, 6], max_tokens=1,
                                           extra_body={"prompt_cache_retention": "forever"})
