"""The engine hands out deltas (each step: the new token of each sample that changed, never the whole output), and
folding them in an OutputState gives exactly the cumulative outputs LLM.generate returns; text is decoded on the
engine side only for samples with stop strings."""

import pytest

from kvprefix import SamplingParams

PROMPT = list(range(30, 70))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["e", "a"]),
    ],
    ids=["no-stop-strings", "stop-strings"],
)
def test_folded_deltas_equal_the_offline_outputs(make_llm, assert_no_leaks, params):
    expected = make_llm().generate(PROMPT, params)[0]
    llm = make_llm()  # a second engine: a cache hit would round the logprobs differently
    engine = llm.llm_engine
    state = engine.add_request("d", PROMPT, params)
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            steps += 1
            assert all(len(s.token_ids) == 1 for s in delta.samples)  # one new token per changed sample
            # The engine decodes text only when stop strings need it.
            assert all((s.text is not None) == bool(params.stop_strings) for s in delta.samples)
            state.apply(delta)
            if steps % 3 == 0:
                state.output()  # a reader that looks now and then decodes as far as it has read
    got = state.output()
    assert got.finished and steps > 1
    for a, b in zip(got.outputs, expected.outputs, strict=True):
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (b.text, b.token_ids, b.finish_reason,
                                                                         b.stop_reason)
        assert a.logprobs == b.logprobs and a.cumulative_logprob == b.cumulative_logprob
        if a.logprobs:
            assert all(isinstance(lp.decoded_token, str) for entry in a.logprobs for lp in entry.values())
    assert_no_leaks(llm)
