#!/usr/bin/env bash
# Creates .venv-guidellm, .venv-aiperf and .venv-lm_eval at the repository root: the clients that
# tests/server/test_benchmark_clients.py (guidellm, aiperf; docs/benchmarks.md) and tests/server/test_lm_eval.py
# (lm-evaluation-harness; docs/server.md) run against a real `kvprefix serve`.
# Each tool gets its own environment because their pins clash with the project's (and with each other's).
#
#   bash benchmarks/client_envs.sh            # all three
#   bash benchmarks/client_envs.sh aiperf     # one
#
# benchmarks/client_envs/TOOL.txt is the tool's complete dependency closure, pinned (pip freeze of a
# resolved install), so the install skips pip's resolver (--no-deps over a closed set) and `pip check`
# proves the set is closed. guidellm's and lm_eval's closures have torch's CPU wheel (guidellm imports torch's
# DataLoader for every dataset; lm_eval's `--model hf` is the reference it is compared with), and a bare torch
# requirement would pull a multi-GB CUDA build.
# Idempotent: an environment whose stamp matches its lock file and this script is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(guidellm aiperf lm_eval)
for tool in "${tools[@]}"; do
    lock="benchmarks/client_envs/$tool.txt"
    venv=".venv-$tool"
    [ -f "$lock" ] || { echo "no lock file $lock (known: guidellm, aiperf, lm_eval)" >&2; exit 2; }
    want=$(cat "$lock" benchmarks/client_envs.sh | sha256sum | cut -d' ' -f1)  # a changed lock or install step rebuilds
    if [ -x "$venv/bin/$tool" ] && [ "$(cat "$venv/.lock-sha256" 2>/dev/null)" = "$want" ]; then
        echo "$venv: up to date"
        continue
    fi
    start=$SECONDS
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --no-deps --no-compile -r "$lock"
    "$venv/bin/python" -m pip check
    # Bytecode now, on every core, rather than on each import: these tools start several processes that each
    # import torch or transformers, and where PYTHONDONTWRITEBYTECODE is set nothing would ever be cached.
    # A few files are for newer Pythons only (torch/testing/_internal/py312_intrinsics.py) and fail, as they
    # do under pip's own compile step, which ignores them too.
    "$venv/bin/python" -m compileall -q -j 0 "$venv/lib" >/dev/null || true
    echo "$want" > "$venv/.lock-sha256"
    echo "$venv: installed in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
done
