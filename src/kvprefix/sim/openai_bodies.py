"""OpenAI request bodies in JSONL (completions or chat), rendered by ``kvprefix.prompts`` exactly as the server
renders them, then hashed with the cache's own ``BlockHasher`` under the checkpoint's identity.

Optional per-line fields: ``timestamp`` (ms since trace start, as in Mooncake rows; default 0), ``cache_salt``
(a client salt, namespaced as the server and ``LLM`` do) and ``user`` (the routing session). Output length is
``max_completion_tokens`` or ``max_tokens``, else ``default_output_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from kvprefix.cache import BlockHasher, cdiv, context_for_checkpoint
from kvprefix.prompts import PromptError, render_body
from kvprefix.sim.trace import TimestampCheck, Trace, TraceError, TraceRequest, iter_rows, require
from kvprefix.tokenizer import Tokenizer

# The KV dtype only salts the root: hashes within one replay share it, whichever it is. float32 is the CPU default
# where bfloat16 is not native, so a replay of bodies hashes like such a server (or one run with --dtype float32).
DEFAULT_KV_DTYPE = "float32"


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a local checkpoint or tokenizer directory (no download)."""
    try:
        return Tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load tokenizer {path!r}: {e}") from None


def read_openai_bodies(
    path: str | Path, tokenizer_path: str, block_size: int, default_output_tokens: int = 256
) -> Trace:
    tokenizer = load_tokenizer(tokenizer_path)
    context = context_for_checkpoint(tokenizer_path, DEFAULT_KV_DTYPE, tokenizer.chat_template)
    base = BlockHasher(block_size, context=context)
    check_time = TimestampCheck(path)
    requests = []
    for line, row in iter_rows(path):
        ts = require(row, "timestamp", path, line, (int, float)) if "timestamp" in row else 0
        check_time(ts, line)
        try:
            prompts = render_body(tokenizer, row)
        except PromptError as e:
            raise TraceError(path, line, str(e)) from None
        out = default_output_tokens
        for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
            if row.get(key) is not None:
                out = require(row, key, path, line, minimum=1)
        hasher = base.for_namespace(None, row.get("cache_salt"))
        for prompt in prompts:
            if not prompt.token_ids:
                raise TraceError(path, line, "the prompt renders to zero tokens")
            requests.append(
                TraceRequest(
                    timestamp=ts / 1000.0,
                    input_length=len(prompt.token_ids),
                    output_length=out,
                    block_hashes=hasher.hash_blocks(prompt.token_ids),
                    num_blocks=cdiv(len(prompt.token_ids), block_size),
                    session=row.get("user"),
                    extra={k: row[k] for k in ("model", "user") if k in row},
                )
            )
    return Trace(Path(path).name, block_size, requests)
