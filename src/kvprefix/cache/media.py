"""Where a replica holds a block (the ``medium`` of its KV events) and what loading one from a tier below the pool
costs, in blocks of prefill, so a router can weigh a block on a replica's disk or in the shared tier.

The names are vLLM's where vLLM has one (``vllm.distributed.kv_events``: ``BlockStored.medium``,
``BlockRemoved.medium``): its block pool announces its own blocks as ``"GPU"`` (``MEDIUM_GPU``), and its offloading
connector's disk medium is ``"Disk"``. kvprefix's pool is that pool whatever its device, so it is ``"GPU"`` on a CPU
engine too. The shared tier has no vLLM name: ``"Shared"``. docs/kv-events.md, docs/router.md.
"""

from __future__ import annotations

from dataclasses import dataclass

POOL = "GPU"  # the engine's own block pool (vLLM's MEDIUM_GPU), on any device
DISK = "Disk"  # the local disk tier, `--kv-disk`
SHARED = "Shared"  # the shared tier every replica of a fleet reads, `--kv-shared`
MEDIA = (POOL, DISK, SHARED)

# A block loaded from a tier costs this many blocks of prefill until the replica has measured both: about what the
# benchmarks measured on this CPU (docs/benchmarks.md: a 2,000-token prefix from the disk 0.092x, from the shared tier
# on loopback 0.088x the TTFT of computing it), rounded up.
DEFAULT_LOAD_COST = 0.1
# A tier hit is never free (loading takes time) and never worth less than a miss: a tier measured slower than
# recomputing is credited as a miss (the replica still loads it; a router should not send a request there for it).
MIN_LOAD_COST, MAX_LOAD_COST = 0.01, 1.0


def load_cost(load_seconds_per_block: float | None, prefill_seconds_per_block: float | None) -> float:
    """Blocks of prefill that loading one block costs: the replica's mean seconds to load and verify a block from the
    tier over its mean seconds to prefill one, kept within [MIN_LOAD_COST, MAX_LOAD_COST]; ``DEFAULT_LOAD_COST``
    until both have been measured."""
    if not load_seconds_per_block or not prefill_seconds_per_block:
        return DEFAULT_LOAD_COST
    return min(MAX_LOAD_COST, max(MIN_LOAD_COST, load_seconds_per_block / prefill_seconds_per_block))


@dataclass(frozen=True)
class Medium:
    """One place a replica holds blocks, as its event stream's hello announces it. ``capacity_blocks``: how many
    blocks it can hold (None: unknown or unbounded); ``load_cost``: blocks of prefill per block loaded from it (0 for
    the pool); ``store``: for the shared tier, which store it is (replicas that name the same one load each other's
    blocks)."""

    name: str
    capacity_blocks: int | None = None
    load_cost: float = 0.0
    store: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "capacity_blocks": self.capacity_blocks, "load_cost": self.load_cost,
                "store": self.store}

    @classmethod
    def from_dict(cls, d: dict) -> Medium:
        return cls(d["name"], d.get("capacity_blocks"), float(d.get("load_cost", 0.0)), d.get("store", ""))
