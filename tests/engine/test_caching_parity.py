"""Prefix caching changes nothing: greedy tokens with caching on equal those with caching off, under any batch
composition, chunked prefill and preemption, and the cached runs really hit."""

import random

import pytest

from kvprefix import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
BLOCK = 16


def shared_prefix_prompts(num: int = 60, seed: int = 0) -> list[list[int]]:
    """Prompts over prefixes of 16, 23, 48, 61 and 100 tokens (block-aligned and not; 61 extends 23), with unique
    suffixes of 1-20 tokens, plus a duplicate prompt and a block-aligned prompt that is a prefix of another."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    base = tokens(23)
    prefixes = [tokens(16), base, tokens(48), base + tokens(38), tokens(100)]
    prompts = [prefixes[i % len(prefixes)] + tokens(rng.randint(1, 20)) for i in range(num)]
    prompts.append(list(prompts[7]))  # identical to an earlier prompt: all but its last token can hit
    prompts.append(prompts[2][: BLOCK * 2])  # block-aligned, a prefix of an earlier prompt
    return prompts


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts()


@pytest.fixture(scope="module")
def reference(make_llm, prompts) -> list[list[int]]:
    """Caching off, one sequence at a time: the plainest possible computation."""
    return token_ids(make_llm(enable_prefix_caching=False, max_num_seqs=1).generate(prompts, GREEDY))


@pytest.mark.parametrize("max_num_seqs", [1, 4, 64])
def test_caching_on_matches_off_in_any_batch_composition(make_llm, assert_no_leaks, prompts, reference, max_num_seqs):
    llm = make_llm(max_num_seqs=max_num_seqs)
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == reference
    cached = [o.num_cached_tokens for o in outputs]
    # Requests admitted after their prefix's first step find its blocks registered (with 64 sequences most of
    # the prompts are admitted in the first two steps, so fewer can hit).
    assert sum(c > 0 for c in cached) >= (len(prompts) // 2 if max_num_seqs <= 4 else 10)
    assert all(c % BLOCK == 0 and c < len(o.prompt_token_ids) for c, o in zip(cached, outputs, strict=True))
    assert llm.get_metrics()["prefix_cache_hits"] == sum(cached)
    assert_no_leaks(llm)


def test_caching_off_batched_matches_sequential(make_llm, assert_no_leaks, prompts, reference):
    assert token_ids(make_llm(enable_prefix_caching=False, max_num_seqs=64).generate(prompts, GREEDY)) == reference


def test_chunked_prefill_splitting_blocks(make_llm, assert_no_leaks, prompts, reference):
    # 24-token chunks end mid-block; blocks are registered only once full, and the next chunk continues them.
    llm = make_llm(max_num_batched_tokens=24, max_num_seqs=8)
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_no_leaks(llm)


def test_preemption_with_a_tiny_pool(make_llm, assert_no_leaks, prompts, reference):
    # 12 blocks of 16 tokens: the longest request needs 8, so concurrent requests must be preempted and recomputed.
    llm = make_llm(num_gpu_blocks=12, max_num_seqs=8)
    outputs = llm.generate(prompts, GREEDY)
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0
    # Each request's output counts its own preemptions (the server's request_num_preemptions histogram).
    assert sum(o.metrics.num_preemptions for o in outputs) == metrics["num_preemptions"]
    assert token_ids(outputs) == reference
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_no_leaks(llm)


def test_second_run_hits_everything_it_can(make_llm, assert_no_leaks, prompts, reference):
    llm = make_llm()
    llm.generate(prompts, GREEDY)
    outputs = llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == reference
    # Every full block except one holding the last prompt token (its logits are needed) is served from the cache.
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // BLOCK * BLOCK for p in prompts]


def test_n_samples_share_the_prompt_blocks(make_llm, assert_no_leaks, prompts, reference):
    llm = make_llm()
    n = 3
    outputs = llm.generate(prompts[:10], SamplingParams(n=n, temperature=0, max_tokens=8, ignore_eos=True))
    for out, ref in zip(outputs, reference[:10], strict=True):
        assert [c.token_ids for c in out.outputs] == [ref] * n
        assert [c.index for c in out.outputs] == list(range(n))
    # The first sample computes the prompt; the other n - 1 hit its full blocks instead of recomputing them.
    fresh = make_llm()
    prompt = prompts[4]
    fresh.generate(prompt, SamplingParams(n=n, temperature=0, max_tokens=4))
    assert fresh.get_metrics()["prefix_cache_hits"] == (n - 1) * ((len(prompt) - 1) // BLOCK * BLOCK)
    assert_no_leaks(fresh)


def test_preempted_requests_do_not_count_as_prefix_hits(make_llm, assert_no_leaks):
    """Three unique prompts under memory pressure share nothing: recomputing a preempted request's own blocks goes
    to the preempted counters, and the hit rate stays 0."""
    prompts = [[3 + (7 * i + j) % 400 for j in range(40 + 8 * i)] for i in range(3)]
    llm = make_llm(num_gpu_blocks=8, max_num_seqs=3)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_preempted_admissions"] >= m["num_preemptions"] > 0
    assert m["prefix_cache_preempted_hits"] > 0  # the preempted requests did find their own blocks again
    assert (m["prefix_cache_hits"], m["prefix_cache_hit_rate"], m["prefix_cache_admissions"]) == (0, 0.0, 3)
    assert m["prefix_cache_queries"] == sum(map(len, prompts))
    assert_no_leaks(llm)
