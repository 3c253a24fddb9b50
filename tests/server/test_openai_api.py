"""The official `openai` client against a real server: completions, chat, streaming, n > 1, stop strings, and
cached tokens that change nothing in the output."""

from __future__ import annotations

import openai
import pytest
from support.servers import LONG_PREFIX, Server, start_server, stop_server


def test_models_and_health(server: Server) -> None:
    client = server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["default-model-v1"]
    assert client.models.retrieve("default-model-v1").id == "default-model-v1"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")
    assert server.get("/health").status_code == 200


def test_chat_history_from_model_dump(server: Server) -> None:
    """The common multi-turn pattern: the previous reply goes back as ``message.model_dump()`` (with its null
    refusal, tool_calls, audio, ... fields), and the second turn hits the first turn's blocks."""
    client = server.client()
    messages = [{"role": "system", "content": LONG_PREFIX}, {"role": "user", "content": "First question."}]
    first = client.chat.completions.create(model="default-model-v1", messages=messages, max_tokens=4,
                                           temperature=0)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "And a second one."}]
    second = client.chat.completions.create(model="default-model-v1", messages=messages, max_tokens=4,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(LONG_PREFIX) // 8
    # Past tool calls render (tests/server/test_tool_calls.py); ones whose arguments are not JSON are refused.
    with pytest.raises(openai.BadRequestError, match="tool_calls"):
        client.chat.completions.create(model="default-model-v1", max_tokens=4, messages=[
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{"}}]},
            {"role": "user", "content": "hi"}])


def test_completion(server: Server) -> None:
    r = server.client().completions.create(model="default-model-v1", prompt="Hello there", max_tokens=5,
                                           temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # shorter than one block: never cached


def test_chat(server: Server) -> None:
    r = server.client().chat.completions.create(
        model="default-model-v1", max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_with_usage_matches_non_streaming(server: Server) -> None:
    client = server.client()
    kw = dict(model="default-model-v1", max_tokens=12, temperature=0,
              messages=[{"role": "user", "content": LONG_PREFIX + " Stream this."}])
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == full.usage.completion_tokens
    # The second identical prompt hit the cache, and the final streamed chunk says so.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_completion_streaming(server: Server) -> None:
    client = server.client()
    stream = client.completions.create(model="default-model-v1", prompt="Count: one two", max_tokens=8,
                                       temperature=0, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    full = client.completions.create(model="default-model-v1", prompt="Count: one two", max_tokens=8, temperature=0)
    assert text == full.choices[0].text


def test_n_greater_than_one(server: Server) -> None:
    r = server.client().completions.create(model="default-model-v1", prompt=LONG_PREFIX, max_tokens=6, n=3,
                                           temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 0 < r.usage.completion_tokens <= 18
    chunks = list(server.client().chat.completions.create(
        model="default-model-v1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, stream=True))
    assert {choice.index for c in chunks for choice in c.choices} == {0, 1}


def test_streaming_n_sends_each_finish_reason_once(server: Server) -> None:
    """Samples of one request that finish at different steps: a finished choice's finish_reason goes out in one
    chunk, never again with an empty delta in the chunks of the samples still running."""
    chunks = list(server.client().completions.create(
        model="default-model-v1", prompt="Finish apart", max_tokens=24, n=4, temperature=1.0, seed=3,
        stop=["a", "e", "o"], stream=True))
    finishes = [(k, c.index) for k, chunk in enumerate(chunks) for c in chunk.choices if c.finish_reason]
    assert sorted(i for _, i in finishes) == [0, 1, 2, 3]
    assert len({k for k, _ in finishes}) > 1  # they did finish in different chunks: the case under test
    for k, i in finishes:
        assert all(c.index != i for chunk in chunks[k + 1 :] for c in chunk.choices)


def test_batch_and_token_prompts(server: Server) -> None:
    r = server.client().completions.create(model="default-model-v1", prompt=["first prompt", "second one"],
                                           max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    ids = server.client().completions.create(model="default-model-v1", prompt=[5, 6, 7, 8], max_tokens=3,
                                             temperature=0)
    assert ids.usage.prompt_tokens == 4


def test_stop_string(server: Server) -> None:
    client = server.client()
    kw = dict(model="default-model-v1", prompt="The stop test prompt", max_tokens=16, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert len(free) > 3
    stop = free[2:4]
    r = client.completions.create(**kw, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == free[: free.index(stop)]  # OpenAI semantics: the stop string is not returned


def test_logprobs(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(model="default-model-v1", messages=[{"role": "user", "content": "lp"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3 and tok.logprob <= 0
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob)  # greedy: the sampled token ranks first
    chunks = list(client.chat.completions.create(
        model="default-model-v1", messages=[{"role": "user", "content": "lp"}], max_tokens=5, temperature=0,
        logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    c = client.completions.create(model="default-model-v1", prompt="lp", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


@pytest.mark.parametrize("chat", [False, True])
def test_shared_prefix_hits_and_output_equals_caching_off(server: Server, server_nocache: Server, chat: bool) -> None:
    prompts = [LONG_PREFIX + f" Question {i}: what is {i} + {i}?" for i in range(3)]
    outputs = {}
    for s in (server, server_nocache):
        client = s.client()
        results = []
        for p in prompts:
            if chat:
                r = client.chat.completions.create(model="default-model-v1", max_tokens=10, temperature=0,
                                                   messages=[{"role": "user", "content": p}])
                results.append((r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens))
            else:
                r = client.completions.create(model="default-model-v1", prompt=p, max_tokens=10, temperature=0)
                results.append((r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
        outputs[s.url] = results
    on, off = outputs[server.url], outputs[server_nocache.url]
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(c > 0 for _, c in on[1:]), on  # later prompts share the long prefix
    assert all(c == 0 for _, c in off)
    server.wait_idle()
    server_nocache.wait_idle()


@pytest.mark.slow
def test_serves_a_checkpoint_given_by_path(server_tmp, tiny_llama_path: str) -> None:
    """--model with a Hugging Face checkpoint directory (tiny random Llama with a chat template)."""
    s = start_server(server_tmp, "--model", tiny_llama_path, "--num-gpu-blocks", "256", "--served-model-name", "tiny")
    try:
        assert [m.id for m in s.client().models.list().data] == ["tiny"]
        r = s.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                               max_tokens=4, temperature=0)
        assert r.usage.completion_tokens <= 4 and r.choices[0].message.role == "assistant"
        assert s.post("/v1/completions", {"model": "default-model-v1", "prompt": "x"}).status_code == 404
        s.wait_idle()
    finally:
        assert stop_server(s) in (0, -15)
