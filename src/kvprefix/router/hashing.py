"""The router's copy of the replicas' block identity: render a request body, tokenize it and hash its blocks
exactly as a replica will, so the router can look them up in what each replica caches.

The renderer is ``kvprefix.prompts`` and the hash ``kvprefix.cache.BlockHasher`` (the replicas' own code). The
execution context is computed from the checkpoint given to the router (``context_for_checkpoint``) and checked
against the root a replica announces in its KV event stream's hello, which also gives the block size and the
hash algorithm: a router whose hashes could never match says so at start instead of routing blind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from kvprefix.cache import BlockHash, BlockHasher, BlockHashMemo, context_for_checkpoint
from kvprefix.cache.event_wire import Hello
from kvprefix.cache.identity import kv_labels
from kvprefix.prompts import PromptError, render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request as a policy sees it (``policies.Routable``), fixed once read."""

    block_hashes: tuple[Hashable, ...]
    session: str | None
    num_blocks: int = 0  # prompt blocks, the partial tail included (0: not hashed)
    # replica id -> the request's blocks that replica holds, where the caller follows the event streams and the
    # router does not (the Ray ingress hands them to Ray's request router with the call)
    held: Mapping[str, frozenset[Hashable]] | None = None


def route_request(body: bytes, headers: Mapping[str, str], tenant: str | None,
                  hasher: RequestHasher | None) -> RouteRequest:
    """What the policies need of a raw request: its block hashes (with ``hasher``; else none) and its session key
    (``prompt_cache_key``, ``user`` or an ``x-session-id`` header). A body that is not a JSON object (or nests
    too deep to parse) routes with neither: the replica answers what is wrong with it."""
    try:
        parsed = from_json(body)  # pydantic's parser, the replicas' own: a sixth of json.loads' time on a chat
    except ValueError:  # not JSON, or nested deeper than it parses: the replica refuses it as well
        parsed = None
    parsed = parsed if isinstance(parsed, dict) else {}
    hashes, num_blocks = hasher.hash_prompt(parsed, tenant) if hasher is not None else ([], 0)
    session = parsed.get("prompt_cache_key") or parsed.get("user") or headers.get("x-session-id")
    return RouteRequest(tuple(hashes), session if isinstance(session, str) else None, num_blocks)


class RequestHasher:
    def __init__(self, tokenizer: Tokenizer, hasher: BlockHasher):
        self.tokenizer = tokenizer
        self.hasher = hasher
        # Most of a prompt is a prefix the router hashed before (docs/router.md, the relay): hashed once.
        self.memo = BlockHashMemo(hasher.block_size, hasher.algo)

    @classmethod
    def for_replica(cls, model: str, hello: Hello) -> RequestHasher:
        """The hasher for ``model`` that gives the root ``hello`` announces; ValueError when none does."""
        tokenizer = SegmentCachedTokenizer(Tokenizer(model), capacity=4096)
        context = context_for_checkpoint(model, "", tokenizer.chat_template)  # fingerprints the files once
        for kv_dtype in kv_labels():
            hasher = BlockHasher(hello.block_size, hello.hash_algo, dataclasses.replace(context, kv_dtype=kv_dtype))
            if hasher.root == hello.root:
                return cls(tokenizer, hasher)
        raise ValueError(
            f"--model {model} does not hash like replica {hello.replica_id} (its root {hello.root.hex()[:16]}... "
            f"matches none of {', '.join(kv_labels())}): give the router the replicas' checkpoint"
        )

    def hash_prompt(self, body: Mapping[str, Any], tenant: str | None) -> tuple[list[BlockHash], int]:
        """The full-block hashes of the body's first prompt in the caller's namespace, and how many blocks the
        prompt spans (its partial tail included); ([], 0) for a body the replica will refuse anyway (it answers
        with the error, the router only routes)."""
        salt = body.get("cache_salt")
        try:
            prompts = render_body(self.tokenizer, body)
            hasher = self.hasher.for_namespace(tenant, salt if isinstance(salt, str) else None)
        except (PromptError, ValueError, TypeError):
            return [], 0
        if not prompts:
            return [], 0
        ids = prompts[0].token_ids
        return self.memo.hash_blocks(hasher, ids), -(-len(ids) // hasher.block_size)
