"""The tool-call grammars on llguidance's real matcher over a real tokenizer: what the renderer writes as a past
call is exactly what the grammar accepts; unknown functions, schema violations and a second call where one is
allowed are not; under "auto" with strict tools text stays free and only valid calls pass."""

from __future__ import annotations

import pytest

from kvprefix.engine.structured import GrammarMasks, grammar_for
from kvprefix.prompts.tools import format_tool_calls
from kvprefix.server.protocol import ChatCompletionRequest
from kvprefix.server.tools import plan_tools
from kvprefix.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
# A nested pydantic model's schema, as LangChain and openai send it: "$ref"s into "$defs" of the same schema.
BOOK = {"type": "function", "function": {"name": "book", "parameters": {
    "$defs": {"Place": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}, "seats": {"type": "integer"}},
    "required": ["at", "seats"]}}}
GOOD = format_tool_calls([("get_weather", {"city": "Paris"})])
TWO = format_tool_calls([("get_weather", {"city": "Oslo"}), ("book", {"at": {"name": "Noma"}, "seats": 2})])


@pytest.fixture(scope="module")
def accepts(default_model_dir: str):
    tokenizer = Tokenizer(default_model_dir)
    masks = GrammarMasks(tokenizer, tokenizer.vocab_size)

    def accepts(body: dict, text: str) -> bool:
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
        matcher = masks.matcher(grammar_for(plan_tools(req).structured))
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    return accepts


def test_required_accepts_exactly_valid_calls(accepts) -> None:
    required = {"tools": [WEATHER, BOOK], "tool_choice": "required"}
    assert accepts(required, GOOD) and accepts(required, TWO)
    assert not accepts(required, format_tool_calls([("launch", {})]))
    assert not accepts(required, format_tool_calls([("get_weather", {"town": "Paris"})]))
    assert not accepts(required, format_tool_calls([("book", {"at": {"title": "x"}, "seats": 2})]))
    assert not accepts(required, "Sure. " + GOOD) and not accepts(required, "")
    assert not accepts({**required, "parallel_tool_calls": False}, TWO)


def test_a_named_function_is_called_once(accepts) -> None:
    named = {"tools": [WEATHER, BOOK], "tool_choice": {"type": "function", "function": {"name": "book"}}}
    assert accepts(named, format_tool_calls([("book", {"at": {"name": "Noma"}, "seats": 4})]))
    assert not accepts(named, GOOD) and not accepts(named, TWO)


def test_auto_with_strict_tools_leaves_text_free_and_calls_valid(accepts) -> None:
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    auto = {"tools": [strict, BOOK]}
    for text in ("Just text, a < b, <tool and </tool_call>.", "", f"Let me look. {GOOD} Done.", TWO):
        assert accepts(auto, text), text
    assert not accepts(auto, format_tool_calls([("get_weather", {"town": "Paris"})]))
    assert not accepts(auto, format_tool_calls([("launch", {})]))
    assert accepts(auto, format_tool_calls([("book", {"anything": True})]))  # not strict: any object
    assert not accepts({**auto, "parallel_tool_calls": False}, f"{GOOD} and {GOOD}")
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [BOOK]})
    assert plan_tools(req).structured is None  # no strict tool: free generation, parsed
