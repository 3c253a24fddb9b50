"""The engine's side of a tier below the pool: copies KV between the paged tensors and verified block objects.

Loads: after the pool's run of hits stops, the tier is asked for the following run (``load_following``); the
blocks it holds are read and verified one by one, their KV bytes copied exactly into fresh pool blocks, which are
then registered like computed blocks, so the request's next lookup hits them and prefill starts at the first block
found nowhere. Writes: every block the pool registers (``BlockStored``) that the tier lacks is copied out and
queued to the write-behind thread; a full queue drops it (counted), a step never waits for the disk.
Retention: ``admit`` checks a request's retention against its tenant's budget and notes it for the request's
blocks not yet in the pool, which the writes then honour (docs/tiers.md#retention).
"""

from __future__ import annotations

import atexit
import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from kvprefix.cache import KVCacheManager
from kvprefix.cache.events import BlockStored
from kvprefix.cache.identity import BlockIdentity
from kvprefix.model import ModelConfig
from kvprefix.tiers import BlockObject, BlockStore, DiskStore, Expected, KVSpec, parse_size
from kvprefix.tiers.objects import object_bytes
from kvprefix.tiers.retention import IN_MEMORY, check_retention, retained_seconds
from kvprefix.tiers.write_behind import WriteBehind

log = logging.getLogger(__name__)
MAX_NOTED_BLOCKS = 1 << 16  # retentions noted for blocks not yet registered (an aborted request's are dropped oldest first)


def kv_spec(identity: BlockIdentity, config: ModelConfig, dtype: torch.dtype) -> KVSpec:
    """What this engine's block KV depends on beside its tokens (the object header's identity fields)."""
    return KVSpec(model=identity.context.model, kv_dtype=identity.context.kv_dtype,
                  element_size=torch.empty((), dtype=dtype).element_size(), block_size=identity.block_size,
                  num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                  head_size=config.head_dim)


class KVTier:
    """One tier under one engine's pool: loads into it at admission, writes behind it after each step."""

    def __init__(self, store: BlockStore, spec: KVSpec, manager: KVCacheManager, kv_caches: list,
                 max_queue: int = 256, retention_budget: int | None = None):
        self.store, self.spec, self.manager = store, spec, manager
        self.retention_budget = store.max_bytes // 2 if retention_budget is None else retention_budget
        self._noted: OrderedDict[bytes, tuple[str, str]] = OrderedDict()  # block hash -> (retention, tenant)
        self.layers = [layer.kv for layer in kv_caches]  # each [num_blocks, block_size, 2 * kv_heads, head_size]
        # Byte views of each layer's blocks: on CPU the paged tensors themselves (loads read straight into them,
        # stores copy out of them), elsewhere one host block that loads stage through.
        cpu = self.layers[0].device.type == "cpu"
        host = self.layers if cpu else [torch.empty_like(layer[0], device="cpu") for layer in self.layers]
        self._bytes = [t.view(torch.uint8).numpy().reshape(t.shape[0] if cpu else 1, -1) for t in host]
        self._on_cpu = cpu
        self.hit_tokens = 0  # tokens loaded into the pool (counted as cached at admission)
        self.writer = WriteBehind(store, max_queue)
        self._loading = False  # blocks registered by a load are on the tier already: not written back
        self._unsubscribe = manager.events.subscribe(self._on_event)
        atexit.register(self.close)

    # ---- retention

    def admit(self, retention: str | None, tenant: str, namespace: str, block_hashes: list) -> None:
        """Notes a new request's ``retention`` for its prompt blocks not in the pool (held ones are retained
        now); ValueError when a duration would take ``tenant`` past its retained-bytes budget."""
        if retention is None:
            return
        seconds = retained_seconds(retention)
        if seconds is not None:
            need = len(block_hashes) * object_bytes(self.spec, namespace, len(block_hashes[0]) if block_hashes else 0)
            held = self.store.retained_bytes(tenant, besides=block_hashes)
            if held + need > self.retention_budget:
                raise ValueError(
                    f"retention {retention!r} of this prompt's {len(block_hashes)} blocks ({need} bytes) would take "
                    f"tenant {tenant or 'default'!r} past its {self.retention_budget}-byte budget of retained KV "
                    f"({held} bytes held; --kv-retention-budget)")
        cached, until = self.manager.pool.cached_blocks, time.time() + (seconds or 0)
        for block_hash in block_hashes:
            if seconds is not None and self.store.contains(block_hash):
                self.writer.submit_retain(block_hash, until, tenant)
            elif block_hash not in cached:
                self._noted[block_hash] = (retention, tenant)
                self._noted.move_to_end(block_hash)
        while len(self._noted) > MAX_NOTED_BLOCKS:
            self._noted.popitem(last=False)

    # ---- loads

    def load_following(self, request, hits: list) -> int:
        """Loads the request's blocks after its pool ``hits`` that the tier holds (leaving its last token to
        compute) into the pool; returns how many were loaded and registered."""
        bs = self.manager.block_size
        first, last = len(hits), (request.num_tokens - 1) // bs
        hashes = request.block_hashes[first:last]
        if not hashes or request.hasher is None:
            return 0
        num = self.store.lookup(hashes)
        if not num:
            return 0
        blocks = self.manager.claim_for_load(request, hits, num)
        loaded, start = 0, time.perf_counter()
        try:
            for block in blocks:  # registered (finish_load) only if it verifies: else its bytes are never read
                if not self.store.load_into(self._expected(request, first + loaded), self._spans(block.block_id)):
                    break
                self._stage_in(block.block_id)
                loaded += 1
        finally:
            self._loading = True
            try:
                self.manager.finish_load(request, hits, blocks, loaded)
            finally:
                self._loading = False
        self.hit_tokens += loaded * bs
        with self.store.stats.lock:
            self.store.stats.load_seconds.observe(time.perf_counter() - start)
        if loaded and request.num_cached_tokens < 0:  # loaded for its first admission: its cached tokens say so
            name = self.store.name
            request.tier_tokens[name] = request.tier_tokens.get(name, 0) + loaded * bs
        return loaded

    def _expected(self, request, i: int) -> Expected:
        bs, hashes = self.manager.block_size, request.block_hashes
        return Expected(hashes[i], hashes[i - 1] if i else request.hasher.root, request.hasher.namespace_id,
                        tuple(request.token_ids[i * bs : (i + 1) * bs]))

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

    # ---- writes

    def _on_event(self, event) -> None:
        if self._loading or not isinstance(event, BlockStored) or event.token_ids is None:
            return
        pool, bs = self.manager.pool, self.manager.block_size
        parent = event.parent_block_hash
        for k, block_hash in enumerate(event.block_hashes):
            block = pool.cached_blocks.get(block_hash)
            prev, parent = parent, block_hash
            retention, tenant = self._noted.pop(block_hash, (None, ""))
            if block is None or prev is None or retention == IN_MEMORY or self.store.contains(block_hash):
                continue
            if not self.writer.has_room():
                self.writer.drop()
                continue
            tokens = tuple(event.token_ids[k * bs : (k + 1) * bs])
            seconds = retained_seconds(retention)
            self.writer.submit(BlockObject(self.spec, event.namespace, block_hash, prev, tokens,
                                           self._copy_out(block.block_id)),
                               None if seconds is None else time.time() + seconds, tenant)

    @torch.inference_mode()
    def _copy_out(self, block_id: int) -> bytes | memoryview:
        """The block's KV bytes in the object's layout: every layer's block, in layer order."""
        if self._on_cpu:
            return memoryview(np.concatenate([layer[block_id] for layer in self._bytes]))
        kv = torch.stack([layer[block_id] for layer in self.layers]).cpu().contiguous()
        return kv.reshape(-1).view(torch.uint8).numpy().tobytes()

    def flush(self) -> None:
        """Waits until every queued write is done."""
        self.writer.flush()

    def close(self) -> None:
        """Stops listening to the pool, finishes the queued writes and stops the writer (idempotent)."""
        if self._unsubscribe is None:
            return
        self._unsubscribe()
        self._unsubscribe = None
        atexit.unregister(self.close)
        self.writer.close()


def open_kv_tier(args, identity: BlockIdentity, config: ModelConfig, dtype: torch.dtype, manager: KVCacheManager,
                 kv_caches: list) -> KVTier | None:
    """The tier ``args`` ask for (``kv_disk``), or None; ValueError with one line for a path or size that cannot
    be used."""
    if not args.kv_disk:
        return None
    if not args.enable_prefix_caching:
        raise ValueError("kv_disk needs prefix caching (blocks are found by their hash)")
    size = parse_size(args.kv_disk_size) if isinstance(args.kv_disk_size, str) else int(args.kv_disk_size)
    budget = args.kv_retention_budget
    budget = parse_size(budget) if isinstance(budget, str) else budget
    check_retention(args.kv_retention)
    if args.kv_disk_queue < 1:
        raise ValueError(f"kv_disk_queue must be >= 1, got {args.kv_disk_queue}")
    store = DiskStore(args.kv_disk, size, kv_spec(identity, config, dtype),
                      progress=lambda n: log.info("kv disk %s: scanned %d objects", args.kv_disk, n))
    log.info("kv disk %s: %d objects, %d of %d bytes", store.root, store.stats.num_objects, store.usage_bytes, size)
    return KVTier(store, store.spec, manager, kv_caches, args.kv_disk_queue, budget)
