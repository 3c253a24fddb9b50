"""Small real GGUF files for the tests, written with the `gguf` package's writer from a random Hugging Face
checkpoint, the way llama.cpp's converter lays them out: its tensor names, q/k rows permuted for its interleaved
RoPE (Llama only), matrices quantized, and the byte-level BPE tokenizer in the metadata."""

from __future__ import annotations

import json

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file

from kvprefix.tokenizer.builtin import IM_END, build_tokenizer

LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL:
        return GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute`: per head, the two rotary halves interleaved row by row."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def roundtrip(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The values a tensor has after quantizing to ``qtype`` and back: what a loader must reproduce."""
    return quants.dequantize(quants.quantize(w, qtype), qtype).reshape(w.shape)


def write_gguf(path: str, checkpoint: str, config: dict, qtype: GGMLQuantizationType, *, pre: str = "smollm",
               arch: str = "llama", tokenizer_vocab_size: int = 512,
               rope_freqs: np.ndarray | None = None, spm=None) -> dict[str, np.ndarray]:
    """Writes ``checkpoint`` (a write_random_checkpoint directory) as a GGUF file; returns, per Hugging Face name,
    the float32 values the file holds (quantized matrices dequantized, in Hugging Face row order). ``spm``: a
    SentencePiece model (train_sentencepiece) whose vocabulary the file gets instead of the byte-level BPE."""
    config = {"rope_theta": 10000.0, **config}
    tensors = {k: v.float().numpy() for k, v in load_file(f"{checkpoint}/model.safetensors").items()}
    writer = GGUFWriter(path, arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if spm is not None:
        add_spm_tokenizer(writer, spm)
    else:
        add_bpe_tokenizer(writer, pre, tokenizer_vocab_size)
    if rope_freqs is not None:  # Llama 3.1+: llama.cpp's converter stores the per-frequency divisors
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    held = {}
    for name, w in tensors.items():
        stored = w
        if arch == "llama" and "q_proj" in name:
            stored = llama_cpp_permute(w, heads)
        elif arch == "llama" and "k_proj" in name:
            stored = llama_cpp_permute(w, kv_heads)
        if w.ndim == 2 and qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(gguf_name(name), quants.quantize(stored, qtype), raw_dtype=qtype)
            held[name] = roundtrip(w, qtype)  # quantization is row-wise: the permutation commutes with it
        elif w.ndim == 2 and qtype == GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name(name), stored.astype(np.float16))
            held[name] = w.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name(name), stored)
            held[name] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def add_bpe_tokenizer(writer: GGUFWriter, pre: str, vocab_size: int) -> None:
    """The built-in byte-level BPE as a "gpt2" vocabulary with ``pre`` as its pre-tokenizer."""
    tok = build_tokenizer(vocab_size)
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t.content for t in tok.added_tokens_decoder.values()}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab[IM_END])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)


def reference_model(checkpoint: str, held: dict[str, np.ndarray]):
    """transformers' model of ``checkpoint`` with the weights the GGUF file holds: the logits to match."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in held.items()}, strict=False)
    return model


# A SentencePiece BPE vocabulary trained at test time, stored as llama.cpp's converter stores one ("llama" model).
SPM_USER_DEFINED = ("<|user|>",)
SPM_CONTROL = ("<|end|>",)
SPM_CHAT_TEMPLATE = (  # Llama 2's shape, reading the BOS and EOS spellings from the template variables
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def _spm_corpus() -> list[str]:
    """A few KB of fixed text: the built-in tokenizer's corpus and pseudo-words, numbers and code from a seed."""
    import random

    from kvprefix.tokenizer.builtin import _CORPUS

    rng = random.Random(0)
    syllables = ["ka", "to", "ri", "en", "the", "an", "ing", "er", "qu", "st", "al", "on", "pre", "fix"]
    lines = _CORPUS.splitlines()
    for _ in range(120):
        words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(rng.randint(3, 9))]
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ":"]) + f" {rng.randint(0, 99999)}")
    lines += [f"def f{i}(x): return x * {i} + {i * i}  # {i}" for i in range(20)]
    return lines


def train_sentencepiece(vocab_size: int = 700):
    """A SentencePiece BPE model with byte fallback and no normalization (as Llama 2's), trained in memory."""
    import io

    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_spm_corpus()), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, character_coverage=1.0, allow_whitespace_only_pieces=True, hard_vocab_limit=False,
        user_defined_symbols=list(SPM_USER_DEFINED), control_symbols=list(SPM_CONTROL), minloglevel=2)
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def add_spm_tokenizer(writer: GGUFWriter, sp, *, add_space_prefix: bool | None = None,
                      add_bos: bool | None = None, byte_tokens: bool = True) -> None:
    """The vocabulary, scores, token types and special ids of ``sp``, as llama.cpp's converter writes them
    (``byte_tokens=False``: the byte tokens renamed to unused ones, as in a vocabulary without byte fallback)."""
    user_defined = {sp.piece_to_id(s) for s in SPM_USER_DEFINED}
    types = []
    for i in range(sp.get_piece_size()):
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                     else 6 if sp.is_byte(i) else 4 if i in user_defined else 1)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if not byte_tokens:
        tokens = [f"[unused{i}]" if kind == 6 else t for i, (t, kind) in enumerate(zip(tokens, types, strict=True))]
        types = [5 if kind == 6 else kind for kind in types]
    writer.add_token_list(tokens)
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(SPM_CHAT_TEMPLATE)
