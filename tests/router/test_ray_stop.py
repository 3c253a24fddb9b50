"""Stopping `kvprefix serve --ray` stops the local Ray cluster it started, every process of it: SIGTERM, as a user
stops a server, used to leave Ray's DashboardAgent and RuntimeEnvAgent running (issue 27)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from support.servers import free_port

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
SRC = Path(__file__).resolve().parents[2] / "src"
START_TIMEOUT_S = 600  # Ray and two replicas start slowly on a loaded 2-core machine


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def in_session(sid: int) -> list[psutil.Process]:
    """The running processes of session ``sid`` (a process started with start_new_session=True and its
    descendants, orphaned or not)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == sid and running(process):
                found.append(process)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return found


def test_stop_processes_kills_what_ignores_sigterm_and_its_children():
    """A process that ignores SIGTERM (as Ray's agents do), with a child of its own: both are gone after the grace
    period, through SIGKILL."""
    from kvprefix.router.ray.cluster import stop_processes

    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); print(flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        parent.stdout.readline()  # its child is started
        stubborn = psutil.Process(parent.pid)
        family = [stubborn, *stubborn.children(recursive=True)]
        assert len(family) == 2
        start = time.monotonic()
        stop_processes({stubborn}, grace_s=0.5)
        assert time.monotonic() - start >= 0.5  # SIGTERM was ignored: it took the SIGKILL
        parent.wait(5)
        assert not [p for p in family if running(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def start_serve_ray(model: str, port: int, log: Path, attempts: int = 3) -> subprocess.Popen:
    """`kvprefix serve --ray --replicas 2` on a new local cluster, in a session of its own, once it serves; again,
    twice at most, when Ray gave up on its own start (it waits a fixed 30 s for the raylet to register)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "kvprefix.cli", "serve", "--ray", "--replicas", "2", "--replica-cpus", "0.5",
           "--host", "127.0.0.1", "--port", str(port), "--model", model, "--dtype", "float32", "--device", "cpu",
           "--num-gpu-blocks", "256", "--max-num-seqs", "4"]
    for attempt in range(attempts):
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while "serving 2 replicas" not in (text := log.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(1)
        else:
            return proc
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for process in in_session(proc.pid):
            process.kill()
        if "timed out during startup" not in text or attempt == attempts - 1:
            raise RuntimeError(f"kvprefix serve --ray did not start:\n{text[-4000:]}")
    raise AssertionError("unreachable")


@pytest.mark.slow
def test_sigterm_stops_every_process_of_the_local_cluster(default_model_dir: str, tmp_path: Path):
    port = free_port()
    log = tmp_path / "serve-ray.log"
    serve = start_serve_ray(default_model_dir, port, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                                messages=[{"role": "user", "content": "hello"}])
        assert answer.usage.prompt_tokens > 0
        cluster = psutil.Process(serve.pid).children(recursive=True)
        names = {p.name() for p in cluster}
        assert {"raylet", "gcs_server", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, names
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(120) == 0
        left = {p for p in cluster if running(p)} | set(in_session(serve.pid))
        assert not left, [(p.pid, p.name()) for p in left]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        for process in in_session(serve.pid):
            process.kill()
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
