"""Fixtures for the planner tests: the traces kept in tests/data/traces and a one-call replay."""

from pathlib import Path

import pytest

from kvprefix.sim.formats import load_trace
from kvprefix.sim.metrics import ReplaySummary, summarize
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace

TRACES = Path(__file__).parents[1] / "data" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return TRACES


@pytest.fixture(scope="session")
def load(traces_dir: Path):
    """Loads a trace of tests/data/traces by file name (cached for the session)."""
    cache: dict[tuple, Trace] = {}

    def _load(name: str, block_size: int | None = None) -> Trace:
        key = (name, block_size)
        if key not in cache:
            cache[key] = load_trace(traces_dir / name, block_size=block_size)
        return cache[key]

    return _load


def simulate(trace: Trace, **config) -> ReplaySummary:
    config.setdefault("capacity_blocks", None)
    cfg = ReplayConfig(**config)
    return summarize(trace, cfg, replay(trace, cfg))


@pytest.fixture
def run():
    return simulate
