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
