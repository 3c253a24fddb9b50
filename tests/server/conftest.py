"""The servers the tests share, one per configuration. `server`, `server_nocache` and `tenant_server` are the real app
over the real engine in this process (support/app_server.py), reached through an ASGI transport; the `*_process`
ones are real `kvprefix serve` processes on 127.0.0.1 for what needs a process (sockets, external tools, load;
server_registry.py: booted ahead in the background, stopped with SIGTERM at the end: a clean exit is part of the
test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.app_server import AppRegistry, AppServer
from support.server_registry import assert_clean_exit, shared_server
from support.servers import ADMIN_KEY, TENANT_KEYS, Server, start_server


@pytest.fixture(scope="session")
def server_tmp(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Path:
    """A folder for the servers a test starts itself (start_server) and their files."""
    return tmp_path_factory.mktemp("server")


DEFAULT = ("--num-gpu-blocks", "2048")
TENANCY = ("--admin-key", ADMIN_KEY, "--max-pending", "4", "--max-pending-per-tenant", "3", "--num-gpu-blocks", "256",
           "--request-log-prompts")


@pytest.fixture(scope="session")
def app_registry(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Iterator[AppRegistry]:
    """The in-process apps; at the end each is drained and shut down, and its log must hold no traceback."""
    registry = AppRegistry(tmp_path_factory.mktemp("apps"), default_model_dir)
    yield registry
    registry.close()


@pytest.fixture(scope="session")
def server(app_registry: AppRegistry) -> AppServer:
    """The default configuration (no keys: one shared namespace, admin open), with a request log; in-process."""
    return app_registry.get(DEFAULT, request_log=True)


@pytest.fixture(scope="session")
def server_nocache(app_registry: AppRegistry) -> AppServer:
    """The default configuration with prefix caching off; in-process."""
    return app_registry.get((*DEFAULT, "--no-enable-prefix-caching"))


@pytest.fixture(scope="session")
def tenant_server(app_registry: AppRegistry) -> AppServer:
    """Tenancy (three keys, two tenants), an admin key, small queues (4 pending, 3 per tenant), a small pool (256
    blocks: evictions happen) and a request log with raw prompts; in-process."""
    return app_registry.get(TENANCY, request_log=True, api_keys=TENANT_KEYS)


server_process = shared_server("server_process", *DEFAULT, request_log=True,
                               doc="`server`'s configuration in a `kvprefix serve` process.")

tenant_server_process = shared_server("tenant_server_process", *TENANCY, request_log=True, api_keys=TENANT_KEYS,
                                      doc="`tenant_server`'s configuration in a `kvprefix serve` process.")

tenants_without_admin = shared_server(
    "tenants_without_admin", "--num-gpu-blocks", "48", api_keys=TENANT_KEYS,
    doc="Tenants and no admin key: the admin endpoints (/metrics, KV events) refuse everyone.")


@pytest.fixture(scope="session")
def builtin_model_server(server_tmp: Path) -> Iterator[Server]:
    """The built-in default model (SmolLM2-135M-Instruct): for the slow tests of what a trained model does."""
    s = start_server(server_tmp, "--num-gpu-blocks", "512", builtin_model=True)
    yield s
    assert_clean_exit(s)
