"""The request-log schema: what the writer writes, the reader reads back; a torn line loses only itself."""

from __future__ import annotations

import json
import os

import pytest

from kvprefix.logs import FORMAT_VERSION, LogError, RequestLogWriter, RequestRecord, iter_records


def record(i: int, **kw) -> RequestRecord:
    return RequestRecord(timestamp=1700000000.0 + i, prompt_tokens=40, block_hashes=["aa", "bb"], output_tokens=3,
                         block_size=16, request_id=f"r{i}", namespace="ns", replica="host:8000", **kw)


def test_round_trip_and_prompts_only_when_asked(tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    for include in (False, True):
        w = RequestLogWriter(str(path), include_prompts=include)
        w.write(record(0, prompt="secret text", message_spans=[[0, 6]], miss_reason="diverged"))
        w.close()
    (_, a), (_, b) = list(iter_records(path))
    assert a.prompt is None and a.message_spans is None and a.miss_reason == "diverged"
    assert b.prompt == "secret text" and b.message_spans == [[0, 6]]
    assert b == record(0, prompt="secret text", message_spans=[[0, 6]], miss_reason="diverged")
    assert json.loads(path.read_text().splitlines()[0])["v"] == FORMAT_VERSION


def test_a_torn_last_line_neither_corrupts_the_next_record_nor_fails_the_file(tmp_path) -> None:
    path = tmp_path / "log.jsonl"
    w = RequestLogWriter(str(path))
    w.write(record(0))
    w.close()
    with open(path, "a") as f:  # a crash mid-write: half a record, no newline
        f.write(record(1).to_json()[:37])
    w = RequestLogWriter(str(path))  # the server restarts and appends
    w.write(record(2))
    w.close()
    torn: list[int] = []
    assert [(line, r.request_id) for line, r in iter_records(path, torn)] == [(1, "r0"), (3, "r2")]
    assert torn == [2]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full (every write: ENOSPC)")
def test_a_failed_write_is_counted_not_raised() -> None:
    lost: list[int] = []
    w = RequestLogWriter("/dev/full", on_error=lambda: lost.append(1))
    for i in range(3):
        w.write(record(i))
    w.close()
    assert w.errors == 3 and len(lost) == 3


def test_version_1_lines_still_read(tmp_path) -> None:
    v1 = {"timestamp": 1.5, "request_id": "x", "endpoint": "chat", "model": "m", "tenant": "t", "prompt_tokens": 20,
          "block_size": 16, "hash_algo": "sha256", "block_hashes": ["ab"], "cached_tokens": 0, "output_tokens": 8,
          "n": 1, "finish_reasons": ["length"], "timings": {"ttft_s": 0.1, "e2e_s": 0.2}, "status": "ok",
          "salted": False, "prompt_cache_key": None, "user": None, "prompt": None, "v": 1}
    path = tmp_path / "v1.jsonl"
    path.write_text(json.dumps(v1) + "\n")
    ((_, r),) = iter_records(path)
    assert r.v == 1 and r.namespace == "" and r.finish_time is None and r.block_hashes == ["ab"]


@pytest.mark.parametrize("row, message", [
    ({"prompt_tokens": 1, "block_hashes": [], "output_tokens": 0}, "missing field 'timestamp'"),
    ({"timestamp": "now", "prompt_tokens": 1, "block_hashes": [], "output_tokens": 0}, "'timestamp' has the wrong"),
    ({"timestamp": 1, "prompt_tokens": 1, "block_hashes": [3], "output_tokens": 0}, "hex strings"),
    ({"timestamp": 1, "prompt_tokens": 1, "block_hashes": [], "output_tokens": 0, "cached_tokens": "4"}, "cached_tokens"),
    ({"timestamp": 1, "prompt_tokens": 1, "block_hashes": [], "output_tokens": 0, "v": 99}, "unsupported"),
    ({"timestamp": 1, "prompt_tokens": 1, "block_hashes": [], "output_tokens": 0, "block_size": 0}, "block_size"),
])
def test_bad_records_name_the_file_and_line(tmp_path, row: dict, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(record(0).to_json() + "\n" + json.dumps(row) + "\n")
    with pytest.raises(LogError, match=f"bad.jsonl:2: .*{message}"):
        list(iter_records(path))
