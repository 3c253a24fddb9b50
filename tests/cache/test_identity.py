"""The execution context comes from a checkpoint's own bytes, one constructor builds the block identity (which
round-trips through its JSON form), and one namespace derivation serves everyone."""

from __future__ import annotations

import json
import os

import pytest

from kvprefix.cache import BlockHasher, BlockIdentity, block_identity, namespace_id, namespace_salt
from kvprefix.cache.identity import context_for_checkpoint


def checkpoint(path, weights: bytes = b"weights-1", tokenizer: str = '{"model": 1}'):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"hidden_size": 8}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text(tokenizer)
    return path


def test_the_same_checkpoint_under_any_path_has_one_context(tmp_path) -> None:
    a = checkpoint(tmp_path / "a")
    copy = checkpoint(tmp_path / "elsewhere" / "copy")
    link = tmp_path / "link"
    os.symlink(a, link)
    contexts = {context_for_checkpoint(p, "bfloat16", "{{ x }}") for p in (str(a), str(a) + "/", str(link), str(copy))}
    assert len(contexts) == 1
    (ctx,) = contexts
    assert ctx.model and ctx.tokenizer and ctx.chat_template and ctx.kv_dtype == "bfloat16" and ctx.salt == ""


def test_other_weights_tokenizer_template_or_dtype_change_the_root(tmp_path) -> None:
    base = context_for_checkpoint(str(checkpoint(tmp_path / "a")), "float32", "t")
    others = [
        context_for_checkpoint(str(checkpoint(tmp_path / "w", weights=b"weights-2")), "float32", "t"),
        context_for_checkpoint(str(checkpoint(tmp_path / "k", tokenizer='{"model": 2}')), "float32", "t"),
        context_for_checkpoint(str(tmp_path / "a"), "float32", "other template"),
        context_for_checkpoint(str(tmp_path / "a"), "bfloat16", "t"),
    ]
    roots = {BlockHasher(16, context=c).root for c in [base, *others]}
    assert len(roots) == 5


def test_a_hub_snapshot_names_its_revision(tmp_path) -> None:
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = checkpoint(tmp_path / "models--org--m" / "snapshots" / rev)
    assert context_for_checkpoint(str(snap), "float32").revision == rev
    assert context_for_checkpoint(str(checkpoint(tmp_path / "plain")), "float32").revision == ""


def test_a_rewritten_checkpoint_is_a_new_identity(tmp_path) -> None:
    path = checkpoint(tmp_path / "a")
    before = context_for_checkpoint(str(path), "float32")
    (path / "model.safetensors").write_bytes(b"retrained-weights")  # same path, new bytes
    assert context_for_checkpoint(str(path), "float32").model != before.model


def test_one_namespace_derivation_and_a_public_id() -> None:
    hasher = BlockHasher(4)
    assert hasher.for_namespace(None, None) is hasher
    assert hasher.for_namespace(None, "s").root == hasher.with_salt(namespace_salt(None, "s")).root
    assert hasher.for_namespace("t", None).root != hasher.for_namespace(None, "t").root
    salted = hasher.for_namespace("tenant", "secret")
    assert salted.namespace_id == namespace_id(salted.root) and len(salted.namespace_id) == 16
    assert "secret" not in salted.namespace_id and salted.namespace_id != hasher.namespace_id


def test_one_constructor_names_dtype_and_quantization_and_round_trips(tmp_path) -> None:
    path = str(checkpoint(tmp_path / "a"))
    identity = block_identity(path, "bfloat16", "int8", "t", block_size=32, hash_algo="xxhash")
    assert identity.context == context_for_checkpoint(path, "bfloat16+int8", "t")
    assert (identity.block_size, identity.hash_algo, identity.checkpoint) == (32, "xxhash", os.path.realpath(path))
    assert identity.hasher().root == BlockHasher(32, "xxhash", identity.context).root
    wire = json.loads(json.dumps(identity.to_dict()))
    assert wire["version"] == 1 and "salt" not in wire["context"]
    assert BlockIdentity.from_dict(wire) == identity
    dense = block_identity(path, "bfloat16", None, "t", block_size=32, hash_algo="xxhash")
    assert dense.hasher().root != identity.hasher().root
    assert identity.differences(dense) == ["kv_dtype bfloat16+int8 vs bfloat16"]


def test_from_dict_refuses_other_versions_and_bad_fields(tmp_path) -> None:
    wire = block_identity(str(checkpoint(tmp_path / "a")), "float32", None, None).to_dict()
    for bad, message in (({**wire, "version": 2}, "version 2"), ({**wire, "block_size": 0}, "block_size"),
                         ({**wire, "context": {"model": "m"}}, "context"), ("x", "version None")):
        with pytest.raises(ValueError, match=message):
            BlockIdentity.from_dict(bad)


def test_a_local_checkpoint_is_checked_by_its_fingerprints(tmp_path) -> None:
    identity = block_identity(str(checkpoint(tmp_path / "a")), "float32", None, "t")
    assert identity.checkpoint_differences(str(checkpoint(tmp_path / "copy"))) == []
    assert identity.template_difference("t") == [] and identity.template_difference("u")
    (other,) = identity.checkpoint_differences(str(checkpoint(tmp_path / "w", weights=b"other")))
    assert other.startswith("model ")
    tokenizer_only = tmp_path / "tok"
    tokenizer_only.mkdir()
    (tokenizer_only / "tokenizer.json").write_text('{"model": 1}')
    assert identity.checkpoint_differences(str(tokenizer_only)) == []  # no weights: the tokenizer decides
