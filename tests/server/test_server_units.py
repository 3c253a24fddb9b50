"""The server's pure parts without a server: salts, keys, admission, and the cache-detail tracker on synthetic
KV events."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvprefix.cache import AllBlocksCleared, BlockHasher, BlockRemoved, BlockStored, namespace_salt
from kvprefix.http.errors import APIError
from kvprefix.http.tenancy import Auth, load_keys_file, validate_client_salt
from kvprefix.server.admission import Admission
from kvprefix.server.cache_detail import CacheTracker


def test_salts_are_unambiguous_and_scoped_by_tenant() -> None:
    assert namespace_salt(None, None) == ""  # the shared namespace hashes like the offline LLM
    salts = {namespace_salt("a", None), namespace_salt(None, "a"), namespace_salt("a", "b"), namespace_salt("b", "a"),
             namespace_salt('a","b', None), namespace_salt("a", '","b')}
    assert len(salts) == 6


@pytest.mark.parametrize("salt", ["", "x" * 65, "has space", "semi;colon", "ünï"])
def test_bad_client_salts(salt: str) -> None:
    with pytest.raises(APIError) as e:
        validate_client_salt(salt)
    assert e.value.status == 400 and e.value.param == "cache_salt"


def test_keys_file_and_auth(tmp_path) -> None:
    good = tmp_path / "keys.json"
    good.write_text(json.dumps({"k1": "alice", "k2": "bob"}))
    auth = Auth.from_options("k0", str(good), admin_key="adm")
    assert auth.tenant("Bearer k1") == "alice" and auth.tenant("bearer k0") == "default"
    for header, code in ((None, 401), ("Bearer nope", 401), ("Basic k1", 401)):
        with pytest.raises(APIError) as e:
            auth.tenant(header)
        assert e.value.status == code
    auth.check_admin("Bearer adm")
    with pytest.raises(APIError):
        auth.check_admin("Bearer k1")
    with pytest.raises(APIError) as e:
        Auth({"k": "t"}).check_admin("Bearer anything")
    assert e.value.status == 403  # tenants but no admin key: admin disabled
    Auth().check_admin(None)  # no keys at all: open
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(["k1"]))
    with pytest.raises(ValueError, match="JSON object"):
        load_keys_file(str(bad))


def test_admission_limits_and_drain() -> None:
    async def run() -> None:
        rejected: list[str] = []
        adm = Admission(3, max_pending_per_tenant=2, on_reject=rejected.append)
        a = await adm.acquire(2, "alice")
        with pytest.raises(APIError) as e:
            await adm.acquire(1, "alice")
        assert e.value.status == 429
        b = await adm.acquire(1, "bob")
        with pytest.raises(APIError) as e:
            await adm.acquire(1, "carol")
        assert e.value.status == 503 and rejected == ["tenant_limit", "overloaded"]
        b.release()
        b.release()  # idempotent
        assert adm.pending == 2
        async with adm.drained(0.05) as idle:
            assert not idle  # alice still runs
            waiting = asyncio.create_task(adm.acquire(1, "bob"))
            await asyncio.sleep(0.01)
            assert not waiting.done() and adm.pending == 3 and adm.running == 2  # held at the gate
        (await waiting).release()
        a.release()
        assert adm.pending == adm.running == 0

    asyncio.run(run())


def test_tracker_reasons_from_events() -> None:
    hasher = BlockHasher(4)
    tracker = CacheTracker(hasher)
    cached = [1, 2, 3, 4, 5, 6, 7, 8]
    hashes = hasher.hash_blocks(cached)
    tracker.on_event(BlockStored(hashes, hasher.root, cached, 4, None, hasher.namespace_id))
    other = hasher.for_namespace("other tenant", None)  # another namespace's first block: never a sibling
    foreign = other.hash_blocks([1, 2, 3, 0])
    tracker.on_event(BlockStored(foreign, other.root, [1, 2, 3, 0], 4, None, other.namespace_id))

    def reason(tokens: list[int], n_cached: int) -> tuple[str, str]:
        d = tracker.diagnose(0, tokens, hasher.hash_blocks(tokens), n_cached, None, None)
        return d.reason, d.message

    assert reason([1, 2, 3], 0)[0] == "prompt_shorter_than_block"
    assert reason(cached + [9], 8)[0] == "full_hit"
    assert reason([1, 2, 3, 4, 5, 6, 0, 0, 9], 4) == ("diverged", "diverged at token 6 from the nearest cached prefix")
    assert reason([1, 2, 9, 9, 9], 0)[1] == "diverged at token 2 from the nearest cached prefix"
    # The other namespace's [1, 2, 3, 0] would match 4 tokens: it must stay invisible.
    assert reason([1, 2, 3, 0, 9], 0)[1] == "diverged at token 3 from the nearest cached prefix"
    assert reason(cached + [9, 9, 9, 9, 9], 8)[0] == "prefix_ended"
    salted = hasher.for_namespace(None, "x")
    d = tracker.diagnose(0, cached + [9], salted.hash_blocks(cached + [9]), 0, None, "x")
    assert d.reason == "different_salt"  # cached without the salt, which the caller could just omit
    tracker.on_event(BlockRemoved([hashes[1]]))
    assert reason(cached + [9], 4)[0] == "evicted"
    tracker.on_event(AllBlocksCleared())
    assert reason(cached + [9], 0)[0] == "not_cached"  # after a reset nothing counts as evicted
    assert CacheTracker(hasher, enabled=False).diagnose(0, cached, hashes, 0, None, None).reason == \
        "caching_disabled"
