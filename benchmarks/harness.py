"""What the benchmarks share: a free port, a `kvprefix serve` or `kvprefix route` process started (healthy, or a
clear error) and stopped, one percentile definition, and one result writer (a table on stdout, JSON in a file).
Scripts import it as `from harness import ...` (they run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Process:
    """A server process on 127.0.0.1 and its URL."""

    proc: subprocess.Popen
    url: str
    port: int

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (a graceful shutdown), then SIGKILL if it does not exit within ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Returns once ``url``/health answers 200; raises if the process exits first or it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{url} did not start within {timeout_s:.0f} s")


def start_kvprefix(command: str, args: Sequence[str], *, port: int | None = None, prefix: Sequence[str] = (),
                   env: dict[str, str] | None = None, log_level: str = "warning", wait: bool = True,
                   timeout_s: float = 180, **popen) -> Process:
    """`kvprefix COMMAND --port PORT --log-level LOG_LEVEL ARGS` (``prefix``: e.g. taskset), waited for unless
    ``wait`` is false (then call ``wait_healthy`` yourself, e.g. after starting several)."""
    port = port or free_port()
    cmd = [*prefix, sys.executable, "-m", "kvprefix.cli", command, "--port", str(port), "--log-level", log_level,
           *args]
    proc = subprocess.Popen(cmd, env=env if env is not None else os.environ.copy(), **popen)
    server = Process(proc, f"http://127.0.0.1:{port}", port)
    if wait:
        try:
            wait_healthy(server.url, proc, timeout_s)
        except BaseException:
            server.stop(5)
            raise
    return server


def start_serve(args: Sequence[str], **kw) -> Process:
    """A `kvprefix serve` with ``args``."""
    return start_kvprefix("serve", args, **kw)


def start_route(args: Sequence[str], **kw) -> Process:
    """A `kvprefix route` with ``args``."""
    return start_kvprefix("route", args, **kw)


def counters(url: str) -> dict[str, float]:
    """Every sample of ``url``/metrics by name (labels dropped: the last sample of a name wins)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default; p50 is the median);
    NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def p50(values: Iterable[float]) -> float:
    return percentile(values, 50)


# The shape of Qwen2.5-0.5B: the engine benchmarks' random checkpoint (qkv bias, vocabulary 151,936).
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)


def ensure_checkpoint(path: str, layers: int = QWEN25_05B["num_hidden_layers"]) -> str:
    """The random Qwen2.5-0.5B-shaped checkpoint at ``path``, written once; with fewer ``layers``, a shallower copy
    of it beside it (scenarios that count tokens give the same counts, faster)."""
    import torch

    from kvprefix.model import write_random_checkpoint

    shape = dict(QWEN25_05B)
    if layers != shape["num_hidden_layers"]:
        path, shape["num_hidden_layers"] = f"{path}-{layers}-layers", layers
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"writing a random Qwen2.5-0.5B-shaped checkpoint ({layers} layers) to {path} (once)")
        write_random_checkpoint(path, "qwen2", seed=0, dtype=torch.bfloat16, **shape)
    return path


# The shape of SmolLM2-135M (the built-in model): the LoRA and beam-search benchmarks' random checkpoint.
SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)


def ensure_smollm2_checkpoint(root: str, layers: int) -> str:
    """A random SmolLM2-135M-shaped checkpoint with ``layers`` layers under ``root``, written once."""
    from kvprefix.model import write_random_checkpoint

    path = os.path.join(root, f"smollm2-135m-shape-{layers}-layers")
    if not os.path.isfile(os.path.join(path, "config.json")):
        print(f"writing a random SmolLM2-135M-shaped checkpoint ({layers} layers) to {path} (once)")
        write_random_checkpoint(path, "llama", seed=0, **{**SMOLLM2_135M, "num_hidden_layers": layers})
    return path

WORDS = ("policy customer refund account order shipping invoice support agent escalate verify identity warranty "
         "return exchange damaged delivery address billing cycle premium plan cancel renewal discount").split()


def system_prompt(num_words: int, seed: int = 0) -> str:
    """The shared system prompt of the server benchmarks' chat traffic: ``num_words`` support-desk words."""
    rng = random.Random(seed)
    return "You are a support assistant. Rules: " + " ".join(rng.choice(WORDS) for _ in range(num_words))


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, formats: dict[str, str] | None = None) -> str:
    """``rows`` as a Markdown table (``columns``: which keys, in order; ``formats``: a format spec per key)."""
    columns = list(columns or (rows[0] if rows else []))
    formats = formats or {}

    def cell(row: dict, key: str) -> str:
        value = row.get(key, "")
        if value is None or value == "":
            return ""
        return format(value, formats[key]) if key in formats else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k) for k in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_results(path: str | Path, results: dict, rows: Sequence[dict] | None = None,
                  columns: Sequence[str] | None = None, formats: dict[str, str] | None = None) -> Path:
    """Prints ``rows`` as a table (if given) and writes ``results`` as JSON to ``path`` (folders made)."""
    if rows:
        print(table(rows, columns, formats))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    return out


def cpu_name() -> str:
    """The CPU's model name, as ``lscpu`` shows it (figures depend on it: say which CPU they came from)."""
    for line in open("/proc/cpuinfo", encoding="utf-8") if os.path.exists("/proc/cpuinfo") else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def dense_quantization() -> str | None:
    """The ``quantization`` value that asks the kvprefix this process imports for dense weights: "none", or None
    in trees from before a quantized GGUF ran compact by default (so --against runs an older tree too)."""
    from kvprefix.cache import identity

    return getattr(identity, "NO_QUANTIZATION", None)
