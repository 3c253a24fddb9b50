"""The disk tier under a real engine: a restarted engine loads a prefix from disk, counts it as cached, and
generates exactly what computing it would (its KV bytes equal the computed ones); an object that does not verify
is a counted miss and the output stays right; a full write queue drops writes, counted, without waiting."""

from __future__ import annotations

import os
import random

import torch

from kvprefix import SamplingParams
from kvprefix.tiers import disk_layout as layout

GREEDY = SamplingParams(temperature=0, max_tokens=12)
rng = random.Random(7)
PREFIX = [rng.randrange(3, 500) for _ in range(200)]  # 12 full 16-token blocks, then 8 tokens
PROMPTS = [PREFIX + [rng.randrange(3, 500) for _ in range(20)] for _ in range(2)]


def run(llm, prompts=PROMPTS):
    outs = llm.generate(prompts, GREEDY)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def block_kv(llm, block_hash) -> torch.Tensor:
    engine = llm.llm_engine
    block = engine.manager.pool.cached_blocks[block_hash]
    return torch.stack([layer.kv[block.block_id] for layer in engine.runner.kv_caches])


def test_a_restarted_engine_loads_the_prefix_from_disk_exactly(make_llm, tmp_path, assert_no_leaks) -> None:
    cold, _ = run(make_llm())
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
    cold, _ = run(make_llm())
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
