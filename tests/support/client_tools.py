"""Running the external clients (guidellm, aiperf, lm-evaluation-harness) against a `kvprefix serve` process: each
lives in its own environment made by `bash benchmarks/client_envs.sh`; without it a test skips, except in CI,
where .ci/run creates them all and a missing one is a failure. ServerWindow reads what the server counted and
logged over one tool run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvprefix.logs.request_log import iter_records
from support.servers import Server

ROOT = Path(__file__).resolve().parents[2]
HITS = "kvprefix:prefix_cache_hits_total"
QUERIES = "kvprefix:prefix_cache_queries_total"
SERVED = "kvprefix:request_success_total{length}"


def tool(name: str) -> Path:
    """The tool's executable in `.venv-NAME`; skips (fails under CI) when the environment is missing."""
    path = ROOT / f".venv-{name}" / "bin" / name
    if not path.exists():
        message = f"{path} is missing: run `bash benchmarks/client_envs.sh {name}`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_tool(cmd: list, cwd: Path, timeout: float = 300, **env_vars: str) -> str:
    """Runs a tool to completion in ``cwd`` and returns its output; fails the test on a non-zero exit."""
    # The tools' own environment only: nothing of ours on their path, and an empty Hugging Face cache (the
    # tokenizer is a local directory; HF_HUB_OFFLINE=1 would break aiperf 0.13.0, which then looks every
    # tokenizer up in the hub cache, local directories too).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HOME=str(cwd / "hf-home"), **env_vars)
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    return out


class ServerWindow:
    """The server's counters and request-log records over one tool run (the server is shared with other tests)."""

    def __init__(self, server: Server):
        self.server = server
        self.before = server.wait_idle()
        self.log_lines = self._lines()

    def _lines(self) -> int:
        return len(self.server.request_log.read_text().splitlines())

    def close(self) -> tuple[dict[str, float], list]:
        after = self.server.wait_idle()
        delta = {k: after[k] - self.before[k] for k in (HITS, QUERIES, SERVED)}
        records = [r for line, r in iter_records(self.server.request_log) if line > self.log_lines]
        return delta, records
