"""How many threads a `kvprefix serve` process gives PyTorch's CPU ops (``EngineArgs.cpu_threads``):
``--cpu-threads``, else ``OMP_NUM_THREADS``, else one per physical core the process may run on, less one. The core
left over runs the rest of the process (the event loop, tokenizer, tier writers) and whatever shares the machine:
the ops' OpenMP threads wait for each other at every op, spinning, so one thread losing its core stalls all of them
(docs/model.md#cpu-threads)."""

from __future__ import annotations

import os
from pathlib import Path


def serving_threads(requested: int | None) -> int:
    """The thread count for ``requested`` (None: the default above)."""
    if requested is not None:
        return requested
    from_env = os.environ.get("OMP_NUM_THREADS", "")
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env)
    return max(1, physical_cores() - 1)


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (hyperthread siblings count once); the CPU count where
    Linux's topology files cannot be read."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text(), (topology / "core_id").read_text()))
        except OSError:
            return len(cpus)
    return len(cores)
