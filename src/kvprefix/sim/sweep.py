"""Runs one replay per point of a grid over capacity, replicas and routing."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import replace

from kvprefix.sim.metrics import ReplaySummary, summarize
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
    """Summaries for every (routing, replicas, capacity), in that nesting order."""
    grid = list(itertools.product(routings, replicas, capacities_blocks))
    configs = [replace(base, routing=r, replicas=n, capacity_blocks=c) for r, n, c in grid]
    show = progress and len(configs) * trace.num_block_refs >= PROGRESS_MIN_BLOCK_REFS
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc="configurations", unit="run", file=sys.stderr)
    out = []
    for config in configs:
        out.append(summarize(trace, config, replay(trace, config, progress=show)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return out
