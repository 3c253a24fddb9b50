"""Loads from the tiers below the pool that run beside the engine's steps, so a load never stalls other requests.

A request whose pool hits stop before its prompt does is probed: the chain of tiers is asked how many of the
following blocks it holds (inline when every tier answers from local state, as the disk does; on the loader
thread when a tier needs a round trip), fresh pool blocks are claimed for them, and the loader thread reads and
verifies each block straight into its pool block. Meanwhile the request keeps its place in the queue and the
engine steps the others; when the load is done the blocks are registered and the request is admitted with them
as hits. A request whose next blocks another request is loading waits for that load instead of loading them too.
Each request is probed once per position, so a request held back by the token budget does not ask again.
A block a tier turned out not to hold (a lookup stopped at it, or it did not load) is told to the tiers'
``TierPresence``: that is how a router learns what the shared tier evicted or expired.

Across replicas (docs/tiers.md#one-computation-per-fleet): the blocks a probe finds nowhere are claimed in the
shared tier (``BlockStore.claim``) before the request computes them. When another replica claimed the first of them,
the request waits for it: it keeps its place, is probed again every ``CLAIM_PROBE_SECONDS``, loads what appeared,
and computes the rest once no claim stands in its way or its deadline passes: as long as it would claim those
blocks for itself, twice what computing them takes by this replica's measure plus half a second.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvprefix.cache import KVCacheManager
from kvprefix.tiers import BlockStore, Expected
from kvprefix.tiers.presence import TierPresence

log = logging.getLogger(__name__)
CLAIM_PROBE_SECONDS = 0.05  # how often a request waiting on another replica's claims asks the tiers again
# How long a claim is held, and the longest a request waits for another's: twice the estimated compute (a mean of
# past steps, which prefills under a heavier load exceed) plus the claimant's writes, a probe and a round trip,
# within a floor and a cap.
CLAIM_FACTOR, CLAIM_MARGIN_SECONDS, CLAIM_SECONDS = 2.0, 0.5, (1.0, 60.0)
UNMEASURED_SECONDS_PER_BLOCK = 0.1  # assumed before this replica's first prefill is measured


class LoadState(enum.Enum):
    NONE = "none"  # nothing to load: admit the request with its pool hits
    WAIT = "wait"  # a load (its own or another request's) is in flight: keep its place, try next step
    LOADED = "loaded"  # blocks were just registered: look the request up again


@dataclass
class _Load:
    """One request's load: the blocks after its ``first`` pool hits, found then read into claimed pool blocks."""

    request: object
    first: int
    expected: list[Expected]
    future: Future
    sources: list[int] | None = None  # the tier of each leading block found (once the lookup is done)
    held: int = 0  # how many blocks after those another replica claimed (once the lookup is done)
    claimer: int = 0  # the tier whose claim that was
    hits: list = field(default_factory=list)  # the pool hits held while loading
    blocks: list | None = None  # the claimed pool blocks (once loading)
    abandoned: bool = False  # its request finished while loading: register what arrives, admit nobody


@dataclass
class _Wait:
    """A request waiting for blocks another replica claimed: from block ``start`` on, until ``deadline``."""

    tier: int  # the tier holding the claims (its stats count the wait)
    start: int
    began: float  # monotonic seconds
    deadline: float
    next_probe: float = 0.0


class TierLoads:
    """``prefill_seconds_per_block()``: this replica's measured prefill time of a block (None before the first),
    which sizes claims and waits; ``writes(block_hash)``: whether a block computed now will be written to the tiers
    (a request that keeps its blocks in memory claims nothing)."""

    def __init__(self, stores: Sequence[BlockStore], manager: KVCacheManager,
                 spans: Callable[[int], list[memoryview]], stage_in: Callable[[int], None],
                 presence: TierPresence | None = None,
                 prefill_seconds_per_block: Callable[[], float | None] = lambda: None,
                 writes: Callable[[bytes], bool] = lambda block_hash: True):
        self.stores, self.manager = list(stores), manager
        self.presence = presence
        self._per_block, self._writes = prefill_seconds_per_block, writes
        self._spans, self._stage_in = spans, stage_in
        self._local_lookup = all(getattr(store, "local_lookup", False) for store in self.stores)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvprefix-tier-loader")
        self._jobs: dict[str, _Load] = {}
        self._abandoned: list[_Load] = []
        self._in_flight: set[bytes] = set()  # block hashes some job is finding or loading
        self._waits: dict[str, _Wait] = {}  # requests waiting on other replicas' claims, by request id
        self._progress = threading.Event()
        self.hit_tokens = {store.name: 0 for store in self.stores}
        self.registering: dict[bytes, int] = {}  # while ``finish_load`` registers: each block's source tier

    # ---- the scheduler's side (engine thread)

    def poll(self, request, hits: list) -> LoadState:
        """Starts, advances or ends the load of ``request``'s blocks after its pool ``hits`` (looked up after
        ``reap``)."""
        job = self._jobs.get(request.request_id)
        if job is None:
            return self._start(request, hits)
        if not job.future.done():
            return LoadState.WAIT
        if job.blocks is None:  # found: claim pool blocks and read into them
            job.sources, job.held, job.claimer = self._result(job.future, ([], 0, 0))
            if len(hits) != job.first:  # the pool changed meanwhile: probe again from where it stands now
                self._end(job)
                return self._start(request, hits)
            self._claims_seen(job)
            return self._load(job, hits)
        loaded = self._finish(job)
        if request.request_id in self._waits:
            return LoadState.WAIT  # loaded what has arrived; the rest is still another replica's to compute
        return LoadState.LOADED if loaded else LoadState.NONE

    def forget(self, request) -> None:
        """``request`` finished or was aborted: a load in flight still completes (its blocks get registered)."""
        self._stop_waiting(request, "aborted")
        job = self._jobs.pop(request.request_id, None)
        if job is None:
            return
        if job.blocks is None:
            self._in_flight.difference_update(e.block_hash for e in job.expected)
        else:
            job.abandoned = True
            self._abandoned.append(job)

    def has_pending(self) -> bool:
        return bool(self._jobs or self._abandoned or self._waits)

    def wait(self, timeout: float) -> None:
        """Blocks until a load makes progress, a waiting request is due to be probed again, or ``timeout`` passes
        (the engine, when nothing else can run)."""
        self._progress.clear()
        if any(job.future.done() for job in [*self._jobs.values(), *self._abandoned]):
            return
        if self._waits:
            due = min(w.next_probe for w in self._waits.values()) - time.monotonic()
            timeout = min(timeout, max(0.0, due))
        self._progress.wait(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    # ---- steps of one load

    def _start(self, request, hits: list) -> LoadState:
        bs = self.manager.block_size
        first, last = len(hits), (request.num_tokens - 1) // bs  # its last token is always computed
        wait = self._waits.get(request.request_id)
        if request.hasher is None or first >= last:
            self._stop_waiting(request, "loaded")  # what it waited for is in the pool now
            return LoadState.NONE
        if wait is not None:
            now = time.monotonic()
            if now >= wait.deadline:  # computing them itself is as quick now: it does, from here
                self._stop_waiting(request, "gave_up")
                request.tier_probe = (first, last)
                return LoadState.NONE
            if now < wait.next_probe:
                return LoadState.WAIT
        elif request.tier_probe == (first, last):
            return LoadState.NONE
        hashes = request.block_hashes[first:last]
        if self._in_flight.intersection(hashes[:1]):
            return LoadState.WAIT  # another request is loading them: they will be pool hits
        request.tier_probe = (first, last)
        expected = [self._expected(request, first + i) for i in range(len(hashes))]
        args = (hashes, request.hasher.namespace_id, self._writes(hashes[0]), self._per_block())
        if self._local_lookup:
            future: Future = Future()
            future.set_result(self._find(*args))
        else:
            future = self._submit(self._find, *args)
        job = _Load(request, first, expected, future)
        self._jobs[request.request_id] = job
        self._in_flight.update(hashes)
        return self.poll(request, hits) if future.done() else LoadState.WAIT

    def _load(self, job: _Load, hits: list) -> LoadState:
        waiting = LoadState.WAIT if job.request.request_id in self._waits else LoadState.NONE
        if not job.sources:
            self._end(job)
            return waiting
        job.hits = list(hits)
        job.blocks = self.manager.claim_for_load(job.request, job.hits, len(job.sources))
        if not job.blocks:  # no free pool block to load into
            self.manager.finish_load(job.request, job.hits, job.blocks, 0)
            self._end(job)
            return waiting
        job.future = self._submit(self._read, job.expected, job.sources, [b.block_id for b in job.blocks])
        return LoadState.WAIT

    def _finish(self, job: _Load) -> int:
        """Registers the blocks that verified, releases the rest; returns how many were loaded."""
        loaded = self._result(job.future, 0)
        request, bs = job.request, self.manager.block_size
        self.registering = {e.block_hash: k for e, k in zip(job.expected, job.sources[:loaded], strict=False)}
        try:
            self.manager.finish_load(request, job.hits, job.blocks, loaded)
        finally:
            self.registering = {}
            self._end(job)
        found = job.sources[:loaded]
        for k, store in enumerate(self.stores):
            tokens = found.count(k) * bs
            if not tokens:
                continue
            self.hit_tokens[store.name] += tokens
            if request.num_cached_tokens < 0 and not job.abandoned:  # its first admission: cached tokens say so
                request.tier_tokens[store.name] = request.tier_tokens.get(store.name, 0) + tokens
        if loaded < len(job.sources):  # stopped at a block that did not verify: do not ask for it again
            request.tier_probe = (job.first + loaded, request.tier_probe[1])
            self._stop_waiting(request, "gave_up")
        return loaded

    # ---- waits on other replicas' claims

    def _claims_seen(self, job: _Load) -> None:
        """Starts, continues or ends ``job``'s request's wait, by what its probe found claimed by others."""
        request, now = job.request, time.monotonic()
        wait = self._waits.get(request.request_id)
        position = job.first + len(job.sources)  # the first block found nowhere
        if job.held:
            if wait is None:
                deadline = now + self._hold_seconds(job.held, self._per_block())
                wait = self._waits[request.request_id] = _Wait(job.claimer, position, now, deadline)
            wait.next_probe = now + CLAIM_PROBE_SECONDS
        elif wait is not None:
            self._stop_waiting(request, "loaded" if position > wait.start else "unclaimed")

    def _stop_waiting(self, request, outcome: str) -> None:
        wait = self._waits.pop(request.request_id, None)
        if wait is not None:
            stats = self.stores[wait.tier].stats
            with stats.lock:
                stats.claim_waits[outcome] += 1
            now = time.monotonic()
            log.debug("request %s waited %.3f s (of at most %.3f s) for blocks claimed elsewhere: %s",
                      request.request_id, now - wait.began, wait.deadline - wait.began, outcome)

    @staticmethod
    def _hold_seconds(blocks: int, per_block: float | None) -> float:
        """How long this replica claims ``blocks`` blocks for, and waits at most for another's claims of them:
        twice what it takes to prefill them by ``per_block`` (its measure), plus a margin, within bounds."""
        floor, cap = CLAIM_SECONDS
        compute = blocks * (per_block or UNMEASURED_SECONDS_PER_BLOCK)
        return min(cap, max(floor, CLAIM_FACTOR * compute + CLAIM_MARGIN_SECONDS))

    def _end(self, job: _Load) -> None:
        if self._jobs.get(job.request.request_id) is job:
            del self._jobs[job.request.request_id]
        self._in_flight.difference_update(e.block_hash for e in job.expected)

    def reap(self) -> None:
        """Registers what finished loads of finished requests brought (before this step's lookups)."""
        for job in [job for job in self._abandoned if job.future.done()]:
            self._abandoned.remove(job)
            self._finish(job)

    def _expected(self, request, i: int) -> Expected:
        bs, hashes = self.manager.block_size, request.block_hashes
        return Expected(hashes[i], hashes[i - 1] if i else request.hasher.root, request.hasher.namespace_id,
                        tuple(request.token_ids[i * bs : (i + 1) * bs]))

    # ---- the loader thread

    def _submit(self, fn, *args) -> Future:
        future = self._executor.submit(fn, *args)
        future.add_done_callback(lambda _: self._progress.set())
        return future

    def _find(self, hashes: Sequence[bytes], namespace: str, claim: bool = False,
              per_block: float | None = None) -> tuple[list[int], int, int]:
        """The tier holding each leading block of ``hashes`` (each tier is asked for what the ones before lack);
        then, if ``claim``, the blocks found nowhere are claimed (``_hold_seconds``): how many leading ones of them
        another replica claimed first, and in which tier."""
        sources: list[int] = []
        for k, store in enumerate(self.stores):
            rest = hashes[len(sources):]
            num = store.lookup(rest, namespace)
            sources += [k] * num
            if num < len(rest):
                self._missing(store, rest[num])
            if len(sources) == len(hashes):
                return sources, 0, 0
        rest = hashes[len(sources):]
        if not claim:
            return sources, 0, 0
        seconds = self._hold_seconds(len(rest), per_block)
        held = [store.claim(rest, namespace, seconds) for store in self.stores]
        tier = max(range(len(held)), key=held.__getitem__)
        return sources, held[tier], tier

    def _missing(self, store: BlockStore, block_hash: bytes) -> None:
        """``store`` does not hold the block (or not in a form that loads): if it was announced, it no longer is."""
        if self.presence is not None:
            self.presence.removed(store.medium, [block_hash])

    def _read(self, expected: list[Expected], sources: list[int], block_ids: list[int]) -> int:
        """Reads and verifies blocks in order into ``block_ids``; returns how many verified (a block that does not
        is left out, and so is everything after it: a chain continues only from a verified parent)."""
        spent = [0.0] * len(self.stores)  # seconds of this run, by tier (each tier's load latency)
        try:
            for i, block_id in enumerate(block_ids):
                start = time.perf_counter()
                ok = self.stores[sources[i]].load_into(expected[i], self._spans(block_id))
                if ok:
                    self._stage_in(block_id)
                spent[sources[i]] += time.perf_counter() - start
                if not ok:
                    self._missing(self.stores[sources[i]], expected[i].block_hash)
                    return i
            return len(block_ids)
        finally:
            for store, seconds in zip(self.stores, spent, strict=True):
                if seconds:
                    with store.stats.lock:
                        store.stats.load_seconds.observe(seconds)

    @staticmethod
    def _result(future: Future, default):
        try:
            return future.result()
        except Exception:  # a tier that fails is a miss, never an error of the request
            log.exception("kv tier load failed")
            return default
