"""vLLM's min_tokens and prompt_logprobs in the engine; prompt logprobs are the same with a warm prefix cache, with
caching off and with chunked prefill, and agree with the logprobs of sampled tokens."""

import math

import pytest

from kvprefix import SamplingParams

PROMPT = list(range(20, 60))  # 40 tokens: two full 16-token blocks and a partial one


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def test_min_tokens_holds_off_stop_tokens_and_strings(llm):
    free = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    first = free.token_ids[0]
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))[0]
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"
    held = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first],
                                               min_tokens=5))[0].outputs[0]
    assert len(held.token_ids) >= 5 and first not in held.token_ids[:5]
    text = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                               min_tokens=8))[0].outputs[0]
    assert text.token_ids == free.token_ids and text.finish_reason == "length"  # nothing was there to ban
    if len(free.text) >= 2:
        with_stop = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                        stop=[free.text[:2]], min_tokens=8))[0].outputs[0]
        assert with_stop.token_ids == free.token_ids  # the stop string came before min_tokens: ignored
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def prompt_logprobs(llm, prompt, k=2):
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k))[0]
    return out, out.prompt_logprobs


def test_prompt_logprobs_with_a_cache_hit_equal_caching_off(make_llm, llm):
    llm.generate(PROMPT + [1, 2, 3], SamplingParams(max_tokens=1))  # warms the cache with PROMPT's blocks
    warm, scored = prompt_logprobs(llm, PROMPT)
    assert warm.num_cached_tokens == 0  # the scored request read nothing from the cache
    off, reference = prompt_logprobs(make_llm(enable_prefix_caching=False), PROMPT)
    chunked, in_chunks = prompt_logprobs(make_llm(max_num_batched_tokens=7), PROMPT)
    assert scored[0] is None and len(scored) == len(PROMPT)
    for got, ref, chunk, token in zip(scored[1:], reference[1:], in_chunks[1:], PROMPT[1:], strict=True):
        assert token in got and set(got) == set(ref) == set(chunk)
        for t in got:
            assert got[t].rank == ref[t].rank
            assert math.isclose(got[t].logprob, ref[t].logprob, abs_tol=1e-5)
            assert math.isclose(got[t].logprob, chunk[t].logprob, abs_tol=1e-4)
    # A later request still hits the blocks the scored one wrote, and n > 1 samples share sample 0's prompt.
    after = llm.generate(PROMPT + [4], SamplingParams(max_tokens=1))[0]
    assert after.num_cached_tokens == 32
    n2 = llm.generate(PROMPT, SamplingParams(n=2, temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    assert len(n2.outputs) == 2 and [set(e) for e in n2.prompt_logprobs[1:]] == [{t} for t in PROMPT[1:]]


def test_prompt_logprobs_agree_with_sampled_logprobs(llm):
    """The logprob of the token sampled after PROMPT equals its prompt logprob once it is part of the prompt."""
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    (token,), (entry,) = out.token_ids, out.logprobs
    _, scored = prompt_logprobs(llm, PROMPT + [token], k=3)
    assert set(scored[-1]) == set(entry)
    for t, lp in entry.items():
        assert math.isclose(scored[-1][t].logprob, lp.logprob, abs_tol=1e-5) and scored[-1][t].rank == lp.rank
