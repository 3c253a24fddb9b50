"""The doctor hashes under one BlockIdentity: a replica's (--identity, checked against --model), else the
checkpoint's own."""

from __future__ import annotations

import json

from support import doctor_logs as logs

from kvprefix.cache import block_identity
from kvprefix.cli import main
from kvprefix.doctor.cli import load_tokenizer
from kvprefix.doctor.rendering import Renderer


def test_the_doctor_hashes_as_the_identity_it_is_given(tokenizer_dir, tmp_path, capsys) -> None:
    tokenizer, own = load_tokenizer(str(tokenizer_dir))
    assert own.identity.context.model == "" and own.identity.hash_algo == "xxhash"  # a tokenizer directory
    replica = block_identity(str(tokenizer_dir), "bfloat16", None, tokenizer.chat_template, hash_algo="sha256")
    entry = tmp_path / "model.json"
    entry.write_text(json.dumps({"max_model_len": 99, "kvprefix": {"block_identity": replica.to_dict()}}))
    _, given = load_tokenizer(str(tokenizer_dir), str(entry))
    assert given.identity == replica and given.max_model_len == 99
    ids = tokenizer.encode("a prompt of a few blocks " * 8)
    renderer = Renderer(lambda: (tokenizer, given), "log")
    assert renderer.hasher(16).hash_blocks(ids) == replica.hasher().hash_blocks(ids)
    assert renderer.hasher(4).block_size == 4 and renderer.hasher(4).root == replica.hasher().root
    log = tmp_path / "bodies.jsonl"
    log.write_text("".join(json.dumps(logs.chat(logs.STABLE, f"question {k}")) + "\n" for k in range(4)))
    argv = ["doctor", str(log), "--model", str(tokenizer_dir), "--identity", str(entry), "--json", "--no-progress"]
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["requests"] == 4
