"""The built-in default model: a small random-weight Llama checkpoint, generated once into a cache directory.

It lets `kvprefix` run with no download. Its weights are random, so its text is meaningless; it exists to exercise
the engine, the prefix cache and the server, not to answer questions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from kvprefix.model.random_checkpoint import write_random_checkpoint

DEFAULT_MODEL_NAME = "default-model-v1"
# Big enough for prompts of several thousand tokens, small enough that a 64-client load test is fast on 2 cores.
DEFAULT_MODEL_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
)
DEFAULT_MODEL_SEED = 1234
DEFAULT_TOKENIZER_VOCAB = 1024  # a cap: the fixed training text runs out of merges at 727 tokens
NOTICE = (
    "kvprefix built-in default model: a small Llama-architecture checkpoint with RANDOM weights, generated "
    "deterministically from a seed. Its output text is meaningless. Use --model / LLM(model=...) with a real "
    "Hugging Face checkpoint directory or hub id for real text."
)


def cache_dir() -> str:
    """$KVPREFIX_CACHE_DIR, else ~/.cache/kvprefix."""
    return os.environ.get("KVPREFIX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvprefix")


def write_default_model(path: str) -> str:
    """Writes the default model's files into `path` (the same bytes every time)."""
    write_random_checkpoint(
        path,
        "llama",
        seed=DEFAULT_MODEL_SEED,
        tokenizer_vocab_size=DEFAULT_TOKENIZER_VOCAB,
        **DEFAULT_MODEL_CONFIG,
    )
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["_kvprefix_notice"] = NOTICE
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
        f.write(f"# {DEFAULT_MODEL_NAME}\n\n{NOTICE}\n")
    return path


def default_model_path() -> str:
    """The default model's directory, generating it on first use.

    Written into a temporary sibling directory and renamed into place, so a concurrent or interrupted build never
    leaves a half-written model where another process would load it.
    """
    target = os.path.join(cache_dir(), DEFAULT_MODEL_NAME)
    if os.path.isfile(os.path.join(target, "README.md")):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=cache_dir())
    try:
        write_default_model(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any other
        os.rename(tmp, target)
    except OSError:
        if not os.path.isfile(os.path.join(target, "README.md")):  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
