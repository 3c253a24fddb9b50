"""Real `kvprefix serve` processes on 127.0.0.1, one per configuration, shared by every test that names it
(server_registry.py: booted ahead in the background, stopped with SIGTERM at the end: a clean exit is part of the
test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.server_registry import assert_clean_exit, shared_server
from support.servers import ADMIN_KEY, TENANT_KEYS, Server, start_server


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Path:
    """A folder for the servers a test starts itself (start_server) and their files."""
    return tmp_path_factory.mktemp("server")


server = shared_server("server", "--num-gpu-blocks", "2048", request_log=True,
                       doc="The default configuration (no keys: one shared namespace, admin open), with a request log.")

server_nocache = shared_server("server_nocache", "--num-gpu-blocks", "2048", "--no-enable-prefix-caching")

tenant_server = shared_server(
    "tenant_server", "--admin-key", ADMIN_KEY, "--max-pending", "4", "--max-pending-per-tenant", "3",
    "--num-gpu-blocks", "256", "--request-log-prompts", request_log=True, api_keys=TENANT_KEYS,
    doc="Tenancy (three keys, two tenants), an admin key, small queues (4 pending, 3 per tenant), a small pool "
        "(256 blocks: evictions happen) and a request log with raw prompts.")

tenants_without_admin = shared_server(
    "tenants_without_admin", "--num-gpu-blocks", "48", api_keys=TENANT_KEYS,
    doc="Tenants and no admin key: the admin endpoints (/metrics, KV events) refuse everyone.")


@pytest.fixture(scope="session")
def builtin_model_server(server_tmp: Path) -> Iterator[Server]:
    """The built-in default model (SmolLM2-135M-Instruct): for the slow tests of what a trained model does."""
    s = start_server(server_tmp, "--num-gpu-blocks", "512", builtin_model=True)
    yield s
    assert_clean_exit(s)
