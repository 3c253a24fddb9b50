"""What clients written for vLLM send and expect (guidellm, aiperf, vLLM's own extensions), against a real server
with the official openai client: each field either works or gets a 400 naming it."""

from __future__ import annotations

import json
import re

import pytest
from support.servers import LONG_PREFIX, Server

M = "default-model-v1"


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_on_every_chunk(server: Server, chat: bool) -> None:
    """guidellm and aiperf --per-chunk-usage: usage so far on every chunk, ending at the final usage."""
    client = server.client()
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=M, max_tokens=6, temperature=0, stream=True, stream_options=opts,
              extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": LONG_PREFIX}], **kw))
    else:
        chunks = list(client.completions.create(prompt=LONG_PREFIX, **kw))
    assert len(chunks) >= 3 and all(c.usage is not None for c in chunks)
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 0
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 6
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    # Each chunk with new text counts more tokens than the one before (outputs are cumulative, so a slow reader
    # may get several tokens in one chunk).
    content = [c.usage.completion_tokens for c in chunks
               if c.choices and (c.choices[0].delta.content if chat else c.choices[0].text)]
    assert content and content[0] >= 1 and all(a < b for a, b in zip(content, content[1:], strict=False))
    # Without the option only the final chunk carries usage, as in OpenAI's API.
    kw["stream_options"] = {"include_usage": True}
    plain = list(client.completions.create(prompt=LONG_PREFIX, **kw))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 6


def test_null_means_not_sent(server: Server) -> None:
    """OpenAI accepts null for optional fields; clients built from typed models send them."""
    nulls = {"n": None, "logprobs": None, "stream": None, "echo": None, "stream_options": None, "seed": None,
             "ignore_eos": None, "user": None}
    r = server.post("/v1/completions", {"model": M, "prompt": "null test", "max_tokens": 3, "temperature": 0,
                                        **nulls})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    same = server.client().completions.create(model=M, prompt="null test", max_tokens=3, temperature=0)
    assert body["choices"][0]["text"] == same.choices[0].text
    chat = server.post("/v1/chat/completions", {"model": M, "messages": [{"role": "user", "content": "x", "name": None}],
                                                "max_tokens": 2, "n": None, "logprobs": None, "stream": None,
                                                "top_logprobs": None, "max_completion_tokens": None})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None


def test_cache_control_parts_are_a_hint(server: Server) -> None:
    """Content parts with Anthropic-style cache_control (LiteLLM, LangChain) render exactly like plain text."""
    client = server.client()
    system = [{"type": "text", "text": LONG_PREFIX, "cache_control": {"type": "ephemeral"}}]
    kw = dict(model=M, max_tokens=4, temperature=0)
    hinted = client.chat.completions.create(messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": "cache control"}], **kw)
    plain = client.chat.completions.create(messages=[{"role": "system", "content": LONG_PREFIX},
                                                     {"role": "user", "content": "cache control"}], **kw)
    assert hinted.usage.prompt_tokens == plain.usage.prompt_tokens
    assert hinted.choices[0].message.content == plain.choices[0].message.content
    assert plain.usage.prompt_tokens_details.cached_tokens >= len(LONG_PREFIX) // 8  # the same blocks


def test_tokenize_and_detokenize_match_what_requests_run(server: Server) -> None:
    client = server.client()
    t = server.post("/tokenize", {"model": M, "prompt": "Hello tokenizer", "return_token_strs": True}).json()
    r = client.completions.create(model=M, prompt="Hello tokenizer", max_tokens=1)
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] > 0
    assert len(t["token_strs"]) == t["count"] and all(isinstance(s, str) for s in t["token_strs"])
    bare = server.post("/tokenize", {"prompt": "Hello tokenizer", "add_special_tokens": False}).json()
    assert bare["count"] <= t["count"] and bare["token_strs"] is None  # always there, as in vLLM
    assert server.post("/detokenize", {"model": M, "tokens": bare["tokens"]}).json() == {"prompt": "Hello tokenizer"}
    messages = [{"role": "user", "content": "Tokenize this chat"}]
    tc = server.post("/tokenize", {"messages": messages}).json()
    assert tc["count"] == client.chat.completions.create(model=M, messages=messages, max_tokens=1).usage.prompt_tokens
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert server.post("/tokenize", {"prompt": "x", "model": "gpt-4"}).status_code == 404
    assert server.post("/tokenize", {"prompt": "x", "frobnicate": 1}).status_code == 400
    deep = "[" * 200_000 + "]" * 200_000  # nested deeper than a parser recurses: a 400, not a server error
    assert server.post("/tokenize", deep.encode(), timeout=30).status_code == 400


def test_chat_template_fields(server: Server) -> None:
    """add_generation_prompt and continue_final_message render as /tokenize shows, in chat completions too."""
    client = server.client()
    messages = [{"role": "user", "content": "Finish my sentence"}, {"role": "assistant", "content": "The sky is"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    ids = server.post("/tokenize", {"messages": messages, **cont}).json()["tokens"]
    text = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert text.endswith("The sky is")  # no end of turn: the model continues the assistant's message
    r = client.chat.completions.create(model=M, messages=messages, max_tokens=1, extra_body=cont)
    assert r.usage.prompt_tokens == len(ids)
    default = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert len(default) > len(ids)  # end of turn and a new assistant header
    both = server.post("/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and "add_generation_prompt" in both.json()["error"]["message"]
    kw = server.post("/v1/chat/completions", {"messages": messages, "chat_template_kwargs": {"chat_template": "x"}})
    assert kw.status_code == 400 and kw.json()["error"]["param"] == "chat_template_kwargs"
    ok = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                              "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text


def test_version_ping_and_request_ids(server: Server) -> None:
    assert server.get("/version").json()["version"]
    assert server.get("/ping").status_code == 200 and server.post("/ping").status_code == 200
    r = server.get("/v1/models")
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and server.get("/v1/models").headers["x-request-id"] != generated
    client = server.client(default_headers={"x-request-id": "trace-42"})
    raw = client.chat.completions.with_raw_response.create(model=M, messages=[{"role": "user", "content": "id"}],
                                                           max_tokens=2)
    assert raw.headers["x-request-id"] == "trace-42" and raw.parse().id == "chatcmpl-trace-42"
    # The same id twice at once (a client retrying): both are served; the engine's ids stay unique.
    stream = client.completions.create(model=M, prompt="same id", max_tokens=8, stream=True)
    again = client.completions.create(model=M, prompt="same id", max_tokens=2)
    assert again.id == "cmpl-trace-42" and [c.id for c in stream][0] == "cmpl-trace-42"
    body_id = server.client().completions.create(model=M, prompt="x", max_tokens=1, extra_body={"request_id": "b-1"})
    assert body_id.id == "cmpl-b-1"
    err = server.post("/v1/completions", {"prompt": "x"}, headers={"x-request-id": "has space"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "x-request-id"
    assert server.post("/v1/completions", {"prompt": "x"}, headers={"x-request-id": "e-1"}).headers[
        "x-request-id"] == "e-1"
    assert server.post("/v1/completions", {"prompt": "x", "request_id": "a b"}).status_code == 400
    server.wait_idle()


def test_min_tokens_include_stop_str_and_token_ids(server: Server) -> None:
    client = server.client()
    kw = dict(model=M, prompt=LONG_PREFIX + " min tokens", max_tokens=8, temperature=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    ids = free.model_extra["token_ids"]
    assert len(ids) == 8 and free.model_extra["prompt_token_ids"] == server.post(
        "/tokenize", {"prompt": kw["prompt"]}).json()["tokens"]
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [ids[0]]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [ids[0]], "min_tokens": 4,
                                                       "return_token_ids": True})
    assert held.usage.completion_tokens >= 4 and ids[0] not in held.choices[0].model_extra["token_ids"][:4]
    # min_characters (vLLM's): the same hold, until the text has that many characters; streamed too.
    for stream in (False, True):
        out = client.completions.create(**kw, stream=stream, extra_body={"stop_token_ids": [ids[0]],
                                                                         "min_characters": 6})
        text = "".join(c.choices[0].text for c in out) if stream else out.choices[0].text
        assert len(text) >= 6, text
    # The stop string comes back with include_stop_str_in_output, as in vLLM.
    stop = free.text[2:4]
    if len(stop) == 2 and stop.strip():
        cut = free.text[: free.text.index(stop)]
        kept = client.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True})
        assert kept.choices[0].text == cut + stop
    # skip_special_tokens=false: the text is every token's text, special ones included.
    raw = client.completions.create(**kw, extra_body={"skip_special_tokens": False, "ignore_eos": True,
                                                      "return_token_ids": True}).choices[0]
    assert raw.text == server.post("/detokenize", {"tokens": raw.model_extra["token_ids"]}).json()["prompt"]
    # Streamed token ids add up to the whole, chat too; the chat prompt ids come in the first chunk.
    stream = list(client.completions.create(**kw, stream=True, extra_body={"ignore_eos": True,
                                                                             "return_token_ids": True}))
    assert [t for c in stream for ch in c.choices for t in ch.model_extra["token_ids"]] == ids
    messages = [{"role": "user", "content": "token ids"}]
    chat = list(client.chat.completions.create(model=M, messages=messages, max_tokens=4, temperature=0, stream=True,
                                               extra_body={"return_token_ids": True, "ignore_eos": True}))
    assert chat[0].model_extra["prompt_token_ids"] == server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert sum(len(ch.model_extra.get("token_ids") or []) for c in chat for ch in c.choices) == 4


def test_truncate_prompt_tokens_keeps_the_end(server: Server) -> None:
    client = server.client()
    ids = server.post("/tokenize", {"prompt": LONG_PREFIX * 20}).json()["tokens"]
    assert len(ids) > 8192  # longer than the context: refused unless truncated
    kw = dict(model=M, max_tokens=4, temperature=0)
    r = client.completions.create(prompt=LONG_PREFIX * 20, **kw, extra_body={"truncate_prompt_tokens": 100})
    same = client.completions.create(prompt=ids[-100:], **kw)
    assert r.usage.prompt_tokens == 100 and r.choices[0].text == same.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": LONG_PREFIX}], **kw,
                                          extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50
    assert server.post("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}).status_code == 400


@pytest.mark.parametrize("chat", [False, True])
def test_prompt_logprobs_with_a_cache_hit_equal_caching_off(server: Server, server_nocache: Server,
                                                            chat: bool) -> None:
    text = LONG_PREFIX + " Score every token of this prompt."
    body = {"model": M, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    body |= {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    warm = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    server.post(path, warm)
    assert server.post(path, warm).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # now cached
    results = []
    for s in (server, server_nocache):
        r = s.post(path, body).json()
        results.append(r["prompt_logprobs"] if chat else r["choices"][0]["prompt_logprobs"])
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the scored tokens bypass the cache
    on, off = results
    assert len(on) == len(off) == r["usage"]["prompt_tokens"] and on[0] is None and off[0] is None
    for a, b in zip(on[1:], off[1:], strict=True):
        assert a.keys() == b.keys() and 2 <= len(a) <= 3
        for t in a:
            assert a[t]["rank"] == b[t]["rank"] and a[t]["logprob"] == pytest.approx(b[t]["logprob"], abs=1e-4)
    stream = server.post(path, {**body, "stream": True})
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "prompt_logprobs"
    assert server.post(path, {**body, "prompt_logprobs": 21}).status_code == 400


def test_return_tokens_as_token_ids(server: Server) -> None:
    r = server.client().chat.completions.create(model=M, messages=[{"role": "user", "content": "ids"}], max_tokens=3,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"return_tokens_as_token_ids": True})
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert tokens and all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens)


NEUTRAL = {"priority": 0, "kv_transfer_params": None, "use_beam_search": False, "length_penalty": 1.0,
           "bad_words": [], "spaces_between_special_tokens": True, "structured_outputs": None, "vllm_xargs": {},
           "guided_decoding_backend": "auto"}
REFUSED = [("priority", 1, "priority scheduling"), ("kv_transfer_params", {}, "disaggregated prefill"),
           ("length_penalty", 0.5, "beam search"),
           ("bad_words", ["x"], "banning words"), ("allowed_token_ids", [1, 2], "restricting sampling"),
           ("logits_processors", ["m.P"], "logits processors"), ("guided_decoding_backend", "xgrammar", "llguidance"),
           ("guided_whitespace_pattern", " ", "compact"), ("vllm_xargs", {"a": 1}, "extension"),
           ("spaces_between_special_tokens", False, "special tokens"), ("mm_processor_kwargs", {"a": 1}, "text only"),
           ("priority", False, "priority scheduling")]


def test_neutral_vllm_values_are_accepted(server: Server) -> None:
    for path, extra in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "add_special_tokens": False, "documents": None,
            "echo": False})):
        r = server.post(path, {"model": M, "max_tokens": 1, **NEUTRAL, **extra})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("field,value,why", REFUSED, ids=[f"{f}={v!r}" for f, v, _ in REFUSED])
def test_unsupported_vllm_fields_get_a_named_400(server: Server, field: str, value, why: str) -> None:
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = server.post(path, {"model": M, "max_tokens": 1, field: value, **extra})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and why in error["message"], error


@pytest.mark.slow
def test_structured_outputs_parse_and_vllm_fields(server: Server) -> None:
    """openai's .parse() with a pydantic model, json_object, and vLLM's structured_outputs / guided_* fields:
    whatever the random model prefers, the output is in the language asked for."""
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        tier: Literal["gold", "silver", "bronze"]

    client = server.client()
    messages = [{"role": "user", "content": "Rate this."}]
    for seed in range(3):
        r = client.chat.completions.parse(model=M, messages=messages, response_format=Verdict, max_tokens=60,
                                          temperature=1.0, seed=seed)
        assert isinstance(r.choices[0].message.parsed, Verdict) and r.choices[0].finish_reason == "stop"
    obj = client.chat.completions.create(model=M, messages=messages, max_tokens=300, temperature=1.0, seed=1,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # an unbounded object can run to max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].message.content.startswith("{")
    choice = client.completions.create(model=M, prompt="Pick:", max_tokens=10, n=4, temperature=1.0,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert {c.text for c in choice.choices} <= {"left", "right"}
    stream = client.completions.create(model=M, prompt="Code:", max_tokens=20, temperature=1.0, stream=True,
                                       extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", "".join(c.choices[0].text for c in stream if c.choices))
    bad = server.post("/v1/chat/completions", {"messages": messages, "structured_outputs": {"regex": "("}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
    both = server.post("/v1/completions", {"prompt": "x", "guided_regex": "a", "structured_outputs": {"choice": ["b"]}})
    assert both.status_code == 400 and "one structured output" in both.json()["error"]["message"]
    two = server.post("/v1/completions", {"prompt": "x", "structured_outputs": {"choice": ["b"], "regex": "a"}})
    assert two.status_code == 400 and two.json()["error"]["param"] == "structured_outputs"
    server.wait_idle()


@pytest.mark.parametrize("field, value", [("guided_choice", []), ("guided_regex", ""), ("guided_json", {}),
                                          ("structured_outputs", {"choice": []})])
def test_empty_structured_outputs_get_a_named_400(server: Server, field: str, value) -> None:
    """An empty choice list, pattern or schema asks for no language: the request's 400, not a 500 (the fuzzer
    found guided_choice: [])."""
    for path, extra in (("/v1/completions", {"prompt": "0"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = server.post(path, {"model": M, "max_tokens": 8, field: value, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    empty = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}}}})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "response_format", empty.text
    assert server.post("/v1/completions", {"model": M, "prompt": "0", "max_tokens": 1}).status_code == 200
