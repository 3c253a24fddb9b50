"""The one reader of body logs and request logs (kvprefix.logs.iter_entries): one entry per prompt, the namespace
as the server derives it, the request log's block size checked, errors that name the file and the line."""

import json

import pytest

from kvprefix.cache import namespace_salt
from kvprefix.logs import BODIES, REQUEST_LOG, LogError, RequestLogWriter, RequestRecord, SharedTools, iter_entries


def test_bodies_one_entry_per_prompt_in_the_servers_namespace(tmp_path):
    path = tmp_path / "bodies.jsonl"
    rows = [{"model": "m", "prompt": ["a", "b"], "tenant": "t", "cache_salt": "s", "timestamp": 1500, "replica": "r1"},
            {"model": "m", "messages": [{"role": "user", "content": "q"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    entries = list(iter_entries(path, BODIES))
    assert [(e.line, e.body.get("prompt"), e.timestamp, e.namespace, e.replica) for e in entries] == [
        (1, "a", 1.5, namespace_salt("t", "s"), "r1"), (1, "b", 1.5, namespace_salt("t", "s"), "r1"),
        (2, None, None, "", "")]


@pytest.mark.parametrize("row, message", [
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "q"}], "tenant": 3}, "field 'tenant' must be a string"),
    ({"messages": [{"role": "user", "content": "q"}], "timestamp": -1}, "field 'timestamp' must be a number"),
    ({"input": "q"}, "a request body needs 'messages'"),
])
def test_bad_bodies_name_the_file_and_line(tmp_path, row, message):
    path = tmp_path / "bodies.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(LogError, match=f"bodies.jsonl:2: {message}"):
        list(iter_entries(path, BODIES))


def test_request_log_entries_keep_the_record_and_check_the_block_size(tmp_path):
    path = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(str(path))
    writer.write(RequestRecord(timestamp=10, prompt_tokens=40, block_hashes=["aa", "bb"], output_tokens=1,
                               block_size=16, endpoint="chat", namespace="ns", replica="r", finish_time=10.25))
    writer.write(RequestRecord(timestamp=11, prompt_tokens=40, block_hashes=["aa"], output_tokens=1))
    writer.close()
    entries = iter_entries(path, REQUEST_LOG)
    e = next(entries)
    assert (e.timestamp, e.namespace, e.replica, e.prefill_s, e.source_block_size) == (10.0, "ns", "r", 0.25, 16)
    assert e.record.block_hashes == e.block_hashes == ["aa", "bb"] and not e.add_special_tokens
    with pytest.raises(LogError, match=r"requests.jsonl:2: missing field 'block_size'$"):
        next(entries)


def test_equal_tools_lists_are_read_as_one_and_only_equal_ones(tmp_path):
    """The reader shares a tools list among bodies that send it again (its JSON written once); lists that differ
    as JSON does (key order, 1 / 1.0 / true, another string) stay their own, and JSON is json.dumps'."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "n": 1}}}
    variants = [[tool], [json.loads(json.dumps(tool).replace('"n": 1', '"n": 1.0'))],
                [json.loads(json.dumps(tool).replace('"n": 1', '"n": true'))],
                [{"function": tool["function"], "type": "function"}], [dict(tool, type="function ")]]
    rows = [{"messages": [{"role": "user", "content": "q"}], "tools": v} for v in variants * 3]
    path = tmp_path / "tools.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shared = SharedTools()
    lists = [e.body["tools"] for e in iter_entries(path, BODIES, shared)]
    assert [json.dumps(t) for t in lists] == [json.dumps(r["tools"]) for r in rows]  # each body's own content
    for k in range(len(variants)):
        assert lists[k] is lists[k + len(variants)] is lists[k + 2 * len(variants)]
        assert all(lists[k] is not lists[j] for j in range(len(variants)) if j != k)
        assert shared.json(lists[k]) == json.dumps(variants[k])
    full = SharedTools(limit=2)
    lists = [e.body["tools"] for e in iter_entries(path, BODIES, full)]
    assert lists[0] is lists[5] and lists[2] is not lists[7] and full.json(lists[7]) == json.dumps(variants[2])
    few_chars = SharedTools(limit_chars=len(json.dumps(variants[0])) + 1)  # room for two lists' JSON, not three
    lists = [e.body["tools"] for e in iter_entries(path, BODIES, few_chars)]
    assert lists[1] is lists[6] and lists[2] is not lists[7]
