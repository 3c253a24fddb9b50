"""Servers the tests share, one per configuration: a `kvprefix serve` is started once for each distinct set of
arguments, booting in the background ahead of the first test that uses it (a boot is seconds of imports and model
loading, which the tests before it overlap), and stopped with SIGTERM, its clean exit checked, when its scope ends.

A fixture made by `shared_server` names a configuration; two fixtures with the same one get the same server. A test
that changes a server for everyone after it (stops or restarts it, fills its queues on purpose) starts its own with
`start_server` instead.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.servers import Server, spawn_server, stop_server, wait_ready


@dataclass(frozen=True)
class ServerSpec:
    args: tuple[str, ...]
    request_log: bool = False
    api_keys: tuple[tuple[str, str], ...] = ()  # {key: tenant}, written to a file given as --api-keys-file
    builtin_model: bool = False  # the built-in default model (SmolLM2-135M-Instruct) instead of the tests' model


# Fixture name -> the configuration it serves, for every fixture made by shared_server (filled at collection).
SPECS: dict[str, ServerSpec] = {}


def shared_server(name: str, *args: str, request_log: bool = False, api_keys: dict[str, str] | None = None,
                  scope: str = "session", doc: str = ""):
    """A pytest fixture ``name`` that yields the server of this configuration. scope="module": the server is
    stopped at the end of the module, as a module's own server was; "session": at the end of the run."""
    spec = ServerSpec(tuple(args), request_log, tuple(sorted((api_keys or {}).items())))
    SPECS[name] = spec

    def fixture(server_registry: ServerRegistry) -> Iterator[Server]:
        yield server_registry.get(spec)
        if scope == "module":
            server_registry.stop(spec)

    fixture.__doc__ = doc
    return pytest.fixture(scope=scope, name=name)(fixture)


def specs_in_order_of_use(items: Iterable[pytest.Item]) -> list[ServerSpec]:
    """The configurations the collected tests use, in the order the run first needs them."""
    order: dict[ServerSpec, None] = {}
    for item in items:
        for name in item.fixturenames:
            if name in SPECS:
                order.setdefault(SPECS[name])
    return list(order)


def assert_clean_exit(server: Server) -> None:
    code = stop_server(server)
    log = server.log_path.read_text()
    assert code in (0, -15) and "Traceback" not in log, log


class ServerRegistry:
    # At most this many servers booted that no test has asked for yet: each idle one holds about half a GB.
    AHEAD = 2

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self._cond = threading.Condition()
        self._servers: dict[ServerSpec, Server] = {}
        self._failed: dict[ServerSpec, BaseException] = {}
        self._booting: set[ServerSpec] = set()
        self._queue: list[ServerSpec] = []
        self._asked: set[ServerSpec] = set()
        self._closed = False
        self._thread: threading.Thread | None = None

    def boot_ahead(self, specs: list[ServerSpec]) -> None:
        """Boots ``specs`` one after another in a background thread (one at a time: the machine may have 2 cores)."""
        with self._cond:
            self._queue = [s for s in specs if s not in self._servers and s not in self._booting]
        self._thread = threading.Thread(target=self._boot_queue, name="server-boot-ahead", daemon=True)
        self._thread.start()

    def get(self, spec: ServerSpec) -> Server:
        """The running server of ``spec``; started here if nothing booted it yet."""
        with self._cond:
            self._asked.add(spec)
            self._cond.notify_all()
            if spec in self._queue:
                self._queue.remove(spec)  # not booting yet: boot it here, now
            elif spec in self._booting or spec in self._servers or spec in self._failed:
                self._cond.wait_for(lambda: spec not in self._booting)
                if spec in self._failed:
                    raise self._failed[spec]
                return self._servers[spec]
            self._booting.add(spec)
        return self._boot(spec)

    def stop(self, spec: ServerSpec) -> None:
        with self._cond:
            server = self._servers.pop(spec)
        assert_clean_exit(server)

    def close(self) -> None:
        """Stops every server left, after the boot in progress; fails if any did not exit cleanly."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        errors = []
        for server in list(self._servers.values()):
            try:
                assert_clean_exit(server)
            except AssertionError as exc:
                errors.append(str(exc))
        self._servers.clear()
        assert not errors, "\n\n".join(errors)

    def _boot_queue(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self._queue or self._unasked() < self.AHEAD)
                if self._closed or not self._queue:
                    return
                spec = self._queue.pop(0)
                self._booting.add(spec)
            try:
                self._boot(spec)
            except Exception:  # recorded in _failed: get() raises it in the test that needs this server
                pass

    def _unasked(self) -> int:
        return sum(1 for s in self._servers if s not in self._asked)

    def _boot(self, spec: ServerSpec) -> Server:
        args = list(spec.args)
        if spec.api_keys:
            text = json.dumps(dict(spec.api_keys))
            keys = self.tmp / f"keys-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
            keys.write_text(text)
            args += ["--api-keys-file", str(keys)]
        try:
            server = wait_ready(spawn_server(self.tmp, *args, request_log=spec.request_log,
                                             builtin_model=spec.builtin_model))
        except BaseException as exc:
            with self._cond:
                self._failed[spec] = exc
                self._booting.discard(spec)
                self._cond.notify_all()
            raise
        with self._cond:
            self._servers[spec] = server
            self._booting.discard(spec)
            self._cond.notify_all()
        return server
