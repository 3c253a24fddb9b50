"""vLLM's OpenAI-server behaviour that clients rely on (issue 30's differences), with the official openai client
against the real app: echo with prompt logprobs, the fields vLLM always returns, one choice per stream chunk,
vLLM's leniency, logit_bias, logprob limits and token ids, and a UTF-8 character cut by max_tokens."""

from __future__ import annotations

import json
import math

import pytest
from support.app_server import AppRegistry
from support.servers import LONG_PREFIX, Server

M = "default-model-v1"
PROMPT = "The quick brown fox jumps over the lazy dog"


def _vocab_size(server: Server) -> int:
    """The tokenizer's vocabulary, from the tokens /detokenize takes (the last id it accepts, plus one)."""
    low, high = 1, 1 << 20
    while low < high:
        mid = (low + high) // 2
        if server.post("/detokenize", {"model": M, "tokens": [mid]}).status_code == 200:
            low = mid + 1
        else:
            high = mid
    return low


def _prompt_ids(server: Server, prompt: str = PROMPT) -> list[int]:
    return server.post("/tokenize", {"model": M, "prompt": prompt}).json()["tokens"]


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_scores_the_prompt_as_prompt_logprobs_do(server: Server, server_nocache: Server,
                                                      max_tokens: int) -> None:
    """lm-evaluation-harness's log-likelihood: echo + logprobs gives the prompt's text and per-token logprobs (the
    first token has none), the same values prompt_logprobs gives, then the completion's."""
    client = server.client()
    ids = _prompt_ids(server)
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1,
                                  temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + max_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Every scored prompt token's own logprob is among its top_logprobs (the token and the k most likely).
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == value and 1 <= len(top) <= 2
    scored = server_nocache.post("/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 1,
                                                     "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    expected = [scored[i][str(t)]["logprob"] for i, t in enumerate(ids) if i]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(lp.token_logprobs[1:len(ids)], expected, strict=True))
    plain = client.completions.create(model=M, prompt=PROMPT, max_tokens=max_tokens or 1, temperature=0)
    assert c.text == PROMPT + (plain.choices[0].text if max_tokens else "")
    # Streamed: the prompt comes first, in the choice's first chunk, and the whole text is the same.
    chunks = list(client.completions.create(model=M, prompt=PROMPT, max_tokens=max_tokens, echo=True, logprobs=1,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_echo_of_token_ids_and_chat(server: Server) -> None:
    client = server.client()
    ids = _prompt_ids(server)
    r = client.completions.create(model=M, prompt=ids, max_tokens=2, echo=True, temperature=0)
    assert r.choices[0].text.startswith(PROMPT)
    # Chat: the last message is echoed when it has the reply's role (continuing an assistant message).
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there"}]
    kw = dict(model=M, messages=messages, max_tokens=3, temperature=0,
              extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kw).choices[0].message.content
    kw["extra_body"]["echo"] = True
    assert client.chat.completions.create(**kw).choices[0].message.content == "Hi there" + plain
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw))
    assert streamed == "Hi there" + plain
    # A user's last message is not the reply's role: nothing is echoed.
    kw = dict(model=M, messages=messages[:1], max_tokens=3, temperature=0)
    assert (client.chat.completions.create(extra_body={"echo": True}, **kw).choices[0].message.content
            == client.chat.completions.create(**kw).choices[0].message.content)


def test_fields_vllm_always_returns(server: Server) -> None:
    """Null when not asked for, never absent: clients read them as attributes."""
    c = server.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 2}).json()
    choice = c["choices"][0]
    for key in ("prompt_logprobs", "prompt_token_ids", "token_ids", "stop_reason"):
        assert key in choice and choice[key] is None, key
    chat = server.post("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 2}).json()
    assert chat["prompt_logprobs"] is None and chat["prompt_token_ids"] is None
    assert chat["choices"][0]["token_ids"] is None and "stop_reason" in chat["choices"][0]
    assert chat["system_fingerprint"] is None and chat["service_tier"] is None and c["system_fingerprint"] is None
    stopped = server.post("/v1/completions", {"model": M, "prompt": LONG_PREFIX, "max_tokens": 30, "temperature": 0,
                                              "ignore_eos": True, "stop": [" "]}).json()["choices"][0]
    if stopped["finish_reason"] == "stop":
        assert stopped["stop_reason"] == " "


def test_chat_chunks_always_carry_content(server: Server) -> None:
    """Every chat chunk without tool calls has delta.content, "" when its step added no text (the last one, ended
    by a stop token), as vLLM sends it: clients written for vLLM concatenate it (vLLM's test_chat)."""
    body = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    first = server.post("/v1/chat/completions", {**body, "return_token_ids": True}).json()["choices"][0]
    streamed = server.post("/v1/chat/completions", {**body, "stream": True,
                                                    "stop_token_ids": [first["token_ids"][0]]}).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["choices"][0]["delta"]["content"] == "" for c in chunks)


@pytest.mark.parametrize("chat", [False, True])
def test_stream_with_n_sends_one_choice_per_chunk(server: Server, chat: bool) -> None:
    client = server.client()
    kw = dict(model=M, max_tokens=5, n=3, temperature=1.0, seed=7, stream=True)
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], **kw))
    else:
        chunks = list(client.completions.create(prompt="hello", **kw))
    assert chunks and all(len(ch.choices) == 1 for ch in chunks)
    finished = {ch.choices[0].index: ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}


def test_vllm_leniency(server: Server) -> None:
    """What vLLM accepts and clients send: extra keys in a message, custom roles, "logprobs": "true", a negative
    seed (reproducible)."""
    base = {"model": M, "max_tokens": 3, "temperature": 0}
    extra_key = server.post("/v1/chat/completions", {**base, "messages": [
        {"role": "user", "content": "hi", "id": "msg-1", "timestamp": 5}]})
    plain = server.post("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}]})
    assert extra_key.status_code == 200 and extra_key.json()["choices"][0]["message"] == plain.json()["choices"][0][
        "message"]
    custom = server.post("/v1/chat/completions", {**base, "messages": [{"role": "narrator", "content": "hi"}]})
    assert custom.status_code == 200, custom.text
    as_text = server.post("/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                                   "logprobs": "true"})
    assert as_text.status_code == 200 and as_text.json()["choices"][0]["logprobs"]["content"]
    seeded = [server.post("/v1/completions", {"model": M, "prompt": "seed", "max_tokens": 6, "temperature": 1.0,
                                              "seed": -42}).json()["choices"][0]["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]
    # Deliberately stricter than vLLM (docs/server.md): an unknown top-level field is a 400, as in OpenAI's API.
    assert server.post("/v1/completions", {"model": M, "prompt": "x", "frobnicate": 1}).status_code == 400


def test_logit_bias(server: Server) -> None:
    client = server.client()
    target = _prompt_ids(server, " fox")[-1]
    r = client.completions.create(model=M, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(target): 100})
    assert r.choices[0].text == server.post("/detokenize", {"tokens": [target] * 4}).json()["prompt"]
    # -100 bans a token: greedy decoding never picks the token it picked before.
    first = client.completions.create(model=M, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    picked = _prompt_ids(server, PROMPT + first.choices[0].text)[len(_prompt_ids(server)):]
    if len(picked) == 1:
        banned = client.completions.create(model=M, prompt=PROMPT, max_tokens=1, temperature=0,
                                           logit_bias={str(picked[0]): -100})
        assert banned.choices[0].text != first.choices[0].text
    for bias, message in (({"100000": 1}, "token_id(s) [100000] in logit_bias contain out-of-vocab token ids. "
                                          f"Vocabulary size: {_vocab_size(server)}"),
                          ({"x": 1}, "Found token_id `x` in logit_bias but token_id must be an integer"),
                          # Every bad key is named, not the first only (vLLM's test_chat_logit_bias_validation).
                          ({"x": 1, "7": 1, "y": 2}, "Found token_id `x`, `y` in logit_bias"),
                          ({"5": 101}, "in [-100, 100]"), ({"5": True}, "in [-100, 100]")):
        e = server.post("/v1/completions", {"model": M, "prompt": "x", "logit_bias": bias}).json()["error"]
        assert e["param"] == "logit_bias" and message in e["message"], e


def test_logprobs_zero_gives_the_sampled_token(server: Server) -> None:
    r = server.client().completions.create(model=M, prompt=PROMPT, max_tokens=3, logprobs=0, temperature=1.0,
                                           seed=3)
    lp = r.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for top, t in zip(lp.top_logprobs, lp.tokens, strict=True)] == lp.token_logprobs


def test_chat_and_tokenize_special_tokens_and_documents(server: Server) -> None:
    messages = [{"role": "user", "content": "hello"}]
    for special in (False, True):
        t = server.post("/tokenize", {"model": M, "messages": messages, "add_special_tokens": special})
        r = server.post("/v1/chat/completions", {"model": M, "messages": messages, "max_tokens": 1,
                                                 "add_special_tokens": special})
        assert t.status_code == r.status_code == 200, (t.text, r.text)
        assert t.json()["count"] == r.json()["usage"]["prompt_tokens"]
    docs = server.post("/v1/chat/completions", {"model": M, "messages": messages, "max_tokens": 1,
                                                "documents": [{"title": "a", "text": "b"}]})
    assert docs.status_code == 200, docs.text


def test_cut_utf8_character_shows_as_replacement(server: Server) -> None:
    """A token holding the first byte of a multi-byte character, cut off by max_tokens, shows as U+FFFD (as vLLM
    shows it), not as nothing."""
    euro = server.post("/tokenize", {"model": M, "prompt": "€", "add_special_tokens": False}).json()["tokens"]
    lead = euro[0]
    assert server.post("/detokenize", {"tokens": [lead]}).json()["prompt"].endswith("\ufffd")
    r = server.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 1, "temperature": 0,
                                        "logit_bias": {str(lead): 100}}).json()["choices"][0]
    assert r["finish_reason"] == "length" and r["text"].endswith("\ufffd")
    streamed = server.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 1, "temperature": 0,
                                               "stream": True, "logit_bias": {str(lead): 100}}).text
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
             if line.startswith("data: {")]
    assert "".join(texts) == r["text"]


@pytest.mark.slow
def test_max_logprobs_and_tokens_as_ids_options(app_registry: AppRegistry) -> None:
    """--max-logprobs -1 (or the vocabulary's size) lifts the cap and allows prompt_logprobs and top_logprobs -1
    (every token of the vocabulary);
    --return-tokens-as-token-ids makes it the default, which a request can still turn off."""
    s = app_registry.get(("--num-gpu-blocks", "256", "--max-logprobs", "-1", "--return-tokens-as-token-ids"))
    r = s.post("/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 2, "logprobs": 30,
                                   "prompt_logprobs": -1}).json()
    choice = r["choices"][0]
    assert all(len(e) == _vocab_size(s) for e in choice["prompt_logprobs"][1:])
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert all(len(top) >= 30 for top in choice["logprobs"]["top_logprobs"])
    off = s.post("/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 2, "logprobs": 1,
                                     "return_tokens_as_token_ids": False}).json()
    assert not any(t.startswith("token_id:") for t in off["choices"][0]["logprobs"]["tokens"])
    # Chat top_logprobs -1 (vLLM's): every token of the vocabulary at each position.
    whole = s.post("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 1, "logprobs": True, "top_logprobs": -1}).json()
    assert len(whole["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == _vocab_size(s)
    # -1 counts as the vocabulary's size against the cap, as in vLLM: a cap that large allows it, one less not.
    vocab = _vocab_size(s)
    for cap, status in ((vocab, 200), (vocab - 1, 400)):
        capped = app_registry.get(("--num-gpu-blocks", "64", "--max-logprobs", str(cap)))
        r = capped.post("/v1/completions", {"model": M, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": -1})
        assert r.status_code == status, r.text


def test_invocations_tokenizer_info_and_load(server: Server) -> None:
    """SageMaker's /invocations routes by the body's shape; /tokenizer_info and /load as vLLM serves them."""
    chat = {"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    completion = {"model": M, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert server.post("/invocations", chat).json() | {"id": 0, "created": 0} == server.post(
        "/v1/chat/completions", chat).json() | {"id": 0, "created": 0}
    routed = server.post("/invocations", completion).json()
    assert routed["object"] == "text_completion"
    assert routed["choices"][0]["text"] == server.post("/v1/completions", completion).json()["choices"][0]["text"]
    neither = server.post("/invocations", {"model": M, "input": "x"})
    assert neither.status_code == 400 and "'messages'" in neither.json()["error"]["message"]
    assert server.post("/invocations", {**completion, "max_tokens": -1}).json()["error"]["param"] == "max_tokens"
    info = server.get("/tokenizer_info").json()
    assert info["chat_template"] and info["eos_token_ids"] and info["vocab_size"] == _vocab_size(server)
    assert server.get("/load").json() == {"server_load": 0}


def test_recent_vllm_fields(server: Server) -> None:
    """truncation_side and logprob_token_ids work; the other fields of vLLM's current protocol are accepted at
    their neutral value or refused with the reason, never "unrecognized"."""
    ids = _prompt_ids(server)
    body = {"model": M, "prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3}
    left = server.post("/v1/completions", {**body, "return_token_ids": True}).json()["choices"][0]
    right = server.post("/v1/completions", {**body, "return_token_ids": True,
                                            "truncation_side": "right"}).json()["choices"][0]
    assert left["prompt_token_ids"] == ids[-3:] and right["prompt_token_ids"] == ids[:3]
    wanted = [5, 17, 300]
    r = server.client().chat.completions.create(
        model=M, messages=[{"role": "user", "content": "Hello"}], max_tokens=2, temperature=0, logprobs=True,
        top_logprobs=len(wanted) + 1, extra_body={"logprob_token_ids": wanted, "return_tokens_as_token_ids": True})
    for step in r.choices[0].logprobs.content:
        listed = [int(t.token.removeprefix("token_id:")) for t in step.top_logprobs]
        assert listed[0] == int(step.token.removeprefix("token_id:")) and set(wanted) <= set(listed)
    alone = server.post("/v1/completions", {"model": M, "prompt": "x", "logprob_token_ids": [1]}).json()["error"]
    assert alone["param"] == "logprob_token_ids" and "requires 'logprobs'" in alone["message"]
    ok = server.post("/v1/completions", {"model": M, "prompt": "x", "max_tokens": 1, "return_token_offsets": True,
                                         "ec_transfer_params": None, "thinking_token_budget": -1})
    assert ok.status_code == 200, ok.text
    for field, value, why in (("repetition_detection", {"min_ngram": 2}, "not implemented"),
                              ("ec_transfer_params", {"a": 1}, "encoder-cache"),
                              ("thinking_token_budget", 100, "thinking budget")):
        e = server.post("/v1/completions", {"model": M, "prompt": "x", field: value}).json()["error"]
        assert e["param"] == field and why in e["message"], e
    chat = {"model": M, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert server.post("/v1/chat/completions", {**chat, "include_reasoning": False}).status_code == 200
    e = server.post("/v1/chat/completions", {**chat, "reasoning_effort": "high"}).json()["error"]
    assert e["param"] == "reasoning_effort" and "no reasoning mode" in e["message"]
