"""The router's copy of the replicas' block identity: render a request body, tokenize it and hash its blocks
exactly as a replica will, so the router can look them up in what each replica caches.

The renderer is ``kvprefix.prompts`` and the hash ``kvprefix.cache.BlockHasher`` (the replicas' own code). The
execution context is computed from the checkpoint given to the router (``context_for_checkpoint``) and checked
against the root a replica announces in its KV event stream's hello, which also gives the block size and the
hash algorithm: a router whose hashes could never match says so at start instead of routing blind.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvprefix.cache import BlockHash, BlockHasher, context_for_checkpoint
from kvprefix.cache.event_wire import Hello
from kvprefix.cache.identity import kv_labels
from kvprefix.prompts import PromptError, Tokenizer, render_body


@dataclass
class RouteRequest:
    """A request as a policy sees it (``policies.Routable``)."""

    block_hashes: Sequence[Hashable]
    session: str | None
    num_blocks: int = 0  # prompt blocks, the partial tail included (0: not hashed)
    # replica id -> its exact cached prefix in blocks, where the caller follows the event streams (the Ray ingress)
    replica_cached: Mapping[str, int] | None = None


def route_request(body: bytes, headers: Mapping[str, str], tenant: str | None,
                  hasher: RequestHasher | None) -> RouteRequest:
    """What the policies need of a raw request: its block hashes (with ``hasher``; else none) and its session key
    (``prompt_cache_key``, ``user`` or an ``x-session-id`` header). A body that is not a JSON object routes with
    neither: the replica answers what is wrong with it."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    parsed = parsed if isinstance(parsed, dict) else {}
    hashes, num_blocks = hasher.hash_prompt(parsed, tenant) if hasher is not None else ([], 0)
    session = parsed.get("prompt_cache_key") or parsed.get("user") or headers.get("x-session-id")
    return RouteRequest(hashes, session if isinstance(session, str) else None, num_blocks)


class SegmentCachedTokenizer(Tokenizer):
    """The replicas' tokenizer, with ``encode`` of rendered text going piece by piece through an LRU cache.

    A fast tokenizer splits its input on the added tokens (``<|im_start|>``, ...) and tokenizes each piece between
    them on its own; a chat template puts such tokens between messages, so the pieces of a long system prompt or
    history repeat from request to request and are tokenized once. Exact only where the tokenizer works that way:
    no normalizer, added tokens that strip nothing, and a probe text that tokenizes alike both ways; else every
    text is tokenized whole, as before.
    """

    def __init__(self, path: str, capacity: int = 4096):
        super().__init__(path)
        self.capacity = capacity
        self._added = self.hf.get_added_vocab()
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
                                 + ")") if self._added else None
        self.exact = self._split is not None and self._splits_like_the_tokenizer()

    def _splits_like_the_tokenizer(self) -> bool:
        backend = self.hf.backend_tokenizer
        if backend.normalizer is not None or any(t.lstrip or t.rstrip or t.single_word
                                                 for t in self.hf.added_tokens_decoder.values()):
            return False
        probe = " ".join(self._added) + " a  b\n\n c" + "".join(f"{t}x y {t}\n" for t in self._added)
        return self._encode_pieces(probe) == super().encode(probe, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens or not self.exact:
            return super().encode(text, add_special_tokens=add_special_tokens)
        return self._encode_pieces(text)

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        cache, capacity = self._pieces, self.capacity
        for k, piece in enumerate(self._split.split(text)):
            if k % 2:  # an added token
                ids.append(self._added[piece])
            elif piece:
                hit = cache.get(piece)
                if hit is None:
                    hit = cache[piece] = super().encode(piece, add_special_tokens=False)
                    if len(cache) > capacity:
                        cache.popitem(last=False)
                else:
                    cache.move_to_end(piece)
                ids += hit
        return ids


class RequestHasher:
    def __init__(self, tokenizer: Tokenizer, hasher: BlockHasher):
        self.tokenizer = tokenizer
        self.hasher = hasher

    @classmethod
    def for_replica(cls, model: str, hello: Hello) -> RequestHasher:
        """The hasher for ``model`` that gives the root ``hello`` announces; ValueError when none does."""
        tokenizer = SegmentCachedTokenizer(model)
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
        return hasher.hash_blocks(ids), -(-len(ids) // hasher.block_size)
