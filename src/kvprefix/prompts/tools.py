"""Tools in a prompt: OpenAI's tool definitions, assistant tool calls and tool results.

A chat template that renders tools (it reads a ``tools`` variable) gets them as transformers passes them. One that
does not (plain ChatML, as the built-in SmolLM2-135M-Instruct and the test checkpoints have) gets them rendered
here, in the tool-calling format SmolLM2 was trained on (HuggingFaceTB's SmolLM2-Instruct model cards, "Function
calling"; the same format Ollama's smollm2 template writes): the functions as a JSON list between ``<tools>`` and
``</tools>`` in the system prompt, the model's calls as a JSON list of ``{"name", "arguments"}`` objects between
``<tool_call>`` and ``</tool_call>``, and a tool's result as a user turn between ``<tool_response>`` and
``</tool_response>``. The wording of the instructions is ours. Past calls render exactly as a constrained call is
generated (``format_tool_calls``), so the next turn of a conversation hits the prefix cache on them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOLS_START, TOOLS_END = "<tools>", "</tools>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>\n", "\n</tool_response>"
# The JSON separators of every call we write or constrain (json.dumps' defaults, as in SmolLM2's examples).
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "

_INSTRUCTIONS = (
    "You can call functions. Here they are, described as a JSON list:\n{start}{tools}{end}\n\n"
    "To call one or more of them, answer with only the list of calls, each with the function's name and its "
    "arguments, in this form:\n"
    '{call_start}[{{"name": "function_name", "arguments": {{"argument_name": "value"}}}}]{call_end}\n'
    "If no function fits the request, answer in plain text."
)


class ToolFormatError(ValueError):
    """A tool definition or tool call that cannot be rendered; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@functools.lru_cache(maxsize=32)
def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable (otherwise the tools would vanish from the prompt)."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        names = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:  # transformers' own extensions (e.g. {% generation %}): look at the text
        return "tools" in template
    return "tools" in names


def function_of(tool: Any, index: int) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool definition ({"type": "function", "function": {...}})."""
    param = f"tools[{index}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"),
                                                                                          Mapping):
        raise ToolFormatError(f"'{param}' must be an object with \"type\": \"function\" and a 'function'", param)
    function = tool["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolFormatError(f"'{param}.function.name' must be a non-empty string", f"{param}.function.name")
    return function


def tools_system_block(tools: Sequence[Any]) -> str:
    """The system-prompt text that lists ``tools`` and says how to call them."""
    functions = []
    for i, tool in enumerate(tools):
        f = function_of(tool, i)
        functions.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    return _INSTRUCTIONS.format(start=TOOLS_START, end=TOOLS_END, call_start=TOOL_CALL_START, call_end=TOOL_CALL_END,
                                tools=_dumps(functions))


def call_arguments(call: Any, param: str) -> tuple[str, Any]:
    """(name, arguments as a JSON value) of one OpenAI tool call from a message's ``tool_calls``; the arguments
    arrive as JSON text (OpenAI's form) or, from some clients, already as an object."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ToolFormatError(f"'{param}' must be an object with a 'function' that has a string 'name'", param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolFormatError(f"'{param}.function.arguments' is not JSON text: {exc}",
                                  f"{param}.function.arguments") from None
    return function["name"], arguments


def format_tool_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """``(name, arguments)`` pairs as the model writes them: ``<tool_call>[{"name": ..., "arguments": ...}]``."""
    return TOOL_CALL_START + _dumps([{"name": n, "arguments": a} for n, a in calls]) + TOOL_CALL_END


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR))


def fallback_messages(messages: Sequence[Mapping[str, Any]], block: str | None
                      ) -> tuple[list[dict[str, str]], list[tuple[int, int]]]:
    """Normalized chat messages (role, content, tool_calls, tool_call_id) as plain role/content messages in the
    fallback format, and for each input message (index in the output, offset of its content there): the tools
    ``block`` (``tools_system_block`` of the request's tools; None without tools) joins the system prompt (a system
    message of its own when there is none), past calls follow the assistant's text, and tool results become user
    turns."""
    out: list[dict[str, str]] = []
    where: list[tuple[int, int]] = []
    if block is not None and (not messages or messages[0]["role"] != "system"):
        out.append({"role": "system", "content": block})
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        offset = 0
        if i == 0 and role == "system" and block is not None:
            content = f"{content}\n\n{block}" if content else block
        elif role == "tool":
            role, content, offset = "user", TOOL_RESPONSE_START + content + TOOL_RESPONSE_END, len(TOOL_RESPONSE_START)
        elif m.get("tool_calls"):
            calls = format_tool_calls([call_arguments(c, f"messages[{i}].tool_calls[{j}]")
                                       for j, c in enumerate(m["tool_calls"])])
            content = f"{content}\n{calls}" if content else calls
        where.append((len(out), offset))
        out.append({"role": role, "content": content})
    return out, where


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages for a template that renders tools: tool calls with their arguments as objects, as
    transformers' templates read them (vLLM hands them over the same way)."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                name, arguments = call_arguments(c, f"messages[{i}].tool_calls[{j}]")
                calls.append({"id": c.get("id"), "type": "function", "function": {"name": name,
                                                                                  "arguments": arguments}})
            m["tool_calls"] = calls
        out.append(m)
    return out
