"""Checkpoint loading: sharded weights, dtypes, cache sizing, and clear errors for what is not supported."""

import json
import os
import shutil

import pytest
import torch

from kvprefix.model import ModelConfig, allocate_kv_cache, kv_cache_bytes_per_block, load_model, write_random_checkpoint


def edit_config(path: str, **changes) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(changes)
    with open(file, "w") as f:
        json.dump(config, f)


@pytest.fixture
def checkpoint_copy(tiny_llama_path: str, tmp_path) -> str:
    return shutil.copytree(tiny_llama_path, tmp_path / "ckpt", dirs_exist_ok=True).as_posix()


def test_sharded_checkpoint_loads_the_same_weights(tiny_llama_path: str, tmp_path) -> None:
    sharded = write_random_checkpoint(str(tmp_path), "llama", seed=0, max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([n for n in os.listdir(sharded) if n.endswith(".safetensors")]) > 1
    one, many = load_model(tiny_llama_path).state_dict(), load_model(sharded).state_dict()
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)


def test_dtype_accepts_names(tiny_llama_path: str) -> None:
    assert load_model(tiny_llama_path, dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16
    assert load_model(tiny_llama_path, dtype="torch.float16").lm_head.weight.dtype == torch.float16


def test_kv_cache_bytes_per_block_matches_allocation(tiny_llama_path: str) -> None:
    config = ModelConfig.from_path(tiny_llama_path)
    for dtype in (torch.float32, torch.bfloat16):
        kv = allocate_kv_cache(config, 3, 16, dtype, "cpu")
        total = sum(t.numel() * t.element_size() for pair in kv for t in pair)
        assert total == 3 * kv_cache_bytes_per_block(config, 16, dtype)
        assert kv[0][0].shape == (3, 16, config.num_key_value_heads, config.head_dim)


def test_legacy_rope_spelling_gives_same_config(tiny_llama_path: str) -> None:
    with open(os.path.join(tiny_llama_path, "config.json")) as f:
        raw = json.load(f)
    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    config = ModelConfig.from_dict(legacy)
    assert (config.rope_type, config.rope_theta, config.rope_parameters["factor"]) == ("linear", 500000.0, 2.0)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "'gpt2'.*accepted model types"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn'.*accepted"),
        ({"hidden_act": "gelu"}, "'gelu'.*accepted"),
    ],
)
def test_unsupported_config_is_named(checkpoint_copy: str, changes: dict, message: str) -> None:
    edit_config(checkpoint_copy, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(checkpoint_copy)


def test_missing_files_are_named(checkpoint_copy: str, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    os.remove(os.path.join(checkpoint_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(checkpoint_copy)


def test_weights_that_do_not_fit_the_config_are_named(checkpoint_copy: str) -> None:
    edit_config(checkpoint_copy, num_hidden_layers=3)
    with pytest.raises(ValueError, match="lacks weights.*layers.2"):
        load_model(checkpoint_copy)
    edit_config(checkpoint_copy, num_hidden_layers=2, intermediate_size=100)
    with pytest.raises(ValueError, match="mlp.*shape"):
        load_model(checkpoint_copy)


def test_bad_dtype_is_named(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="'int8'.*accepted"):
        load_model(tiny_llama_path, dtype="int8")
