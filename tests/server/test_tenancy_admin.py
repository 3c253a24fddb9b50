"""Tenancy (keys -> tenants -> server-side cache salt), admin endpoints, overload. On the tenant server: three
keys for two tenants, an admin key, at most 4 pending requests and a 96-block pool."""

from __future__ import annotations

import json
import threading

import openai
import pytest
from support.servers import ADMIN, LONG_PREFIX, Server

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

    def bob_detail(p: str, salt: str) -> dict:
        r = tenant_server.client(BOB).completions.create(model="default-model-v1", prompt=p, max_tokens=2,
                                                         extra_body={"cache_detail": True, "cache_salt": salt})
        return r.usage.model_extra["cache_detail"][0]

    # Identical, or differing only late in the first block: alice's blocks are invisible to bob (each probe in
    # a fresh namespace of bob's, so that his own probes do not answer).
    for i, p in enumerate((prompt, "detail isolatioN: " + LONG_PREFIX[:400])):
        d = bob_detail(p, f"probe-{i}")
        assert d["cached_tokens"] == 0 and d["reason"] == "not_cached", d
    # Bob's own first probe is cached: a near-copy in that namespace diverges from it.
    d = bob_detail("detail isolation? " + LONG_PREFIX[:400], "probe-0")
    assert d["reason"] == "diverged" and d["message"].startswith("diverged at token"), d


def test_auth_errors(tenant_server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        tenant_server.client("wrong-key").models.list()
    r = tenant_server.post("/v1/completions", {"prompt": "x"})
    assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
    r = tenant_server.post("/v1/chat/completions", b"{not json", headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401  # authentication comes before any parsing
    r = tenant_server.post("/reset_prefix_cache", headers={"authorization": f"Bearer {ALICE}"})
    assert r.status_code == 401  # a tenant key is not the admin key
    assert tenant_server.get("/metrics").status_code == 401
    assert tenant_server.get("/metrics", headers=ADMIN).status_code == 200


@pytest.mark.slow
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


def test_overload_tenant_share_is_429_and_full_server_503(tenant_server: Server) -> None:
    """Admission happens before a response starts, so once create() returns, the request holds its slot."""

    def hold(key: str):
        return tenant_server.client(key).completions.create(
            model="default-model-v1", prompt="hold a slot", max_tokens=800, stream=True,
            extra_body={"ignore_eos": True})

    def status(key: str) -> int:
        try:
            tenant_server.client(key).completions.create(model="default-model-v1", prompt="one more", max_tokens=2)
            return 200
        except openai.APIStatusError as e:
            return e.status_code

    held = [hold(ALICE) for _ in range(3)]
    try:
        assert status(ALICE_2) == 429  # alice's share (3) is taken, whichever of her keys she uses
        held.append(hold(BOB))  # bob still gets in: 4 pending, the server's limit
        assert status(BOB) == 503
    finally:
        for stream in held:
            stream.close()
    m = tenant_server.wait_idle(ADMIN)
    assert m["kvprefix:server_rejected_requests_total{tenant_limit}"] >= 1
    assert m["kvprefix:server_rejected_requests_total{overloaded}"] >= 1
    assert _cached(tenant_server, ALICE, "served again after the overload") == 0


def test_request_log_with_prompts_and_tenant_pseudonyms(tenant_server: Server) -> None:
    for key in (ALICE, BOB, ALICE_2):
        _cached(tenant_server, key, f"logged prompt of {key}")
    rows = [json.loads(line) for line in tenant_server.request_log.read_text().splitlines()][-3:]
    assert [r["prompt"] for r in rows] == [f"logged prompt of {k}" for k in (ALICE, BOB, ALICE_2)]
    alice, bob, alice_2 = (r["tenant"] for r in rows)
    assert alice == alice_2 != bob and "alice" not in alice
    assert all(r["salted"] for r in rows)
