"""Runs one replay per point of a grid over capacity, replicas and routing."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import replace

from kvprefix.sim.metrics import SINGLE, ReplaySummary, summarize
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace

# Below this many block references in all, a progress bar would only flicker.
PROGRESS_MIN_BLOCK_REFS = 2_000_000


def sweep(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    replicas: Sequence[int],
    routings: Sequence[str],
    base: ReplayConfig,
    progress: bool = True,
) -> list[ReplaySummary]:
    """Summaries for every (routing, replicas, capacity), in that nesting order; with one replica routing does
    not matter, so each capacity runs once."""
    grid: dict[tuple, ReplayConfig] = {}
    for r, n, c in itertools.product(routings, replicas, capacities_blocks):
        grid.setdefault((r if n > 1 else SINGLE, n, c), replace(base, routing=r, replicas=n, capacity_blocks=c))
    configs = list(grid.values())
    show = progress and len(configs) * trace.num_block_refs >= PROGRESS_MIN_BLOCK_REFS
    bar = None
    if show and len(configs) > 1:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc="configurations", unit="run", file=sys.stderr)
    out = []
    for config in configs:
        # One bar at a time: per request for a single long run, per configuration for a sweep.
        out.append(summarize(trace, config, replay(trace, config, progress=show and bar is None)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out
