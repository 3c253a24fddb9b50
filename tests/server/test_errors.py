"""Every bad input gets an OpenAI-style error with the documented status and a message naming the problem
(docs/server.md, "Errors"); afterwards the server still serves and no block is left referenced."""

from __future__ import annotations

import pytest
from support.servers import Server

OK_C = {"model": "default-model-v1", "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": "default-model-v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

C, CHAT = "/v1/completions", "/v1/chat/completions"
# (id, path, body: raw bytes or a dict merged over a valid body, status, message substring, param)
CASES = [
    ("malformed-json", C, b'{"prompt": "x",', 400, "malformed JSON", None),
    ("not-an-object", C, b"[1, 2]", 400, "JSON object", None),
    ("empty-body", C, b"", 400, "empty", None),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8", None),
    ("lone-surrogate", C, b'{"prompt": "\\ud800"}', 400, "malformed JSON", None),
    ("nan", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "temperature"),
    ("max-tokens-string", C, {"max_tokens": "5"}, 400, "'max_tokens'", "max_tokens"),
    ("max-tokens-bool", C, {"max_tokens": True}, 400, "'max_tokens'", "max_tokens"),
    ("prompt-number", C, {"prompt": 5}, 400, "'prompt'", "prompt"),
    ("prompt-empty", C, {"prompt": ""}, 400, "'prompt'", "prompt"),
    ("prompt-empty-list", C, {"prompt": []}, 400, "'prompt'", "prompt"),
    ("temperature-string", C, {"temperature": "hot"}, 400, "'temperature'", "temperature"),
    ("stream-string", C, {"stream": "yes"}, 400, "'stream'", "stream"),
    ("missing-prompt", C, b'{"model": "default-model-v1"}', 400, "missing required parameter: 'prompt'", "prompt"),
    ("unknown-model", C, {"model": "gpt-4"}, 404, "does not exist", "model"),
    ("max-tokens-zero", C, {"max_tokens": 0}, 400, "'max_tokens'", "max_tokens"),
    ("max-tokens-negative", C, {"max_tokens": -3}, 400, "'max_tokens'", "max_tokens"),
    ("max-tokens-too-large", C, {"max_tokens": 10**6}, 400, "maximum context length", "prompt"),
    ("prompt-too-long", C, {"prompt": [7] * 8200}, 400, "maximum context length", "prompt"),
    ("token-out-of-vocab", C, {"prompt": [1, 2, 10**6]}, 400, "out of vocabulary", "prompt"),
    ("stop-token-out-of-vocab", C, {"stop_token_ids": [10**6]}, 400, "out of vocabulary", "stop_token_ids"),
    ("max-tokens-zero-without-echo", C, {"max_tokens": 0}, 400, "0 only with 'echo'", "max_tokens"),
    ("temperature-negative", C, {"temperature": -1}, 400, "'temperature'", "temperature"),
    ("temperature-too-high", C, {"temperature": 2.5}, 400, "'temperature'", "temperature"),
    ("top-p-zero", C, {"top_p": 0}, 400, "'top_p'", "top_p"),
    ("top-k-bad", C, {"top_k": -5}, 400, "'top_k'", "top_k"),
    ("n-zero", C, {"n": 0}, 400, "'n'", "n"),
    ("n-too-large", C, {"n": 1000}, 400, "'n'", "n"),
    ("penalty-range", C, {"presence_penalty": 9}, 400, "'presence_penalty'", "presence_penalty"),
    ("too-many-stops", C, {"stop": ["a", "b", "c", "d", "e"]}, 400, "'stop'", "stop"),
    ("unknown-param", C, {"frobnicate": 1}, 400, "unrecognized request argument supplied: frobnicate", "frobnicate"),
    ("logprobs-too-many", C, {"logprobs": 21}, 400, "greater than max allowed: 20", "logprobs"),
    ("top-logprobs-too-many", CHAT, {"logprobs": True, "top_logprobs": 21}, 400, "greater than max allowed: 20",
     "top_logprobs"),
    ("prompt-logprobs-whole-vocabulary", C, {"prompt_logprobs": -1}, 400, "--max-logprobs -1", "prompt_logprobs"),
    ("top-logprobs-alone", CHAT, {"top_logprobs": 2}, 400, "'top_logprobs' requires 'logprobs'", "top_logprobs"),
    ("logprobs-not-bool", CHAT, {"logprobs": 3}, 400, "'logprobs'", "logprobs"),
    ("stream-options-without-stream", C, {"stream_options": {"include_usage": True}}, 400, "'stream_options'",
     "stream_options"),
    ("bad-cache-salt", C, {"cache_salt": "no spaces allowed!"}, 400, "'cache_salt'", "cache_salt"),
    ("empty-messages", CHAT, {"messages": []}, 400, "'messages'", "messages"),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "'messages'", "messages"),
    ("role-not-text", CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "'messages.0.role'",
     "messages.0.role"),
    ("content-number", CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "'messages.0.content'",
     "messages.0.content"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "images are not supported", "messages.0.content"),
    ("unknown-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, 400,
     "content part type 'hologram' is not supported", "messages.0.content"),
    ("null-prompt", C, {"prompt": None}, 400, "missing required parameter: 'prompt'", "prompt"),
    ("tool-choice-unknown", CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "'g' is not among the functions in 'tools' (f)", "tool_choice.function.name"),
    ("json-schema-without-schema", CHAT, {"response_format": {"type": "json_schema"}}, 400, "json_schema",
     "response_format.json_schema"),
    ("response-format-unknown", CHAT, {"response_format": {"type": "xml"}}, 400, "'response_format.type'",
     "response_format.type"),
    ("chat-max-tokens-zero", CHAT, {"max_completion_tokens": 0}, 400, "'max_completion_tokens'",
     "max_completion_tokens"),
    # Values the engine cannot honour never reach it (one such request used to kill the engine for everyone).
    ("top-k-beyond-int64", C, {"top_k": 2**63}, 400, "'top_k'", "top_k"),
    ("top-k-huge", C, {"top_k": 10**30}, 400, "'top_k'", "top_k"),
    ("seed-beyond-int64", C, {"seed": 2**64}, 400, "[type=less_than_equal]", "seed"),  # pydantic's type, as vLLM
    ("stop-token-id-huge", C, {"stop_token_ids": [10**30]}, 400, "'stop_token_ids.0'", "stop_token_ids.0"),
    ("prompt-token-id-huge", C, {"prompt": [1, 10**30]}, 400, "'prompt", None),
    ("too-many-stop-token-ids", C, {"stop_token_ids": list(range(257))}, 400, "'stop_token_ids'", "stop_token_ids"),
    ("too-many-prompts", C, {"prompt": ["x"] * 257}, 400, "'prompt", None),
    ("too-many-messages", CHAT, {"messages": [{"role": "user", "content": "x"}] * 4097}, 400, "'messages'",
     "messages"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server: Server, case) -> None:
    _, path, body, status, message, param = case
    if isinstance(body, dict):
        body = {**(OK_C if path == C else OK_CHAT), **body}
    r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    assert err["type"] in ("invalid_request_error", "not_found_error")


def test_not_found_and_method(server: Server) -> None:
    r = server.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = server.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = server.post("/reset_prefix_cache?timeout=-1")
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"


def test_oversized_body(server: Server) -> None:
    big = b'{"prompt": "' + b"a" * (17 * 2**20) + b'"}'
    r = server.post(C, big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit must hold while streaming the body in
        for _ in range(17):
            yield b"a" * 2**20

    r = server.post(C, chunked())
    assert r.status_code == 413


@pytest.mark.slow  # replays every case above: ~9 s on the loaded 2-core machine
def test_still_serves_and_no_leak_after_bad_inputs(server: Server) -> None:
    for _, path, body, *_ in CASES:
        server.post(path, body if isinstance(body, bytes) else {**(OK_C if path == C else OK_CHAT), **body})
    r = server.client().completions.create(model="default-model-v1", prompt="still alive?", max_tokens=3)
    assert r.choices[0].text is not None
    server.wait_idle()


def test_a_batch_over_the_pending_limits_gets_a_400_not_retry_forever(tenant_server: Server) -> None:
    """Retrying a batch larger than the limits can never succeed: 400 naming the limit, not 503/429 + Retry-After."""
    for prompts, option in ((["x"] * 4, "--max-pending-per-tenant"), (["x"] * 5, "--max-pending-per-tenant")):
        r = tenant_server.post(C, {**OK_C, "prompt": prompts}, headers={"authorization": "Bearer key-bob"})
        assert r.status_code == 400 and "retry-after" not in r.headers, r.text
        assert "can never be admitted" in r.json()["error"]["message"] and option in r.json()["error"]["message"]
    ok = tenant_server.post(C, {**OK_C, "prompt": ["x"] * 3}, headers={"authorization": "Bearer key-bob"})
    assert ok.status_code == 200, ok.text
