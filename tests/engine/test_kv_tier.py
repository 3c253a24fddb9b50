"""The disk tier under a real engine: a restarted engine loads a prefix from disk, counts it as cached, and
generates exactly what computing it would (its KV bytes equal the computed ones); an object that does not verify
is a counted miss and the output stays right; a full write queue drops writes, counted, without waiting; a load in
flight never holds up other requests, is shared by requests wanting the same blocks, and outlives an abort."""

from __future__ import annotations

import os
import random
import threading

import torch
from support.engine_kv import GREEDY, block_kv, run

from kvprefix import SamplingParams
from kvprefix.tiers import disk_layout as layout

rng = random.Random(7)
PREFIX = [rng.randrange(3, 500) for _ in range(200)]  # 12 full 16-token blocks, then 8 tokens
PROMPTS = [PREFIX + [rng.randrange(3, 500) for _ in range(20)] for _ in range(2)]


def test_a_restarted_engine_loads_the_prefix_from_disk_exactly(make_llm, tmp_path, assert_no_leaks) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    first = make_llm(kv_disk=str(tmp_path))
    assert run(first, PROMPTS[:1])[0] == cold[:1]
    first.llm_engine.kv_tier.flush()
    assert first.llm_engine.get_metrics()["kv_disk_stores"] >= 12
    second = make_llm(kv_disk=str(tmp_path))  # a restart: an empty pool over the same directory
    tokens, cached = run(second, PROMPTS[1:])
    assert tokens == cold[1:]
    assert cached == [192]  # the prefix's 12 full blocks, loaded from disk
    m = second.llm_engine.get_metrics()
    assert m["kv_disk_hit_tokens"] == 192 and m["prefix_cache_hits"] == 192 and m["kv_disk_verify_failures"] == 0
    hashes = second.llm_engine.hasher.hash_blocks(PROMPTS[1][:192])
    for h in hashes:
        assert torch.equal(block_kv(first, h), block_kv(second, h))  # the bytes computed, not close to them
    assert_no_leaks(second)
    first.llm_engine.close()
    second.llm_engine.close()


def test_a_corrupted_object_is_a_counted_miss_and_the_output_stays_right(make_llm, tmp_path) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    first = make_llm(kv_disk=str(tmp_path))
    run(first, PROMPTS[:1])
    first.llm_engine.close()
    hashes = first.llm_engine.hasher.hash_blocks(PREFIX[:192])
    path = layout.object_path(str(tmp_path), hashes[5])
    with open(path, "r+b") as f:  # one byte of the sixth block's payload
        f.seek(os.path.getsize(path) - 40)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    second = make_llm(kv_disk=str(tmp_path))
    tokens, cached = run(second, PROMPTS[1:])
    assert tokens == cold[1:]
    assert cached == [5 * 16]  # the blocks before the bad one
    m = second.llm_engine.get_metrics()
    assert m["kv_disk_verify_failures_checksum"] == 1 and m["kv_disk_hit_tokens"] == 80
    second.llm_engine.close()


def test_a_full_write_queue_drops_writes_and_counts_them(make_llm, tmp_path) -> None:
    llm = make_llm(kv_disk=str(tmp_path), kv_disk_queue=1)
    long = [rng.randrange(3, 500) for _ in range(1600)]  # 100 blocks registered in one step
    llm.generate([long], SamplingParams(temperature=0, max_tokens=1))
    llm.llm_engine.close()
    m = llm.llm_engine.get_metrics()
    assert m["kv_disk_dropped_writes_queue_full"] > 0
    assert m["kv_disk_stores"] + m["kv_disk_dropped_writes"] == 100


def gate_loads(llm) -> threading.Event:
    """Holds the disk tier's loader thread before each of its (real) block reads until the event is set, so a test
    can act while a load is in flight."""
    store = llm.llm_engine.kv_tier.stores[0]
    opened, read = threading.Event(), store.load_into

    def gated(expected, spans):
        opened.wait(30)
        return read(expected, spans)

    store.load_into = gated
    return opened


def drive(engine, states: dict, steps: int | None = None) -> list[str]:
    """Steps the engine (``steps`` times, or until every request finished); returns the ids that got a token."""
    got: list[str] = []
    done = 0
    while engine.has_unfinished_requests() if steps is None else done < steps:
        for delta in engine.step():
            states[delta.request_id].apply(delta)
            got.append(delta.request_id)
        done += 1
    return got


def restarted_with_prefix_on_disk(make_llm, tmp_path):
    """An engine over a disk tier that holds ``PREFIX``'s blocks, computed by an engine before it."""
    first = make_llm(kv_disk=str(tmp_path))
    run(first, PROMPTS[:1])
    first.llm_engine.close()
    return make_llm(kv_disk=str(tmp_path))


def test_a_load_in_flight_never_stalls_other_requests(make_llm, tmp_path, assert_no_leaks) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    llm = restarted_with_prefix_on_disk(make_llm, tmp_path)
    opened, engine = gate_loads(llm), llm.llm_engine
    other = [rng.randrange(3, 500) for _ in range(30)]
    states = {"other": engine.add_request("other", {"prompt_token_ids": other}, GREEDY),
              "loading": engine.add_request("loading", {"prompt_token_ids": PROMPTS[1]}, GREEDY)}
    got = drive(engine, states, steps=GREEDY.max_tokens + 2)
    assert got.count("other") == GREEDY.max_tokens and "loading" not in got  # finished while the load waited
    assert [r.request_id for r in engine.scheduler.waiting] == ["loading"]
    opened.set()
    drive(engine, states)
    out = states["loading"].output()
    assert out.outputs[0].token_ids == cold[1] and out.num_cached_tokens == 192
    assert engine.get_metrics()["kv_disk_hit_tokens"] == 192
    assert_no_leaks(llm)
    engine.close()


def test_requests_sharing_a_prefix_load_it_once(make_llm, tmp_path, assert_no_leaks) -> None:
    cold, _ = run(make_llm(), PROMPTS)
    llm = restarted_with_prefix_on_disk(make_llm, tmp_path)
    tokens, cached = run(llm, [PROMPTS[1], PROMPTS[1][:-3] + [7, 8, 9]])
    # The second waited for the first's load, then for its prompt's 13th block (computed by the first).
    assert tokens[0] == cold[1] and cached == [192, 208]
    m = llm.llm_engine.get_metrics()
    assert m["kv_disk_hit_blocks"] == 12 and m["kv_disk_hit_tokens"] == 192
    assert_no_leaks(llm)
    llm.llm_engine.close()


def test_a_request_aborted_during_its_load_leaves_the_blocks_cached(make_llm, tmp_path, assert_no_leaks) -> None:
    llm = restarted_with_prefix_on_disk(make_llm, tmp_path)
    opened, engine = gate_loads(llm), llm.llm_engine
    states = {"loading": engine.add_request("loading", {"prompt_token_ids": PROMPTS[1]}, GREEDY)}
    drive(engine, states, steps=2)
    engine.abort_request("loading")
    opened.set()
    states["next"] = engine.add_request("next", {"prompt_token_ids": PROMPTS[1]}, GREEDY)
    drive(engine, states)
    assert states["next"].output().num_cached_tokens == 192
    assert engine.get_metrics()["kv_disk_hit_blocks"] == 12  # from the pool: the abandoned load was registered
    assert_no_leaks(llm)
    engine.close()
