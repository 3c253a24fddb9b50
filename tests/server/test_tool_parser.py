"""The tool-call parser on text as models write it (SmolLM2's list form, the Hermes single-object form, text
around calls, truncation, malformed blocks): fed in any pieces, the streamed parse adds up to the whole parse, and
no piece of a <tool_call> tag is ever content."""

from __future__ import annotations

import json
import random

import pytest

from kvprefix.prompts.tools import format_tool_calls
from kvprefix.server.tool_parser import ToolCallParser, parse_tool_calls

NAMES = {"get_weather", "add"}
# (text, content, [(name, arguments)])
CASES = [
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>',
     None, [("get_weather", '{"city": "Paris"}')]),
    ('Let me check.\n<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}},\n'
     '{"name": "add", "arguments": {"a": 2, "b": [3, {"x": "}]\\""}]}}\n]</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Oslo", "unit": "C"}'), ("add", '{"a": 2, "b": [3, {"x": "}]\\""}]}')]),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nThe sum follows.',
     "The sum follows.", [("add", '{"a": 1, "b": 2}')]),
    # Another key order streams nothing until the block ends, then parses whole.
    ('<tool_call>[{"arguments": {"a": 1, "b": 2}, "name": "add"}]</tool_call>', None, [("add", '{"a": 1, "b": 2}')]),
    # A function that is not among the tools, broken JSON, or a mention of the tag: text.
    ('<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>',
     '<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>', []),
    ('<tool_call>[{"name": get_weather}]</tool_call>', '<tool_call>[{"name": get_weather}]</tool_call>', []),
    # A block given back as text keeps the text after it as written (only a block of calls drops its whitespace).
    ('<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>\n\nNext',
     '<tool_call>[{"name": "launch", "arguments": {}}]</tool_call>\n\nNext', []),
    ("Write <tool_ like this, or <tool_call", "Write <tool_ like this, or <tool_call", []),
    ("The weather in Paris is sunny.  ", "The weather in Paris is sunny.  ", []),
    # Cut off by max_tokens: a call whose arguments began keeps them as far as they go; a bare tag is text.
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    ('Hm <tool_call>[{"name": "get_we', 'Hm <tool_call>[{"name": "get_we', []),
    ("<tool_call>[]</tool_call>", None, []),
]


def _stream(text: str, cuts: list[int], max_calls: int | None = None):
    parser = ToolCallParser(NAMES, max_calls)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[list[str]] = []
    for d in (c for delta in deltas for c in delta.tool_calls):
        if d.id is not None:
            assert d.index == len(calls) and d.name in NAMES
            calls.append([d.name, d.arguments])
        else:
            calls[d.index][1] += d.arguments
    return deltas, content, [tuple(c) for c in calls]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_whole_and_streamed_parses_agree(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    rng = random.Random(text)
    for cuts in [list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))]:
        deltas, streamed_content, streamed_calls = _stream(text, cuts)
        assert (streamed_content or None, streamed_calls) == (content, calls)
        if calls:  # nothing of a tag reaches the content, whatever the cuts
            assert all("<tool" not in d.content for d in deltas)


def test_a_name_goes_out_before_its_arguments_end() -> None:
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    parser = ToolCallParser(NAMES)
    head = parser.feed(text[:text.index("Paris")])
    assert [(d.name, d.arguments) for d in head.tool_calls] == [("get_weather", '{"city": "')]
    rest = parser.feed(text[text.index("Paris"):])
    assert [(d.id, d.arguments) for d in rest.tool_calls] == [(None, 'Paris"}')] and not rest.content


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = format_tool_calls([("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Lima"})])
    content, calls = parse_tool_calls(text, NAMES, max_calls=1)
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1, "b": 2}]
    assert _stream(text, list(range(1, len(text))), max_calls=1)[2] == [("add", '{"a": 1, "b": 2}')]


def test_what_the_renderer_writes_parses_back() -> None:
    calls = [("add", {"a": 1, "b": 2, "note": "é\n\"q\""}), ("get_weather", {"city": "Paris"})]
    content, parsed = parse_tool_calls(format_tool_calls(calls), NAMES)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
