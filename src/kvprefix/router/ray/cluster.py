"""The Ray cluster `kvprefix serve --ray` runs on: one it joins (``--ray-address``), left running on exit, or a
local one it starts, every process of which it stops on exit, however the exit comes (SIGTERM, Ctrl-C, an error).

Ray's own shutdown stops the processes the driver started (GCS, raylet, dashboard, monitors), not all of those
the raylet started: its DashboardAgent and RuntimeEnvAgent ignore SIGTERM and outlive it for about a minute,
orphaned. So the local cluster is every descendant of this process, followed until each has exited: those left
after Ray's shutdown get SIGTERM, then SIGKILL after a grace period."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil
import ray

log = logging.getLogger("kvprefix.router.ray")
GRACE_S = 5.0  # how long a process left after Ray's shutdown has between SIGTERM and SIGKILL


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _with_children(processes: Iterable[psutil.Process]) -> set[psutil.Process]:
    """``processes`` and every running descendant of theirs (those started since they were last looked at)."""
    found = set(processes)
    for process in list(found):
        try:
            found.update(process.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return {p for p in found if _running(p)}


def _wait(processes: set[psutil.Process], timeout_s: float) -> set[psutil.Process]:
    """Those of ``processes`` (and their children) still running after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (processes := _with_children(processes)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return processes


def stop_processes(processes: set[psutil.Process], grace_s: float = GRACE_S) -> None:
    """Stops ``processes`` and their children: SIGTERM to each, SIGKILL to what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        processes = _with_children(processes)
        for process in processes:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if not (processes := _wait(processes, wait_s)):
            return
    log.warning("processes of the local Ray cluster still running after SIGKILL: %s",
                ", ".join(str(p.pid) for p in processes))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the server as Ctrl-C does: through the `finally` blocks


@contextmanager
def ray_cluster(address: str | None) -> Iterator[None]:
    """Connected to the cluster at ``address`` (``auto`` or HEAD:PORT), or to a new local one when None, for the
    block's duration; SIGTERM interrupts the block as Ctrl-C does. On exit it disconnects and, for a local
    cluster, stops every process of it."""
    own = psutil.Process()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ray.init(address=address, include_dashboard=False)
        # Ray's driver handler would stop the raylet at once (and with it the replicas, before Serve drains them)
        signal.signal(signal.SIGTERM, _interrupt)
        yield
    finally:
        # A second Ctrl-C or SIGTERM would cut the stop short and leave the cluster running: it waits for this
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            cluster = own.children(recursive=True) if address is None else []
            ray.shutdown()
            if left := _with_children(cluster):
                log.info("stopping %d processes of the local Ray cluster left after its shutdown", len(left))
                stop_processes(left)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
