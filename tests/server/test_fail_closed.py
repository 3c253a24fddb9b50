"""Configuration fails closed: a tenant never reads the shared /metrics without the admin key, and options that
look like auth but configure none (an empty keys file, an empty key) refuse to start instead of serving openly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from support.servers import Server


@pytest.mark.slow
def test_metrics_refused_with_tenants_and_no_admin_key(tenants_without_admin: Server) -> None:
    for headers in ({}, {"authorization": "Bearer key-alice"}):
        r = httpx.get(tenants_without_admin.url + "/metrics", headers=headers, timeout=10)
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"], r.text
        assert "prompt_tokens_total" not in r.text


def _serve(*args: str) -> subprocess.CompletedProcess:
    # A missing model makes a server that got past the option checks fail at once rather than serve.
    return subprocess.run([sys.executable, "-m", "kvprefix.cli", "serve", "--model", "/nonexistent/model", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("contents", ["{}", '{"   ": "alice"}'])
def test_keys_file_without_usable_keys_refuses_to_start(tmp_path: Path, contents: str) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(contents)
    p = _serve("--api-keys-file", str(keys))
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvprefix serve:") and str(keys) in last, p.stderr


@pytest.mark.parametrize("option", ["--api-key", "--admin-key"])
@pytest.mark.parametrize("value", ["", "  "])
def test_empty_key_refuses_to_start(option: str, value: str) -> None:
    p = _serve(option, value)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvprefix serve:") and option in last, p.stderr
