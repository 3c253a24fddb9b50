"""Real `kvprefix serve` processes on 127.0.0.1, started once per session and stopped with SIGTERM (a clean exit
is part of the test)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import ADMIN_KEY, TENANT_KEYS, Server, start_server, stop_server


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Path:
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def server(server_tmp: Path) -> Iterator[Server]:
    """The default configuration (no keys: one shared namespace, admin open), with a request log."""
    s = start_server(server_tmp, "--num-gpu-blocks", "2048", request_log=True)
    yield s
    assert stop_server(s) in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()


@pytest.fixture(scope="session")
def server_nocache(server_tmp: Path) -> Iterator[Server]:
    s = start_server(server_tmp, "--num-gpu-blocks", "2048", "--no-enable-prefix-caching")
    yield s
    assert stop_server(s) in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()


@pytest.fixture(scope="session")
def tenant_server(server_tmp: Path) -> Iterator[Server]:
    """Tenancy (three keys, two tenants), an admin key, small queues (4 pending, 3 per tenant), a small pool
    (256 blocks: evictions happen) and a request log with raw prompts."""
    keys = server_tmp / "keys.json"
    keys.write_text(json.dumps(TENANT_KEYS))
    s = start_server(server_tmp, "--api-keys-file", str(keys), "--admin-key", ADMIN_KEY, "--max-pending", "4",
                     "--max-pending-per-tenant", "3", "--num-gpu-blocks", "256", "--request-log-prompts",
                     request_log=True)
    yield s
    assert stop_server(s) in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()



@pytest.fixture(scope="session")
def builtin_model_server(server_tmp: Path) -> Iterator[Server]:
    """The built-in default model (SmolLM2-135M-Instruct): for the slow tests of what a trained model does."""
    s = start_server(server_tmp, "--num-gpu-blocks", "512", builtin_model=True)
    yield s
    assert stop_server(s) in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()
