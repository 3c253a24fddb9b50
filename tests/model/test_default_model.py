"""The built-in default model: deterministic bytes, built once into the cache dir, loads and runs."""

import filecmp
import os
import subprocess
import sys

import pytest
import torch
from paged import greedy_generate

from kvprefix.model import allocate_kv_cache, default_model_path, load_model
from kvprefix.model.default_model import write_default_model
from kvprefix.prompts import Tokenizer


def test_same_bytes_every_build(default_model_dir: str, tmp_path) -> None:
    other = write_default_model(str(tmp_path))
    names = sorted(os.listdir(default_model_dir))
    assert names == sorted(os.listdir(other))
    match, mismatch, errors = filecmp.cmpfiles(default_model_dir, other, names, shallow=False)
    assert (mismatch, errors) == ([], [])


@pytest.mark.slow
def test_same_bytes_in_another_process(default_model_dir: str, tmp_path) -> None:
    # A new interpreter has fresh hash seeds (Python's and the tokenizer trainer's): nothing may depend on them.
    code = f"from kvprefix.model.default_model import write_default_model; write_default_model({str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    names = sorted(os.listdir(default_model_dir))
    assert filecmp.cmpfiles(default_model_dir, tmp_path, names, shallow=False)[0] == names


def test_built_once_into_cache_dir_and_reused(default_model_dir: str) -> None:
    assert default_model_dir == os.path.join(os.environ["KVPREFIX_CACHE_DIR"], "default-model-v1")
    weights = os.path.join(default_model_dir, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    assert default_model_path() == default_model_dir
    assert os.stat(weights).st_mtime_ns == before
    assert [n for n in os.listdir(os.path.dirname(default_model_dir)) if n.startswith(".")] == []  # no temp dirs


def test_says_its_weights_are_random(default_model_dir: str) -> None:
    with open(os.path.join(default_model_dir, "README.md")) as f:
        assert "RANDOM weights" in f.read()
    with open(os.path.join(default_model_dir, "config.json")) as f:
        assert "meaningless" in f.read()


def test_loads_and_generates(default_model_dir: str) -> None:
    model = load_model(default_model_dir)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.max_position_embeddings) == (4, 256, 8192)
    tokenizer = Tokenizer(default_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}])
    kv = allocate_kv_cache(config, 8, 16, torch.float32, "cpu")
    out = greedy_generate(model, kv, 16, prompt, 8, block_ids=[3, 1])
    assert len(out) == 8 and all(0 <= t < config.vocab_size for t in out)
