"""Loading PEFT LoRA adapters: what a good one becomes, the one-line errors of bad ones, and the content
fingerprint that names its cache namespace."""

import json
import os
import shutil

import pytest

from kvprefix.cache.identity import adapter_fingerprint
from kvprefix.model import load_model, write_random_checkpoint, write_random_lora_adapter
from kvprefix.model.lora import load_lora_adapter


@pytest.fixture(scope="module")
def model(tiny_llama_path):
    return load_model(tiny_llama_path)


@pytest.fixture(scope="module")
def adapter_dir(tiny_llama_path, tmp_path_factory) -> str:
    return write_random_lora_adapter(tiny_llama_path, str(tmp_path_factory.mktemp("a") / "r8"), rank=8, seed=1,
                              targets=("q_proj", "v_proj", "down_proj"))


def test_stacked_projections_take_their_parts(model, adapter_dir):
    adapter = load_lora_adapter(adapter_dir, model, max_rank=8)
    assert adapter.rank == 8 and adapter.fingerprint == adapter_fingerprint(adapter_dir)
    a, b = adapter.weights[(0, "self_attn.qkv_proj")]
    config = model.config
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    assert a.shape == (16, 64) and b.shape == (q + 2 * kv, 16)  # q and v: two rank-8 blocks
    assert b[q : q + kv].abs().sum() == 0 and b[:q, 8:].abs().sum() == 0  # k untouched; q reads only its own A
    assert set(adapter.weights) == {(layer, m) for layer in (0, 1) for m in ("self_attn.qkv_proj", "mlp.down_proj")}


def test_fingerprint_is_the_content(adapter_dir, tmp_path, tiny_llama_path):
    copy = shutil.copytree(adapter_dir, tmp_path / "copy")
    assert adapter_fingerprint(str(copy)) == adapter_fingerprint(adapter_dir)
    write_random_lora_adapter(tiny_llama_path, str(copy), rank=8, seed=2, targets=("q_proj", "v_proj", "down_proj"))
    assert adapter_fingerprint(str(copy)) != adapter_fingerprint(adapter_dir)


def test_rank_over_the_limit(model, adapter_dir):
    with pytest.raises(ValueError, match=r"has rank 8, over the limit max_lora_rank=4$"):
        load_lora_adapter(adapter_dir, model, max_rank=4)


@pytest.mark.parametrize("missing", ["adapter_config.json", "adapter_model.safetensors"])
def test_missing_file(model, adapter_dir, tmp_path, missing):
    copy = shutil.copytree(adapter_dir, tmp_path / "copy")
    os.remove(copy / missing)
    with pytest.raises(ValueError, match=f"missing {missing}"):
        load_lora_adapter(str(copy), model, max_rank=16)


def test_adapter_of_another_model_is_refused(model, tmp_path):
    wider = write_random_checkpoint(str(tmp_path / "wider"), "llama", seed=3, hidden_size=128,
                                    intermediate_size=256, num_hidden_layers=2)
    other = write_random_lora_adapter(wider, str(tmp_path / "wide-adapter"), rank=4, targets=("o_proj",))
    with pytest.raises(ValueError, match=r"layer 0 o_proj has A \(4, 128\) and B \(128, 4\); the base model needs "
                                         r"A \(4, 64\) and B \(64, 4\)"):
        load_lora_adapter(other, model, max_rank=16)
    deeper = write_random_checkpoint(str(tmp_path / "deeper"), "llama", seed=3, num_hidden_layers=3)
    other = write_random_lora_adapter(deeper, str(tmp_path / "deep-adapter"), rank=4, targets=("o_proj",))
    with pytest.raises(ValueError, match="has weights for layer 2; the model has 2 layers"):
        load_lora_adapter(other, model, max_rank=16)


def test_target_module_the_model_lacks(model, tiny_llama_path, tmp_path):
    other = write_random_lora_adapter(tiny_llama_path, str(tmp_path / "lm"), rank=4, targets=("lm_head",))
    with pytest.raises(ValueError, match="not a LoRA A/B of a decoder projection; supported target modules: q_proj"):
        load_lora_adapter(other, model, max_rank=16)


def test_unsupported_peft_option(model, adapter_dir, tmp_path):
    copy = shutil.copytree(adapter_dir, tmp_path / "copy")
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="uses DoRA, which kvprefix does not apply"):
        load_lora_adapter(str(copy), model, max_rank=16)
