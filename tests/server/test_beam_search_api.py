"""vLLM's beam search on /v1/completions and /v1/chat/completions through the official openai client (extra_body):
n beams ranked best first, width 1 is greedy, the prompt hits the cache, chat streams the result and completions
answers it whole (vLLM's), and what beam search does not take is a 400 that names it."""

from __future__ import annotations

import json

import httpx
import pytest
from support.servers import LONG_PREFIX, Server

M = "default-model-v1"
BEAM = {"use_beam_search": True}


def _score(choice, num_prompt_tokens: int, length_penalty: float) -> float:
    """vLLM's ranking from the response: summed logprobs over the length (prompt included, a final EOS not)."""
    lps = choice.logprobs.token_logprobs
    eos = choice.finish_reason == "stop"
    return sum(lps) / (num_prompt_tokens + len(lps) - eos) ** length_penalty


@pytest.mark.parametrize("length_penalty", [1.0, 0.3])
def test_completions_return_the_best_beams_first(server: Server, length_penalty: float) -> None:
    client = server.client()
    r = client.completions.create(model=M, prompt="Beam search keeps", n=3, max_tokens=8, temperature=0,
                                  logprobs=2, extra_body={**BEAM, "length_penalty": length_penalty})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3  # three different beams
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    scores = [_score(c, r.usage.prompt_tokens, length_penalty) for c in r.choices]
    assert scores == sorted(scores, reverse=True)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    server.wait_idle()  # every beam's blocks are free


def test_width_one_is_greedy_and_best_of_is_the_width(server: Server) -> None:
    client = server.client()
    kw = dict(model=M, prompt="Width one", max_tokens=10, temperature=0)
    greedy = client.completions.create(**kw, extra_body={"ignore_eos": True})
    beam = client.completions.create(**kw, extra_body={**BEAM, "ignore_eos": True})
    assert beam.choices[0].text == greedy.choices[0].text
    three = client.completions.create(**kw, n=3, extra_body=BEAM)
    best_two_of_three = client.completions.create(**kw, n=2, extra_body={**BEAM, "best_of": 3})
    assert [c.text for c in best_two_of_three.choices] == [c.text for c in three.choices[:2]]


def test_batched_prompts_and_the_prompt_cache(server: Server) -> None:
    """vLLM's own check: two copies of a prompt give the same beams; then the prompt is served from the cache."""
    client = server.client()
    prompt = LONG_PREFIX + " Beam search on a cached prompt."
    batch = client.completions.create(model=M, prompt=[prompt, prompt], n=2, max_tokens=5, temperature=0,
                                      extra_body=BEAM)
    texts = [c.text for c in batch.choices]
    assert len(texts) == 4 and texts[0] != texts[1] and texts[:2] == texts[2:]
    again = client.completions.create(model=M, prompt=prompt, n=2, max_tokens=5, temperature=0, extra_body=BEAM)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens // 16 * 16 and cached > 0
    assert [c.text for c in again.choices] == texts[:2]


def test_chat_beams_with_logprobs_and_a_streamed_result(server: Server) -> None:
    client = server.client()
    kw = dict(model=M, messages=[{"role": "user", "content": "Name two colours."}], n=2, max_completion_tokens=10,
              temperature=0, logprobs=True, top_logprobs=5, extra_body=BEAM)
    whole = client.chat.completions.create(**kw)
    assert len(whole.choices) == 2 and whole.choices[0].message.content != whole.choices[1].message.content
    # Each step's alternatives are its candidates: the 2 x width most likely (and the sampled one), as in vLLM.
    assert all(4 <= len(t.top_logprobs) <= 5 for c in whole.choices for t in c.logprobs.content)
    # Streamed (vLLM's): the roles, then each choice's whole text in one chunk when the search is done.
    chunks = list(client.chat.completions.create(**kw, stream=True))
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks:
        assert len(chunk.choices) == 1
        c = chunk.choices[0]
        texts[c.index] += c.delta.content or ""
        reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert sum(1 for ch in chunks if ch.choices[0].delta.content) == 2


def test_a_streamed_completions_beam_search_is_answered_whole(server: Server) -> None:
    """vLLM does not stream a completions beam search: the response is the plain JSON body."""
    body = {"model": M, "prompt": "Streamed beams", "n": 2, "max_tokens": 6, "temperature": 0, "stream": True,
            **BEAM}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    whole = server.post("/v1/completions", {**body, "stream": False}).json()
    got = json.loads(r.text)
    assert got["object"] == "text_completion" and [c["text"] for c in got["choices"]] == \
        [c["text"] for c in whole["choices"]]


REFUSED = [({"stop": ["x"]}, "stop", "does not apply to beam search"),
           ({"top_p": 0.5}, "top_p", "does not apply to beam search"),
           ({"presence_penalty": 1.0}, "presence_penalty", "does not apply to beam search"),
           ({"min_tokens": 2}, "min_tokens", "does not apply to beam search"),
           ({"seed": 7}, "seed", "does not apply to beam search"),
           ({"prompt_logprobs": 1}, "prompt_logprobs", "does not apply to beam search"),
           ({"response_format": {"type": "json_object"}}, "response_format", "beam search"),
           ({"n": 3, "best_of": 2}, "best_of", "at least 'n' (3)"),
           ({"best_of": 17}, "best_of", "at most 16"),
           ({"echo": True, "logprobs": 1}, "echo", "scores the prompt")]


@pytest.mark.parametrize("extra,param,why", REFUSED, ids=[p for _, p, _ in REFUSED])
def test_what_beam_search_does_not_take_is_a_named_400(server: Server, extra: dict, param: str, why: str) -> None:
    r = server.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 2, **BEAM, **extra})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and why in error["message"], error


def test_width_limits_and_length_penalty_without_beams(server: Server) -> None:
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        too_wide = server.post(path, {"model": M, "max_tokens": 2, "n": 17, **BEAM, **extra})
        assert too_wide.status_code == 400 and too_wide.json()["error"]["param"] == "n"
        penalty = server.post(path, {"model": M, "max_tokens": 2, "length_penalty": 0.5, **extra})
        assert penalty.status_code == 400 and "use_beam_search" in penalty.json()["error"]["message"]
    named = server.post("/v1/chat/completions", {
        "model": M, "max_tokens": 2, **BEAM, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert named.status_code == 400 and named.json()["error"]["param"] == "tool_choice"
    server.wait_idle()


def test_a_client_that_gives_up_aborts_the_search_and_frees_its_beams(server: Server) -> None:
    before = server.wait_idle()
    with pytest.raises(httpx.TimeoutException):
        server.post("/v1/completions", {"prompt": "never read", "n": 4, "max_tokens": 4000, "ignore_eos": True,
                                        **BEAM}, timeout=0.5)
    after = server.wait_idle(timeout=5)
    # One finished sequence per choice, each ended by the abort.
    assert after["kvprefix:request_success_total{abort}"] == before["kvprefix:request_success_total{abort}"] + 4
