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
ARCH_CONFIGS = {
    "llama": dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(tie_word_embeddings=True),  # qkv bias is always on in Qwen2
    "qwen3": dict(head_dim=32),  # != hidden_size / heads (16): head_dim must come from config
}


@pytest.fixture(scope="session", params=sorted(ARCH_CONFIGS))
def arch_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch = request.param
    return write_random_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=1, **ARCH_CONFIGS[arch])
