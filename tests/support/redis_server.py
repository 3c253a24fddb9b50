"""A real `redis-server` for the shared-tier tests: on 127.0.0.1, a free port, persistence off, stopped by its pid.

`RedisServer(tmp).start()` waits until it answers PING; `kill()` is a SIGKILL, `restart()` starts it again on the
same port (empty: nothing was saved), `pause()`/`resume()` stop and continue the process (a server that answers
nothing: every call times out), `stop()` a SIGTERM. Extra `redis-server` options go to the constructor.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from support.servers import free_port

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None and not os.environ.get("CI"),
                                 reason="redis-server is not installed (apt-get install redis-server; .ci/run does)")


class RedisServer:
    def __init__(self, tmp: Path, *options: str, port: int | None = None):
        self.tmp, self.options, self.port = tmp, options, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client of this server ("another client of the same Redis")."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        assert REDIS_SERVER, "redis-server is not installed"
        log = open(self.tmp / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp), "--daemonize", "no", *self.options],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 20
        with self.client() as c:
            while True:
                try:
                    if c.ping():
                        return self
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.05)

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, as a crash: everything in it is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGKILL)
            self.proc.wait(10)

    def restart(self) -> RedisServer:
        """Killed and started again on the same port, empty."""
        self.kill()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a server too slow for any timeout)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
