"""Every path option of every command, given a path it cannot use, through the real `kvprefix` command: it refuses
to start with one line naming the option, the path and why (no traceback, no usage text, before anything loads)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import tmpfs

TRACE = Path(__file__).parents[1] / "data" / "traces" / "lmcache_multi_round_qa_example_bs16.jsonl"

# (command line before the path, the option's name in the message, what the option needs)
WRITE_DIR = [(["serve", "--kv-disk"], "--kv-disk")]
WRITE_FILE = [
    (["serve", "--request-log"], "--request-log"),
    (["simulate", "--example", "seed", "--json"], "--json"),
    (["simulate", "--example", "seed", "--plot"], "--plot"),
    (["doctor", "LOG", "--html"], "--html"),
]
READ_FILE = [
    (["serve", "--api-keys-file"], "--api-keys-file"),
    (["route", "--replica", "http://127.0.0.1:1", "--api-keys-file"], "--api-keys-file"),
    (["simulate"], "trace"),
    (["simulate", "--tokenizer"], "--tokenizer"),
    (["doctor"], "log"),
    (["cache", "stats"], "dir"),
]


def refusal(tmp_path: Path, words: list[str], path: str) -> str:
    """Runs the command with ``path``; asserts it exits 2 with one line on stderr and returns that line."""
    log = tmp_path / "log.jsonl"
    log.write_text("")
    args = [str(log) if w == "LOG" else w for w in words]
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", *args, path], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.parametrize("words, option", WRITE_DIR + WRITE_FILE)
def test_a_path_under_a_regular_file_is_refused(tmp_path, words, option) -> None:
    (tmp_path / "file").write_text("x")
    path = f"{tmp_path}/file/below/it"
    line = refusal(tmp_path, words, path)
    assert line == f"kvprefix {words[0]}: {option} {path}: {tmp_path}/file is a regular file, not a directory"


@pytest.mark.parametrize("words, option", WRITE_FILE)
def test_a_directory_where_a_file_is_needed_is_refused(tmp_path, words, option) -> None:
    (tmp_path / "adir").mkdir()
    line = refusal(tmp_path, words, str(tmp_path / "adir"))
    assert line == f"kvprefix {words[0]}: {option} {tmp_path}/adir: a directory, not a file"


@pytest.mark.parametrize("words, option", WRITE_DIR + [(["cache", "stats"], "dir")])
def test_a_regular_file_where_a_directory_is_needed_is_refused(tmp_path, words, option) -> None:
    (tmp_path / "f").write_text("x")
    line = refusal(tmp_path, words, str(tmp_path / "f"))
    assert line == f"kvprefix {words[0]}: {option} {tmp_path}/f: a regular file, not a directory"


@pytest.mark.parametrize("words, option", WRITE_DIR + WRITE_FILE)
def test_a_directory_that_takes_no_new_files_is_refused(tmp_path, words, option) -> None:
    """/proc takes no new files, even from root (for whom permission bits do not count)."""
    line = refusal(tmp_path, words, "/proc/kvprefix-test/x")
    assert line.startswith(f"kvprefix {words[0]}: {option} /proc/kvprefix-test/x: cannot write in /proc: "), line


@pytest.mark.parametrize("words, option", WRITE_DIR + WRITE_FILE)
def test_a_read_only_file_system_is_refused(tmp_path, words, option) -> None:
    with tmpfs.small_tmpfs(tmp_path / "ro") as mount:
        (mount / "old.log").write_text("")
        tmpfs.remount_read_only(mount)
        for path in (f"{mount}/new/x", f"{mount}/old.log"):
            if option == "--kv-disk" and path.endswith(".log"):
                continue
            line = refusal(tmp_path, words, path)
            assert line.startswith(f"kvprefix {words[0]}: {option} {path}: ") and \
                line.endswith("read-only file system"), line


@pytest.mark.parametrize("words, option", READ_FILE)
def test_a_missing_input_is_refused(tmp_path, words, option) -> None:
    line = refusal(tmp_path, words, str(tmp_path / "missing"))
    kind = {"--tokenizer": "file or directory", "dir": "directory"}.get(option, "file")
    assert line == f"kvprefix {words[0]}: {option} {tmp_path}/missing: no such {kind}"


def test_a_usable_path_is_taken(tmp_path) -> None:
    """The checks refuse only what cannot work: a new file in new folders is written."""
    out = tmp_path / "new" / "folders" / "summary.json"
    r = subprocess.run([sys.executable, "-m", "kvprefix.cli", "simulate", str(TRACE), "--mode", "order",
                        "--no-progress", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())
