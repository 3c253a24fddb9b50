"""Fixtures for the planner tests: the shared traces and a one-call replay."""

import os
from pathlib import Path

import pytest

from kvprefix.sim.formats import load_trace
from kvprefix.sim.metrics import ReplaySummary, summarize
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace

# The traces live beside the project (../shared/traces), never inside it; KVPREFIX_TRACES_DIR overrides.
TRACES = Path(os.environ.get("KVPREFIX_TRACES_DIR", Path(__file__).parents[3] / "shared" / "traces"))


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    # Fail, not skip: the published-number oracles are the point of these tests and must not vanish quietly.
    if not TRACES.is_dir():
        pytest.fail(f"shared traces not found at {TRACES}; put ../shared beside the checkout or set KVPREFIX_TRACES_DIR")
    return TRACES


@pytest.fixture(scope="session")
def load(traces_dir: Path):
    """Loads a shared trace by file name (cached for the session)."""
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
