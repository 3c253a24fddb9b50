"""The default model's tool calls (SmolLM2's format, kvprefix.prompts.tools) out of generated text, as OpenAI
tool-call deltas while the text streams in, or as a message's ``tool_calls`` at the end.

A non-streamed response is the streamed parse of the whole text, so the two agree. A block is ``<tool_call>`` + a
JSON list of ``{"name": ..., "arguments": {...}}`` (or one such object, the Hermes form) + ``</tool_call>``. Names
go out once complete, arguments as they arrive; no part of a tag is ever sent as content. A block of another shape
is parsed whole when it ends, and is content unless it is a list of calls to known tools.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field

from kvprefix.prompts.tools import TOOL_CALL_END, TOOL_CALL_START

_MAX_HEADER_CHARS = 256  # '{"name": "<at most 64 characters>", "arguments": ' with room for odd whitespace
_WS = " \t\r\n"


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its id and name in the first piece, then arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        for d in other.tool_calls:
            if d.id is None:
                self.add_arguments(d.index, d.arguments)
            else:
                self.tool_calls.append(d)

    def add_arguments(self, index: int, text: str) -> None:
        if self.tool_calls and self.tool_calls[-1].index == index:
            self.tool_calls[-1].arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index, arguments=text))


class ToolCallParser:
    """Feeds on text deltas of one sample. ``names``: the tools that may be called; ``max_calls``: the calls kept
    (1 under parallel_tool_calls false; later ones are dropped)."""

    def __init__(self, names: Collection[str], max_calls: int | None = None):
        self.names = frozenset(names)
        self.max_calls = max_calls
        self.num_calls = 0
        self._state = "text"
        self._buf = ""  # text not yet handled
        self._block = ""  # the current block's text since its tag, kept while none of its calls went out
        self._calls_in_block = 0
        self._held = ""  # trailing whitespace of content, sent only if more text (not a block) follows
        self._block_ws = ""  # the whitespace before the current block: content again if the block is text
        self._after_block = False  # drop the whitespace that follows a block
        self._list = False  # the block is a list of calls (else one object)
        self._depth, self._in_string, self._escape = 0, False, False  # where the arguments' JSON is
        self._emit = True  # the current call goes out (False for calls past max_calls)
        self._scanned = 0  # in a block parsed whole: how much of the buffer holds no end tag

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """The rest, once the sample ended: a partial tag, or a block that ended before any call in it went out,
        is text; an unfinished block whose calls went out ends with them."""
        out = ParsedDelta()
        if self._state == "text":
            self._content(out, self._buf, final=True)
        elif self._state == "fallback":
            self._fallback(out, self._block + self._buf, closed=False)
        elif self._calls_in_block == 0:
            self._content(out, self._block_ws + TOOL_CALL_START + self._block + self._buf, final=True)
        self._buf, self._state = "", "done"
        return out

    def _step(self, out: ParsedDelta) -> bool:
        """Handles what it can of the buffer; False when it needs more text."""
        state, buf = self._state, self._buf
        if state == "text":
            i = buf.find(TOOL_CALL_START)
            if i >= 0:
                self._content(out, buf[:i], block_follows=True)
                self._state, self._buf, self._list = "open", buf[i + len(TOOL_CALL_START):], False
                return True
            keep = len(buf) - _partial_suffix(buf, TOOL_CALL_START)
            self._content(out, buf[:keep])
            self._buf = buf[keep:]
            return False
        if state == "fallback":
            i = buf.find(TOOL_CALL_END, self._scanned)
            if i < 0:  # next time, look only where the tag can still begin
                self._scanned = max(0, len(buf) - len(TOOL_CALL_END) + 1)
                return False
            self._scanned = 0
            parsed = self._fallback(out, self._block + buf[:i], closed=True)
            self._end_block(buf[i + len(TOOL_CALL_END):], after_calls=parsed)
            return True
        if state == "header":
            return self._header(out, buf)
        if state == "arguments":
            return self._arguments(out, buf)
        return self._punctuation()

    def _punctuation(self) -> bool:
        """Between the parts of a block: '[' or '{' opens it, '{' begins a call, '}' ends one, ',' or ']' follow,
        then the end tag."""
        rest = self._buf.lstrip(_WS)
        self._record(self._buf[:len(self._buf) - len(rest)])
        self._buf = rest
        if not rest:
            return False
        state, ch = self._state, rest[0]
        if state == "end_tag":
            if rest.startswith(TOOL_CALL_END):
                self._end_block(rest[len(TOOL_CALL_END):])
                return True
            return False if TOOL_CALL_END.startswith(rest) else self._deviate()
        if state == "after_call" and not self._list:
            self._state = "end_tag"
        elif state in ("open", "next") and ch == "{":
            self._state = "header"
        elif state == "open" and ch == "[":
            self._record(ch)
            self._state, self._list, self._buf = "next", True, rest[1:]
        elif state in ("open", "next"):
            return self._not_calls()
        elif (state, ch) == ("after_args", "}"):
            self._state, self._buf = "after_call", rest[1:]
        elif state == "after_call" and ch in ",]":
            self._state, self._buf = "next" if ch == "," else "end_tag", rest[1:]
        else:
            return self._deviate()
        return True

    def _header(self, out: ParsedDelta, buf: str) -> bool:
        status, name, end = _parse_header(buf)
        if status == "more" and len(buf) <= _MAX_HEADER_CHARS:
            return False
        if status != "ok" or name not in self.names:
            return self._not_calls()
        self._emit = self.max_calls is None or self.num_calls < self.max_calls
        if self._emit:
            out.tool_calls.append(ToolCallDelta(self.num_calls, _call_id(), name))
            self.num_calls += 1
        self._calls_in_block += 1
        self._state, self._buf = "arguments", buf[end:]
        self._depth, self._in_string, self._escape = 0, False, False
        return True

    def _arguments(self, out: ParsedDelta, buf: str) -> bool:
        end = None
        for i, ch in enumerate(buf):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece, self._buf = (buf, "") if end is None else (buf[:end], buf[end:])
        if self._emit and piece:
            out.add_arguments(self.num_calls - 1, piece)
        if end is None:
            return False
        self._state = "after_args"
        return True

    def _record(self, text: str) -> None:
        if self._calls_in_block == 0:
            self._block += text

    def _not_calls(self) -> bool:
        """Not the streamed shape: before any call of the block went out, the block is parsed whole when it ends;
        after, the block ends here."""
        if self._calls_in_block == 0:
            self._state = "fallback"
            return True
        return self._deviate()

    def _deviate(self) -> bool:
        """Text that breaks the block's shape after a call went out: the block ends there, the rest is text."""
        self._state, self._block, self._calls_in_block, self._after_block = "text", "", 0, False
        return True

    def _end_block(self, rest: str, after_calls: bool = True) -> None:
        """After a block of calls the whitespace that follows is dropped; after one given back as text, kept."""
        self._state, self._buf, self._block, self._calls_in_block = "text", rest, "", 0
        self._after_block = after_calls

    def _fallback(self, out: ParsedDelta, inner: str, closed: bool) -> bool:
        """A whole block that did not stream as calls: its calls if it parses as calls to known tools, else text.
        True when it gave calls."""
        calls = _whole_block_calls(inner, self.names)
        if calls is None:
            self._content(out, self._block_ws + TOOL_CALL_START + inner + (TOOL_CALL_END if closed else ""),
                          final=not closed)
            return False
        for name, arguments in calls:
            if self.max_calls is None or self.num_calls < self.max_calls:
                out.tool_calls.append(ToolCallDelta(self.num_calls, _call_id(), name, arguments))
                self.num_calls += 1
        return True

    def _content(self, out: ParsedDelta, text: str, block_follows: bool = False, final: bool = False) -> None:
        if block_follows:
            self._block_ws = ""
        if self._after_block:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_block = False
        text = self._held + text
        if block_follows:
            kept = text.rstrip(_WS)
            self._held, self._block_ws, text = "", text[len(kept):], kept
        elif final:
            self._held = ""
        else:
            kept = text.rstrip(_WS)
            self._held, text = text[len(kept):], kept
        out.content += text


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


_HEADER = ("{", None, '"name"', None, ":", None, "NAME", None, ",", None, '"arguments"', None, ":", None)


def _parse_header(buf: str) -> tuple[str, str | None, int]:
    """('ok', name, where the arguments begin) for '{"name": "...", "arguments": {'; 'more' while that may still
    come; 'fail' when it cannot."""
    pos, name = 0, None
    for piece in _HEADER:
        if piece is None:  # optional whitespace
            while pos < len(buf) and buf[pos] in _WS:
                pos += 1
            if pos == len(buf):
                return "more", None, 0
        elif piece == "NAME":
            if buf[pos] != '"':
                return "fail", None, 0
            end = pos + 1
            while end < len(buf) and buf[end] != '"':
                end += 2 if buf[end] == "\\" else 1
            if end >= len(buf):
                return "more", None, 0
            try:
                name = json.loads(buf[pos:end + 1])
            except json.JSONDecodeError:
                return "fail", None, 0
            pos = end + 1
        else:
            got = buf[pos:pos + len(piece)]
            if got != piece:
                return ("more" if piece.startswith(got) and pos + len(got) == len(buf) else "fail"), None, 0
            pos += len(piece)
    if pos == len(buf):
        return "more", None, 0
    return ("ok", name, pos) if buf[pos] == "{" else ("fail", None, 0)


def _whole_block_calls(inner: str, names: frozenset[str]) -> list[tuple[str, str]] | None:
    try:
        value = json.loads(inner)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names and isinstance(item.get("arguments"), dict)):
            return None
        calls.append((item["name"], json.dumps(item["arguments"], ensure_ascii=False)))
    return calls


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, names: Collection[str], max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """(content, OpenAI tool_calls) of a whole generated text: the streamed parse, joined."""
    parser = ToolCallParser(names, max_calls)
    whole = parser.feed(text)
    whole.extend(parser.finish())
    calls = [{"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
             for d in whole.tool_calls]
    return whole.content or None, calls
