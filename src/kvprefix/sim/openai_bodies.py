"""OpenAI request bodies in JSONL (completions or chat), rendered and tokenized with a local Hugging Face
tokenizer, then hashed with the cache's own ``BlockHasher``.

Optional per-line fields: ``timestamp`` (ms since trace start, as in Mooncake rows; default 0) and
``cache_salt`` (a tenant salt, as the server applies it). Output length is ``max_completion_tokens`` or
``max_tokens``, else ``default_output_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from kvprefix.cache import BlockHasher, ExecutionContext, cdiv
from kvprefix.sim.trace import TimestampCheck, Trace, TraceError, TraceRequest, iter_rows, require


def load_tokenizer(name_or_path: str):
    """A Hugging Face tokenizer from a local directory (no download)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load tokenizer {name_or_path!r}: {e}") from None


def _prompt_token_ids(row: dict, tokenizer, path: str | Path, line: int) -> list[int]:
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise TraceError(path, line, "field 'messages' must be a non-empty list")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # template errors come in many types (jinja, ValueError, KeyError)
            raise TraceError(path, line, f"cannot render messages with the chat template: {e}") from None
        # The template already wrote any BOS; adding special tokens again would change every hash.
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    if "prompt" in row:
        prompt = row["prompt"]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and prompt:
            return tokenizer(prompt)["input_ids"]
        raise TraceError(path, line, "field 'prompt' must be a non-empty string or list of token ids (one per line)")
    raise TraceError(path, line, "a request body needs 'messages' (chat) or 'prompt' (completions)")


def read_openai_bodies(
    path: str | Path, tokenizer_path: str, block_size: int, default_output_tokens: int = 256
) -> Trace:
    tokenizer = load_tokenizer(tokenizer_path)
    base = BlockHasher(block_size, context=ExecutionContext(tokenizer=str(tokenizer_path)))
    check_time = TimestampCheck(path)
    requests = []
    for line, row in iter_rows(path):
        ts = require(row, "timestamp", path, line, (int, float)) if "timestamp" in row else 0
        check_time(ts, line)
        token_ids = _prompt_token_ids(row, tokenizer, path, line)
        if not token_ids:
            raise TraceError(path, line, "the prompt renders to zero tokens")
        out = default_output_tokens
        for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
            if row.get(key) is not None:
                out = require(row, key, path, line, minimum=1)
        salt = row.get("cache_salt") or ""
        hasher = base.with_salt(salt)
        requests.append(
            TraceRequest(
                timestamp=ts / 1000.0,
                input_length=len(token_ids),
                output_length=out,
                block_hashes=hasher.hash_blocks(token_ids),
                num_blocks=cdiv(len(token_ids), block_size),
                session=row.get("user"),
                extra={k: row[k] for k in ("model", "user") if k in row},
            )
        )
    return Trace(Path(path).name, block_size, requests)
