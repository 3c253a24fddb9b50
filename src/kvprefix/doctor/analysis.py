"""The doctor's passes, in order: observe (read, render, hash, compare), fix (render with each fix), attribute
(replay every rendering through the planner and credit each cause)."""

from __future__ import annotations

import gc
from collections.abc import Callable

from kvprefix.doctor.attribute import attribute
from kvprefix.doctor.diagnosis import Diagnosis, Options
from kvprefix.doctor.fixing import fix
from kvprefix.doctor.observe import observe
from kvprefix.doctor.rendering import Renderer
from kvprefix.doctor.source import Log, log_format
from kvprefix.logs import BODIES, LogError, iter_entries
from kvprefix.tokenizer import Tokenizer

DEFAULT_BLOCK_SIZE = 16


def diagnose(path: str, load_tokenizer: Callable[[], Tokenizer], options: Options | None = None) -> Diagnosis:
    # Without the cyclic collector: the doctor's data holds no cycle, and collections would walk the token lists in
    # flight (docs/doctor.md). Process-wide: one diagnosis at a time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        options = options or Options()
        log = open_log(path, load_tokenizer, options)
        obs = observe(log)
        fixed = fix(log, obs)
        return attribute(path, obs, fixed, options.capacity_tokens)
    finally:
        if collecting:
            gc.enable()


def open_log(path: str, load_tokenizer: Callable[[], Tokenizer], options: Options) -> Log:
    """The log, at the block size asked (default: 16 for bodies, the request log's own)."""
    fmt = log_format(path)
    bs = options.block_size or (DEFAULT_BLOCK_SIZE if fmt == BODIES else _logged_block_size(path, fmt))
    if options.capacity_tokens is not None and options.capacity_tokens < bs:
        raise ValueError(f"--capacity {options.capacity_tokens} is smaller than one {bs}-token block")
    return Log(path, fmt, bs, Renderer(load_tokenizer, path), options.progress, options.progress_every_s)


def _logged_block_size(path: str, fmt: str) -> int:
    for entry in iter_entries(path, fmt):
        return entry.source_block_size or DEFAULT_BLOCK_SIZE
    raise LogError(path, None, "the log is empty")
