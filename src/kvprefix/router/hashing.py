"""The router's copy of the replicas' block identity: render a request body, tokenize it and hash its blocks
exactly as a replica will, so the router can look them up in what each replica caches.

The renderer is ``kvprefix.prompts.render_body`` and the hash ``kvprefix.cache.BlockHasher`` (the replicas' own
code). The hasher is the one of the ``BlockIdentity`` a replica announces in its KV event stream's hello; the router
only needs the checkpoint's tokenizer, which it loads from ``--model``, else from the path the identity names or the
built-in default model, whichever has the replica's fingerprints. A router that cannot reproduce a replica's
identity says so at start, naming the replica and what differs, instead of routing blind.
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic_core import from_json

from kvprefix.cache import BlockHash, BlockHasher, BlockHashMemo, BlockIdentity
from kvprefix.cache.event_wire import Hello
from kvprefix.prompts import PromptError, render_body
from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer
from kvprefix.tokenizer.chat_template import ChatTemplate


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A request as a policy sees it (``policies.Routable``), fixed once read."""

    block_hashes: tuple[Hashable, ...]
    session: str | None
    num_blocks: int = 0  # prompt blocks, the partial tail included (0: not hashed)
    # replica id -> medium (``cache.media``) -> the request's blocks that replica holds there (for the shared tier:
    # those any replica reading the same store announced), where the caller follows the event streams and the
    # router does not (the Ray ingress hands them to Ray's request router with the call)
    held: Mapping[str, Mapping[str, frozenset[Hashable]]] | None = None


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
    """A body's block hashes as a replica computes them. ``max_model_len``: the replica's context length (for
    ``truncate_prompt_tokens`` -1)."""

    def __init__(self, tokenizer: Tokenizer, hasher: BlockHasher, max_model_len: int | None = None):
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.max_model_len = max_model_len
        # LoRA adapter name -> content fingerprint (the router refreshes it from the replicas' model lists): a
        # request whose "model" is an adapter hashes in that adapter's namespace, as the replica will.
        self.adapters: dict[str, str] = {}
        # Most of a prompt is a prefix the router hashed before (docs/router.md, the relay): hashed once.
        self.memo = BlockHashMemo(hasher.block_size, hasher.algo)

    @classmethod
    def for_replica(cls, hello: Hello, model: str | None = None, replica: str | None = None,
                    chat_template: ChatTemplate | None = None) -> RequestHasher:
        """The hasher of the replica that sent ``hello`` (named ``replica``, default its id), with the tokenizer of
        ``model`` or of the checkpoint its identity names, rendering with ``chat_template`` where given (the
        replicas' ``--chat-template`` options); a one-line ValueError when this router cannot reproduce its
        identity."""
        name = replica or hello.replica_id
        identity = hello.identity
        if identity is None:
            raise ValueError(f"replica {name} does not announce its block identity (an older kvprefix): upgrade it")
        plain = Tokenizer(checkpoint_for(identity, model, name))
        if chat_template is not None:
            plain = plain.with_chat_template(chat_template)
        tokenizer = SegmentCachedTokenizer(plain, capacity=4096)
        differs = identity.template_difference(tokenizer.chat_template, tokenizer.content_format())
        if differs:
            given = "the --chat-template options given" if chat_template else (
                f"{model or identity.checkpoint}'s own: give the router the replicas' --chat-template options")
            raise ValueError(f"replica {name} renders with another chat template than {given} ({differs[0]})")
        hasher = identity.hasher()
        if hasher.root != hello.root:
            raise ValueError(f"replica {name} announces the root {hello.root.hex()[:16]}..., but its identity gives "
                             f"{hasher.root.hex()[:16]}...")
        return cls(tokenizer, hasher, hello.max_model_len)

    def hash_prompt(self, body: Mapping[str, Any], tenant: str | None) -> tuple[list[BlockHash], int]:
        """The full-block hashes of the body's first prompt in the caller's namespace, and how many blocks the
        prompt spans (its partial tail included); ([], 0) for a body the replica will refuse anyway (it answers
        with the error, the router only routes)."""
        salt, model = body.get("cache_salt"), body.get("model")
        lora = self.adapters.get(model) if isinstance(model, str) else None
        try:
            prompts = render_body(self.tokenizer, body, self.max_model_len)
            hasher = self.hasher.for_namespace(tenant, salt if isinstance(salt, str) else None, lora)
        except (PromptError, ValueError, TypeError):
            return [], 0
        if not prompts:
            return [], 0
        ids = prompts[0].token_ids
        return self.memo.hash_blocks(hasher, ids), -(-len(ids) // hasher.block_size)


def checkpoint_for(identity: BlockIdentity, model: str | None, replica: str) -> str:
    """A local checkpoint with the fingerprints of ``identity``: ``model`` when given, else the path the identity
    names, else the built-in default model; ValueError naming ``replica`` and what differs when there is none."""
    if model is not None:
        differs = identity.checkpoint_differences(model)
        if differs:
            raise ValueError(f"--model {model} is not the checkpoint of replica {replica}: {'; '.join(differs)}")
        return model
    tried = []
    for path in dict.fromkeys((identity.checkpoint, _default_model())):
        if not path or not os.path.exists(path):
            tried.append(f"{path or 'the built-in default model'} is not here")
            continue
        differs = identity.checkpoint_differences(path)
        if not differs:
            return path
        tried.append(f"{path} differs ({'; '.join(differs)})")
    raise ValueError(f"replica {replica} runs {identity.checkpoint or 'an unnamed checkpoint'}, which this router "
                     f"cannot find: {', '.join(tried)}; give --model, a copy of the replicas' checkpoint")


def _default_model() -> str:
    from kvprefix.cache.default_model import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return ""
