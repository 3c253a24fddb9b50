"""The one reader of the planner's and doctor's logs, as ``LogEntry``s: JSONL of OpenAI request bodies, and
kvprefix's request log. Errors are ``LogError`` (file and line). A body's namespace is derived as the server derives
it; a request log names it by its public id. Requests share blocks only within one ``namespace``."""

from __future__ import annotations

import json
import marshal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvprefix.cache import namespace_salt
from kvprefix.logs.request_log import RequestRecord, iter_records
from kvprefix.logs.rows import BODIES, LogError, iter_rows
from kvprefix.prompts import PromptError, completion_prompts


@dataclass
class LogEntry:
    """One prompt of the log. ``body`` (an OpenAI body with one prompt) or ``text`` (rendered text from a request
    log written with prompts) is what can be rendered again; a hashes-only record has neither."""

    line: int
    timestamp: float | None  # seconds; None when the log gives no times
    namespace: str  # bodies: the namespace salt (tenant + cache_salt); request log: the public namespace id
    replica: str
    prefill_s: float | None  # how long the prompt took to compute, when the log says (ttft)
    body: dict[str, Any] | None = None
    text: str | None = None
    message_spans: list | None = None
    add_special_tokens: bool = False  # text: completions prompts are tokenized with BOS, chat text is not
    block_hashes: list[str] | None = None  # request log: the logged hashes (at ``source_block_size``)
    source_block_size: int | None = None
    prompt_tokens: int = 0
    miss_reason: str | None = None
    model: str = ""  # the model (or adapter) the request named
    record: RequestRecord | None = None  # request log: the whole record


class SharedTools:
    """Equal tools lists read as one shared list with its JSON (logs repeat a few lists; the doctor needs their JSON
    often). Up to ``limit`` lists and ``limit_chars`` characters of JSON; never mutated (a fix makes a new list)."""

    def __init__(self, limit: int = 4096, limit_chars: int = 1 << 23) -> None:
        self.limit = limit
        self.limit_chars = limit_chars
        self._chars = 0
        self._by_bytes: dict[bytes, list] = {}
        self._json_of: dict[int, str] = {}  # by id: every list here is held by _by_bytes, so its id stays its own

    def share(self, tools: list) -> list:
        # marshal's bytes tell JSON values apart as JSON does (key order, 1 / 1.0 / true), cheaper than dumps;
        # version 2 writes no back-references, so equal lists give equal bytes.
        key = marshal.dumps(tools, 2)
        known = self._by_bytes.get(key)
        if known is None and len(self._by_bytes) < self.limit and self._chars < self.limit_chars:
            known = self._by_bytes[key] = tools
            text = self._json_of[id(tools)] = json.dumps(tools)
            self._chars += len(text)
        return tools if known is None else known

    def json(self, tools: list) -> str:
        """``json.dumps(tools)``; looked up for a shared list."""
        text = self._json_of.get(id(tools))
        return json.dumps(tools) if text is None else text


def iter_entries(path: str | Path, fmt: str, tools: SharedTools | None = None) -> Iterator[LogEntry]:
    """The entries of a log of format ``fmt`` (``BODIES`` or ``REQUEST_LOG``, as ``detect_format`` names them).
    ``tools``: where bodies' tools lists are shared (a fresh one per call otherwise)."""
    return iter_bodies(path, tools or SharedTools()) if fmt == BODIES else iter_request_log(path)


def iter_bodies(path: str | Path, tools: SharedTools) -> Iterator[LogEntry]:
    """One entry per prompt: a batch of completions prompts is one request per prompt, as the server runs it."""
    for line, row in iter_rows(path):
        yield from _body_entries(path, line, row, tools)


def _body_entries(path, line: int, row: dict[str, Any], tools: SharedTools) -> Iterator[LogEntry]:
    ts = row.get("timestamp")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0):
        raise LogError(path, line, f"field 'timestamp' must be a number of milliseconds >= 0, got {ts!r}")
    for key in ("tenant", "cache_salt", "replica", "model"):
        if row.get(key) is not None and not isinstance(row[key], str):
            raise LogError(path, line, f"field {key!r} must be a string, got {row[key]!r}")
    common = dict(line=line, timestamp=None if ts is None else ts / 1000.0,
                  namespace=namespace_salt(row.get("tenant"), row.get("cache_salt")),
                  replica=row.get("replica") or "", prefill_s=None, model=row.get("model") or "")
    if "messages" in row:
        if not isinstance(row["messages"], list) or not row["messages"]:
            raise LogError(path, line, "'messages' must be a non-empty list")
        if row.get("tools") is not None:
            if not isinstance(row["tools"], list):
                raise LogError(path, line, "'tools' must be a list")
            row["tools"] = tools.share(row["tools"])
        yield LogEntry(body=row, **common)
        return
    if "prompt" not in row:
        raise LogError(path, line, "a request body needs 'messages' (chat) or 'prompt' (completions)")
    try:
        prompts = completion_prompts(row["prompt"])
    except PromptError as exc:
        raise LogError(path, line, str(exc)) from None
    for prompt in prompts:
        yield LogEntry(body={**row, "prompt": prompt}, **common)


def iter_request_log(path: str | Path, torn: list[int] | None = None, default_block_size: int | None = None,
                     block_size_hint: str = "") -> Iterator[LogEntry]:
    """The records of a request log, each checked for its block size (else ``default_block_size``; the error ends
    with ``block_size_hint``) and one hash per full block. Torn lines are skipped (numbers appended to ``torn``)."""
    for line, rec in iter_records(path, torn):
        block_size = rec.block_size or default_block_size
        if block_size is None:
            raise LogError(path, line, f"missing field 'block_size'{block_size_hint}")
        if len(rec.block_hashes) != rec.prompt_tokens // block_size:
            raise LogError(path, line, f"{len(rec.block_hashes)} block_hashes for {rec.prompt_tokens} prompt "
                                       f"tokens, but {block_size}-token blocks give {rec.prompt_tokens // block_size}")
        ttft = rec.timings.get("ttft_s") if isinstance(rec.timings, dict) else None
        if not isinstance(ttft, (int, float)):
            ttft = None if rec.finish_time is None else max(0.0, rec.finish_time - rec.timestamp)
        yield LogEntry(
            line=line, timestamp=float(rec.timestamp), namespace=rec.namespace, replica=rec.replica,
            prefill_s=ttft, text=rec.prompt, message_spans=rec.message_spans,
            add_special_tokens=rec.endpoint != "chat", block_hashes=rec.block_hashes, source_block_size=block_size,
            prompt_tokens=rec.prompt_tokens, miss_reason=rec.miss_reason, model=rec.model, record=rec)
