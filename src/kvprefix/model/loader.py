"""load_model: a checkpoint directory (or hub id when online) or a .gguf file -> CausalLM with its weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
import torch
from safetensors import safe_open

from kvprefix.model.config import ModelConfig
from kvprefix.model.gguf_loader import gguf_parameters
from kvprefix.model.llama import CausalLM
from kvprefix.tokenizer.gguf_file import is_gguf, open_gguf

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint tensors that are derived, not learned (older transformers saved them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accepts a torch dtype or its name ("bfloat16", "torch.float16", ...)."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; accepted: {list(DTYPES)}")
    return DTYPES[name]


def default_dtype(device: torch.device) -> torch.dtype:
    """The dtype "auto" means: bfloat16 on CUDA and on CPUs with native bfloat16 matmuls, else float32 (other CPUs
    would emulate bfloat16; docs/model.md, "Speed and dtype")."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cpu" and native_bfloat16_cpu() else torch.float32


def native_bfloat16_cpu() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (AVX512-BF16 or AMX); elsewhere PyTorch emulates them."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own probes (private names)
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_model_path(model: str) -> str:
    """A local directory or .gguf file as is; otherwise a Hugging Face hub id, downloaded (safetensors and tokenizer
    files only)."""
    model = os.path.expanduser(model)
    if os.path.isdir(model) or (is_gguf(model) and os.path.isfile(model)):
        return model
    if is_gguf(model):
        raise FileNotFoundError(f"GGUF file {model!r} does not exist")
    if os.path.exists(model) or model.startswith((".", "/")):
        raise FileNotFoundError(
            f"model path {model!r} is not a directory; a checkpoint directory or a .gguf file is expected"
        )
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        # Mistral repos also ship the weights again in their own format (consolidated*.safetensors).
        return snapshot_download(model, allow_patterns=patterns, ignore_patterns=["consolidated*"])
    except Exception as e:  # offline, unknown id, gated repo: say what was tried
        raise FileNotFoundError(
            f"model {model!r} is neither a local directory nor a downloadable Hugging Face hub id ({e})"
        ) from e


def safetensors_files(path: str) -> list[str]:
    """The weight files of a checkpoint: per the shard index if present, else every *.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise FileNotFoundError(f"shards listed in {index!r} are missing: {missing}")
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors") and not n.startswith("consolidated"))
    if not names:
        raise FileNotFoundError(f"no *.safetensors weights in {path!r} (only safetensors checkpoints are supported)")
    return [os.path.join(path, n) for n in names]


def load_model(model: str, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
    """Builds the decoder for `model` (directory, hub id or .gguf file) and loads its weights, in eval mode on
    `device`."""
    path = resolve_model_path(model)
    config = ModelConfig.from_path(path)
    dtype = resolve_dtype(dtype)
    # Built on the meta device so no memory is spent on an initialization that the weights overwrite.
    with torch.device("meta"):
        net = CausalLM(config, dtype)
    net.to_empty(device=device)
    net.tie_weights()
    views = net.checkpoint_views()  # checkpoint name -> the parameter (or the rows of a stacked one) it fills
    loaded: set[str] = set()
    for source, name, tensor in _checkpoint_tensors(path, config):
        if name not in views:
            raise ValueError(f"unexpected tensor {name!r} in {source!r} for a {config.model_type} model")
        if tensor.shape != views[name].shape:
            raise ValueError(
                f"tensor {name!r} in {source!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(views[name].shape)}"
            )
        views[name].copy_(tensor)
        loaded.add(name)
    if config.tie_word_embeddings:
        loaded.add("lm_head.weight")  # shares the embedding's storage
    missing = sorted(set(views) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    net.name_or_path = path
    return net.eval()


def _checkpoint_tensors(path: str, config: ModelConfig) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(where it came from, parameter name, values) for every weight of the checkpoint."""
    if is_gguf(path):
        gguf = open_gguf(path)
        for gguf_name, name, values in gguf_parameters(gguf, config):
            # The reader maps the file read-only; torch wants a writable array (copied only when it is a view).
            yield f"{path}:{gguf_name}", name, torch.from_numpy(np.require(values, requirements=["C", "W"]))
        return
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_IGNORED_SUFFIXES):
                    yield file, name, f.get_tensor(name)
