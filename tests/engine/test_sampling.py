"""Sampling behaviour end to end: seeds, top-k/top-p/min-p, stops, penalties, logprobs, and parameter validation."""

import itertools
import math

import pytest

from kvprefix import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10] * 5
OTHER_PROMPTS = [[11, 12, 13] * 7, list(range(40, 90))]


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def generate_one(llm, params: SamplingParams, prompt=PROMPT):
    return llm.generate(prompt, params)[0].outputs[0]


def greedy(llm, max_tokens: int = 16) -> list[int]:
    return generate_one(llm, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)).token_ids


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = generate_one(llm, params).token_ids
    again = generate_one(llm, params).token_ids
    batched = llm.generate(
        [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1]],
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
    )
    assert alone == again == batched[1].outputs[0].token_ids
    other_seed = generate_one(llm, SamplingParams(temperature=1.0, seed=8, max_tokens=16, ignore_eos=True)).token_ids
    assert other_seed != alone


def test_n_seeded_samples_differ_from_each_other_but_reproduce(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    first = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    assert len({tuple(t) for t in first}) == 3
    assert [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs] == first


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)], ids=["top_k", "top_p", "min_p"])
def test_truncation_to_the_top_token_is_greedy(llm, params):
    sampled = generate_one(llm, SamplingParams(temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, **params))
    assert sampled.token_ids == greedy(llm)


def test_max_tokens_ends_with_length(llm):
    out = generate_one(llm, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length" and out.stop_reason is None


def test_stop_string_is_trimmed_from_the_text(llm):
    full = generate_one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop = full.text[6:9]
    cut = full.text.find(stop)
    out = generate_one(llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    assert (out.text, out.finish_reason, out.stop_reason) == (full.text[:cut], "stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    kept = generate_one(
        llm, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    )
    assert kept.text == full.text[: cut + len(stop)]


def test_stop_token_ids_and_eos(llm):
    tokens = greedy(llm)
    stop_token = tokens[3]
    out = generate_one(llm, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_token]))
    end = tokens.index(stop_token) + 1
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (tokens[:end], "stop", stop_token)
    engine = llm.llm_engine
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({stop_token})
    try:
        eos = generate_one(llm, SamplingParams(temperature=0, max_tokens=16))
        ignored = generate_one(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    finally:
        engine.eos_token_ids = saved
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == (tokens[:end], "stop", None)
    assert ignored.token_ids == tokens


def test_penalties_stop_repetition(llm):
    base = greedy(llm, max_tokens=40)
    assert len(set(base)) < len(base)  # this random model loops without penalties
    for name in ("presence_penalty", "frequency_penalty"):
        out = generate_one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **{name: 2.0}))
        assert len(set(out.token_ids)) == 40, name
    # The repetition penalty also covers the prompt's tokens.
    rep = generate_one(llm, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=2.0))
    assert len(set(rep.token_ids)) == 40 and not set(rep.token_ids) & set(PROMPT)


def test_logprobs(llm):
    k = 3
    out = generate_one(llm, SamplingParams(temperature=0.8, seed=0, max_tokens=10, ignore_eos=True, logprobs=k))
    assert len(out.logprobs) == len(out.token_ids) == 10
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) in (k, k + 1)
        top = sorted((lp for t, lp in entry.items() if lp.rank <= k), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in itertools.pairwise(top))
        assert all(lp.logprob <= 0 and isinstance(lp.decoded_token, str) for lp in entry.values())
    assert math.isclose(
        out.cumulative_logprob,
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)),
        rel_tol=1e-5,
    )
    only_sampled = generate_one(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
    assert all(
        list(e) == [t] and e[t].rank == 1 for t, e in zip(only_sampled.token_ids, only_sampled.logprobs, strict=True)
    )
    assert generate_one(llm, SamplingParams(max_tokens=2)).logprobs is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("logprobs", -1),
        ("stop", ""),
        ("stop_token_ids", [-1]),
        ("temperature", float("nan")),
    ],
)
def test_invalid_parameters_name_the_value(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
