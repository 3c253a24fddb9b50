"""OpenAI request bodies in JSONL (completions or chat), rendered by ``kvprefix.prompts.render_body`` exactly as the
server renders them, then hashed with the cache's own ``BlockHasher`` under a ``BlockIdentity``: a replica's (from
its ``/v1/models`` entry) or the checkpoint's own.

Optional per-line fields beside the body: ``timestamp`` (ms since trace start, as in Mooncake rows; default 0),
``tenant`` (the authenticated tenant the request was sent as: the server salts the namespace by it, never by a body
field, and refuses a body with one), ``cache_salt`` and ``user`` (the routing session). A ``model`` other than the
first request's names a LoRA adapter, hashed apart from the base model (``logs.adapters``). Output length is
``max_completion_tokens`` or ``max_tokens``, else ``default_output_tokens``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from kvprefix.cache import BlockIdentity, block_identity, cdiv
from kvprefix.logs import AdapterNames, SharedTools, adapter_extras, iter_bodies
from kvprefix.prompts import PromptError, render_body
from kvprefix.sim.trace import TimestampCheck, Trace, TraceError, TraceRequest, require
from kvprefix.tokenizer import Tokenizer
from kvprefix.tokenizer.chat_template import ChatTemplate

# The KV dtype only salts the root: hashes within one replay share it, whichever it is. float32 is the CPU default
# where bfloat16 is not native, so a replay of bodies hashes like such a server (or one run with --dtype float32).
DEFAULT_KV_DTYPE = "float32"


@dataclass(frozen=True)
class ReplicaModel:
    """What a reader of bodies needs of the replicas: the identity of their blocks and their context length
    (``truncate_prompt_tokens`` -1; None where unknown)."""

    identity: BlockIdentity
    max_model_len: int | None = None


def read_replica_model(source: str) -> ReplicaModel:
    """A replica's identity from ``source``: its base URL (``GET /v1/models``), or a JSON file holding that
    listing, one model entry of it, or a ``BlockIdentity.to_dict``."""
    if source.startswith(("http://", "https://")):
        import httpx

        try:
            data = httpx.get(source.rstrip("/") + "/v1/models", timeout=10).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ValueError(f"cannot read {source}/v1/models: {exc}") from None
    else:
        try:
            data = json.loads(Path(source).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the identity file {source}: {exc}") from None
    entry = data["data"][0] if isinstance(data, dict) and isinstance(data.get("data"), list) and data["data"] else data
    if isinstance(entry, dict) and isinstance(entry.get("kvprefix"), dict):
        max_model_len = entry.get("max_model_len")
        return ReplicaModel(BlockIdentity.from_dict(entry["kvprefix"].get("block_identity")),
                            max_model_len if isinstance(max_model_len, int) else None)
    return ReplicaModel(BlockIdentity.from_dict(entry))


def replica_model_for(path: str, tokenizer: Tokenizer, block_size: int, hash_algo: str = "sha256",
                      replica: ReplicaModel | None = None) -> ReplicaModel:
    """``replica`` at ``block_size`` after checking that ``path`` (the tokenizer's checkpoint) is its checkpoint
    and ``tokenizer`` renders with its chat template; without one, the identity of ``path`` itself (with the
    tokenizer's template) in ``DEFAULT_KV_DTYPE`` with ``hash_algo``."""
    template, content_format = tokenizer.chat_template, tokenizer.content_format()
    if replica is None:
        return ReplicaModel(block_identity(path, DEFAULT_KV_DTYPE, None, template, content_format=content_format,
                                           block_size=block_size, hash_algo=hash_algo))
    identity = replica.identity
    differs = identity.checkpoint_differences(path)
    if differs:
        raise ValueError(f"{path} is not the checkpoint of the given identity: {'; '.join(differs)}")
    differs = identity.template_difference(template, content_format)
    if differs:
        raise ValueError(f"the replica renders with another chat template than the one given here ({differs[0]}): "
                         "give its --chat-template and --chat-template-content-format")
    return replace(replica, identity=replace(identity, block_size=block_size))


def load_tokenizer(path: str, chat_template: ChatTemplate | None = None) -> Tokenizer:
    """The tokenizer of a local checkpoint or tokenizer directory (no download), rendering with ``chat_template``
    where given."""
    try:
        tokenizer = Tokenizer(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load tokenizer {path!r}: {e}") from None
    return tokenizer if chat_template is None else tokenizer.with_chat_template(chat_template)


def read_openai_bodies(path: str | Path, tokenizer_path: str, block_size: int | None,
                       default_output_tokens: int = 256, replica: ReplicaModel | None = None,
                       chat_template: ChatTemplate | None = None) -> Trace:
    """``block_size``: default the replica's, else 16; ``chat_template``: render with it (the replicas')."""
    tokenizer = load_tokenizer(tokenizer_path, chat_template)
    block_size = block_size or (replica.identity.block_size if replica else 16)
    replica = replica_model_for(os.fspath(tokenizer_path), tokenizer, block_size, replica=replica)
    base = replica.identity.hasher()
    check_time = TimestampCheck(path)
    adapters = AdapterNames()
    requests = []
    for entry in iter_bodies(path, SharedTools()):  # the one reader of body logs: one entry per prompt
        body, line = entry.body, entry.line
        ts = 0 if entry.timestamp is None else body["timestamp"]
        check_time(ts, line)
        try:
            (prompt,) = render_body(tokenizer, body, replica.max_model_len)
        except PromptError as e:
            raise TraceError(path, line, str(e)) from None
        if not prompt.token_ids:
            raise TraceError(path, line, "the prompt renders to zero tokens")
        out = default_output_tokens
        for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins when both are given
            if body.get(key) is not None:
                out = require(body, key, path, line, minimum=1)
        requests.append(
            TraceRequest(
                timestamp=ts / 1000.0,
                input_length=len(prompt.token_ids),
                output_length=out,
                block_hashes=base.with_salt(entry.namespace).hash_blocks(
                    prompt.token_ids, extras=adapter_extras(adapters.adapter(entry.model))),
                num_blocks=cdiv(len(prompt.token_ids), block_size),
                session=body.get("user"),
                extra={k: body[k] for k in ("model", "user") if k in body},
            )
        )
    return Trace(Path(path).name, block_size, requests)
