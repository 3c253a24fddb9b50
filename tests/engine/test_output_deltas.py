"""The engine hands out deltas (each step: the new token of each sample that changed, never the whole output), and
folding them in an OutputState gives exactly the cumulative outputs LLM.generate returns; text is decoded on the
engine side only for samples with stop strings."""

import pytest

from kvprefix import SamplingParams
from kvprefix.engine.output_state import OutputState
from kvprefix.engine.outputs import RequestDelta, RequestMetrics, RequestOutputKind, SampleDelta
from kvprefix.engine.text import SampleText

PROMPT = list(range(30, 70))
# Sampled (n=2, logprobs) without stop strings, and greedy with them (text decides the stop on the engine thread).
WITH_AND_WITHOUT_STOP_STRINGS = pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["e", "a"]),
    ],
    ids=["no-stop-strings", "stop-strings"],
)


@WITH_AND_WITHOUT_STOP_STRINGS
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


def test_prompt_logprobs_come_once_and_the_reader_decodes_them(make_llm, assert_no_leaks):
    llm = make_llm()
    engine = llm.llm_engine
    state = engine.add_request("p", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                           prompt_logprobs=1))
    carried = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            carried.append(delta.prompt_logprobs is not None)
            state.apply(delta)
    assert carried == [True, False, False]  # in the delta of the first token only, never copied again
    got = state.output().prompt_logprobs
    assert got[0] is None and len(got) == len(PROMPT)
    assert all(isinstance(lp.decoded_token, str) for entry in got[1:] for lp in entry.values())
    assert_no_leaks(llm)


@pytest.mark.parametrize("stop", [[], ["\x00never"]], ids=["reader-decodes", "engine-decodes"])
def test_skip_special_tokens_applies_where_text_is_decoded(make_llm, stop):
    """A special token in the output shows as its spelling only with skip_special_tokens=False, whether the reader
    decodes it (no stop strings) or the engine thread does (stop strings: SampleText, as Request runs it)."""
    tokenizer = make_llm().get_tokenizer()
    special = sorted(tokenizer.special_tokens)[0]
    ids = [tokenizer.hf.convert_tokens_to_ids(special), *tokenizer.encode(" plain words", add_special_tokens=False)]
    for skip in (True, False):
        params = SamplingParams(stop=stop, skip_special_tokens=skip)
        engine_text = None
        if stop:
            sample_text = SampleText(tokenizer, PROMPT, params)
            for t in ids:
                assert sample_text.add(t) is None
            engine_text = sample_text.text
        state = OutputState("x", None, PROMPT, [params], tokenizer, [], "", 0.0)
        state.apply(RequestDelta("x", [SampleDelta(0, ids, text=engine_text, finish_reason="length")], True, 0,
                                 RequestMetrics(0.0)))
        text = state.output().outputs[0].text
        assert (special in text) is (not skip) and text.endswith("plain words")


@WITH_AND_WITHOUT_STOP_STRINGS
def test_delta_outputs_add_up_to_the_cumulative_output(make_llm, assert_no_leaks, params):
    """DELTA outputs hold only the samples that changed, each with only its new text, tokens and logprob entries
    (already decoded); joined, they are the cumulative output, and streamed text is never retracted."""
    expected = make_llm().generate(PROMPT, params)[0]
    llm = make_llm()
    engine = llm.llm_engine
    state = engine.add_request("d", PROMPT, params)
    texts, tokens, entries, reasons = ([[] for _ in range(params.n)] for _ in range(4))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            state.apply(delta)
            out = state.output(RequestOutputKind.DELTA)
            assert sorted(o.index for o in out.outputs) == sorted(s.index for s in delta.samples)
            for o in out.outputs:
                assert len(o.token_ids) == 1
                texts[o.index].append(o.text)
                tokens[o.index] += o.token_ids
                entries[o.index] += o.logprobs or []
                reasons[o.index].append(o.finish_reason)
    for b in expected.outputs:
        i = b.index
        # the finish reason once, in the last delta
        assert reasons[i] == [None] * (len(b.token_ids) - 1) + [b.finish_reason]
        assert ("".join(texts[i]), tokens[i]) == (b.text, b.token_ids)
        assert entries[i] == (b.logprobs or [])
        assert all(isinstance(lp.decoded_token, str) for entry in entries[i] for lp in entry.values())
    assert_no_leaks(llm)
