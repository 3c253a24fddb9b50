"""The doctor on kvprefix's own request log (hashes only, and with prompts), and bad input: one line that names
the file and the line."""

import json
import random

import pytest
import support.doctor_logs as logs
from support.doctor_corpus import SHAPES

from kvprefix.cache import BlockHasher
from kvprefix.cli import main
from kvprefix.logs import RequestLogWriter, RequestRecord
from kvprefix.prompts import render_body
from kvprefix.tokenizer import Tokenizer


def write_request_log(path, rows, tokenizer_dir, with_prompts, later=None):
    """What `kvprefix serve --request-log` writes for these bodies: the server's renderer and hashes. ``later``:
    (from which row, another tokenizer directory) the server renders with from then on (a new chat template)."""
    tokenizer = Tokenizer(str(tokenizer_dir))
    hasher = BlockHasher(16, "sha256")
    writer = RequestLogWriter(str(path), include_prompts=with_prompts)
    for i, row in enumerate(rows):
        if later is not None and i == later[0]:
            tokenizer = Tokenizer(str(later[1]))
        prompt = render_body(tokenizer, row)[0]
        ts = 1_796_000_000.0 + row.get("timestamp", 0) / 1000
        writer.write(RequestRecord(
            timestamp=ts, prompt_tokens=len(prompt.token_ids),
            block_hashes=[h.hex() for h in hasher.hash_blocks(prompt.token_ids)], output_tokens=8, block_size=16,
            hash_algo="sha256", request_id=f"chatcmpl-{i}-0", endpoint="chat", model="m", tenant="t",
            timings={"ttft_s": 0.5, "e2e_s": 1.0}, finish_time=ts + 1.0, namespace=hasher.namespace_id,
            replica=row.get("replica", "host-1:8000"), prompt=prompt.text,
            message_spans=[list(s) if s else None for s in prompt.message_spans]))
    writer.close()
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["doctor", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("make,kind", [(logs.scattered, "routing"), (logs.concurrent, "concurrency")])
def test_hashes_only_request_log_reports_routing_and_concurrency_without_a_model(capsys, tmp_path, tokenizer_dir,
                                                                                 make, kind):
    log = write_request_log(tmp_path / "requests.jsonl", make(), tokenizer_dir, with_prompts=False)
    code, out, _ = run(capsys, log, "--json")  # no --model: nothing to render, so no tokenizer is loaded
    assert code == 0
    report = json.loads(out)
    assert report["causes"][0]["kind"] == kind
    assert report["causes"][0]["hit_rate_after"] > report["hit_rate"]


def test_request_log_with_prompts_shows_the_volatile_span(capsys, tmp_path, tokenizer_dir):
    log = write_request_log(tmp_path / "requests.jsonl", logs.volatile(), tokenizer_dir, with_prompts=True)
    code, out, _ = run(capsys, log, "--model", tokenizer_dir, "--json")
    assert code == 0
    report = json.loads(out)
    top = report["causes"][0]
    assert top["kind"] == "volatile-prefix" and top["example"]["field"] == "messages[0].content"
    assert "«2026-12-01T12:00:01Z. »" in top["example"]["this"]
    assert top["hit_rate_after"] > report["hit_rate"] + 0.3


@pytest.mark.parametrize("name", ["two-volatile-lines", "session-first-line", "several-volatile-spans"])
def test_request_log_with_prompts_moves_volatile_spans_of_any_length(capsys, tmp_path, tokenizer_dir, name):
    """The spans found in the rendered text (the template's own text around them) and cut from it."""
    rows = SHAPES[name].make(120, random.Random(0))
    log = write_request_log(tmp_path / "requests.jsonl", rows, tokenizer_dir, with_prompts=True)
    report = json.loads(run(capsys, log, "--model", tokenizer_dir, "--json")[1])
    top = report["causes"][0]
    assert top["kind"] == "volatile-prefix" and top["hit_rate_after"] > 0.8 > 0.3 > report["hit_rate"]


def test_request_log_whose_default_system_prompt_changed_is_template_drift(capsys, tmp_path, tokenizer_dir):
    """The server's template changed its default system prompt halfway: the same conversations render anew."""
    new_template = logs.write_tokenizer(tmp_path / "new-template", "You are a helpful assistant. Be brief.")
    rows = [{**row, "messages": row["messages"][1:]} for row in logs.default_system() if len(row["messages"]) == 4]
    log = write_request_log(tmp_path / "requests.jsonl", rows, tokenizer_dir, True, (len(rows) // 2, new_template))
    report = json.loads(run(capsys, log, "--model", tokenizer_dir, "--json")[1])
    top = report["causes"][0]
    assert top["kind"] == "template-drift" and "before messages[0]" in top["example"]["detail"]
    assert "Be brief." in top["example"]["this"] and "«" in top["example"]["other"]
    one_template = write_request_log(tmp_path / "fixed.jsonl", rows, tokenizer_dir, True)
    fixed = json.loads(run(capsys, one_template, "--model", tokenizer_dir, "--json")[1])
    assert top["hit_rate_after"] == pytest.approx(fixed["hit_rate"], abs=1e-12) and fixed["hit_rate"] > report[
        "hit_rate"]
    assert [c["kind"] for c in fixed["causes"]] == ["no-sharing"]
    code, out, _ = run(capsys, log, "--model", tokenizer_dir, "--html", tmp_path / "report.html")
    assert code == 0 and "(the template's own text): " in out
    assert "the template&#x27;s own text" in (tmp_path / "report.html").read_text()


def test_request_log_and_bodies_agree_on_the_hit_rate(capsys, tmp_path, tokenizer_dir):
    rows = logs.shuffled_tools()
    bodies = logs.write_jsonl(tmp_path / "bodies.jsonl", rows)
    log = write_request_log(tmp_path / "requests.jsonl", rows, tokenizer_dir, with_prompts=False)
    a = json.loads(run(capsys, bodies, "--model", tokenizer_dir, "--json")[1])
    b = json.loads(run(capsys, log, "--json")[1])
    assert a["hit_rate"] == b["hit_rate"] and a["requests"] == b["requests"]


def test_terminal_report_ranks_and_marks_the_divergence(capsys, tmp_path, tokenizer_dir):
    code, out, _ = run(capsys, logs.write_jsonl(tmp_path / "log.jsonl", logs.volatile()), "--model", tokenizer_dir)
    assert code == 0
    assert "1. volatile-prefix: 39 requests" in out and "hit rate" in out and "-> " in out
    assert "line      2 at token" in out and "«2026-12-01T12:00:01Z. »" in out
    assert "fix: move the volatile span" in out


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
BAD_BODIES = [
    ("not JSON", [GOOD, GOOD, "{not json"], 3, "not valid JSON"),
    ("messages not a list", [GOOD, json.dumps({"messages": "hi"})], 2, "'messages' must be a non-empty list"),
    ("bad timestamp", [GOOD, json.dumps({"prompt": "x", "timestamp": "soon"})], 2, "'timestamp'"),
    ("no role", [GOOD, GOOD, GOOD, json.dumps({"messages": [{"content": "x"}]})], 4, "'role'"),
    ("no prompt", [GOOD, json.dumps({"messages": [{"role": "user", "content": "x"}]}), json.dumps({"model": "m"})],
     3, "needs 'messages'"),
]


@pytest.mark.parametrize("name,lines,line,message", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_name_the_file_and_line(capsys, tmp_path, tokenizer_dir, name, lines, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, path, "--model", tokenizer_dir)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"{path}:{line}: " in err and message in err


def test_bad_request_log_names_the_line(capsys, tmp_path, tokenizer_dir):
    log = write_request_log(tmp_path / "requests.jsonl", logs.clean(3), tokenizer_dir, with_prompts=False)
    rows = log.read_text().splitlines()
    broken = json.loads(rows[1])
    del broken["prompt_tokens"]
    log.write_text("\n".join([rows[0], json.dumps(broken), rows[2]]) + "\n")
    code, _, err = run(capsys, log)
    assert code == 2 and f"{log}:2: missing field 'prompt_tokens'" in err


def test_other_traces_and_empty_files_are_refused(capsys, tmp_path):
    mooncake = tmp_path / "trace.jsonl"
    mooncake.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}) + "\n")
    code, _, err = run(capsys, mooncake)
    assert code == 2 and "OpenAI request bodies" in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(capsys, empty)
    assert code == 2 and "empty" in err


def test_progress_off_a_terminal_is_a_line_now_and_then(capsys, tmp_path, tokenizer_dir):
    """A job whose stderr is a file gets progress lines (every 10 s by default; here every time it looks)."""
    from kvprefix.doctor.analysis import diagnose
    from kvprefix.doctor.cli import load_tokenizer
    from kvprefix.doctor.diagnosis import Options

    log = logs.write_jsonl(tmp_path / "log.jsonl", logs.volatile(600))
    quiet = diagnose(str(log), lambda: load_tokenizer(str(tokenizer_dir)), Options())
    assert capsys.readouterr().err == ""
    loud = diagnose(str(log), lambda: load_tokenizer(str(tokenizer_dir)), Options(progress="lines",
                                                                                progress_every_s=0.0))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "kvprefix doctor: log.jsonl: reading: line 256 of 600 (43%), 0 s"
    assert any(": fixing: line 512 of 600" in line for line in lines)
    assert loud.to_dict() == quiet.to_dict()


def test_request_log_with_prompts_parting_outside_a_message(capsys, tmp_path, default_model_dir):
    """Shuffled tools in a request log with prompts, of a template that does not render tools (so they are
    written after the system prompt's own text, kvprefix.prompts.tools): the renderings part where no message
    span is (the log has no bodies to name the tools from). The doctor still reports; it crashed."""
    rows = logs.shuffled_tools()
    log = write_request_log(tmp_path / "requests.jsonl", rows, default_model_dir, with_prompts=True)
    code, out, _ = run(capsys, log, "--model", default_model_dir, "--json")
    report = json.loads(out)
    assert code == 0 and report["requests"] == len(rows) and report["hit_rate"] < 1


@pytest.mark.slow
def test_the_doctor_on_the_default_model_never_imports_torch(tmp_path):
    """`kvprefix doctor LOG` with no --model renders with the built-in model's tokenizer: loading torch (seconds) for
    it would be waste. In a fresh interpreter, since this one has torch loaded."""
    import subprocess
    import sys

    log = tmp_path / "bodies.jsonl"
    body = {"model": "m", "messages": [{"role": "system", "content": "You help. " * 40}, {"role": "user", "content": "Hi"}]}
    log.write_text("\n".join(json.dumps(body) for _ in range(3)) + "\n")
    code = ("import sys; from kvprefix.cli import main; code = main(['doctor', sys.argv[1], '--json', '--no-progress']); "
            "print('torch' in sys.modules, file=sys.stderr); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 3
    assert done.stderr.strip().splitlines()[-1] == "False"
