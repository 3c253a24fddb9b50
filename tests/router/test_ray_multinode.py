"""Ray Serve on a cluster started as docs/router.md says for more than one machine, here on one: a head
(`ray start --head`), a second node joining it (`ray start --address HEAD:PORT`, its own ports), then
`kvprefix serve --ray --ray-address HEAD:PORT --replicas 2` deploying onto it. Each node offers one CPU and each
replica takes one, so Ray must place one replica on each node; Ray's state API says where each one runs, and
the `openai` client is answered by both."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from support.routers import shared_prefix_traffic
from support.servers import free_port

ray = pytest.importorskip("ray")
RAY = str(Path(sys.executable).with_name("ray"))
SRC = Path(__file__).resolve().parents[2] / "src"
MODEL = "default-model-v1"
START_TIMEOUT_S = 600  # Ray and two replicas start slowly on a loaded 2-core machine


@dataclass
class RayCluster:
    address: str  # HEAD_IP:PORT, what `ray start --address` and `--ray-address` take
    dashboard: str  # the state API's address
    env: dict[str, str]  # what the nodes' workers import: this tree's kvprefix


def node_env() -> dict[str, str]:
    """Every node imports kvprefix from this tree, as every machine of a real cluster must have it installed."""
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Token auth off (the nodes listen on 127.0.0.1 only): Ray 2.60 turns it on by itself once ~/.ray/auth_token
    # exists (a local ray.init writes one), and with it this test's head kept missing Ray's 30 s start deadline
    env["RAY_AUTH_MODE"] = "disabled"
    return env


def ray_start(log: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    """`ray start --block`: the node's processes live as long as this one; SIGTERM drains and stops them (unlike
    `ray stop`, which would stop every Ray node on the machine, other sessions' included)."""
    ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    cmd = [RAY, "start", "--block", "--num-cpus", "1", "--node-ip-address", "127.0.0.1",
           "--object-store-memory", str(200 * 2**20), "--min-worker-port", "0", "--max-worker-port", "0",
           *[a for p in ports for a in (p, str(free_port()))], *args]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen, timeout: float = 90) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alive_nodes(dashboard: str) -> list:
    from ray.util.state import list_nodes

    try:
        return list_nodes(address=dashboard, filters=[("state", "=", "ALIVE")])
    except Exception:  # the dashboard (the state API's server) is not up yet
        return []


def wait_for(what: str, ready, procs: list[subprocess.Popen], logs: list[Path], timeout: float = START_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while not (result := ready()):
        dead = [log for p, log in zip(procs, logs, strict=True) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'exited' if dead else 'timed out'}\n" +
                               "\n".join(f"--- {log}\n{log.read_text()[-4000:]}" for log in dead or logs))
        time.sleep(1)
    return result


def started(what: str, start, ready, procs: list[subprocess.Popen], logs: list[Path], attempts: int = 3):
    """Starts a node with ``start()`` (a process and its log) until ``ready()``: again, twice at most, when
    `ray start` gave up by itself (Ray waits a fixed 30 s for a new raylet to register, which this loaded machine
    can miss); the process that came up is added to ``procs``."""
    for attempt in range(attempts):
        proc, log = start()
        procs.append(proc)
        logs.append(log)
        try:
            return wait_for(what, ready, procs, logs)
        except RuntimeError:
            if proc.poll() is None or attempt == attempts - 1:  # timed out, or still failing: not a lost race
                raise
            procs.pop()
            logs.pop()


@pytest.fixture
def two_node_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RayCluster]:
    """A head and a worker node on this machine, each its own raylet with one CPU; Ray's session files in a short
    temporary directory (its socket paths are limited to ~107 characters)."""
    temp_dir = tempfile.mkdtemp(prefix="kvprefix-ray-")
    env = node_env()
    monkeypatch.setenv("RAY_AUTH_MODE", env["RAY_AUTH_MODE"])  # the state API's client here, as the nodes
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    head: dict[str, str] = {}

    def start_head() -> tuple[subprocess.Popen, Path]:
        port, dashboard_port = free_port(), free_port()
        head.update(address=f"127.0.0.1:{port}", dashboard=f"http://127.0.0.1:{dashboard_port}")
        log = tmp_path / f"ray-head-{port}.log"
        return ray_start(log, env, "--head", "--port", str(port), "--temp-dir", temp_dir, "--include-dashboard",
                         "true", "--dashboard-port", str(dashboard_port),
                         "--ray-client-server-port", str(free_port())), log

    def start_worker() -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"ray-worker-{free_port()}.log"
        return ray_start(log, env, "--address", head["address"]), log

    try:
        started("ray head", start_head, lambda: alive_nodes(head["dashboard"]), procs, logs)
        started("second node", start_worker, lambda: len(alive_nodes(head["dashboard"])) == 2, procs, logs)
        yield RayCluster(head["address"], head["dashboard"], env)
    finally:
        for proc in reversed(procs):  # the worker node first, then the head
            stop(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)


def engine_nodes(dashboard: str) -> dict[str, str]:
    """Ray replica id -> node id of every live engine replica, from Ray's state API."""
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, filters=[("class_name", "=", "ServeReplica:kvprefix:Engine"),
                                                     ("state", "=", "ALIVE")])
    return {a.name.rsplit("#", 1)[-1]: a.node_id for a in actors}


@pytest.mark.slow
def test_serve_ray_deploys_one_replica_on_each_node_of_a_started_cluster(two_node_cluster: RayCluster,
                                                                         default_model_dir: str, tmp_path: Path):
    from kvprefix.router.ray.engine import REPLICA_HEADER

    port = free_port()
    log = tmp_path / "serve-ray.log"
    cmd = [sys.executable, "-m", "kvprefix.cli", "serve", "--ray", "--ray-address", two_node_cluster.address,
           "--replicas", "2", "--replica-cpus", "1", "--policy", "prefix", "--host", "127.0.0.1", "--port", str(port),
           "--model", default_model_dir, "--served-model-name", MODEL, "--dtype", "float32", "--device", "cpu",
           "--num-gpu-blocks", "512", "--max-num-seqs", "16"]
    with open(log, "w") as out:
        serve = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=two_node_cluster.env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for("kvprefix serve --ray", lambda: "serving 2 replicas" in log.read_text(), [serve], [log])
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        traffic = shared_prefix_traffic(rounds=2)
        served, cached = [], []
        for messages in traffic:
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2,
                                                                   temperature=0)
            served.append(raw.headers[REPLICA_HEADER])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)

        placed = engine_nodes(two_node_cluster.dashboard)
        nodes = {n.node_id for n in alive_nodes(two_node_cluster.dashboard)}
        assert len(placed) == 2 and set(placed.values()) == nodes, (placed, nodes)  # one replica per node
        assert set(served) == set(placed), (served, placed)  # both answered
        assert all(c > 0 for c in cached[len(traffic) // 2:]), cached  # each prompt's second question hits
    finally:
        stop(serve)  # serve.shutdown(): Serve and the application leave the cluster
    assert serve.returncode == 0
    assert len(alive_nodes(two_node_cluster.dashboard)) == 2  # a cluster it joined keeps running
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
