"""The shapes the doctor once missed (issue 27: two volatile lines at the top of the system prompt, a session id
before a shared article, a short shared instruction in chat) and others of the kind (a volatile line mid-prompt,
several volatile spans, one in the tools, one in an assistant turn), from the planted-cause corpus's generators
(``support.doctor_corpus``): the planted cause ranked first, its span shown in its field, and a fix that wins
most of what the volatile text cost. Logs with nothing planted keep a clean bill. The whole corpus is slow."""

import random

import pytest
from support.doctor_corpus import REQUESTS, SHAPES, write
from support.doctor_logs import doctor

from kvprefix.doctor.volatile import VolatileSite, parts

ONCE_MISSED = ["two-volatile-lines", "session-first-line", "short-prefix-chat", "volatile-mid-prompt",
               "several-volatile-spans", "volatile-tool-list", "volatile-assistant-turn", "clean", "unique"]


def _report(capsys, tmp_path, tokenizer_dir, name, n=120):
    return doctor(capsys, write(tmp_path / f"{name}.jsonl", name, n), tokenizer_dir, *SHAPES[name].args)


@pytest.mark.parametrize("name", ONCE_MISSED)
def test_the_planted_cause_ranks_first(capsys, tmp_path, tokenizer_dir, name):
    report = _report(capsys, tmp_path, tokenizer_dir, name)
    top, planted = report["causes"][0], SHAPES[name].cause
    assert top["kind"] == planted
    if planted == "no-sharing":
        assert [c["kind"] for c in report["causes"]] == ["no-sharing"]
    elif planted == "volatile-prefix":  # both renderings meet again: nearly everything after the span is won
        assert report["hit_rate"] < 0.3 and top["hit_rate_after"] > 0.8
    else:
        assert top["hit_rate_after"] > report["hit_rate"] + 0.1


@pytest.mark.parametrize("name,field,shown", [
    ("two-volatile-lines", "messages[0].content", "system⏎Request: «req_"),
    ("session-first-line", "messages[1].content", "user⏎Session: «"),
    ("volatile-mid-prompt", "messages[0].content", "store.⏎Local time: «2026-11-"),
    ("several-volatile-spans", "messages[0].content", "system⏎Trace «"),
    ("volatile-tool-list", "tools[0].function.description", "Order data refreshed at «2026-11-"),
    ("volatile-assistant-turn", "messages[2].content", "This is session «"),
])
def test_the_volatile_span_is_shown_in_its_field(capsys, tmp_path, tokenizer_dir, name, field, shown):
    ex = _report(capsys, tmp_path, tokenizer_dir, name)["causes"][0]["example"]
    assert ex["field"] == field
    assert shown in ex["this"] and ex["this"] != ex["other"]


def test_two_volatile_lines_are_named_and_moved_together(capsys, tmp_path, tokenizer_dir):
    top = _report(capsys, tmp_path, tokenizer_dir, "two-volatile-lines")["causes"][0]
    assert "a request id" in top["example"]["detail"] and "an e-mail address" in top["example"]["detail"]
    assert "Signed in: " in top["example"]["this"].split("»")[0]  # one span: both lines
    assert "the span after 'Request: '" in top["fix"]


def test_parts_of_any_length_and_number_meet_again():
    stable = "the rules every request shares, long enough to count as meeting again. " * 2
    old = f"Trace 1a2b\n{stable}Customer: Ana Lima <ana@example.com>, account 1234.\n{stable}end"
    new = f"Trace 9f8e7d6c\n{stable}Customer: Bruno Costa <bruno.costa@example.org>, account 98765.\n{stable}end"
    found = parts(new, old, len("Trace "), len(new))
    assert [new[s:e] for s, e, _, _ in found] == [
        "9f8e7d6c\n", "Bruno Costa <bruno.costa@example.org>, account 98765.\n"]
    assert [old[s:e] for _, _, s, e in found] == ["1a2b\n", "Ana Lima <ana@example.com>, account 1234.\n"]
    rng = random.Random(0)
    new, old = (f"Profile: {' '.join(rng.choice(['ab', 'cd', 'ef']) for _ in range(300))}\n{stable}" for _ in "ab")
    found = parts(new, old, len("Profile: "), len(new))  # a value of about 900 characters
    assert len(found) == 1 and found[0][1] - found[0][0] > 800
    new, old = f"A {stable}", f"A inserted words {stable}"
    assert parts(new, old, 2, len(new)) == []  # an insertion is no changed value


def test_a_site_cuts_the_span_of_another_request_at_its_place():
    site = VolatileSite("messages[0].content", "Request: ", "You are", 80)
    assert site.cut("Request: req_1\nSigned in: A <a@b.c>\nYou are helpful.") == (
        "Request: You are helpful.", "req_1\nSigned in: A <a@b.c>\n")
    assert site.cut("Request: " + "x" * 200 + "You are") is None  # far longer than any span it was learned from
    assert VolatileSite("prompt", "", "", 10).cut("whole") == ("", "whole")


@pytest.mark.slow
def test_the_whole_corpus_is_diagnosed_right(capsys, tmp_path, tokenizer_dir):
    wrong = {}
    for name, shape in SHAPES.items():
        report = _report(capsys, tmp_path, tokenizer_dir, name, REQUESTS)
        if report["causes"][0]["kind"] != shape.cause:
            wrong[name] = [c["kind"] for c in report["causes"]]
    assert wrong == {}
