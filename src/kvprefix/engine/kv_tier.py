"""The engine's side of the tiers below the pool: copies KV between the paged tensors and verified block objects.

The tiers form a chain, fastest first (disk, then a shared store). Loads: when a request's pool hits stop, the
chain is asked for the following run (each tier for what the ones before it lack); the blocks found are read and
verified on a loader thread straight into fresh pool blocks while the engine keeps stepping the other requests
(``TierLoads``); once done they are registered like computed blocks, so the request's next lookup hits them and its
prefill starts at the first block found nowhere. Writes: every block the pool registers (``BlockStored``) is copied
out once and queued to each tier but the one it was just loaded from, on that tier's write-behind thread, which
skips what its tier holds already; a full queue drops the write (counted): a step never waits for a tier.
Retention: ``admit`` checks a request's retention against its tenant's budget and notes it for the request's
blocks not yet in the pool, which the writes then honour (docs/tiers.md#retention). What each tier holds is kept in
``presence`` (``tiers.presence``), whose KV events tell routers which blocks this replica can load from where, and
``media`` says what each tier holds at most and costs to load from (docs/kv-events.md).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from kvprefix.cache import KVCacheManager
from kvprefix.cache.events import BlockStored
from kvprefix.cache.identity import BlockIdentity
from kvprefix.cache.media import Medium, load_cost
from kvprefix.engine.tier_loads import TierLoads
from kvprefix.model import ModelConfig
from kvprefix.tiers import BlockObject, BlockStore, DiskStore, KVSpec, RedisStore, parse_size
from kvprefix.tiers.objects import object_bytes
from kvprefix.tiers.presence import TierPresence
from kvprefix.tiers.retention import IN_MEMORY, check_retention, retained_seconds
from kvprefix.tiers.write_behind import WriteBehind

log = logging.getLogger(__name__)
MAX_NOTED_BLOCKS = 1 << 16  # retentions noted for blocks not yet registered (an aborted request's are dropped oldest first)
# Shared-tier blocks this replica keeps announced when the store's size is unknown (no maxmemory): a bound on memory
# (about 50 MB of hashes at most).
MAX_KNOWN_SHARED_BLOCKS = 1 << 18


def kv_spec(identity: BlockIdentity, config: ModelConfig, dtype: torch.dtype) -> KVSpec:
    """What this engine's block KV depends on beside its tokens (the object header's identity fields)."""
    return KVSpec(model=identity.context.model, kv_dtype=identity.context.kv_dtype,
                  element_size=torch.empty((), dtype=dtype).element_size(), block_size=identity.block_size,
                  num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                  head_size=config.head_dim)


class KVTier:
    """The chain of tiers under one engine's pool: loads into it at admission, writes behind it after each step."""

    def __init__(self, stores: list[BlockStore], spec: KVSpec, manager: KVCacheManager, kv_caches: list,
                 max_queue: int = 256, retention_budget: int | None = None,
                 prefill_seconds_per_block: Callable[[], float | None] = lambda: None):
        self.stores, self.spec, self.manager = stores, spec, manager
        self.retention_budget = stores[0].max_bytes // 2 if retention_budget is None else retention_budget
        self._noted: OrderedDict[bytes, tuple[str, str]] = OrderedDict()  # block hash -> (retention, tenant)
        self.layers = [layer.kv for layer in kv_caches]  # each [num_blocks, block_size, 2 * kv_heads, head_size]
        # Byte views of each layer's blocks: on CPU the paged tensors themselves (loads read straight into them,
        # stores copy out of them), elsewhere one host block that loads stage through.
        cpu = self.layers[0].device.type == "cpu"
        host = self.layers if cpu else [torch.empty_like(layer[0], device="cpu") for layer in self.layers]
        self._bytes = [t.view(torch.uint8).numpy().reshape(t.shape[0] if cpu else 1, -1) for t in host]
        self._on_cpu = cpu
        self.block_bytes = object_bytes(spec, "0" * 16, 32)  # one object (16-hex namespace id, 32-byte hashes)
        self.presence = TierPresence(manager.block_size)
        for store in stores:
            # A tier whose deletions go unseen is known at most as many blocks as it can hold: the oldest go first.
            bound = None if store.sees_evictions else self.capacity_blocks(store) or MAX_KNOWN_SHARED_BLOCKS
            self.presence.track(store.medium, bound)
            store.watch(self.presence)
        self.writers = [WriteBehind(store, max_queue, self.presence) for store in stores]
        self.loads = TierLoads(stores, manager, self._spans, self._stage_in, self.presence,
                               prefill_seconds_per_block, self._writes)
        self._unsubscribe = manager.events.subscribe(self._on_event)
        atexit.register(self.close)

    @property
    def hit_tokens(self) -> dict[str, int]:
        """Prompt tokens loaded from each tier into the pool, by tier name."""
        return self.loads.hit_tokens

    # ---- what routers are told

    def capacity_blocks(self, store: BlockStore) -> int | None:
        """How many blocks ``store`` holds at most (None: its size is unknown, as a Redis without maxmemory)."""
        return store.max_bytes // self.block_bytes if store.max_bytes else None

    def load_costs(self, prefill_seconds_per_block: float | None) -> dict[str, float]:
        """Blocks of prefill one block loaded from each tier costs (``cache.media.load_cost``), by tier name: its
        mean seconds to load and verify a block since start over ``prefill_seconds_per_block``."""
        out = {}
        for store in self.stores:
            with store.stats.lock:
                blocks, seconds = store.stats.hit_blocks, store.stats.load_seconds.total
            out[store.name] = load_cost(seconds / blocks if blocks else None, prefill_seconds_per_block)
        return out

    def media(self, prefill_seconds_per_block: float | None) -> list[Medium]:
        """Each tier as a KV event stream's hello announces it."""
        costs = self.load_costs(prefill_seconds_per_block)
        return [Medium(store.medium, self.capacity_blocks(store), costs[store.name], store.store_id)
                for store in self.stores]

    # ---- retention

    def admit(self, retention: str | None, tenant: str, namespace: str, block_hashes: list) -> None:
        """Notes a new request's ``retention`` for its prompt blocks not in the pool, and retains those the tiers
        hold already; ValueError when a duration would take ``tenant`` past its retained-bytes budget."""
        if retention is None:
            return
        seconds = retained_seconds(retention)
        if seconds is not None:
            need = len(block_hashes) * object_bytes(self.spec, namespace, len(block_hashes[0]) if block_hashes else 0)
            held = sum(store.retained_bytes(tenant, besides=block_hashes) for store in self.stores)
            if held + need > self.retention_budget:
                raise ValueError(
                    f"retention {retention!r} of this prompt's {len(block_hashes)} blocks ({need} bytes) would take "
                    f"tenant {tenant or 'default'!r} past its {self.retention_budget}-byte budget of retained KV "
                    f"({held} bytes held; --kv-retention-budget)")
            until = time.time() + seconds
            for writer in self.writers:  # on the writer thread: a tier that lacks a block passes it over
                writer.submit_retain(block_hashes, until, tenant)
        cached = self.manager.pool.cached_blocks
        for block_hash in block_hashes:  # to be computed or loaded: its write honours the retention
            if block_hash not in cached:
                self._noted[block_hash] = (retention, tenant)
                self._noted.move_to_end(block_hash)
        while len(self._noted) > MAX_NOTED_BLOCKS:
            self._noted.popitem(last=False)

    # ---- loads and writes

    def _writes(self, block_hash: bytes) -> bool:
        """Whether the block, computed now, will be written below the pool (not when its retention is in memory)."""
        return self._noted.get(block_hash, (None, ""))[0] != IN_MEMORY

    def _spans(self, block_id: int) -> list[memoryview]:
        """Where a block's payload goes, layer by layer: the block itself on CPU, else the host staging block."""
        row = block_id if self._on_cpu else 0
        return [memoryview(layer[row]) for layer in self._bytes]

    @torch.inference_mode()
    def _stage_in(self, block_id: int) -> None:
        """Off CPU: the verified staging block into the device's paged tensors (on CPU it was read in place)."""
        if self._on_cpu:
            return
        for layer, staged in zip(self.layers, self._bytes, strict=True):
            layer[block_id].view(-1).view(torch.uint8).copy_(torch.from_numpy(staged[0]))

    def _on_event(self, event) -> None:
        if not isinstance(event, BlockStored) or event.token_ids is None:
            return
        pool, bs = self.manager.pool, self.manager.block_size
        parent = event.parent_block_hash
        for k, block_hash in enumerate(event.block_hashes):
            block = pool.cached_blocks.get(block_hash)
            prev, parent = parent, block_hash
            retention, tenant = self._noted.pop(block_hash, (None, ""))
            if block is None or prev is None or retention == IN_MEMORY:
                continue
            seconds = retained_seconds(retention)
            until = None if seconds is None else time.time() + seconds
            obj = None  # copied out once, for the first tier that has room
            source = self.loads.registering.get(block_hash)  # the tier it was just loaded from, if any
            for tier, writer in enumerate(self.writers):
                if tier == source:
                    continue
                if not writer.has_room():
                    writer.drop()
                    continue
                if obj is None:
                    tokens = tuple(event.token_ids[k * bs : (k + 1) * bs])
                    obj = BlockObject(self.spec, event.namespace, block_hash, prev, tokens,
                                      self._copy_out(block.block_id))
                writer.submit(obj, until, tenant)

    @torch.inference_mode()
    def _copy_out(self, block_id: int) -> bytes:
        """The block's KV bytes in the object's layout: every layer's block, in layer order."""
        if self._on_cpu:
            return np.concatenate([layer[block_id] for layer in self._bytes]).data
        kv = torch.stack([layer[block_id] for layer in self.layers]).cpu().contiguous()
        return kv.reshape(-1).view(torch.uint8).numpy().tobytes()

    def flush(self) -> None:
        """Waits until every queued write is done."""
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        """Stops listening to the pool, lets loads in flight end, finishes the queued writes and stops the
        threads (idempotent)."""
        if self._unsubscribe is None:
            return
        self._unsubscribe()
        self._unsubscribe = None
        atexit.unregister(self.close)
        self.loads.close()
        for writer in self.writers:
            writer.close()


def open_kv_tier(args, identity: BlockIdentity, config: ModelConfig, dtype: torch.dtype, manager: KVCacheManager,
                 kv_caches: list, prefill_seconds_per_block: Callable[[], float | None] = lambda: None
                 ) -> KVTier | None:
    """The chain of tiers ``args`` ask for: the disk (``kv_disk``), then the shared store (``kv_shared``); None
    for neither (``prefill_seconds_per_block``: the engine's measure, which sizes claims). ValueError with one line
    for a path, size or URL that cannot be used."""
    if not args.kv_disk and not args.kv_shared:
        return None
    if not args.enable_prefix_caching:
        option = "kv_disk" if args.kv_disk else "kv_shared"
        raise ValueError(f"{option} needs prefix caching (blocks are found by their hash)")
    if args.kv_disk_queue < 1:
        raise ValueError(f"kv_disk_queue must be >= 1, got {args.kv_disk_queue}")
    check_retention(args.kv_retention)
    budget = args.kv_retention_budget
    budget = parse_size(budget) if isinstance(budget, str) else budget
    spec = kv_spec(identity, config, dtype)
    stores: list[BlockStore] = []
    if args.kv_disk:
        size = parse_size(args.kv_disk_size) if isinstance(args.kv_disk_size, str) else int(args.kv_disk_size)
        disk = DiskStore(args.kv_disk, size, spec,
                         progress=lambda n: log.info("kv disk %s: scanned %d objects", args.kv_disk, n))
        log.info("kv disk %s: %d objects, %d of %d bytes", disk.root, disk.stats.num_objects, disk.usage_bytes, size)
        stores.append(disk)
    if args.kv_shared:
        shared = RedisStore(args.kv_shared, spec, timeout=args.kv_shared_timeout, key_prefix=args.kv_shared_prefix)
        log.info("kv shared tier %s: keys under %r", shared.url.redacted, shared.key_prefix)
        stores.append(shared)
    return KVTier(stores, spec, manager, kv_caches, args.kv_disk_queue, budget, prefill_seconds_per_block)
