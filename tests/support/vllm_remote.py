"""vLLM's test harness, by the names its OpenAI-server tests use (tests/utils.py's RemoteOpenAIServer,
vllm.tokenizers.get_tokenizer, ModelConfig's vocabulary size), over a real `kvprefix serve` of the built-in model on
127.0.0.1: what lets tests/vllm_conformance run vLLM's own test files with only the model, the server start and
model-specific constants changed. The reference tokenizer is transformers' reading of the same GGUF file, not ours.
"""

from __future__ import annotations

import functools
from pathlib import Path

import openai

from kvprefix.cache.default_model import DEFAULT_MODEL_NAME, default_model_path
from kvprefix.model import write_random_lora_adapter
from support.server_registry import ServerRegistry, ServerSpec

MODEL_NAME = DEFAULT_MODEL_NAME  # SmolLM2-135M-Instruct, the name the server gives the built-in model


class RemoteOpenAIServer:
    """A `kvprefix serve` of the built-in model with ``args``, serving it as ``model``, through the session's server
    registry (its clean exit checked when stopped). vLLM's files each start their own server; here the plain
    configuration (no ``args``), which most of them use, is one process for the session (a boot is tens of seconds
    on 2 cores), and any other stops when the fixture that asked for it ends (each holds about a GB)."""

    show_hidden_metrics = False  # vLLM's --show-hidden-metrics-for-version: no hidden metrics here

    def __init__(self, model: str, args: list[str], registry: ServerRegistry):
        self._spec = ServerSpec((*args, "--served-model-name", model), builtin_model=True)
        self._registry = registry if args else None  # whom to ask to stop it at the end; None: kept
        self.url_root = registry.get(self._spec).url

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._registry is not None:
            self._registry.stop(self._spec)

    def url_for(self, *parts: str) -> str:
        return "/".join((self.url_root, *parts))

    def get_client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key="none", max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key="none", max_retries=0, **kwargs)


@functools.cache
def get_tokenizer(tokenizer_name: str = MODEL_NAME):
    """transformers' tokenizer of the built-in model, read from its GGUF file (once per session: it takes seconds)."""
    from transformers import AutoTokenizer

    assert tokenizer_name == MODEL_NAME, tokenizer_name
    path = Path(default_model_path())
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def get_vocab_size(model_name: str = MODEL_NAME) -> int:
    return len(get_tokenizer(model_name))


def write_lora_adapter(out_dir: Path) -> str:
    """A random PEFT LoRA adapter (rank 8) of the built-in model, made by peft: what stands in for the adapter of
    another model that vLLM's tests download (typeof/zephyr-7b-beta-lora)."""
    path = Path(default_model_path())
    return write_random_lora_adapter(str(path.parent), str(out_dir), rank=8, gguf_file=path.name)
