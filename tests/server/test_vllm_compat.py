"""What clients written for vLLM send and expect (guidellm, aiperf, vLLM's own extensions), against a real server
with the official openai client: each field either works or gets a 400 naming it."""

from __future__ import annotations

import httpx
import pytest
from server_helpers import LONG_PREFIX, Server

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
    assert bare["count"] <= t["count"] and "token_strs" not in bare
    assert server.post("/detokenize", {"model": M, "tokens": bare["tokens"]}).json() == {"prompt": "Hello tokenizer"}
    messages = [{"role": "user", "content": "Tokenize this chat"}]
    tc = server.post("/tokenize", {"messages": messages}).json()
    assert tc["count"] == client.chat.completions.create(model=M, messages=messages, max_tokens=1).usage.prompt_tokens
    assert server.post("/detokenize", {"tokens": [10**6]}).status_code == 400
    assert server.post("/tokenize", {"prompt": "x", "model": "gpt-4"}).status_code == 404
    assert server.post("/tokenize", {"prompt": "x", "frobnicate": 1}).status_code == 400


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
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ping").status_code == 200 and httpx.post(server.url + "/ping").status_code == 200
    r = httpx.get(server.url + "/v1/models")
    generated = r.headers["x-request-id"]
    assert len(generated) == 32 and httpx.get(server.url + "/v1/models").headers["x-request-id"] != generated
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
