"""What a replica caches, as its KV events describe it: the publisher's snapshot source and a subscriber's mirror.

``BlockIndex``: hash -> (parent, namespace), one entry per cached block of one medium; ``MediaIndex``: one
``BlockIndex`` per medium (the pool, the disk, the shared tier: ``cache.media``). ``StreamMirror`` feeds one replica's
wire stream into a ``MediaIndex`` and checks sequence numbers, so a router holds the exact sets or knows it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvprefix.cache.event_wire import (
    BlockRun,
    Event,
    Goodbye,
    Heartbeat,
    Hello,
    LoadCosts,
    Message,
    SnapshotBlocks,
    SnapshotEnd,
    SnapshotStart,
)
from kvprefix.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvprefix.cache.hashing import BlockHash, leading_blocks_in
from kvprefix.cache.media import POOL, Medium


class BlockIndex:
    def __init__(self, blocks: dict[BlockHash, tuple[BlockHash | None, str]] | None = None):
        self._blocks = blocks if blocks is not None else {}

    def apply(self, event: KVCacheEvent) -> None:
        blocks = self._blocks
        if isinstance(event, BlockStored):
            parent, namespace = event.parent_block_hash, event.namespace
            for h in event.block_hashes:
                blocks[h] = (parent, namespace)
                parent = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                blocks.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            blocks.clear()

    def add(self, block_hash: BlockHash, parent: BlockHash | None, namespace: str) -> None:
        self._blocks[block_hash] = (parent, namespace)

    def add_run(self, run: BlockRun) -> None:
        parent = run.parent
        for h in run.hashes:
            self._blocks[h] = (parent, run.namespace)
            parent = h

    def copy(self) -> BlockIndex:
        return BlockIndex(dict(self._blocks))

    def blocks(self) -> dict[BlockHash, tuple[BlockHash | None, str]]:
        """hash -> (parent, namespace), a copy."""
        return dict(self._blocks)

    def runs(self, max_run: int = 512, medium: str = POOL) -> list[BlockRun]:
        """The index as runs of chained blocks (at most ``max_run`` each), in the order they were stored: a
        request's blocks arrive together, so most chains come out whole."""
        out: list[BlockRun] = []
        last: BlockHash | None = None
        for h, (parent, namespace) in self._blocks.items():
            run = out[-1] if out else None
            if run is not None and parent == last and namespace == run.namespace and len(run.hashes) < max_run:
                run.hashes.append(h)
            else:
                out.append(BlockRun(namespace, parent, [h], medium))
            last = h
        return out

    def cached_prefix_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a request's chain are cached."""
        return leading_blocks_in(self._blocks, block_hashes)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks


class MediaIndex:
    """A replica's blocks by medium (``of(medium)``: that medium's ``BlockIndex``); an event goes to its medium's
    index, ``AllBlocksCleared`` to the pool's (a reset empties the pool, not the tiers below it)."""

    def __init__(self, indexes: dict[str, BlockIndex] | None = None):
        self._indexes = indexes if indexes is not None else {}

    def of(self, medium: str) -> BlockIndex:
        index = self._indexes.get(medium)
        if index is None:
            index = self._indexes[medium] = BlockIndex()
        return index

    def apply(self, event: KVCacheEvent) -> None:
        self.of(getattr(event, "medium", POOL)).apply(event)

    def add(self, blocks: Sequence[tuple[BlockHash, BlockHash | None, str, str]]) -> None:
        """(hash, parent, namespace, medium) of blocks held (a snapshot's source)."""
        for h, parent, namespace, medium in blocks:
            self.of(medium).add(h, parent, namespace)

    def add_run(self, run: BlockRun) -> None:
        self.of(run.medium).add_run(run)

    def copy(self) -> MediaIndex:
        return MediaIndex({medium: index.copy() for medium, index in self._indexes.items()})

    def runs(self, max_run: int = 512) -> list[BlockRun]:
        """Every medium's runs (``BlockIndex.runs``), the pool's first."""
        media = sorted(self._indexes, key=lambda m: m != POOL)
        return [run for medium in media for run in self._indexes[medium].runs(max_run, medium)]

    def __len__(self) -> int:
        """Blocks in every medium (a block held in two counts twice)."""
        return sum(len(index) for index in self._indexes.values())


class StreamError(ValueError):
    """The stream broke its contract (a skipped or repeated sequence number, a resume into another epoch)."""


class StreamMirror:
    """One replica's cached blocks by medium (``blocks``; ``index``: the pool's), kept exact from its event stream,
    and its media as its hello announced them with their latest load costs (``media``). ``ready`` is False until a
    snapshot or a resume has given a complete state; ``since``/``epoch`` are what to reconnect with."""

    def __init__(self) -> None:
        self.blocks = MediaIndex()
        self.media: dict[str, Medium] = {}
        self.replica_id: str | None = None
        self.epoch: str | None = None
        self.since: int | None = None  # the last event applied
        self.ready = False
        self._snapshot_seq: int | None = None

    @property
    def index(self) -> BlockIndex:
        """The blocks in the replica's pool."""
        return self.blocks.of(POOL)

    def apply(self, msg: Message) -> None:
        if isinstance(msg, Event):
            if not self.ready or msg.seq != self.since + 1:
                raise StreamError(f"event {msg.seq} after {self.since} (ready={self.ready})")
            self.blocks.apply(msg.event)
            self.since = msg.seq
        elif isinstance(msg, Hello):
            if msg.resume and (msg.epoch != self.epoch or self.since is None):
                raise StreamError(f"resume offered into epoch {msg.epoch}, but this mirror is at {self.epoch}")
            self.replica_id, self.epoch = msg.replica_id, msg.epoch
            self.media = {m.name: m for m in msg.media} or {POOL: Medium(POOL)}
            self.ready = msg.resume
        elif isinstance(msg, SnapshotStart):
            self.blocks, self.ready, self._snapshot_seq = MediaIndex(), False, msg.seq
        elif isinstance(msg, SnapshotBlocks):
            for run in msg.runs:
                self.blocks.add_run(run)
        elif isinstance(msg, SnapshotEnd):
            if msg.seq != self._snapshot_seq:
                raise StreamError(f"snapshot ended at {msg.seq}, began at {self._snapshot_seq}")
            self.since, self.ready = msg.seq, True
        elif isinstance(msg, Heartbeat):
            if self.ready and msg.seq != self.since:
                raise StreamError(f"heartbeat at {msg.seq}, but {self.since} was the last event")
        elif isinstance(msg, LoadCosts):
            self.media = {name: replace(m, load_cost=msg.costs.get(name, m.load_cost)) for name, m in self.media.items()}
        elif isinstance(msg, Goodbye):
            self.ready = False
