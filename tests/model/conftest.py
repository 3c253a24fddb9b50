"""Tiny random checkpoints, one per supported architecture, each exercising that variant's distinctive feature."""

import pytest

from kvprefix.model import write_random_checkpoint

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the scaled band matters at the test's positions.
    "original_max_position_embeddings": 16,
}
CHECKPOINTS = {  # name -> (arch, config)
    "llama3": ("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),  # qkv bias is always on in Qwen2
    "qwen3": ("qwen3", dict(head_dim=32)),  # != hidden_size / heads (16): head_dim must come from config
}


@pytest.fixture(scope="session", params=sorted(CHECKPOINTS))
def arch_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch, config = CHECKPOINTS[request.param]
    return write_random_checkpoint(str(tmp_path_factory.mktemp(request.param)), arch, seed=1, **config)
