"""Retention in the engine (`LLM(kv_retention=...)`, `SamplingParams(kv_retention=...)`): in_memory blocks are
never written below the pool, a duration retains what is written (and what the tier already held), the request's
own value wins over the engine's default, and one past the tenant's budget is refused before it is queued."""

from __future__ import annotations

import random

import pytest

from kvprefix import SamplingParams
from kvprefix.tiers import disk_layout as layout

rng = random.Random(5)
PROMPT = [rng.randrange(3, 500) for _ in range(8 * 16 + 3)]  # 8 full blocks


def notes_and_objects(root) -> tuple[int, int]:
    return len(list(root.glob("objects/*/*.ret"))), len(list(layout.iter_objects(str(root))))


def test_the_engine_default_and_the_request_own_retention(make_llm, tmp_path) -> None:
    llm = make_llm(kv_disk=str(tmp_path), kv_retention="in_memory")
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    llm.llm_engine.kv_tier.flush()
    assert notes_and_objects(tmp_path) == (0, 0)  # the engine's default: nothing below the pool
    other = [rng.randrange(3, 500) for _ in range(4 * 16 + 1)]
    llm.generate([other], SamplingParams(temperature=0, max_tokens=1, kv_retention="24h"))
    llm.llm_engine.kv_tier.flush()
    assert notes_and_objects(tmp_path) == (4, 4)  # the request's own: written and retained
    llm.llm_engine.close()


def test_a_duration_retains_blocks_the_tier_already_holds(make_llm, tmp_path) -> None:
    llm = make_llm(kv_disk=str(tmp_path))
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))
    llm.llm_engine.kv_tier.flush()
    assert notes_and_objects(tmp_path) == (0, 8)  # the default: written, not retained
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, kv_retention="1h"))
    llm.llm_engine.kv_tier.flush()
    assert notes_and_objects(tmp_path) == (8, 8)
    llm.llm_engine.close()


def test_a_retention_past_the_budget_is_refused_before_it_is_queued(make_llm, tmp_path) -> None:
    llm = make_llm(kv_disk=str(tmp_path), kv_retention_budget=1)
    with pytest.raises(ValueError, match="past its 1-byte budget of retained KV"):
        llm.generate([PROMPT], SamplingParams(max_tokens=1, kv_retention="5m"))
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([PROMPT], SamplingParams(max_tokens=1))  # no retention asked: served and written
    assert out[0].outputs[0].token_ids
    llm.llm_engine.close()


def test_a_bad_retention_is_refused_by_name(make_llm) -> None:
    with pytest.raises(ValueError, match="kv_retention must be one of"):
        SamplingParams(kv_retention="forever")
