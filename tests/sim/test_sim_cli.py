"""`kvprefix simulate` end to end: a sweep to table, JSON and PNG; bad input gets a message and exit code 2."""

import json
import shutil
import subprocess
import sys

import pytest

from kvprefix.cli import main


@pytest.mark.slow
def test_sweep_writes_table_json_and_plot(traces_dir, tmp_path, capsys):
    out_json, out_png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = [
        "simulate", str(traces_dir / "vllm_prefix_repetition_default_bs16.jsonl"), "--mode", "order",
        "--capacity", "1024,4096,unbounded", "--replicas", "2", "--routing", "round-robin,kv-events,shared",
        "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "kv-events" in table and "unbounded" in table and "token-weighted" in table
    doc = json.loads(out_json.read_text())
    assert set(doc["hit_rate_definitions"]) == {"token_hit_rate", "block_hit_rate", "request_hit_rate"}
    runs = doc["runs"]
    assert len(runs) == 9 and {r["routing"] for r in runs} == {"round-robin", "kv-events", "shared"}
    unbounded = [r for r in runs if r["capacity_tokens"] is None]
    assert all(r["per_replica"] for r in runs) and all(r["evictions"] == 0 for r in unbounded)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate"], "give a trace file"),
        (["simulate", "/nonexistent/trace.jsonl"], "trace /nonexistent/trace.jsonl: no such file"),
        (["simulate", "{trace}", "--capacity", "lots"], "expected sizes like"),
        (["simulate", "{trace}", "--routing", "fastest"], "unknown routing 'fastest'"),
        (["simulate", "{trace}", "--replicas", "0"], "expected a positive integer"),
        (["simulate", "{trace}", "--block-size", "24"], "cannot convert 16-token blocks to 24-token blocks"),
        (["simulate", "{trace}", "--capacity", "8"], "smaller than one 16-token block"),
        (["simulate", "{trace}", "--load-cap", "0.5", "--routing", "kv-events"], "load_cap must be >= 1.0"),
        (["simulate", "{bad}"], "bad.jsonl:2: missing field 'input_length'"),
    ],
)
def test_bad_input_exits_2_with_a_message(traces_dir, tmp_path, capsys, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1}\n')
    trace = traces_dir / "vllm_prefix_repetition_default_bs16.jsonl"
    argv = [a.format(trace=trace, bad=bad) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_installed_command_runs_the_seed_example():
    done = subprocess.run(
        [sys.executable, "-m", "kvprefix.cli", "simulate", "--example", "seed"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "4296" in done.stdout and "712" in done.stdout


def test_openai_bodies_hash_under_a_replicas_identity(tiny_llama_path, tmp_path, capsys):
    """--identity: a replica's /v1/models entry sets the block size, the algorithm and the context length, and a
    tokenizer that is not the identity's checkpoint is refused, naming what differs."""
    from kvprefix.cache import block_identity
    from kvprefix.sim.openai_bodies import read_openai_bodies, read_replica_model
    from kvprefix.tokenizer import Tokenizer

    identity = block_identity(tiny_llama_path, "bfloat16", None, Tokenizer(tiny_llama_path).chat_template,
                              block_size=8, hash_algo="xxhash")
    entry = tmp_path / "model.json"
    entry.write_text(json.dumps({"data": [{"id": "m", "max_model_len": 12, "kvprefix": {"block_identity":
                                                                                         identity.to_dict()}}]}))
    bodies = tmp_path / "bodies.jsonl"
    bodies.write_text(json.dumps({"prompt": "one two three four five six seven eight nine ten eleven twelve " * 3,
                                  "truncate_prompt_tokens": -1, "tenant": "acme"}) + "\n")
    (request,) = read_openai_bodies(bodies, tiny_llama_path, None, replica=read_replica_model(str(entry))).requests
    assert request.input_length == 12 and request.num_blocks == 2
    assert request.block_hashes == identity.hasher().for_namespace("acme", None).hash_blocks(
        Tokenizer(tiny_llama_path).encode("one two three four five six seven eight nine ten eleven twelve " * 3)[-12:])
    argv = ["simulate", str(bodies), "--tokenizer", tiny_llama_path, "--identity", str(entry), "--no-progress"]
    assert main(argv) == 0 and "hit(tok)" in capsys.readouterr().out
    other = shutil.copytree(tiny_llama_path, tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + "\n")  # same tokens, other bytes
    assert main(["simulate", str(bodies), "--tokenizer", str(other), "--identity", str(entry)]) == 2
    assert "is not the checkpoint of the given identity: tokenizer" in capsys.readouterr().err
