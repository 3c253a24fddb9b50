"""The execution context comes from a checkpoint's own bytes, and one namespace derivation serves everyone."""

from __future__ import annotations

import os

from kvprefix.cache import BlockHasher, context_for_checkpoint, namespace_id, namespace_salt


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
