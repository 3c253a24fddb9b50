"""The KV event wire format: the messages of a replica's event stream, each one JSON object (docs/kv-events.md).

One codec for both ends: the server encodes, routers and tests decode, so the two can never disagree. Hashes
travel as lowercase hex; token ids and extra keys never travel (they are the prompt). Version 2 added where a
block is held (``medium``, ``cache.media``) and what each place costs to load from; a version-1 stream (no medium)
is read as the pool's. Pure Python, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvprefix.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvprefix.cache.hashing import BlockHash
from kvprefix.cache.identity import BlockIdentity
from kvprefix.cache.media import POOL, Medium

WIRE_VERSION = 2
READS_VERSIONS = (1, 2)  # version 1: a replica without tier events (every block in its pool)


@dataclass(frozen=True)
class Hello:
    """First message of every stream. ``epoch`` names this process's stream: sequence numbers of two epochs
    are unrelated. ``seq`` is the last number assigned when the stream opened; ``resume`` True means the events
    after the subscriber's ``since`` follow, False that a snapshot follows. ``identity`` names the replica's blocks
    (a router builds its hasher from it) and ``max_model_len`` is its context length (``truncate_prompt_tokens``
    -1 keeps that many tokens); both None from a replica that predates them. ``media``: where it holds blocks, the
    pool first, each with its capacity and load cost (empty from a replica that predates them: the pool only)."""

    replica_id: str
    epoch: str
    block_size: int
    hash_algo: str
    root: BlockHash  # the unsalted namespace's root, for a router to check that it hashes alike
    seq: int
    resume: bool
    version: int = WIRE_VERSION
    identity: BlockIdentity | None = None
    max_model_len: int | None = None
    media: tuple[Medium, ...] = ()


@dataclass(frozen=True)
class Event:
    """One cache event with its sequence number: consecutive integers per epoch, starting at 1. A decoded
    BlockStored has no token ids and no extra keys."""

    seq: int
    replica_id: str
    event: KVCacheEvent


@dataclass(frozen=True)
class BlockRun:
    """Cached blocks of one namespace in one medium, each the parent of the next; ``parent`` precedes the first."""

    namespace: str
    parent: BlockHash | None
    hashes: list[BlockHash]
    medium: str = POOL


@dataclass(frozen=True)
class SnapshotStart:
    """Forget this replica's blocks: the set cached after event ``seq`` follows, ``num_blocks`` in all."""

    seq: int
    num_blocks: int


@dataclass(frozen=True)
class SnapshotBlocks:
    runs: list[BlockRun]


@dataclass(frozen=True)
class SnapshotEnd:
    """The snapshot is complete; the live events continue with ``seq + 1``."""

    seq: int


@dataclass(frozen=True)
class Heartbeat:
    """Sent when a stream is idle; ``seq`` is the last event the stream delivered."""

    seq: int


@dataclass(frozen=True)
class LoadCosts:
    """What loading a block from each tier costs now, in blocks of prefill (``Medium.load_cost``), by medium: sent,
    unnumbered, when the replica's measurement has moved since the hello or the last one."""

    costs: dict[str, float]


@dataclass(frozen=True)
class Goodbye:
    """The server ends the stream. ``reason`` "overflow": the subscriber read too slowly; "shutdown": the
    replica is stopping. ``seq`` is the last event delivered: reconnect with ``since=seq`` and the epoch."""

    seq: int
    reason: str
    message: str = ""


Message = Hello | Event | SnapshotStart | SnapshotBlocks | SnapshotEnd | Heartbeat | LoadCosts | Goodbye


def _hex(h: BlockHash | None) -> str | None:
    return None if h is None else h.hex()


def _unhex(s: str | None) -> BlockHash | None:
    return None if s is None else bytes.fromhex(s)


def _encode_event(msg: Event) -> dict[str, Any]:
    event = msg.event
    head = {"seq": msg.seq, "replica_id": msg.replica_id}
    if isinstance(event, BlockStored):
        return {"type": "stored", **head, "namespace": event.namespace, "parent": _hex(event.parent_block_hash),
                "hashes": [h.hex() for h in event.block_hashes], "block_size": event.block_size,
                "medium": event.medium}
    if isinstance(event, BlockRemoved):
        return {"type": "removed", **head, "hashes": [h.hex() for h in event.block_hashes], "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "cleared", **head}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode(msg: Message) -> dict[str, Any]:
    """The JSON-able dict of a message."""
    if isinstance(msg, Event):
        return _encode_event(msg)
    if isinstance(msg, Hello):
        hello = {"type": "hello", "version": msg.version, "replica_id": msg.replica_id, "epoch": msg.epoch,
                 "block_size": msg.block_size, "hash_algo": msg.hash_algo, "root": msg.root.hex(), "seq": msg.seq,
                 "resume": msg.resume}
        if msg.identity is not None:
            hello["identity"] = msg.identity.to_dict()
        if msg.max_model_len is not None:
            hello["max_model_len"] = msg.max_model_len
        if msg.media:
            hello["media"] = [m.to_dict() for m in msg.media]
        return hello
    if isinstance(msg, SnapshotStart):
        return {"type": "snapshot", "seq": msg.seq, "num_blocks": msg.num_blocks}
    if isinstance(msg, SnapshotBlocks):
        return {"type": "snapshot_blocks", "runs": [
            {"namespace": r.namespace, "parent": _hex(r.parent), "hashes": [h.hex() for h in r.hashes],
             "medium": r.medium} for r in msg.runs]}
    if isinstance(msg, SnapshotEnd):
        return {"type": "snapshot_end", "seq": msg.seq}
    if isinstance(msg, Heartbeat):
        return {"type": "heartbeat", "seq": msg.seq}
    if isinstance(msg, LoadCosts):
        return {"type": "load_costs", "costs": msg.costs}
    if isinstance(msg, Goodbye):
        return {"type": "goodbye", "seq": msg.seq, "reason": msg.reason, "message": msg.message}
    raise TypeError(f"not a wire message: {msg!r}")


def decode(d: dict[str, Any]) -> Message:
    """The message of a decoded JSON object. Raises ValueError for an unknown type, a newer version or a
    missing field."""
    kind = d.get("type")
    try:
        if kind == "stored":
            hashes = [bytes.fromhex(h) for h in d["hashes"]]
            event = BlockStored(hashes, _unhex(d["parent"]), None, d["block_size"], None, d["namespace"],
                                d.get("medium", POOL))
            return Event(d["seq"], d["replica_id"], event)
        if kind == "removed":
            event = BlockRemoved([bytes.fromhex(h) for h in d["hashes"]], d.get("medium", POOL))
            return Event(d["seq"], d["replica_id"], event)
        if kind == "cleared":
            return Event(d["seq"], d["replica_id"], AllBlocksCleared())
        if kind == "hello":
            if d["version"] not in READS_VERSIONS:
                raise ValueError(f"KV event stream version {d['version']}; this reader knows "
                                 f"{', '.join(map(str, READS_VERSIONS))}")
            identity = BlockIdentity.from_dict(d["identity"]) if d.get("identity") is not None else None
            media = tuple(Medium.from_dict(m) for m in d.get("media") or ())
            return Hello(d["replica_id"], d["epoch"], d["block_size"], d["hash_algo"], bytes.fromhex(d["root"]),
                         d["seq"], d["resume"], d["version"], identity, d.get("max_model_len"), media)
        if kind == "snapshot":
            return SnapshotStart(d["seq"], d["num_blocks"])
        if kind == "snapshot_blocks":
            return SnapshotBlocks([BlockRun(r["namespace"], _unhex(r["parent"]), [bytes.fromhex(h) for h in r["hashes"]],
                                            r.get("medium", POOL)) for r in d["runs"]])
        if kind == "snapshot_end":
            return SnapshotEnd(d["seq"])
        if kind == "heartbeat":
            return Heartbeat(d["seq"])
        if kind == "load_costs":
            return LoadCosts({str(k): float(v) for k, v in d["costs"].items()})
        if kind == "goodbye":
            return Goodbye(d["seq"], d["reason"], d.get("message", ""))
    except KeyError as exc:
        raise ValueError(f"KV event message of type {kind!r} lacks the field {exc.args[0]!r}") from None
    raise ValueError(f"unknown KV event message type {kind!r}")


def dumps(msg: Message) -> bytes:
    """One line of the stream: compact JSON and a newline."""
    return json.dumps(encode(msg), separators=(",", ":")).encode() + b"\n"


def loads(line: bytes | str) -> Message:
    return decode(json.loads(line))
