"""Tools in prompts: the SmolLM2-format fallback for templates that do not render tools, tool calls and tool
results in the history, a template's own tools rendering, and the same text from every renderer."""

from __future__ import annotations

import json

import pytest
from support.tokenizer_files import tokenizer_dir

from kvprefix.prompts import PromptError, render_bodies, render_body, render_chat
from kvprefix.prompts.tools import format_tool_calls, template_renders_tools
from kvprefix.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path: str) -> Tokenizer:
    return Tokenizer(tiny_llama_path)


def test_chatml_gets_the_tools_block_calls_and_results_in_smollm2_format(tokenizer: Tokenizer) -> None:
    assert not template_renders_tools(tokenizer.chat_template)
    r = render_chat(tokenizer, HISTORY, tools=[WEATHER])
    system = r.text[:r.text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\n")
    listed = system[system.index("<tools>") + len("<tools>"):system.index("</tools>")]
    assert json.loads(listed) == [WEATHER["function"]]
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
            '</tool_call><|im_end|>') in r.text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in r.text
    assert r.text.endswith("<|im_start|>assistant\n")
    # Spans are per request message (the inserted system message has none) and cover that message's own text.
    assert len(r.message_spans) == 3
    assert r.text[slice(*r.message_spans[0])] == "Weather in Paris?"
    assert r.message_spans[1] is None and r.text[slice(*r.message_spans[2])] == "18 C, sunny"
    assert r.token_ids == tokenizer.encode(r.text, add_special_tokens=False)


def test_the_tools_block_joins_an_existing_system_prompt(tokenizer: Tokenizer) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = render_chat(tokenizer, messages, tools=[WEATHER])
    assert r.text.startswith("<|im_start|>system\nBe brief.\n\n") and r.text.count("<|im_start|>system") == 1
    assert r.text[slice(*r.message_spans[0])] == "Be brief."
    assert render_chat(tokenizer, messages).text.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_a_past_call_renders_as_a_constrained_call_is_written(tokenizer: Tokenizer) -> None:
    # What the required/named grammar generates is this text: the history of the next turn repeats it exactly.
    assert format_tool_calls([("f", {"a": 1, "b": "é"}), ("g", {})]) == (
        '<tool_call>[{"name": "f", "arguments": {"a": 1, "b": "é"}}, {"name": "g", "arguments": {}}]</tool_call>')


def test_every_renderer_renders_tools_the_same(tokenizer: Tokenizer, tiny_llama_path: str) -> None:
    from kvprefix import LLM, SamplingParams

    body = {"messages": HISTORY, "tools": [WEATHER]}
    (one,) = render_body(tokenizer, body)
    assert one == render_chat(tokenizer, HISTORY, tools=[WEATHER])
    batched = render_bodies(tokenizer, [body, {"messages": HISTORY[:1], "tools": [WEATHER]}, {"messages": HISTORY}])
    assert batched[0] == [one]
    assert batched[1] == render_body(tokenizer, {"messages": HISTORY[:1], "tools": [WEATHER]})
    assert batched[2] == render_body(tokenizer, {"messages": HISTORY})
    llm = LLM(tiny_llama_path, num_gpu_blocks=64)
    (out,) = llm.chat(HISTORY, SamplingParams(max_tokens=1), tools=[WEATHER])
    assert out.prompt == one.text and out.prompt_token_ids == one.token_ids


def test_a_template_that_renders_tools_gets_them_as_they_are(tmp_path, tiny_llama_path: str) -> None:
    tokenizer_dir(
        tmp_path, tiny_llama_path,
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = Tokenizer(str(tmp_path))
    assert template_renders_tools(tok.chat_template)
    r = render_chat(tok, HISTORY, tools=[WEATHER])
    # The template's own rendering: arguments arrive as an object, the tool turn keeps its role.
    assert r.text.startswith("TOOLS:get_weather;<|im_start|>user\n")
    assert "CALL get_weather(Paris)" in r.text and "<|im_start|>tool\n18 C, sunny" in r.text
    assert "<tools>" not in r.text


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tools_and_calls_name_the_field(tokenizer: Tokenizer, body: dict, param: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(PromptError) as e:
        render_body(tokenizer, body)
    assert e.value.param == param
