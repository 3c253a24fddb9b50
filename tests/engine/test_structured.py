"""Structured outputs in the engine (llguidance): whatever the random model prefers, every output is in the
language asked for, and the sample stops when the language is complete."""

import json
import re

import pytest

from kvprefix import SamplingParams
from kvprefix.engine import StructuredOutputsParams

PROMPT = list(range(30, 50))


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def run(llm, n=3, **spec):
    params = SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(**spec))
    return llm.generate(PROMPT, params)[0].outputs


@pytest.mark.slow
def test_json_schema_choice_regex_and_grammar(llm, assert_no_leaks):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tier": {"enum": ["gold", "silver"]}},
              "required": ["ok", "tier"], "additionalProperties": False}
    for o in run(llm, json=schema):
        doc = json.loads(o.text)
        assert o.finish_reason == "stop" and set(doc) == {"ok", "tier"} and doc["tier"] in ("gold", "silver")
    assert {o.text for o in run(llm, n=4, choice=["red", "green", "blue"])} <= {"red", "green", "blue"}
    for o in run(llm, regex=r"[0-9]{3}-[a-c]{2}"):
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", o.text) and o.finish_reason == "stop"
    for o in run(llm, grammar='start: "(" NUM ("," NUM)~1..3 ")"\nNUM: /[1-9]/'):
        assert re.fullmatch(r"\(\d(,\d){1,3}\)", o.text), o.text
    free = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=20))[0].outputs[0]
    with pytest.raises(json.JSONDecodeError):  # without a grammar the random model writes no JSON
        json.loads(free.text)
    assert_no_leaks(llm)


def test_bad_specs_are_value_errors(llm):
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    for spec, match in ((dict(regex="("), "regex"), (dict(grammar="start: nope"), "grammar"),
                        (dict(json={"type": "nope"}), "json"), (dict(choice=[""]), "choice")):
        with pytest.raises(ValueError, match=match):
            llm.generate(PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))


def test_masking_equals_llguidance_reference(default_model_dir):
    """Our bitmask unpacking against llguidance's own (its numpy kernel), row by row through a grammar's states,
    in a batch with an unconstrained row and logits one token wider than the grammar's vocabulary."""
    import llguidance.numpy
    import numpy as np
    import torch

    from kvprefix.engine.structured import GrammarMasks, grammar_for
    from kvprefix.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer(default_model_dir)
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size)
    matcher = masks.matcher(grammar_for(StructuredOutputsParams(regex=r"(ab|c)[0-9]{2,4}")))
    text = tokenizer.encode("ab123", add_special_tokens=False)
    generator = torch.Generator().manual_seed(3)
    for token in text:
        logits = torch.randn(2, tokenizer.vocab_size + 1, generator=generator)
        ours = masks.apply(logits.clone(), [None, matcher])
        bitmask = llguidance.numpy.allocate_token_bitmask(1, tokenizer.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
        reference = logits[1:].numpy().copy()
        llguidance.numpy.apply_token_bitmask_inplace(reference, bitmask)
        assert torch.equal(ours[0], logits[0]) and np.array_equal(ours[1:].numpy(), reference)
        assert 0 < int(torch.isfinite(ours[1]).sum()) < tokenizer.vocab_size  # the grammar cut, and left some
        assert matcher.consume_token(token)


def test_a_spec_is_compiled_once_for_the_server_check_and_the_engine(monkeypatch):
    """The server compiles a request's grammar to answer a 400 early; the engine's add_request gets it back from the
    spec instead of compiling it again (a spec equal to it but another object compiles on its own)."""
    from kvprefix.engine import structured

    compiled = []
    real = structured._compile
    monkeypatch.setattr(structured, "_compile", lambda spec: compiled.append(spec) or real(spec))
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first = structured.grammar_for(spec)
    assert structured.grammar_for(spec) is first and compiled == [spec]
    assert structured.grammar_for(StructuredOutputsParams(json=spec.json)) == first and len(compiled) == 2
