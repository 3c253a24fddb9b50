"""A bounded fuzz run: hypothesis builds request bodies field by field from the API's own fields, mixing valid
values, wrong types, out-of-range numbers, odd strings and unknown keys. No body may get a 5xx, and the server
must end idle with every block free."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.servers import Server

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=20),
    st.lists(st.integers(-5, 2000), max_size=5), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
text = st.text(max_size=60)
token_ids = st.lists(st.integers(0, 800), min_size=0, max_size=40)


def _field(valid: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(valid, valid, junk)  # mostly plausible values, so the fuzz reaches the engine too


COMMON = {
    "model": _field(st.sampled_from(["default-model-v1", "other-model"])),
    "max_tokens": _field(st.integers(-2, 6)),
    "n": _field(st.integers(0, 3)),
    "temperature": _field(st.floats(-1, 3)),
    "top_p": _field(st.floats(0, 1.5)),
    "top_k": _field(st.integers(-3, 50)),
    "min_p": _field(st.floats(-0.5, 1.5)),
    "presence_penalty": _field(st.floats(-3, 3)),
    "repetition_penalty": _field(st.floats(0, 3)),
    "seed": _field(st.integers(-5, 2**64)),
    "stop": _field(st.one_of(text, st.lists(text, max_size=6))),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": _field(text),
    "prompt_cache_key": _field(text),
    "cache_salt": _field(st.from_regex(r"[A-Za-z0-9._:-]{0,70}", fullmatch=True)),
    "cache_detail": _field(st.booleans()),
    "logprobs": junk,
    "echo": _field(st.booleans()),
}
MESSAGE = st.fixed_dictionaries(
    {"role": _field(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
     "content": _field(st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                                max_size=2)))})
COMPLETION = st.fixed_dictionaries(
    {"prompt": _field(st.one_of(text, token_ids, st.lists(text, max_size=3), st.lists(token_ids, max_size=2)))},
    optional={k: v for k, v in COMMON.items() if k != "model"} | {"model": COMMON["model"], "zzz_unknown": junk},
)
# Chat without max_tokens may generate up to the context length (OpenAI semantics): always send one, fuzzed.
CHAT = st.fixed_dictionaries(
    {"messages": _field(st.lists(MESSAGE, max_size=3)), "max_tokens": COMMON["max_tokens"]},
    optional={k: v for k, v in COMMON.items() if k not in ("echo", "max_tokens")}
    | {"max_completion_tokens": COMMON["max_tokens"]},
)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=st.one_of(COMPLETION.map(lambda b: ("/v1/completions", b)),
                      CHAT.map(lambda b: ("/v1/chat/completions", b))))
def test_fuzz_no_5xx(server: Server, body) -> None:
    path, payload = body
    r = server.post(path, json.dumps(payload).encode())
    assert r.status_code < 500, (payload, r.text)
    if r.status_code >= 400:
        assert "message" in r.json()["error"]


def test_fuzz_left_no_leak(server: Server) -> None:
    server.wait_idle()
    assert server.client().completions.create(model="default-model-v1", prompt="after fuzz", max_tokens=2).choices
