"""Opt-in JSONL request log: one line per prompt, the format the planner and the doctor read (docs/request-log.md).

It records what a replay needs (arrival time, tenant pseudonym, prompt length, the prompt's block hashes as the
cache keys them, cached and output tokens, timings) and no prompt text unless the operator asks for it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

FORMAT_VERSION = 1


@dataclass
class RequestRecord:
    timestamp: float  # arrival, Unix epoch seconds
    request_id: str
    endpoint: str  # "completions" or "chat"
    model: str
    tenant: str  # pseudonym (tenancy.pseudonym)
    prompt_tokens: int
    block_size: int
    hash_algo: str
    block_hashes: list[str]  # hex, full prompt blocks only, parent-chained, salted as the cache keys them
    cached_tokens: int
    output_tokens: int  # sum over the n choices
    n: int
    finish_reasons: list[str]
    timings: dict[str, float | None]  # seconds: ttft_s (None if no token came), e2e_s
    status: str  # "ok" or "aborted" (client went away or server shut down)
    salted: bool  # True when a tenant or cache_salt salted the hashes (they then match no unsalted hash)
    prompt_cache_key: str | None = None
    user: str | None = None  # hashed like the tenant
    prompt: str | None = None  # raw text, only with --request-log-prompts
    v: int = field(default=FORMAT_VERSION)


class RequestLog:
    """Appends records as JSON lines, flushed per line so the file can be tailed or read while serving."""

    def __init__(self, path: str, include_prompts: bool = False):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.include_prompts = include_prompts
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: RequestRecord) -> None:
        if self._file is None:
            return
        if not self.include_prompts:
            record.prompt = None
        self._file.write(json.dumps(asdict(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
