"""Each planted cause is named, ranked first, shown at the right span, and its fix raises the hit rate; clean
logs get a clean bill; each counterfactual equals the doctor's own reading of the log fixed by hand."""

import pytest
import support.doctor_logs as logs
from support.doctor_logs import doctor

from kvprefix.doctor.kinds import FIXABLE
from kvprefix.prompts import render_body
from kvprefix.tokenizer import Tokenizer

PLANTED = [
    ("volatile", logs.volatile, "volatile-prefix", ()),
    ("shuffled tools", logs.shuffled_tools, "reordered", ()),
    ("reordered JSON keys", logs.reordered_keys, "reordered", ()),
    ("whitespace drift", logs.whitespace_drift, "template-drift", ()),
    ("short prefix", logs.short_prefix, "short-prefix", ()),
    ("eviction", logs.evicting, "eviction", ("--capacity", "800")),
    ("routing", logs.scattered, "routing", ()),
    ("concurrency", logs.concurrent, "concurrency", ()),
    ("tenants", logs.tenants, "namespace", ()),
    ("few-shot examples reordered", logs.few_shot, "reordered", ()),
    ("documents in tags reordered", lambda: logs.rag(layout="tags"), "reordered", ()),
    ("numbered documents reordered", lambda: logs.rag(layout="numbered"), "reordered", ()),
    ("documents between blank lines reordered", lambda: logs.rag(layout="blank lines"), "reordered", ()),
    ("default system prompt", logs.default_system, "template-drift", ()),
    ("adapters", logs.adapters, "namespace", ()),
]


@pytest.mark.parametrize("name,make,kind,extra", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_cause_ranks_first_and_its_fix_raises_the_hit_rate(capsys, tmp_path, tokenizer_dir, name, make,
                                                                   kind, extra):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", make()), tokenizer_dir, *extra)
    top = report["causes"][0]
    assert top["kind"] == kind
    assert top["requests"] > 0 and top["tokens_lost"] >= report["block_size"]
    assert top["hit_rate_after"] > report["hit_rate"]


def test_volatile_prefix_names_the_field_and_the_span(capsys, tmp_path, tokenizer_dir):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", logs.volatile()), tokenizer_dir)
    ex = report["causes"][0]["example"]
    assert ex["field"] == "messages[0].content"
    assert "a timestamp" in ex["detail"]
    assert "«2026-12-01T12:00:01Z. »" in ex["this"] and "«2026-12-01T12:00:00Z. »" in ex["other"]
    assert (ex["line"], ex["other_line"]) == (2, 1)
    assert "Current time: " in report["causes"][0]["fix"]


def test_shuffled_tools_points_at_the_tools(capsys, tmp_path, tokenizer_dir):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", logs.shuffled_tools()), tokenizer_dir)
    ex = report["causes"][0]["example"]
    assert ex["field"] == "tools" and "tools in another order" in ex["detail"]
    assert ex["this"].count("«") == 1 and ex["this"] != ex["other"]


def test_whitespace_drift_points_at_the_message(capsys, tmp_path, tokenizer_dir):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", logs.whitespace_drift()), tokenizer_dir)
    ex = report["causes"][0]["example"]
    assert ex["field"] == "messages[2].content" and "whitespace differs" in ex["detail"]


CLEAN = [logs.clean, logs.multi_turn] + [lambda layout=layout: logs.rag(layout=layout, shuffled=False)
                                         for layout in logs.LAYOUTS]


@pytest.mark.parametrize("make", CLEAN, ids=["stable prefix + tools", "multi-turn"] + [
    f"RAG, documents in one order ({layout})" for layout in logs.LAYOUTS])
def test_clean_logs_get_a_clean_bill(capsys, tmp_path, tokenizer_dir, make):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", make()), tokenizer_dir)
    assert report["hit_rate"] > 0.7
    assert [c["kind"] for c in report["causes"]] == ["no-sharing"]


def test_unique_traffic_is_no_sharing_and_no_fix(capsys, tmp_path, tokenizer_dir):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", logs.unique()), tokenizer_dir)
    assert report["hit_rate"] == 0.0
    assert [c["kind"] for c in report["causes"]] == ["no-sharing"]
    assert report["causes"][0]["hit_rate_after"] is None
    assert report["causes"][0]["requests"] == report["requests"]


def _with_tools(rows):
    for row, shuffled in zip(rows, logs.shuffled_tools(len(rows)), strict=True):
        row["tools"] = shuffled["tools"]
    return rows


def _interleaved(a, b):
    """Two populations in one log (each cause alone wins its own): a, b, a, b, ..."""
    rows = [row for pair in zip(a, b, strict=True) for row in pair]
    return [{**row, "timestamp": i * 1000} for i, row in enumerate(rows)]


def _scattered(rows, replicas):
    return [{**row, "replica": f"replica-{i % replicas}"} for i, row in enumerate(rows)]


MIXED = [
    ("volatile + shuffled tools", lambda: _with_tools(logs.volatile()), "volatile-prefix", "reordered"),
    ("few-shot + volatile", lambda: _interleaved(logs.few_shot(), logs.volatile()), "reordered", "volatile-prefix"),
    ("documents + volatile", lambda: _interleaved(logs.rag(), logs.volatile()), "reordered", "volatile-prefix"),
    ("default system prompt + routing", lambda: _scattered(logs.default_system(), 3), "template-drift", "routing"),
    ("adapters + volatile", lambda: _interleaved(logs.adapters(), logs.volatile()), "namespace", "volatile-prefix"),
]


@pytest.mark.parametrize("name,make,first,second", MIXED, ids=[m[0] for m in MIXED])
def test_two_causes_mixed_are_both_in_the_top_three(capsys, tmp_path, tokenizer_dir, name, make, first, second):
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", make()), tokenizer_dir)
    top3 = [c["kind"] for c in report["causes"][:3]]
    assert first in top3 and second in top3


def _fixed_by_hand_volatile(rows):
    out = []
    for row in rows:
        system, user = row["messages"][0]["content"], row["messages"][1]["content"]
        stamp = system.split(" ")[2]  # "Current time: 2026-12-01T12:00:00Z. ..."
        out.append({**row, "messages": [{"role": "system", "content": system.replace(stamp + " ", "")},
                                        {"role": "user", "content": user + "\n" + stamp}]})
    return out


def _fixed_by_hand_tools(rows):
    first = [t["function"]["name"] for t in rows[0]["tools"]]
    return [{**r, "tools": sorted(r["tools"], key=lambda t: first.index(t["function"]["name"]))} for r in rows]


def _drop(key):
    return lambda rows: [{k: v for k, v in r.items() if k != key} for r in rows]


def _fixed_by_hand_drift(rows):
    """Every copy of an answer as it was first sent."""
    first: dict[str, str] = {}
    out = []
    for row in rows:
        messages = []
        for m in row["messages"]:
            content = first.setdefault(" ".join(m["content"].split()), m["content"])
            messages.append({**m, "content": content})
        out.append({**row, "messages": messages})
    return out


def _fixed_by_hand_examples(rows):
    """The few-shot examples of every request in the order of the first request's."""
    first = rows[0]["messages"][1:-1]
    pairs = [first[k : k + 2] for k in range(0, len(first), 2)]
    return [{**r, "messages": [r["messages"][0], *(m for p in pairs for m in p), r["messages"][-1]]} for r in rows]


def _fixed_by_hand_documents(layout):
    """Every request's documents in the order they were first seen in the log."""
    def fix(rows):
        rank: dict[str, int] = {}
        out = []
        for row in rows:
            user = row["messages"][1]["content"]
            docs = sorted((d for d in logs.DOCUMENTS if d in user), key=user.index)
            for d in docs:
                rank.setdefault(d, len(rank))
            question = user.split("\n\nQuestion: ")[1]
            content = (f"Answer from these documents.\n\n{logs.LAYOUTS[layout](sorted(docs, key=rank.get))}"
                       f"\n\nQuestion: {question}")
            out.append({**row, "messages": [row["messages"][0], {"role": "user", "content": content}]})
        return out
    return fix


def _fixed_by_hand_system(rows):
    """The first request sends no system message: none does."""
    assert rows[0]["messages"][0]["role"] != "system"
    return [{**r, "messages": [m for m in r["messages"] if m["role"] != "system"]} for r in rows]


COUNTERFACTUALS = [
    ("volatile-prefix", logs.volatile, _fixed_by_hand_volatile, (), ()),
    ("reordered", logs.shuffled_tools, _fixed_by_hand_tools, (), ()),
    ("template-drift", logs.whitespace_drift, _fixed_by_hand_drift, (), ()),
    ("short-prefix", logs.short_prefix, lambda rows: rows, (), ("--block-size", "4")),
    ("routing", logs.scattered, _drop("replica"), (), ()),
    ("concurrency", logs.concurrent, _drop("timestamp"), (), ()),
    ("namespace", logs.tenants, _drop("tenant"), (), ()),
    ("eviction", logs.evicting, lambda rows: rows, ("--capacity", "800"), ()),
    ("reordered few-shot examples", logs.few_shot, _fixed_by_hand_examples, (), ()),
    *((f"reordered documents ({layout})", lambda layout=layout: logs.rag(layout=layout),
       _fixed_by_hand_documents(layout), (), ()) for layout in logs.LAYOUTS),
    ("template-drift default system prompt", logs.default_system, _fixed_by_hand_system, (), ()),
    ("namespace adapters", logs.adapters, _drop("model"), (), ()),
]


@pytest.mark.parametrize("name,make,fix,extra,fixed_extra", COUNTERFACTUALS, ids=[c[0] for c in COUNTERFACTUALS])
def test_counterfactual_equals_a_replay_of_the_log_fixed_by_hand(capsys, tmp_path, tokenizer_dir, name, make, fix,
                                                                 extra, fixed_extra):
    kind = next(k for k in FIXABLE if name.startswith(k) or name.split(" ")[0] == k)
    rows = make()
    report = doctor(capsys, logs.write_jsonl(tmp_path / "log.jsonl", rows), tokenizer_dir, *extra)
    cause = next(c for c in report["causes"] if c["kind"] == kind)
    fixed = doctor(capsys, logs.write_jsonl(tmp_path / "fixed.jsonl", fix(rows)), tokenizer_dir, *fixed_extra)
    assert cause["hit_rate_after"] == pytest.approx(fixed["hit_rate"], abs=1e-12)
    assert not any(c["kind"] == kind for c in fixed["causes"])
    assert all(c["kind"] not in FIXABLE or c["tokens_lost"] < cause["tokens_lost"] for c in fixed["causes"])


def test_a_smaller_block_size_is_replayed_with_the_same_capacity_in_tokens(capsys, tmp_path, tokenizer_dir):
    """At a capacity that holds every prompt, the short-prefix counterfactual (a quarter of the block size) is the
    unbounded one: the smaller blocks get as many tokens of KV, not as many blocks."""
    rows = _interleaved(logs.short_prefix(), logs.evicting(groups=8, rounds=5))
    tokenizer = Tokenizer(str(tokenizer_dir))
    capacity = sum(len(render_body(tokenizer, row)[0].token_ids) for row in rows)  # a quarter of it evicts
    path = logs.write_jsonl(tmp_path / "log.jsonl", rows)

    def short(*extra):
        return next(c for c in doctor(capsys, path, tokenizer_dir, *extra)["causes"] if c["kind"] == "short-prefix")

    assert short("--capacity", str(capacity))["hit_rate_after"] == short()["hit_rate_after"]
