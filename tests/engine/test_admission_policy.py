"""Cache-aware admission: requests whose prefix is cached go first, a request that waited max_wait_steps goes
before them (no starvation under a stream of cached requests), and the greedy outputs are FCFS's."""

import itertools
import random

import pytest

from kvprefix import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
HOT = list(range(100, 148))  # 3 full blocks, cached by the warm-up


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def warm(llm) -> None:
    llm.generate(HOT + [7], GREEDY)


@pytest.mark.parametrize("policy", ["fcfs", "cache_aware"])
def test_cached_requests_are_admitted_first_only_when_cache_aware(make_llm, assert_no_leaks, policy):
    rng = random.Random(0)
    llm = make_llm(max_num_batched_tokens=64, scheduling_policy=policy)
    warm(llm)
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"cold{i}", tokens(rng, 70), GREEDY)
    for i in range(4):
        engine.add_request(f"hot{i}", HOT + tokens(rng, 8), GREEDY)
    engine.step()
    first = [r.request_id for r in engine.scheduler.running]
    # Cache-aware: the 4 hot requests cost 8 tokens each and all fit with a cold chunk; FCFS: the first cold one
    # takes the whole budget.
    assert first == (["hot0", "hot1", "hot2", "hot3", "cold0"] if policy == "cache_aware" else ["cold0"])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


@pytest.mark.parametrize("max_wait_steps", [5, 10_000])
def test_no_starvation_under_a_stream_of_cached_requests(make_llm, assert_no_leaks, max_wait_steps):
    """A cold request queued first, then every step 10 new cached requests, more than the budget admits: without
    aging the cold one never gets in; with it, it is admitted once it has waited max_wait_steps."""
    rng = random.Random(1)
    llm = make_llm(max_num_batched_tokens=64, scheduling_policy="cache_aware", max_wait_steps=max_wait_steps)
    warm(llm)
    engine = llm.llm_engine
    engine.add_request("cold", tokens(rng, 100), ONE_TOKEN)
    ids = itertools.count()
    admitted_at = None
    for step in range(1, 31):
        for _ in range(10):
            engine.add_request(f"hot{next(ids)}", HOT + tokens(rng, 8), ONE_TOKEN)
        engine.step()
        if admitted_at is None and any(r.request_id == "cold" for r in engine.scheduler.running):
            admitted_at = step
    if max_wait_steps == 5:
        assert admitted_at == 5  # ranked first in the step in which it has waited max_wait_steps
    else:
        assert admitted_at is None  # the hostile mix starves it without aging: the case under test
    engine.abort_all()
    assert_no_leaks(llm)


def test_greedy_outputs_are_those_of_fcfs(make_llm, assert_no_leaks):
    rng = random.Random(2)
    prefixes = [tokens(rng, n) for n in (40, 64, 90)]
    prompts = [rng.choice(prefixes) + tokens(rng, rng.randint(1, 20)) for _ in range(30)] + [tokens(rng, 30)] * 3
    results = {}
    for policy in ("fcfs", "cache_aware"):
        llm = make_llm(max_num_batched_tokens=64, max_num_seqs=6, num_gpu_blocks=40, scheduling_policy=policy)
        results[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts[:4] + prompts, GREEDY)]
        assert_no_leaks(llm)
    assert results["cache_aware"] == results["fcfs"]


def test_an_unknown_policy_is_refused(make_llm):
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, cache_aware, got 'lpm'"):
        make_llm(scheduling_policy="lpm")
