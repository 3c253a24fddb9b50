"""Tenancy (keys -> tenants -> server-side cache salt), admin endpoints, overload. On the tenant server: three
keys for two tenants, an admin key, at most 4 pending requests and a 96-block pool."""

from __future__ import annotations

import asyncio
import threading

import httpx
import openai
import pytest
from server_helpers import ADMIN, LONG_PREFIX, Server

ALICE, ALICE_2, BOB = "key-alice", "key-alice-2", "key-bob"


def _cached(server: Server, key: str, prompt: str, **extra) -> int:
    r = server.client(key).completions.create(model="default-model-v1", prompt=prompt, max_tokens=2, temperature=0,
                                              extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_share_blocks(tenant_server: Server) -> None:
    prompt = "tenancy isolation: " + LONG_PREFIX[:400]
    assert _cached(tenant_server, ALICE, prompt) == 0
    assert _cached(tenant_server, BOB, prompt) == 0  # same tokens, other tenant: a miss
    assert _cached(tenant_server, BOB, prompt) > 0  # bob's own copy now hits
    assert _cached(tenant_server, ALICE_2, prompt) > 0  # alice's second key is the same tenant


def test_client_salt_subdivides_a_tenant(tenant_server: Server) -> None:
    prompt = "salted: " + LONG_PREFIX[:400]
    assert _cached(tenant_server, ALICE, prompt) == 0
    assert _cached(tenant_server, ALICE, prompt, cache_salt="user-1") == 0
    assert _cached(tenant_server, ALICE, prompt, cache_salt="user-1") > 0
    # Bob cannot reach alice's salted namespace by sending the same salt: the tenant is part of the salt.
    assert _cached(tenant_server, BOB, prompt, cache_salt="user-1") == 0


def test_cache_detail_never_looks_into_another_tenant(tenant_server: Server) -> None:
    prompt = "detail isolation: " + LONG_PREFIX[:400]
    _cached(tenant_server, ALICE, prompt)
    r = tenant_server.client(BOB).completions.create(model="default-model-v1", prompt=prompt, max_tokens=2,
                                                     extra_body={"cache_detail": True})
    detail = r.usage.model_extra["cache_detail"]
    assert detail[0]["cached_tokens"] == 0 and detail[0]["reason"] == "not_cached"


def test_auth_errors(tenant_server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        tenant_server.client("wrong-key").models.list()
    r = tenant_server.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    r = tenant_server.post("/reset_prefix_cache", headers={"authorization": f"Bearer {ALICE}"})
    assert r.status_code == 401  # a tenant key is not the admin key
    assert httpx.get(tenant_server.url + "/metrics").status_code == 401
    assert httpx.get(tenant_server.url + "/metrics", headers=ADMIN).status_code == 200


def test_reset_refused_while_running_then_waits(tenant_server: Server) -> None:
    """The true outcome: 409 while a request holds blocks; with wait=true, success once it finished."""
    started = threading.Event()

    def long_stream() -> None:
        stream = tenant_server.client(ALICE).completions.create(
            model="default-model-v1", prompt="a long generation", max_tokens=300, stream=True,
            extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    r = tenant_server.post("/reset_prefix_cache", headers=ADMIN)
    assert r.status_code == 409 and "running" in r.json()["error"]["message"]
    r = tenant_server.post("/flush_cache?wait=true&timeout=60", headers=ADMIN)
    assert r.status_code == 200 and r.json()["success"] is True
    t.join()
    assert _cached(tenant_server, ALICE, "a long generation" * 5) == 0
    tenant_server.wait_idle(ADMIN)


def test_reset_wait_times_out(tenant_server: Server) -> None:
    started = threading.Event()
    stop = threading.Event()

    def long_stream() -> None:
        stream = tenant_server.client(BOB).completions.create(
            model="default-model-v1", prompt="keep running", max_tokens=1000, stream=True,
            extra_body={"ignore_eos": True})
        for _ in stream:
            started.set()
            if stop.is_set():
                stream.close()  # disconnect: the server aborts the request
                return

    t = threading.Thread(target=long_stream)
    t.start()
    assert started.wait(30)
    r = tenant_server.post("/reset_prefix_cache?wait=true&timeout=0.3", headers=ADMIN)
    assert r.status_code == 409 and "after waiting" in r.json()["error"]["message"]
    stop.set()
    t.join()
    tenant_server.wait_idle(ADMIN)


def test_overload_is_a_fast_503(tenant_server: Server) -> None:
    async def one(client: openai.AsyncOpenAI) -> int:
        try:
            await client.completions.create(model="default-model-v1", prompt="overload", max_tokens=64,
                                            extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as e:
            return e.status_code

    async def burst() -> list[int]:
        client = tenant_server.async_client(ALICE)
        return await asyncio.gather(*(one(client) for _ in range(12)))

    codes = asyncio.run(burst())
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 4, codes
    assert tenant_server.metrics(ADMIN)["kvprefix:server_rejected_requests_total{overloaded}"] >= 1
    tenant_server.wait_idle(ADMIN)
