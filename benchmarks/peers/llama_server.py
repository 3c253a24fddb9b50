"""llama.cpp's C++ `llama-server`, built once from the sources that the registry's llama-cpp-python sdist vendors.

The build lives in a cache directory (``$XDG_CACHE_HOME/kvprefix/llama.cpp-<version>``, default ``~/.cache``) and is
reused while its configure options stay the same. Every failure a user can cause (no cmake, no compiler, no network
to the registry, a failed build, a server that does not come up) is a `PeerError` with a one-line message.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

LLAMA_CPP_PYTHON_VERSION = "0.3.36"

# A native build (-march=native) crashes in ggml's AMX path on CPUs with AMX (Sapphire Rapids class): configure
# for an explicit instruction set instead, AMX off, and each x86 extension ggml can use on exactly when this CPU
# has it (a binary with AVX512 dies of SIGILL on an AVX2-only CPU such as AMD's Zen 3). The wrong-looking greedy
# answer to the bare check question comes with and without the AVX512 extensions alike (docs/benchmarks.md).
BASE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "OFF",
    "GGML_AMX_TILE": "OFF", "GGML_AMX_INT8": "OFF", "GGML_AMX_BF16": "OFF",
    "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_EXAMPLES": "OFF", "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_SERVER": "ON", "LLAMA_OPENSSL": "OFF",
}
# ggml's option -> the /proc/cpuinfo flag that says the CPU runs it.
CPU_FEATURE_OPTIONS = {
    "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_BMI2": "bmi2",
    "GGML_AVX512": "avx512f", "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16",
    "GGML_AVX512_VBMI": "avx512vbmi",
}


def cmake_options(cpu_flags: set[str]) -> dict[str, str]:
    """BASE_OPTIONS plus every instruction-set option, on where ``cpu_flags`` has its feature."""
    features = {opt: "ON" if flag in cpu_flags else "OFF" for opt, flag in CPU_FEATURE_OPTIONS.items()}
    return {**BASE_OPTIONS, **features}


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (Linux); a one-line error elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as e:
        raise PeerError(f"cannot read /proc/cpuinfo to pick llama.cpp's instruction sets: {e}") from None
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.partition(":")[2].split())


class PeerError(RuntimeError):
    """A problem with the peer's setup, told to the user in one line."""


def cache_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "kvprefix" / f"llama.cpp-{version}"


def _options_stamp(options: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:16]


def fetch_sources(cache: Path, version: str) -> Path:
    """The vendored llama.cpp tree of llama-cpp-python==version, downloaded (sdist, no deps) once into cache/src."""
    src = cache / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        print(f"[peer] downloading llama-cpp-python=={version} sources (sdist, ~75 MB) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PeerError(f"could not download llama-cpp-python=={version} from the package registry: {last}")
        prefix = f"{sdists[0].name[:-len('.tar.gz')]}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise PeerError(f"{sdists[0].name} has no vendor/llama.cpp directory")
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(Path(tmp) / "src", members=[m for m in members if m.name], filter="data")
        shutil.move(str(Path(tmp) / "src"), src)
    return src


def _check_toolchain() -> tuple[str, list[str]]:
    """cmake and the generator to use; a clear error when cmake or a C/C++ compiler is missing."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise PeerError("cmake not found: install it (pip install cmake, or your system's package) and rerun")
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    cxx = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if cc is None or cxx is None or not (shutil.which(cc) and shutil.which(cxx)):
        raise PeerError("no C/C++ compiler found (looked for $CC/$CXX, cc/gcc/clang, c++/g++/clang++): "
                        "install one (e.g. apt-get install build-essential) and rerun")
    if shutil.which("ninja"):
        return cmake, ["-G", "Ninja"]
    if shutil.which("make"):
        return cmake, ["-G", "Unix Makefiles"]
    raise PeerError("neither ninja nor make found: install one (pip install ninja) and rerun")


def _run_with_progress(cmd: list[str], log: Path, what: str) -> None:
    """Run a build step at low priority, its output to `log`, printing its [n/N] or [ NN%] progress now and then."""
    progress = re.compile(r"^\[\s*(\d+)/(\d+)\]|^\[\s*(\d+)%\]")
    started = time.monotonic()
    last_print = 0.0
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(["nice", "-n", "19", *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = progress.match(line)
            now = time.monotonic()
            if m and now - last_print > 15:
                done = f"{m[1]}/{m[2]}" if m[1] else f"{m[3]}%"
                print(f"[peer] {what}: {done} ({now - started:.0f} s)", file=sys.stderr)
                last_print = now
        rc = proc.wait()
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-1:] or ["no output"]
        raise PeerError(f"{what} failed (exit {rc}): {tail[0][:200]} (full log: {log})")


def build_server(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> Path:
    """Path of a llama-server binary built with cmake_options() for this CPU, building it (a long step on 2 cores)
    if it is missing or was built with other options."""
    cache = cache_dir(version)
    build = cache / "build"
    binary = build / "bin" / "llama-server"
    stamp_file = build / "kvprefix-options.txt"
    options = cmake_options(cpu_flags())
    stamp = _options_stamp(options)
    if binary.is_file() and stamp_file.is_file() and stamp_file.read_text() == stamp:
        return binary
    cmake, generator = _check_toolchain()
    src = fetch_sources(cache, version)
    log = cache / "build.log"
    print(f"[peer] building llama-server from {src} into {build} (log: {log}); this takes a while on 2 cores",
          file=sys.stderr)
    defines = [f"-D{k}={v}" for k, v in options.items()]
    _run_with_progress([cmake, "-S", str(src), "-B", str(build), *generator, *defines], log, "configure")
    _run_with_progress([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs)], log, "build")
    if not binary.is_file():
        raise PeerError(f"the build finished without {binary} (log: {log})")
    stamp_file.write_text(stamp)
    return binary


class LlamaServer:
    """One llama-server process on 127.0.0.1:port, started with `args` on `gguf`."""

    def __init__(self, binary: Path, gguf: Path, port: int, args: list[str], log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        cmd = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port), *args]
        self._out = log.open("w")
        self._out.write(f"$ {' '.join(cmd)}\n")
        self._out.flush()
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
                raise PeerError(f"llama-server exited ({self.proc.returncode}): {tail[0][:200]} (log: {self.log})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise PeerError(f"llama-server did not become ready in {timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
