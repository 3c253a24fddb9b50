"""What clients written for vLLM send and expect (guidellm, aiperf, vLLM's own extensions), against a real server
with the official openai client: each field either works or gets a 400 naming it."""

from __future__ import annotations

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
