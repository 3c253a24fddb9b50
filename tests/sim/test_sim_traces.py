"""Trace readers: the three formats, exact block-size coarsening, and errors that name the bad line."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvprefix.cache import BlockHasher, context_for_checkpoint
from kvprefix.sim.formats import detect_format, load_trace
from kvprefix.sim.trace import TraceError, coarsen
from kvprefix.tokenizer import Tokenizer


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts=0, n=40, out=8, ids=(1, 2, 3), **extra):
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids), **extra}


def test_mooncake_rows_keep_extra_fields_and_drop_the_partial_tail(tmp_path):
    path = write_jsonl(tmp_path / "t_bs16.jsonl", [row(session_id=4, turn=2, group=1), row(ts=1500, n=48)])
    trace = load_trace(path)
    first, second = trace.requests
    assert trace.block_size == 16  # from the file name
    assert first.block_hashes == [1, 2] and first.num_blocks == 3  # 40 tokens: two full blocks and a partial one
    assert second.block_hashes == [1, 2, 3] and second.timestamp == 1.5
    assert first.session == 4 and first.extra == {"session_id": 4, "turn": 2, "group": 1}


def test_coarsening_keeps_every_mth_id(tmp_path):
    ids = list(range(100, 106))  # 83 tokens at 16: five full blocks and a partial one
    path = write_jsonl(tmp_path / "t_bs16.jsonl", [row(n=83, ids=ids)])
    (r,) = load_trace(path, block_size=32).requests
    assert r.block_hashes == [101, 103] and r.num_blocks == 3
    (r,) = load_trace(path, block_size=48).requests
    assert r.block_hashes == [102] and r.num_blocks == 2


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=40), min_size=2, max_size=6),
    factor=st.integers(2, 4),
)
def test_coarsened_ids_share_exactly_when_coarse_hashes_do(prompts, factor):
    # Blocks of 2 tokens over a 2-letter alphabet collide often: a real test of which prefixes are shared.
    fine, coarse = BlockHasher(2), BlockHasher(2 * factor)
    converted = [coarsen(fine.hash_blocks(p), factor, len(p) // (2 * factor)) for p in prompts]
    direct = [coarse.hash_blocks(p) for p in prompts]
    for a in range(len(prompts)):
        assert len(converted[a]) == len(direct[a])
        for b in range(len(prompts)):
            for k in range(min(len(direct[a]), len(direct[b]))):
                assert (converted[a][k] == converted[b][k]) == (direct[a][k] == direct[b][k])


def read_rows(rows: list[list[int]]) -> list[list]:
    """Full-block ids the Mooncake reader gives for rows of hash_ids (16-token blocks, no partial tail)."""
    with tempfile.TemporaryDirectory() as d:
        path = write_jsonl(Path(d) / "t_bs16.jsonl", [row(n=16 * len(ids), ids=ids) for ids in rows])
        return [r.block_hashes for r in load_trace(path).requests]


rows_of_ids = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=6)


@settings(max_examples=100, deadline=None)
@given(rows=rows_of_ids)
def test_mooncake_positions_share_a_block_only_when_their_whole_prefixes_match(rows):
    # Ids over {0, 1, 2} repeat within rows and at other positions: only a whole matching prefix is a shared block.
    out = read_rows(rows)
    positions = [(a, k) for a in range(len(rows)) for k in range(len(rows[a]))]
    for a, k in positions:
        for b, j in positions:
            assert (out[a][k] == out[b][j]) == (rows[a][: k + 1] == rows[b][: j + 1]), (rows, out)


@settings(max_examples=60, deadline=None)
@given(blocks=rows_of_ids, start=st.integers(-(10**6), 10**6))
def test_mooncake_chained_ids_are_read_unchanged(blocks, start):
    # Chain the ids the way trace builders do (one id per distinct prefix, in no particular order): kept as they are.
    ids_of: dict[tuple, int] = {}
    rows = [[ids_of.setdefault(tuple(b[: k + 1]), start - 7 * len(ids_of)) for k in range(len(b))] for b in blocks]
    assert read_rows(rows) == rows


def test_an_id_repeated_in_a_row_is_a_new_block_each_time(tmp_path, run):
    # [7, 7, 7] is three different blocks: a request that cached only the first block [7] can reuse one block.
    path = write_jsonl(tmp_path / "t_bs16.jsonl", [row(n=17, ids=[7, 8]), row(ts=1, n=49, ids=[7, 7, 7, 9])])
    s = run(load_trace(path), mode="order")
    assert s.cached_blocks == 1 and s.prefill_tokens_with_cache == 17 + 49 - 16


@pytest.mark.parametrize(
    "rows, block_size, message",
    [
        ([row(), {"timestamp": 1, "output_length": 1, "hash_ids": [1]}], None, r":2: missing field 'input_length'"),
        ([row(ts=5), row(ts=6), row(ts=4)], None, r":3: timestamp 4 is earlier than the previous row's \(6\)"),
        ([row(n=40, ids=[1, 2])], None, r":1: 2 hash_ids for input_length 40, but 16-token blocks need 3"),
        ([row(), row(n="40")], None, r":2: field 'input_length' must be an integer"),
        ([row(), "{not json"], None, r":2: not valid JSON"),
        ([row(ids=["a", "b", "c"])], None, r":1: hash_ids must be integers"),
        ([row()], 24, r"cannot convert 16-token blocks to 24-token blocks exactly"),
    ],
)
def test_bad_mooncake_traces_name_the_line(tmp_path, rows, block_size, message):
    path = write_jsonl(tmp_path / "bad_bs16.jsonl", rows)
    with pytest.raises(TraceError, match=message) as info:
        load_trace(path, block_size=block_size)
    assert str(path) in str(info.value)


def test_unknown_format_names_the_line(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", ["", {"foo": 1}])
    with pytest.raises(TraceError, match=r"x.jsonl:2: unknown trace format"):
        detect_format(path)


def write_request_log(path: Path, rows: list[tuple]) -> Path:
    """A log written by the server's own writer: (arrival s, tenant, block hashes, prompt tokens, cached)."""
    from kvprefix.logs import RequestLogWriter, RequestRecord

    log = RequestLogWriter(str(path))
    for i, (ts, tenant, hashes, n, cached) in enumerate(rows):
        log.write(
            RequestRecord(
                timestamp=ts, request_id=f"r{i}", endpoint="chat", model="m", tenant=tenant, prompt_tokens=n,
                block_size=16, hash_algo="sha256", block_hashes=hashes, cached_tokens=cached, output_tokens=4, n=1,
                finish_reasons=["stop"], timings={"ttft_s": 0.1, "e2e_s": 0.2}, status="ok", salted=False,
            )
        )  # fmt: skip
    log.close()
    return path


def test_request_log_from_the_server_writer(tmp_path, run):
    # Lines are written when requests finish: arrivals come out of order and are sorted.
    path = write_request_log(
        tmp_path / "requests.jsonl",
        [(1700000002.0, "t1", ["aa", "bb", "cc"], 50, 32), (1700000000.0, "t1", ["aa", "bb"], 40, 0),
         (1700000001.5, "t2", ["dd", "ee"], 40, 0)],
    )  # fmt: skip
    trace = load_trace(path)
    assert trace.block_size == 16 and [r.timestamp for r in trace.requests] == [0.0, 1.5, 2.0]
    last = trace.requests[2]
    assert last.block_hashes == ["aa", "bb", "cc"] and last.session == "t1" and last.extra["cached_tokens"] == 32
    s = run(trace, mode="order")
    assert s.cached_blocks == 2  # the third request reuses the first's two blocks, as the server's cache did


def test_request_log_errors(tmp_path):
    good = {"timestamp": 1.0, "prompt_tokens": 40, "block_hashes": ["aa", "bb"], "output_tokens": 1}
    path = write_jsonl(tmp_path / "requests.jsonl", [good, {**good, "block_hashes": ["aa"], "block_size": 16}])
    with pytest.raises(
        TraceError, match=r"requests.jsonl:1: missing field 'block_size' \(or give --trace-block-size\)"
    ):
        load_trace(path)
    with pytest.raises(TraceError, match=r"requests.jsonl:2: 1 block_hashes for 40 prompt tokens"):
        load_trace(path, trace_block_size=16)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A tiny word-level Hugging Face tokenizer with a chat template, saved locally."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "<unk>", "system:", "user:", "assistant:"] + [f"w{i}" for i in range(64)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return str(path)


def test_openai_bodies_are_rendered_tokenized_and_hashed(tmp_path, tokenizer_dir, run):
    system = " ".join(f"w{i % 64}" for i in range(40))
    chat = [
        {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"w{i}"}]}
        for i in range(3)
    ]
    rows = [*chat, {"prompt": system, "max_tokens": 5}, {**chat[0], "cache_salt": "tenant-b"}]
    trace = load_trace(write_jsonl(tmp_path / "bodies.jsonl", rows), tokenizer=tokenizer_dir, block_size=4)
    reqs = trace.requests
    assert reqs[0].input_length == 1 + 40 + 1 + 1 + 1  # "system:", 40 words, "user:", word, "assistant:"
    hasher = BlockHasher(4, context=context_for_checkpoint(tokenizer_dir, "float32", Tokenizer(tokenizer_dir).chat_template))
    assert reqs[0].block_hashes == hasher.hash_blocks([2] + [5 + i % 64 for i in range(40)] + [3, 5, 4])
    assert reqs[0].block_hashes[:10] == reqs[1].block_hashes[:10] == reqs[2].block_hashes[:10]
    assert reqs[3].output_length == 5 and reqs[0].output_length == 256
    assert not set(reqs[4].block_hashes) & set(reqs[0].block_hashes)  # another salt shares nothing
    s = run(trace, mode="order")
    assert s.cached_blocks == 2 * 10


def test_openai_bodies_of_an_adapter_share_blocks_only_with_that_adapter(tmp_path, tokenizer_dir, run):
    """A ``model`` other than the first names a LoRA adapter: its blocks are apart from the base model's, as the
    engine keeps them; two requests of one adapter share."""
    system = " ".join(f"w{i % 64}" for i in range(40))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "w1"}]}
    rows = [{**body, "model": "base"}, {**body, "model": "sql-lora"}, {**body, "model": "sql-lora"}, body]
    trace = load_trace(write_jsonl(tmp_path / "bodies.jsonl", rows), tokenizer=tokenizer_dir, block_size=4)
    base, adapter, adapter_again, unnamed = (r.block_hashes for r in trace.requests)
    assert not set(base) & set(adapter)
    assert adapter == adapter_again and unnamed == base  # a body naming no model runs on the base model
    assert run(trace, mode="order").cached_blocks == 2 * (len(base) - 1)  # the last token is always computed


def test_openai_bodies_errors(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "bodies.jsonl", [{"prompt": "w1 w2"}, {"model": "m", "input": "w1"}])
    with pytest.raises(ValueError, match="--tokenizer"):
        load_trace(path)
    with pytest.raises(TraceError, match=r"bodies.jsonl:2: a request body needs 'messages'"):
        load_trace(path, tokenizer=tokenizer_dir)
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        load_trace(path, tokenizer=str(tmp_path / "missing"))
