"""The project's C kernels (``model/kernels/*.c``: decode attention over the paged cache, prefill attention,
RMSNorm, the int4 matmul, the int8 matmul on int8 activations, rotary and SiLU, a decode step's layers in one call),
compiled on first use by the machine's C compiler for its own CPU (``-march=native``: the sources' AVX512, AVX2 or
plain C path) and cached under ``~/.cache/kvprefix/kernels`` by source, compiler and CPU, then loaded with ctypes
(docs/model.md#native-kernels). Where no compiler builds one, or ``KVPREFIX_NATIVE_KERNELS=0``, ``load`` returns
None and callers keep PyTorch's ops (logged once)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
SOURCES = Path(__file__).with_name("kernels")
# -ffp-contract=off: the float steps are the source's own (its fmaf), not the compiler's choice of contractions.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
OPENMP = "-fopenmp"  # where the compiler has it: the kernels split outputs over PyTorch's thread count
DISABLE_ENV = "KVPREFIX_NATIVE_KERNELS"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvprefix/kernels`` (``~/.cache`` by default), or a folder of this user's under the temp
    directory where that cannot be made (a read-only home)."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvprefix" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        return home
    except OSError:
        return Path(tempfile.gettempdir()) / f"kvprefix-kernels-{os.getuid()}"


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel library ``kernels/<name>.c`` (built once per source, compiler and CPU), or None."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        log.info("native kernel %s off (%s=0): PyTorch's ops instead", name, DISABLE_ENV)
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc, or $CC) to build the native kernel %s: PyTorch's slower ops instead "
                    "(docs/model.md#native-kernels)", name)
        return None
    try:
        path = build(name, compiler)
        try:
            return ctypes.CDLL(str(path))
        except OSError:  # a damaged file in the cache: built again, once
            path.unlink(missing_ok=True)
            return ctypes.CDLL(str(build(name, compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native kernel %s not built (%s): PyTorch's slower ops instead", name, exc)
        return None


def probed(name: str, bind, agrees):
    """The entry point of ``kernels/<name>.c`` (``bind(library)``), or None: not built, no path for this CPU
    (``bind`` returns None), or not ``agrees(fn)`` with its reference on a probe (logged: its callers keep
    PyTorch's path)."""
    lib = load(name)
    if lib is None:
        return None
    fn = bind(lib)
    if fn is None:
        log.info("native kernel %s has no path for this CPU: PyTorch's op instead", name)
        return None
    if not agrees(fn):
        log.warning("native kernel %s disagrees with its reference on a probe: PyTorch's path instead", name)
        return None
    return fn


def build(name: str, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of ``kernels/<name>.c`` in the cache (compiled there first when absent), keyed by the
    source and the sources and headers beside it (which it may include), the compiler's version, the flags and the
    CPU. Written under a temporary name and renamed: concurrent builders never see half a file. OSError when the
    compiler fails."""
    source = SOURCES / f"{name}.c"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [p.read_text() for p in (source, *sorted(SOURCES.glob("*.[ch]")))]  # with what it may include
    key = hashlib.sha256("\0".join([*texts, version, " ".join(flags), _cpu()]).encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in ([OPENMP], []):
            done = subprocess.run([compiler, *flags, *extra, "-o", partial, str(source)], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode == 0:
                break
        else:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    log.info("built native kernel %s", target)
    return target


def _cpu() -> str:
    """What ``-march=native`` compiles for: the CPU's model and flags (Linux), else the machine's name."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]  # every processor's entry alike
        return "\n".join(line for line in first.splitlines() if line.startswith(("model name", "flags", "Features")))
    except OSError:
        return platform.machine() + platform.processor()
