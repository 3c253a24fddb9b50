"""A decode-only step's decoder layers, all in one call to the native kernel ``kernels/decode_layer.c``: the same
kernels as each layer's own forward (int4 projections, RMSNorm, rotary, decode attention, SiLU) in the same order,
so the same bits, without the ~20 Python-dispatched ops and calls a layer between them
(docs/model.md#native-kernels).

``DecodeStep.of`` says whether a step qualifies: decodes only (as many as the int4 layers run their kernel for),
none sharing a cascade prefix, bfloat16 on CPU, the kernel built, every layer ``fusable`` (compact int4 weights on
the native kernel, no bias, window, q/k norm or deterministic mode) and no forward hook on them. Any other step
runs the layers' forwards."""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from kvprefix.model import native_attention
from kvprefix.model.attention import AttentionMetadata, LayerKV
from kvprefix.model.config import ModelConfig
from kvprefix.model.native_kernels import probed


def _projections(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def fusable(layer) -> bool:
    """Whether the kernel computes ``layer`` (a ``llama.DecoderLayer``) as its forward would (hooks aside: see
    ``LayerStack.hooked``)."""
    attn = layer.self_attn
    return (attn.window is None and not attn.qk_norm and not attn.batch_invariant
            and native_attention.supports_heads(attn.num_heads, attn.num_kv_heads, attn.head_dim)
            and all(getattr(p, "native", False) and p.bias is None and p.dense.shape[0] == p.out_features
                    for p in _projections(layer))
            and layer.input_layernorm.weight.dtype == layer.post_attention_layernorm.weight.dtype == torch.bfloat16)


class LayerStack:
    """A model's decoder layers as the kernel takes them, built once per model and set of caches (``stack``):
    whether every layer is ``fusable``, and their pointers packed as ``struct kvp_layer`` (int64s). What may change
    after loading, a hook on any of their modules (a LoRA adapter's), is checked every step (``hooked``); modules
    swapped after the model's first decode step are not seen."""

    def __init__(self, layers, kv_caches) -> None:
        self.key = _stack_key(kv_caches)
        # Each module's hook dicts: registering a hook adds to them in place, so checking them sees it.
        self.hooks = [d for layer in layers for m in layer.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self.fusable = bool(layers) and all(fusable(layer) for layer in layers)
        self.count = len(layers)
        if self.fusable:
            pointers = []
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                pointers += [layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr()]
                for p in _projections(layer):
                    pointers += [p.qweight.data_ptr(), p.scales_and_zeros.data_ptr()]
                pointers.append(kv_cache.kv.data_ptr())
            self.pointers = torch.tensor(pointers, dtype=torch.int64)
            first = layers[0]
            attn = first.self_attn
            # Decodes beyond what every projection runs its int4 kernel for take the layers' dense matmuls.
            self.max_decodes = min(p.dense_above_rows for layer in layers for p in _projections(layer))
            self.eps, self.scale, self.inner = first.input_layernorm.eps, attn.scale, first.mlp.inner
            self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)

    def hooked(self) -> bool:
        """Whether a forward hook (global, or on any of the layers' modules) would be bypassed."""
        return bool(_global_hooks()) or any(self.hooks)


def _stack_key(kv_caches) -> tuple:
    """What the packed pointers were built for: the caches by address (a cache freed and another made at its address
    is the same pointer, so still right); the layers are the dict's own key (weakly held, never a stale id)."""
    return tuple(c.kv.data_ptr() for c in kv_caches)


def _global_hooks() -> dict:
    from torch.nn.modules import module

    return module._global_forward_hooks or module._global_forward_pre_hooks


_stacks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layers (nn.ModuleList) -> LayerStack


def stack(layers, kv_caches) -> LayerStack:
    """The ``LayerStack`` of ``layers`` (an ``nn.ModuleList``) and ``kv_caches``, built on first use."""
    cached = _stacks.get(layers)
    if cached is None or cached.key != _stack_key(kv_caches):
        cached = _stacks[layers] = LayerStack(layers, kv_caches)
    return cached


class DecodeStep:
    """One step's decodes as the kernel takes them: the layers, and the decodes' block tables, lengths and new
    tokens' cache rows."""

    def __init__(self, layers: LayerStack, block_size: int, table: torch.Tensor, seq_lens: torch.Tensor,
                 slots: torch.Tensor) -> None:
        self.layers, self.block_size, self.table, self.seq_lens, self.slots = layers, block_size, table, seq_lens, slots

    @classmethod
    def of(cls, meta: AttentionMetadata, layers, kv_caches, x: torch.Tensor) -> DecodeStep | None:
        """The step's ``DecodeStep``, or None where it does not qualify (see the module's docstring)."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or not kv_caches or kernel() is None:
            return None
        cache = kv_caches[0].kv
        if cache.dtype != torch.bfloat16:
            return None
        layer_stack = stack(layers, kv_caches)
        if not layer_stack.fusable or layer_stack.hooked() or meta.slot_mapping.numel() > layer_stack.max_decodes:
            return None
        return cls.of_plan(meta, cache.shape[1], layer_stack)

    @classmethod
    def of_plan(cls, meta: AttentionMetadata, block_size: int, layers: LayerStack) -> DecodeStep | None:
        """The step's ``DecodeStep`` where its batch is decodes only, none in a cascade; else None."""
        plan = meta.plan(block_size)
        if plan.prefills or plan.decodes is None or plan.shared is not None:
            return None
        decodes = plan.decodes
        table = decodes.blocks.view(decodes.seq_lens.numel(), -1)
        return cls(layers, block_size, table, decodes.seq_lens.contiguous(), meta.slot_mapping.contiguous())

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fn=None) -> None:
        """The layers' forwards on x [decodes, hidden] in place (x contiguous), on ``fn`` (a ``bind``-ing; default
        ``kernel()``)."""
        layers = self.layers
        failed = (fn or kernel())(x.data_ptr(), x.shape[0], x.shape[1], layers.eps, layers.pointers.data_ptr(),
                                  layers.count, *layers.heads, layers.inner, cos.data_ptr(), sin.data_ptr(),
                                  self.slots.data_ptr(), self.block_size, self.table.data_ptr(), self.table.shape[1],
                                  self.seq_lens.data_ptr(), layers.scale, torch.get_num_threads())
        if failed == -1:
            raise MemoryError("decode layers kernel: no scratch memory")
        if failed:
            raise ValueError("decode layers kernel: shapes it does not take (see ``fusable``)")


def bind(lib: ctypes.CDLL):
    """The kernel's entry point in ``lib`` (a build of ``kernels/decode_layer.c``), with its C signature; None where
    the build has no path for its CPU (its int4 projections need AVX512-BF16)."""
    if not lib.kvp_decode_layer_supported():
        return None
    fn = lib.kvp_decode_layers
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ctypes.c_float, ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64, ptr,
                   ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def agrees(fn) -> bool:
    """Whether ``fn`` computes a small random layer (int4 weights, two decodes of different lengths) bit for bit
    as its forward does, hidden state and cache both (which also holds only where the forward runs the same native
    kernels)."""
    from kvprefix.model.llama import DecoderLayer  # llama imports this module
    from kvprefix.model.quantized_linear import Int4Linear
    from kvprefix.model.rope import RotaryEmbedding

    config = ModelConfig(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_theta=10000.0, sliding_windows=(None,))
    generator = torch.Generator().manual_seed(0)
    layer = DecoderLayer(config, 0, torch.bfloat16)
    for parent in (layer.self_attn, layer.mlp):
        for name, linear in list(parent.named_children()):
            weight = torch.randn(linear.out_features, linear.in_features, generator=generator) / 8
            setattr(parent, name, Int4Linear.from_float(weight))
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = torch.rand(64, generator=generator).bfloat16() + 0.5
    if not fusable(layer):
        return False
    meta, positions = AttentionMetadata.for_chunks([(5, 1, [3, 1]), (9, 1, [0, 4, 2])], 4)
    cos, sin = RotaryEmbedding(config)(positions, torch.bfloat16)
    cache = torch.randn(5, 4, 4, 16, generator=generator).bfloat16()
    x = torch.randn(2, 64, generator=generator).bfloat16()
    expected_cache, got_cache, got = cache.clone(), cache.clone(), x.clone()
    expected = layer(x, cos, sin, meta, LayerKV(expected_cache))
    DecodeStep.of_plan(meta, 4, LayerStack([layer], [LayerKV(got_cache)])).run(got, cos, sin, fn=fn)
    return torch.equal(got, expected) and torch.equal(got_cache, expected_cache)


@functools.cache
def kernel():
    """The kernel's entry point, or None: not built, no path for this CPU, or not ``agrees``-ing."""
    return probed("decode_layer", bind, agrees)
