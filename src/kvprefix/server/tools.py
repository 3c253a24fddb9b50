"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request: which calls are parsed from the output
(tool_parser), and under ``"required"`` or a named function the grammar that makes the output a valid block of calls
(as vLLM does with guided decoding). Under ``"auto"`` with ``strict`` tools, text stays free and every block of
calls in it is held to the grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvprefix.engine.sampling_params import StructuredOutputsParams
from kvprefix.engine.structured import grammar_for
from kvprefix.http.errors import bad_request
from kvprefix.prompts.tools import ITEM_SEPARATOR, KEY_SEPARATOR, TOOL_CALL_END, TOOL_CALL_START
from kvprefix.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from kvprefix.server.tool_parser import ToolCallParser

# The tool definitions as JSON: the required/named grammar holds every schema, and must stay under
# engine.structured's MAX_SPEC_CHARS with its own text (about 250 characters per function) added.
MAX_TOOLS_CHARS = 32768
# The arguments as kvprefix.prompts.tools writes them: no free whitespace, json.dumps' separators.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ITEM_SEPARATOR, "key_separator": KEY_SEPARATOR}


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output is read: calls to ``names`` are parsed (at most ``max_calls``), and
    ``structured`` (under required or a named function) constrains the output to calls."""

    names: frozenset[str]
    max_calls: int | None
    structured: StructuredOutputsParams | None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.names, self.max_calls)


def plan_tools(req: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools or tool_choice "none"); a 400 naming the field for what the engine
    cannot honour. Compiles the grammar: run it off the event loop."""
    choice, tools = req.tool_choice, req.tools
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    size = len(json.dumps([t.model_dump(exclude_none=True) for t in tools]))
    if size > MAX_TOOLS_CHARS:
        raise bad_request(f"'tools' is {size} characters as JSON; at most {MAX_TOOLS_CHARS} are accepted",
                          param="tools")
    names = [t.function.name for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise bad_request(f"'tools' names the function {twice!r} twice", param="tools")
    for i, t in enumerate(tools):
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(f"'tools[{i}].function.parameters' must describe an object (type 'object'), got "
                              f"{kind!r}", param=f"tools[{i}].function.parameters")
    if choice == "none":
        return None
    max_calls = None if req.parallel_tool_calls else 1
    auto = choice in (None, "auto")
    if auto and not any(t.function.strict for t in tools):
        return ToolPlan(frozenset(names), max_calls, None)  # free generation, parsed
    if auto:  # strict tools: text stays free, every call in it is a valid one
        called = list(enumerate(tools))
    elif isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise bad_request(f"'tool_choice.function.name' {name!r} is not among the functions in 'tools' "
                              f"({', '.join(names)})", param="tool_choice.function.name")
        called = [(names.index(name), tools[names.index(name)])]
        max_calls = 1  # a named function is called once, as in OpenAI's and vLLM's API
    else:  # "required"
        called = list(enumerate(tools))
    grammar = _call_grammar(called, parallel=max_calls is None, free_text=auto)
    try:
        grammar_for(grammar)
    except ValueError as exc:
        for i, t in called:  # name the function whose schema does not compile, where one alone does not
            try:
                grammar_for(StructuredOutputsParams(json=_arguments_schema(t)))
            except ValueError as one:
                raise bad_request(f"invalid 'tools[{i}].function.parameters': {one}",
                                  param=f"tools[{i}].function.parameters") from None
        raise bad_request(f"'tools' cannot be compiled into a grammar: {exc}", param="tools") from None
    return ToolPlan(frozenset(t.function.name for _, t in called), max_calls, grammar)


def _arguments_schema(tool: ToolDefinition) -> dict:
    schema = dict(tool.function.parameters or {})
    schema.setdefault("type", "object")
    return schema


# Text with no <tool_call> in it (llguidance's lexemes take & and ~): so a call cannot slip by as text.
_FREE_TEXT = ["TEXT: /(.|\\n)*/ & ~/(.|\\n)*" + TOOL_CALL_START + "(.|\\n)*/",
              f"trig[lazy]: TEXT {json.dumps(TOOL_CALL_START)}"]


def _call_grammar(tools: list[tuple[int, ToolDefinition]], parallel: bool, free_text: bool
                  ) -> StructuredOutputsParams:
    """A Lark grammar (llguidance's dialect): one block of calls, or with ``free_text`` any text with blocks of
    calls in it (tool_choice auto with strict tools; a tool that is not strict takes any object there). Each
    function's arguments are a %json of their own, so that a schema's "$ref"s stay relative to that schema."""
    rules = []
    for i, tool in tools:
        head = "{" + json.dumps("name") + KEY_SEPARATOR + json.dumps(tool.function.name) + ITEM_SEPARATOR + \
            json.dumps("arguments") + KEY_SEPARATOR
        schema = _arguments_schema(tool) if tool.function.strict or not free_text else {"type": "object"}
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} " + json.dumps("}"))
        rules.append(f"args_{i}: %json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}))
    more = f" ({json.dumps(ITEM_SEPARATOR)} call)*" if parallel else ""
    block = f"{json.dumps('[')} call{more} {json.dumps(']' + TOOL_CALL_END)}"
    if free_text:
        head = [f"start: (trig block){'*' if parallel else '?'} TEXT", *_FREE_TEXT, f"block: {block}"]
    else:
        head = [f"start: {json.dumps(TOOL_CALL_START)} {block}"]
    call = "call: " + " | ".join(f"call_{i}" for i, _ in tools)
    return StructuredOutputsParams(grammar="\n".join([*head, call, *rules]) + "\n")
