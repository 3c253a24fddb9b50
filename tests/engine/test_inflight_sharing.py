"""In-flight prefix sharing: requests that arrive together with one cold prefix compute its full blocks once (the
rest wait behind the first and hit), across chunked prefill, with outputs identical to sharing off, and leaders
that are aborted or preempted release their followers at once."""

import random

import pytest

from kvprefix import SamplingParams
from kvprefix.cache import BlockHasher
from kvprefix.engine.inflight import InflightPrefixes
from kvprefix.engine.request import Request
from kvprefix.tokenizer import Tokenizer

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def burst(num: int, prefix_len: int, seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """``num`` prompts of one cold ``prefix_len``-token prefix, each with a unique 5-30-token rest."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(prefix_len)]
    return prefix, [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(5, 30))] for _ in range(num)]


def ideal_computed(prefix: list[int], prompts: list[list[int]]) -> int:
    """The prefix's full blocks once, plus every prompt's rest."""
    shared = len(prefix) // BLOCK * BLOCK
    return sum(map(len, prompts)) - (len(prompts) - 1) * shared


@pytest.mark.parametrize("budget", [48, 2048], ids=["chunked", "one-step"])
def test_a_cold_burst_computes_the_shared_prefix_once(make_llm, assert_no_leaks, budget):
    prefix, prompts = burst(8, 200)
    computed = {}
    outputs = {}
    for share in (True, False):
        llm = make_llm(max_num_batched_tokens=budget, share_inflight_prefixes=share)
        outputs[share] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        m = llm.get_metrics()
        computed[share] = m["prompt_tokens_computed"]
        assert_no_leaks(llm)
        if share and budget > 200:  # the 7 followers were admitted in the leader's step: each waited once
            assert m["num_inflight_prefix_waits"] == 7
    assert computed[True] == ideal_computed(prefix, prompts)
    if budget > 200:  # one step admits several requests: without sharing each computes the prefix
        assert computed[False] > 3 * computed[True]
    assert outputs[True] == outputs[False]


def test_n_samples_and_identical_prompts_share_in_flight(make_llm, assert_no_leaks):
    prefix, prompts = burst(3, 100, seed=1)
    llm = make_llm()
    outs = llm.generate([prompts[0], prompts[0], prompts[1]], SamplingParams(n=2, temperature=0, max_tokens=4))
    # 6 sequences of two prompts with one 100-token prefix (6 full blocks): every full block is computed once;
    # each sequence but the first of its prompt computes only the block of its last token.
    def tail(p: list[int]) -> int:
        return len(p) - (len(p) - 1) // BLOCK * BLOCK

    p0, p1 = prompts[0], prompts[1]
    assert llm.get_metrics()["prompt_tokens_computed"] == len(p0) + 3 * tail(p0) + (len(p1) - 96) + tail(p1)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[1].token_ids
    assert_no_leaks(llm)


def test_an_aborted_leader_releases_its_followers_at_once(make_llm, assert_no_leaks):
    prefix, prompts = burst(3, 96, seed=2)
    llm = make_llm(max_num_batched_tokens=32)  # the leader needs 4 steps for its prompt
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["r0"]  # r0 took the whole budget
    engine.abort_request("r0")
    engine.step()
    # The next step: r1 leads now, hitting the 2 blocks r0 registered before it left (r2 follows r1).
    assert [r.request_id for r in engine.scheduler.running] == ["r1"]
    assert engine.scheduler.running[0].num_cached_tokens == 2 * BLOCK
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


def test_greedy_outputs_match_sharing_off_under_preemption(make_llm, assert_no_leaks):
    """A small pool preempts leaders and followers alike; outputs stay those of sharing off, nothing leaks."""
    rng = random.Random(3)
    prompts = []
    for k in range(4):
        _, group = burst(6, rng.choice([40, 64, 90]), seed=10 + k)
        prompts += group
    rng.shuffle(prompts)
    results = {}
    for share in (True, False):
        llm = make_llm(num_gpu_blocks=24, max_num_seqs=8, max_num_batched_tokens=64, share_inflight_prefixes=share)
        results[share] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        m = llm.get_metrics()
        assert m["num_preemptions"] > 0
        assert_no_leaks(llm)
    assert results[True] == results[False]


def test_a_follower_waits_no_longer_than_computing_the_blocks_itself(tiny_llama_path):
    """The bound, on the policy object: 5 in-flight blocks at a 32-token budget are 3 steps of work."""
    hasher = BlockHasher(BLOCK, "sha256")
    tokenizer = Tokenizer(tiny_llama_path)

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, GREEDY, hasher, max_tokens=6, eos_token_ids=frozenset(), tokenizer=tokenizer)

    prompt = list(range(10, 10 + 5 * BLOCK + 3))
    leader, follower = request("a", prompt), request("b", prompt)
    inflight = InflightPrefixes(BLOCK, max_num_batched_tokens=32)
    inflight.add(leader)
    assert [inflight.should_wait(follower, 0, step) for step in range(10, 14)] == [True, True, True, False]
    other = request("c", list(range(600, 700)))
    assert not inflight.should_wait(other, 0, 10)  # nothing of its prompt is in flight
    fresh = request("d", prompt)
    assert inflight.should_wait(fresh, 0, 20)
    inflight.remove(leader)
    assert not inflight.should_wait(fresh, 0, 20)  # the leader left: no wait, whatever the bound
    assert inflight.num_waits == 2


def test_a_request_that_skips_cache_reads_does_not_wait_in_flight(make_llm, assert_no_leaks):
    """prompt_logprobs computes the whole prompt anyway: waiting behind a leader's blocks would only delay it."""
    prefix, prompts = burst(3, 64, seed=3)
    llm = make_llm(max_num_batched_tokens=2048)
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, [GREEDY, scored, GREEDY])
    m = llm.get_metrics()
    assert m["num_inflight_prefix_waits"] == 1  # only the third waited; the scored one was admitted at once
    assert outs[1].num_cached_tokens == 0 and len(outs[1].prompt_logprobs) == len(prompts[1])
    assert_no_leaks(llm)
