"""Weight-only int8/int4 layers: the ops' dequantization convention, packing from float weights and from GGUF blocks
(files the tests write with the gguf writer), and a tiny random Llama generating with quantized weights."""

import re

import gguf
import numpy as np
import pytest
import torch
from support.paged import Chunk, greedy_generate, run_batch

from kvprefix.engine import LLM, SamplingParams
from kvprefix.model import allocate_kv_cache, load_model, native_int4, native_int8
from kvprefix.model.quantized_linear import (
    INT8_ACTIVATIONS,
    Int4Linear,
    Int8Linear,
    gguf_rows_from_permuted,
    linear_weight_bytes,
    pack_gguf_tensors,
    pack_int8_weight,
    quantize_model,
)

BF16_EPS = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding moves a value by at most |v| * 2**-9
Q = gguf.GGMLQuantizationType


def effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The weight the layer's matmul applies, [out, in] in float32 (identity input; output rounded to bf16)."""
    return layer(torch.eye(layer.in_features)).float().t()


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): Hugging Face q/k rows -> GGUF rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _int8_path(request, monkeypatch) -> str:
    if request.param == "native" and native_int8.kernel() is None:
        pytest.skip("no native int8 kernel here (no AVX512-VNNI, or no C compiler)")
    if request.param == "fbgemm":
        if not INT8_ACTIVATIONS:  # fbgemm's u8s8 kernel is exact only with VNNI (x86)
            pytest.skip("no exact u8s8 kernel on this CPU")
        monkeypatch.setattr(native_int8, "kernel", lambda: None)
    return request.param


@pytest.fixture(params=["weight-only", "fbgemm", "native"])
def int8_path(request, monkeypatch) -> str:
    """Int8 layers built weight-only, or on int8 activations on fbgemm or on the native kernel (each where this
    CPU has it)."""
    return _int8_path(request, monkeypatch)


@pytest.fixture(params=["fbgemm", "native"])
def activations_path(request, monkeypatch) -> str:
    """Int8 layers on int8 activations, on fbgemm or on the native kernel (each where this CPU has it)."""
    return _int8_path(request, monkeypatch)


@pytest.fixture(params=["native", "pytorch"])
def int4_path(request, monkeypatch) -> str:
    """Int4 layers built on the native kernel (where this CPU has one) or on PyTorch's op."""
    if request.param == "native" and native_int4.kernel() is None:
        pytest.skip("no native int4 kernel here (no AVX512-BF16, or no C compiler)")
    if request.param == "pytorch":
        monkeypatch.setattr(native_int4, "kernel", lambda: None)
    return request.param


def test_int4_convention_is_q_minus_8_times_scale_plus_zero(int4_path) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = 40, 96  # n not a multiple of 16: exercises the padding rows
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.1 + 0.01).bfloat16().float()
    zeros = (torch.randn(n, k // 32, generator=gen) * 0.1).bfloat16().float()
    layer = Int4Linear(q, scales, zeros)
    assert layer.native == (int4_path == "native")
    expected = (q - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    torch.testing.assert_close(effective_weight(layer), expected, rtol=BF16_EPS, atol=1e-6)
    x = torch.randn(3, k, generator=gen)
    assert layer(x).shape == (3, n) and layer(x).dtype == torch.float32
    torch.testing.assert_close(layer(x), x.bfloat16().float() @ expected.t(), rtol=0.02, atol=0.02)


def test_int8_convention_is_q_times_channel_scale(int8_path: str) -> None:
    activations = int8_path != "weight-only"
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (24, 64), generator=gen, dtype=torch.int8)
    scales = (torch.rand(24, generator=gen) * 0.01).bfloat16().float()
    bias = torch.randn(24, generator=gen)
    layer = Int8Linear(q, scales, bias, int8_activations=activations)
    assert (layer.native_qweight is not None) == (int8_path == "native")
    assert (layer.packed is not None) == (int8_path == "fbgemm")
    # One-hot rows quantize exactly: the weight itself comes out.
    torch.testing.assert_close(effective_weight(Int8Linear(q, scales, int8_activations=activations)),
                               q.float() * scales[:, None], rtol=BF16_EPS, atol=1e-6)
    x = torch.randn(2, 5, 64, generator=gen)
    rows = x if activations else x.bfloat16().float()  # two int8 passes a row are as exact as float32 here
    expected = rows @ (q.float() * scales[:, None]).t() + bias
    tolerance = 1e-3 if activations else 0.02
    torch.testing.assert_close(layer(x), expected, rtol=tolerance, atol=tolerance)


def test_int8_activations_in_two_passes_are_as_exact_as_bfloat16_ones(activations_path: str) -> None:
    """One int8 pass a row (255 levels of its max) is far coarser where a row has outlier columns; the second
    pass, on the first one's rounding error, brings the product within bfloat16's error of the exact one."""
    gen = torch.Generator().manual_seed(7)
    layer = Int8Linear.from_float(torch.randn(256, 576, generator=gen) * 0.05)
    assert (layer.native_qweight is not None) == (activations_path == "native")
    x = torch.randn(8, 576, generator=gen) * torch.logspace(-2, 2, 576)[torch.randperm(576, generator=gen)]
    weight = layer.qweight.double() * layer.scales.double()[:, None]
    exact = x.double() @ weight.t()

    def error(out: torch.Tensor) -> float:
        return float((out.double() - exact).norm() / exact.norm())

    bf16 = x.bfloat16().double() @ weight.t()
    assert error(layer(x)) < error(bf16) / 10  # float32 in and out: only the second pass's rounding is left
    # fbgemm's own single pass
    one_pass = torch.ops.quantized.linear_dynamic(x, pack_int8_weight(layer.qweight, layer.scales.float()), False)
    assert error(one_pass) > 5 * error(bf16)


def test_int8_activations_make_each_row_independent_of_the_batch(activations_path: str) -> None:
    gen = torch.Generator().manual_seed(4)
    layer = Int8Linear.from_float(torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen))
    assert (layer.native_qweight is not None) == (activations_path == "native")
    layer.int8_activations_above_rows = 0  # as the lm_head: one row on the same kernel too
    x = torch.randn(Int8Linear.dense_above_rows, 96, generator=gen) * torch.logspace(-3, 3, 96)  # outlier columns
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(layer(x), alone)
    assert torch.equal(layer(x[:7]), alone[:7])
    layer.int8_activations_above_rows = 1  # a projection: a lone row takes the weight-only op (close, not equal)
    scale = float(alone[:1].abs().max())  # bfloat16 activations: an error relative to the row's largest output
    torch.testing.assert_close(layer(x[:1]), alone[:1], rtol=0, atol=4 * BF16_EPS * scale)


@pytest.mark.skipif(native_int8.kernel() is None or not INT8_ACTIVATIONS, reason="needs the kernel and fbgemm's")
def test_the_native_int8_layer_computes_fbgemms_numbers_in_place_of_its_copy(monkeypatch) -> None:
    """The same two int8 passes a row on either: the same outputs but for float32's last roundings, for bfloat16,
    float32 and float16 inputs, a batch of 3-d rows, a bias and outputs beyond a tile of 16. The native layer holds
    the kernel's packing (as many bytes as q, padded to a tile) instead of fbgemm's."""
    gen = torch.Generator().manual_seed(8)
    w, bias = torch.randn(200, 576, generator=gen) * 0.05, torch.randn(200, generator=gen)
    native = Int8Linear.from_float(w, bias)
    with monkeypatch.context() as patch:
        patch.setattr(native_int8, "kernel", lambda: None)
        fbgemm = Int8Linear.from_float(w, bias)
    assert native.packed is None and fbgemm.native_qweight is None and fbgemm.packed is not None
    assert native.native_qweight.dtype == torch.uint8 and native.native_qweight.numel() == 208 * 576
    for layer in (native, fbgemm):
        layer.int8_activations_above_rows, layer.keeps_float32 = 0, True  # as the lm_head
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = (torch.randn(2, 3, 576, generator=gen) * torch.logspace(-2, 1, 576)).to(dtype)
        got, expected = native(x), fbgemm(x)
        assert got.shape == (2, 3, 200) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
        torch.testing.assert_close(native(x[1, 1:2]), got[1, 1:2], rtol=0, atol=0)  # a row alone


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_requantization_error_is_bounded(cls) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 128, generator=gen)
    eff = effective_weight(cls.from_float(w))
    if cls is Int8Linear:
        step = w.abs().amax(1, keepdim=True) / 127
    else:
        groups = w.reshape(48, 4, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, 1)
    # Half a quantization step, plus the bfloat16 rounding of the scale (x up to 127 or 8 steps) and the output.
    bound = step / 2 * (1 + BF16_EPS * 256) + w.abs() * BF16_EPS
    assert ((eff - w).abs() <= bound).all()


@pytest.mark.parametrize("dense", [torch.bfloat16, torch.float32])  # native bfloat16 CPUs, and the others
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_prefill_sized_inputs_take_the_dequantized_path_with_the_same_weights(cls, dense, monkeypatch,
                                                                              int4_path) -> None:
    """The weight-only kernels (int8 layers take them on CPUs without an exact u8s8 kernel)."""
    from kvprefix.model import quantized_linear

    if cls is Int8Linear and int4_path == "native":
        pytest.skip("int8 layers have one weight-only path")
    monkeypatch.setattr(quantized_linear, "_DENSE", dense)
    gen = torch.Generator().manual_seed(5)
    kw = {"int8_activations": False} if cls is Int8Linear else {}
    layer = cls.from_float(torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen), **kw)
    x = torch.randn(cls.dense_above_rows + 1, 64, generator=gen)
    kernel_rows = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    # Equal but for bfloat16 rounding of the outputs (the dense matmul rounds its result, the kernels too).
    scale = float(kernel_rows.abs().max())
    torch.testing.assert_close(layer(x), kernel_rows, rtol=0.0, atol=4 * BF16_EPS * scale)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
    """A GGUF file with one [48, 64] tensor per type; returns its path and the float weights quantized."""
    rng = np.random.default_rng(3)
    path = str(tmp_path_factory.mktemp("gguf") / "blocks.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    weights = {}
    for kind in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16):
        w = rng.standard_normal((48, 64)).astype(np.float32) * 0.1
        name = f"w.{kind.name}"
        data = w.astype(np.float16) if kind == Q.F16 else gguf.quants.quantize(w, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind == Q.F16 else kind)
        weights[name] = w
    _close(writer)
    return path, weights


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _reference(reader: gguf.GGUFReader, name: str) -> torch.Tensor:
    tensor = next(t for t in reader.tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).float()


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_pack_into_int4_without_loss(gguf_file, kind: str) -> None:
    path, _ = gguf_file
    reader = gguf.GGUFReader(path)
    ref = _reference(reader, f"w.{kind}")
    layer = pack_gguf_tensors(path, [(f"w.{kind}", None)])
    assert isinstance(layer, Int4Linear)
    # Exact but for bfloat16: the block's d and zero (x up to 8 steps of q) and the output each round once.
    blocks = ref.reshape(48, 2, 32)
    d = ((blocks.amax(-1) - blocks.amin(-1)) / 15).repeat_interleave(32, 1)
    err = (effective_weight(layer) - ref).abs()
    assert (err <= BF16_EPS * (ref.abs() + 8 * d + blocks.abs().amax(-1).repeat_interleave(32, 1))).all()
    assert err.max() < d.min() / 4  # far below a quantization step: no weight moved to another level


@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_other_types_are_requantized_per_channel_int8(gguf_file, kind: str) -> None:
    path, _ = gguf_file
    ref = _reference(gguf.GGUFReader(path), f"w.{kind}")
    layer = pack_gguf_tensors(path, [(f"w.{kind}", None)])
    assert isinstance(layer, Int8Linear)
    step = ref.abs().amax(1, keepdim=True) / 127
    assert ((effective_weight(layer) - ref).abs() <= step / 2 * (1 + BF16_EPS * 256) + ref.abs() * BF16_EPS).all()


def test_rows_reorder_output_channels_and_unknown_names_fail(gguf_file) -> None:
    path, _ = gguf_file
    rows = torch.randperm(48, generator=torch.Generator().manual_seed(4))
    plain = effective_weight(pack_gguf_tensors(path, [("w.Q4_1", None)]))
    assert torch.equal(effective_weight(pack_gguf_tensors(path, [("w.Q4_1", rows)])), plain[rows])
    with pytest.raises(ValueError, match="no tensor 'w.missing'"):
        pack_gguf_tensors(path, [("w.missing", None)])


def test_rows_undo_llama_cpp_permutation() -> None:
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    for heads in (1, 2, 4):
        permuted = llama_cpp_permute(w, heads)
        assert np.array_equal(permuted[gguf_rows_from_permuted(64, heads).numpy()], w)


# ---- a model with quantized weights ----------------------------------------------------------------------------


PROMPTS = [list(range(3, 40)), list(range(3, 30)) + [7, 7, 9], [5, 9, 2, 11] * 6]


def _greedy(model, prompt: list[int], max_new: int = 12) -> list[int]:
    kv = allocate_kv_cache(model.config, 8, 16, torch.bfloat16, "cpu")
    return greedy_generate(model, kv, 16, prompt, max_new, list(range(8)))


def _logits(model, prompt: list[int]) -> torch.Tensor:
    kv = allocate_kv_cache(model.config, 8, 16, torch.bfloat16, "cpu")
    return run_batch(model, kv, 16, [Chunk(prompt, 0, len(prompt), list(range(8)))])[0]


def _agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens equal before the first difference."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


# Logits error relative to their norm; unrelated logits would be ~1.4. Int4 on a random untrained model (weights
# of std 1/sqrt(hidden), no outliers to learn around) moves the logits by about a third.
@pytest.mark.parametrize("method,max_rel_err", [("int8", 0.05), ("int4", 0.5)])
def test_requantized_model_stays_close_to_dense(tiny_llama_path: str, method: str, max_rel_err: float) -> None:
    dense = load_model(tiny_llama_path, torch.bfloat16)
    quant = quantize_model(load_model(tiny_llama_path, torch.bfloat16), method)
    assert linear_weight_bytes(quant) < linear_weight_bytes(dense) / (1.9 if method == "int8" else 3.0)
    agree, errors = [], []
    for prompt in PROMPTS:
        ref, got = _logits(dense, prompt), _logits(quant, prompt)
        errors.append(round(float((got - ref).norm() / ref.norm()), 3))
        agree.append(_agreement(_greedy(dense, prompt), _greedy(quant, prompt)))
    print(f"{method}: logits error {errors}; greedy tokens equal to dense bfloat16 before the first difference: "
          f"{agree} of 12")
    assert max(errors) < max_rel_err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_blocks_model_matches_its_dequantized_weights(tiny_llama_path: str, tmp_path, arch: str,
                                                           int4_path) -> None:
    """Every projection in Q4_1 (q/k rows permuted as llama.cpp writes them in "llama" files only), lm_head in
    Q8_0: the packed model against a dense model holding the dequantized weights."""
    dense = load_model(tiny_llama_path, torch.bfloat16)
    config = dense.config
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, arch)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    with torch.no_grad():
        # Each checkpoint projection, also those the decoder stacks (q/k/v, gate/up): written and read back by name.
        for name, weight in dense.checkpoint_views().items():
            match = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.(\w+_proj)\.weight", name)
            if match is None:
                continue
            i, module_name = match.groups()
            blocks = gguf.quants.quantize(weight.float().numpy(), Q.Q4_1)
            heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}.get(module_name)
            stored = blocks if heads is None or arch != "llama" else llama_cpp_permute(blocks, heads)
            writer.add_tensor(f"blk.{i}.{names[module_name]}.weight", stored, raw_dtype=Q.Q4_1)
            weight.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_1)))
        head = dense.lm_head.weight.float().numpy()
        writer.add_tensor("output.weight", gguf.quants.quantize(head, Q.Q8_0), raw_dtype=Q.Q8_0)
        dense.lm_head.weight.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(head, Q.Q8_0),
                                                                         Q.Q8_0)))
    _close(writer)
    packed = quantize_model(load_model(tiny_llama_path, torch.bfloat16), "gguf", path)
    assert all(isinstance(layer.mlp.down_proj, Int4Linear) for layer in packed.model.layers)
    assert isinstance(packed.lm_head, Int8Linear)
    agree = []
    for prompt in PROMPTS:
        ref, got = _logits(dense, prompt), _logits(packed, prompt)
        assert (got - ref).norm() / ref.norm() < 0.05
        agree.append(_agreement(_greedy(dense, prompt), _greedy(packed, prompt)))
    print(f"gguf blocks: greedy tokens equal to the dequantized dense model before the first difference: {agree}")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_outputs_identical_with_caching_on_and_off(tiny_llama_path: str, method: str, int4_path) -> None:
    if method == "int8" and int4_path == "native":
        pytest.skip("int8 layers have no int4 path")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for caching in (True, False):
        llm = LLM(tiny_llama_path, quantization=method, enable_prefix_caching=caching, dtype="bfloat16",
                  num_gpu_blocks=64)
        llm.generate(PROMPTS[0], params)  # the later prompts share its first blocks: a hit with caching on
        results = llm.generate(PROMPTS, params)
        outputs[caching] = [r.outputs[0].token_ids for r in results]
        assert (results[1].num_cached_tokens > 0) == caching
    assert outputs[True] == outputs[False]


def test_engine_refuses_what_it_cannot_run(tiny_llama_path: str) -> None:
    with pytest.raises(ValueError, match="unsupported quantization 'fp8'; accepted: int8, int4, gguf, none"):
        LLM(tiny_llama_path, quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf checkpoint"):
        LLM(tiny_llama_path, quantization="gguf")


def test_quantization_changes_the_hash_root(tiny_llama_path: str) -> None:
    roots = {q: LLM(tiny_llama_path, quantization=q, num_gpu_blocks=8).llm_engine.hasher.root for q in (None, "int8")}
    assert roots[None] != roots["int8"]

