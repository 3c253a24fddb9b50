"""tools and tool_choice against a real server with the official openai client: under "required" and a named
function every call parses and matches its schema, whatever the random test model prefers; streamed deltas add up
to the non-streamed message; history with calls and results renders as the renderer renders it; every bad field is
a 400 naming it, and fails only that request."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
from support.servers import Server

from kvprefix.prompts import render_body
from kvprefix.tokenizer import Tokenizer

M = "default-model-v1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "unit": {"type": "string", "enum": ["C", "F"]}}, "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 8}}, "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _valid_calls(choice) -> list:
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls, choice
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return calls


@pytest.mark.slow
def test_required_and_named_calls_always_parse_and_match_the_schema(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="required", n=6,
                                       temperature=1.0, seed=3, max_tokens=400, parallel_tool_calls=False)
    names = set()
    for choice in r.choices:
        (call,) = _valid_calls(choice)
        names.add(call.function.name)
        assert choice.message.content is None
    assert names <= {"get_weather", "add"}
    named = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, n=4, temperature=1.0, seed=4,
                                           max_tokens=400, tool_choice={"type": "function",
                                                                        "function": {"name": "add"}})
    for choice in named.choices:
        (call,) = _valid_calls(choice)
        assert call.function.name == "add"
    parallel = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                              temperature=1.0, seed=5, max_tokens=1500)
    for choice in parallel.choices:
        calls = _valid_calls(choice)
        assert [c.id for c in calls] == list(dict.fromkeys(c.id for c in calls))
    server.wait_idle()


@pytest.mark.slow
def test_streamed_tool_call_deltas_add_up_to_the_message(server: Server) -> None:
    client = server.client()
    kw = dict(model=M, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, max_tokens=1500)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # the first piece of a call: id, type and name, in index order
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    assert finish == whole.finish_reason == "tool_calls" and content == ""
    assert list(calls.values()) == [{"name": c.function.name, "arguments": c.function.arguments}
                                    for c in _valid_calls(whole)]
    server.wait_idle()


def test_history_with_calls_and_results_renders_like_the_renderer(server: Server) -> None:
    """The openai client's own message objects go back in; /tokenize shows the same tokens as render_body (the
    router's and the doctor's renderer) for the same body."""
    client = server.client()
    first = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, max_tokens=400, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = _valid_calls(first.choices[0])
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    second = client.chat.completions.create(model=M, messages=history, tools=TOOLS, max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    body = json.loads(json.dumps({"messages": history, "tools": TOOLS}))
    tokens = server.post("/tokenize", body).json()["tokens"]
    (rendered,) = render_body(Tokenizer(os.environ["KVPREFIX_TEST_MODEL"]), body)
    assert tokens == rendered.token_ids and second.usage.prompt_tokens == len(tokens)
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in rendered.text
    assert call.function.arguments in rendered.text  # the past call renders as it was generated


def test_tool_choice_none_returns_text_and_auto_parses_none_out_of_gibberish(server: Server) -> None:
    client = server.client()
    kw = dict(model=M, messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    none = client.chat.completions.create(tool_choice="none", **kw).choices[0]
    auto = client.chat.completions.create(**kw).choices[0]
    # The same prompt (tools are rendered under "none" too): the same text, which the random model never makes a
    # call of.
    assert none.message.tool_calls is None and auto.message.tool_calls is None
    assert auto.message.content == none.message.content and none.finish_reason == auto.finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER] * 129}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "big", "parameters": {
        "type": "object", "description": "x" * 40000}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [ADD, {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_a_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    r = server.post("/v1/chat/completions", {"model": M, "messages": ASK, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "\n" not in r.json()["error"]["message"]


def test_tools_with_a_response_format_under_tool_choice_none(server: Server) -> None:
    r = server.client().chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="none",
                                                max_tokens=40, temperature=0, response_format={
                                                    "type": "json_schema", "json_schema": {"name": "n", "schema": {
                                                        "type": "object", "properties": {"n": {"enum": [1, 2]}},
                                                        "required": ["n"]}}})
    assert json.loads(r.choices[0].message.content)["n"] in (1, 2) and r.choices[0].message.tool_calls is None
