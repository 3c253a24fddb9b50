"""The native kernels (model/kernels/*.c) against their float64 references on every branch of the C source: the
build for this CPU and the portable builds (AVX2 where the CPU has it; plain C anywhere), each row or decode
independent of the batch and of the thread count, and PyTorch's ops kept where none builds."""

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch
from support.paged import Chunk, run_batch

from kvprefix.model import (
    AttentionMetadata,
    allocate_kv_cache,
    load_model,
    native_attention,
    native_decode,
    native_int4,
    native_int8,
    native_kernels,
    native_layer_ops,
    native_norm,
    native_prefill,
)
from kvprefix.model.native_kernels import FLAGS
from kvprefix.model.quantized_linear import quantize_model
from kvprefix.model.rope import rotate_with_ops_

COMPILER = shutil.which(os.environ.get("CC", "cc"))
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C compiler")


def cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return flag in f.read().split()
    except OSError:
        return False


# The build this process uses (-march=native), AVX2 (Haswell's), and plain C (no SIMD path); the portable two
# compile apiece, so they run in the slow lane.
BUILDS = [
    pytest.param(FLAGS, id="native"),
    pytest.param(tuple(f if f != "-march=native" else "-march=haswell" for f in FLAGS), id="avx2",
                 marks=[pytest.mark.slow, pytest.mark.skipif(not cpu_has("avx2"), reason="CPU without AVX2")]),
    pytest.param(tuple(f if f != "-march=native" else "-march=x86-64" for f in FLAGS), id="plain-c",
                 marks=[pytest.mark.slow, pytest.mark.skipif(not cpu_has("sse2"), reason="not x86")]),
]


@contextlib.contextmanager
def thread_count(n: int):
    """PyTorch's thread count, which the kernels take as theirs, set to ``n`` inside the block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def assert_rows_are_their_own(matmul, x: torch.Tensor, out: torch.Tensor, *weights) -> None:
    """``matmul(rows, *weights)`` of each row of x alone gives its row of ``out`` (x's result), and so do all rows
    on two threads: a row's result depends neither on the other rows nor on the thread count."""
    for r in range(x.shape[0]):
        assert torch.equal(matmul(x[r : r + 1], *weights)[0], out[r])
    with thread_count(2):
        assert torch.equal(matmul(x, *weights), out)


def bound(name: str, flags: tuple[str, ...], module):
    """``name``'s kernel built with ``flags``, bound by ``module`` (not the build this process uses)."""
    return module.bind(ctypes.CDLL(str(native_kernels.build(name, COMPILER, flags))))


def attention_case(decodes: int, heads: int, kv_heads: int, dim: int, lens: list[int], dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    block_size, blocks = 16, 64
    cache = torch.randn(blocks, block_size, 2 * kv_heads, dim, generator=gen).to(dtype)
    q = (torch.randn(decodes, heads, dim, generator=gen) * 2).to(dtype)
    width = max(-(-n // block_size) for n in lens)
    table = torch.stack([torch.randperm(blocks, generator=gen)[:width] for _ in range(decodes)])
    return q, cache, table, torch.tensor(lens)


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS)
def test_decode_attention_matches_its_reference_and_each_decode_is_its_own(flags) -> None:
    fn = bound("decode_attention", flags, native_attention)
    shapes = [(9, 3, 64), (4, 4, 128), (8, 1, 48), (6, 2, 20)]  # GQA 3, MHA, MQA; dims specialized, SIMD, scalar
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
        for i, (heads, kv_heads, dim) in enumerate(shapes):
            q, cache, table, lens = attention_case(3, heads, kv_heads, dim, [1, 37, 300], dtype, seed=i)
            out = native_attention.decode_attention(q, cache, table, lens, dim**-0.5, fn=fn)
            expected = native_attention.reference_attention(q, cache, table, lens, dim**-0.5)
            torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
            for d in range(3):
                alone = native_attention.decode_attention(q[d : d + 1], cache, table[d : d + 1], lens[d : d + 1],
                                                          dim**-0.5, fn=fn)
                assert torch.equal(alone[0], out[d])


@needs_compiler
def test_decode_attention_is_free_of_the_thread_count_and_of_extreme_scores() -> None:
    q, cache, table, lens = attention_case(4, 9, 3, 64, [5, 64, 129, 700], torch.float32, seed=9)
    q[0] *= 1e4  # scores far beyond exp's range: the max subtracted first, one position takes it all
    out = native_attention.decode_attention(q, cache, table, lens, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), native_attention.reference_attention(q, cache, table, lens, 0.125),
                               rtol=1e-5, atol=1e-5)
    with thread_count(2):
        assert torch.equal(native_attention.decode_attention(q, cache, table, lens, 0.125), out)


@pytest.fixture(scope="module")
def prefill_fn():
    """The prefill kernel of this CPU's build, bound without the probe (so a wrong kernel fails here, not just
    there); skipped without AVX512-BF16 or a compiler."""
    fn = bound("prefill_attention", FLAGS, native_prefill) if COMPILER else None
    if fn is None:
        pytest.skip("no native prefill attention here (it needs AVX512-BF16 and a C compiler)")
    return fn


def prefill_case(heads: int, kv_heads: int, dim: int, context: int, new: int, seed: int, spread: float = 2.0):
    """A chunk's queries (a strided view, as the step's q is) and the keys and values of all its positions."""
    gen = torch.Generator().manual_seed(seed)
    kv = (torch.randn(context + new, 2 * kv_heads, dim, generator=gen) * spread).bfloat16()
    q = (torch.randn(new, heads + 1, dim, generator=gen) * spread).bfloat16()[:, 1:]
    return q, kv[:, :kv_heads], kv[:, kv_heads:]


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "context", "new"), [
    (9, 3, 64, 0, 150), (9, 3, 64, 200, 70), (4, 4, 128, 65, 3), (8, 1, 64, 0, 1), (6, 2, 256, 127, 129)])
def test_prefill_attention_matches_its_reference_and_each_row_is_its_own(prefill_fn, heads, kv_heads, dim, context,
                                                                         new) -> None:
    """Against float64 attention within bfloat16's rounding; and a row's bits are its own: the chunk split in two
    calls (the second after the first's positions) or run on 2 threads gives the same bits."""
    q, keys, values = prefill_case(heads, kv_heads, dim, context, new, seed=new)
    out = native_prefill.prefill_attention(q, keys, values, dim**-0.5, fn=prefill_fn)
    exact = native_prefill.reference_attention(q, keys, values, dim**-0.5)
    assert (out.double() - exact).norm() / exact.norm() <= 2**-8
    split = new // 3
    head = native_prefill.prefill_attention(q[:split], keys[: context + split], values[: context + split], dim**-0.5,
                                            fn=prefill_fn)
    tail = native_prefill.prefill_attention(q[split:], keys, values, dim**-0.5, fn=prefill_fn)
    assert torch.equal(torch.cat([head, tail]), out)
    with thread_count(2):
        assert torch.equal(native_prefill.prefill_attention(q, keys, values, dim**-0.5, fn=prefill_fn), out)


def test_prefill_attention_takes_scores_far_beyond_exps_range(prefill_fn) -> None:
    """Scores of thousands, the largest late in a row: the running max rescales what came before, nothing
    overflows."""
    q, keys, values = prefill_case(9, 3, 64, 300, 40, seed=3, spread=12.0)
    keys[-45:] *= 4  # the largest scores come in the last blocks
    out = native_prefill.prefill_attention(q, keys, values, 0.125, fn=prefill_fn)
    assert torch.isfinite(out).all()
    exact = native_prefill.reference_attention(q, keys, values, 0.125)
    assert (out.double() - exact).norm() / exact.norm() <= 2**-8


def test_prefill_attention_refuses_what_it_does_not_take(prefill_fn) -> None:
    q, keys, values = prefill_case(4, 2, 96, 0, 8, seed=0)
    with pytest.raises(ValueError, match="head size 96"):
        native_prefill.prefill_attention(q, keys, values, 0.1, fn=prefill_fn)
    q, keys, values = prefill_case(4, 2, 64, 0, 8, seed=0)
    with pytest.raises(ValueError, match="scratch"):
        native_prefill.prefill_attention(q, keys, values, 0.1, scratch=torch.empty(8, dtype=torch.bfloat16),
                                         fn=prefill_fn)
    assert not native_prefill.supports(q.float()) and not native_prefill.supports(q[..., :32])


def test_the_prefill_kernel_is_on_where_the_cpu_has_it(prefill_fn) -> None:
    """Where this CPU's build has the kernel, its probe passes and bfloat16 prefill takes it (the model tests'
    ``native`` cases would otherwise skip)."""
    assert native_prefill.kernel() is not None and native_prefill.supports(torch.zeros(1, 2, 64, dtype=torch.bfloat16))


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS[1:])
def test_prefill_attention_has_no_portable_path(flags) -> None:
    """Without AVX512-BF16 the build says so and ``bind`` gives None: attention keeps PyTorch's ways."""
    assert bound("prefill_attention", flags, native_prefill) is None


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS)
def test_rms_norm_keeps_pytorchs_roundings_and_each_row_is_its_own(flags) -> None:
    """float32 to its rounding; bfloat16 element for element but where the squares' sum, added in another order,
    moves the last step's rounding (one bfloat16 step, rarely)."""
    fn = bound("rms_norm", flags, native_norm)
    gen = torch.Generator().manual_seed(5)
    for size in (576, 37, 8):  # vector lanes only, a remainder, one vector
        x = torch.randn(200, size, generator=gen) * torch.logspace(-2, 2, size)
        weight = torch.rand(size, generator=gen) * 2
        out = native_norm.rms_norm(x, weight, 1e-5, fn=fn)
        torch.testing.assert_close(out, native_norm.reference_rms_norm(x, weight, 1e-5), rtol=1e-6, atol=1e-6)
        xb, wb = x.bfloat16(), weight.bfloat16()
        got, expected = native_norm.rms_norm(xb, wb, 1e-5, fn=fn), native_norm.reference_rms_norm(xb, wb, 1e-5)
        differ = got != expected
        assert differ.float().mean() < 1e-3  # a near-tie in the rounding, not a different formula
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=0)
        alone = torch.cat([native_norm.rms_norm(xb[r : r + 1], wb, 1e-5, fn=fn) for r in range(0, 200, 37)])
        assert torch.equal(alone, got[::37])


def int4_case(n: int, k: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, k // 32, generator=gen) / 16 + 1e-3
    zeros = torch.randn(n, k // 32, generator=gen) / 16
    x = (torch.randn(rows, k, generator=gen) * torch.logspace(-1, 1, k)).bfloat16()
    return x, q, scales, zeros


@needs_compiler
@pytest.mark.skipif(native_int4.kernel() is None, reason="no AVX512-BF16 (the int4 kernel's only path)")
def test_int4_matmul_matches_its_reference_and_each_row_is_its_own() -> None:
    """To the bfloat16 rounding of its output (the float32 sums' own error is far below it), for one and several
    tiles and groups and for rows within and beyond one pass over a tile (4); a row alone equals itself in a
    batch, on one thread or two."""
    for i, (n, k) in enumerate([(16, 32), (48, 96), (576, 1536)]):
        x, q, scales, zeros = int4_case(n, k, 9, seed=i)
        packed, scales_and_zeros = native_int4.pack(q, scales, zeros)
        out = native_int4.int4_matmul(x, packed, scales_and_zeros, n)
        expected = native_int4.reference_matmul(x, q, scales, zeros)
        torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-5 * float(expected.abs().max()))
        assert_rows_are_their_own(native_int4.int4_matmul, x, out, packed, scales_and_zeros, n)


@needs_compiler
@pytest.mark.skipif(native_int4.kernel() is None, reason="no AVX512-BF16 (the int4 kernel's only path)")
def test_int4_matmul_refuses_shapes_it_does_not_take() -> None:
    x, q, scales, zeros = int4_case(32, 64, 1, seed=0)
    packed, scales_and_zeros = native_int4.pack(q, scales, zeros)
    with pytest.raises(ValueError, match="multiples of 16 and 32"):
        native_int4.int4_matmul(x, packed, scales_and_zeros, 24)


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS[1:])
def test_int4_matmul_has_no_portable_path_so_layers_keep_pytorchs_op(flags) -> None:
    """Without AVX512-BF16 the build says so and ``bind`` gives None (``probed``: PyTorch's op, logged)."""
    assert bound("int4_matmul", flags, native_int4) is None


def int8_case(n: int, k: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) / 64 + 1e-4
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=gen)]
    return x, q, scales


@needs_compiler
@pytest.mark.skipif(native_int8.kernel() is None, reason="no AVX512-VNNI (the int8 kernel's only path)")
def test_int8_matmul_matches_its_reference_and_each_row_is_its_own() -> None:
    """Each output within float32's last four roundings of the float64 reference (the int32 sums are exact, so
    element by element, not relative to the largest), bfloat16 and float32 rows with outlier columns, for one and
    several tiles, a partial last tile, rows within and beyond one pass over a tile (4); the two passes within
    1e-4 of x's own product; a row alone equals itself in a batch, on one thread or two."""
    for i, (n, k) in enumerate([(16, 16), (27, 48), (1000, 576)]):
        for dtype in (torch.bfloat16, torch.float32):
            x, q, scales = int8_case(n, k, 9, seed=i)
            x = x.to(dtype)
            packed, packed_scales = native_int8.pack(q, scales)
            out = native_int8.int8_matmul(x, packed, packed_scales, n)
            expected = native_int8.reference_matmul(x, q, scales)
            torch.testing.assert_close(out.double(), expected, rtol=5e-7, atol=0)
            exact = x.double() @ (q.double() * scales.bfloat16().double()[:, None]).t()
            assert (out.double() - exact).norm() / exact.norm() < 1e-4
            assert_rows_are_their_own(native_int8.int8_matmul, x, out, packed, packed_scales, n)


@needs_compiler
@pytest.mark.skipif(native_int8.kernel() is None, reason="no AVX512-VNNI (the int8 kernel's only path)")
def test_int8_matmul_at_full_range_and_on_rows_without_a_scale() -> None:
    """Weights of +-127 against rows at their max (every product at full range, the sums at their largest) come
    out exact; a zero row gives zeros, a row with a NaN or an infinity NaNs, and the rows beside them their own."""
    q = torch.full((32, 1024), 127, dtype=torch.int8)
    q[1::2] = -127
    scales = torch.ones(32)
    packed, packed_scales = native_int8.pack(q, scales)
    x = torch.ones(5, 1024) * torch.tensor([[1.0], [-3.0], [0.0], [1.0], [2.0]])
    x[3, 7], x[4, 9] = float("nan"), float("inf")
    out = native_int8.int8_matmul(x.bfloat16(), packed, packed_scales, 32)
    assert torch.equal(out[:2], (x[:2] @ q.float().t()))  # 127 * 1024 * 3: exact in float32
    assert torch.equal(out[2], torch.zeros(32)) and out[3:].isnan().all()


@needs_compiler
@pytest.mark.skipif(native_int8.kernel() is None, reason="no AVX512-VNNI (the int8 kernel's only path)")
def test_int8_matmul_refuses_shapes_it_does_not_take() -> None:
    x, q, scales = int8_case(32, 24, 1, seed=0)
    packed, packed_scales = native_int8.pack(q, scales)
    with pytest.raises(ValueError, match="a multiple of 16"):
        native_int8.int8_matmul(x, packed, packed_scales, 32)


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS[1:])
def test_int8_matmul_has_no_portable_path_so_layers_keep_fbgemm(flags) -> None:
    """Without AVX512-VNNI the build says so and ``bind`` gives None (``probed``: fbgemm's path, logged)."""
    assert bound("int8_matmul", flags, native_int8) is None


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS)
def test_rotary_and_silu_mul_compute_pytorchs_bits_and_each_row_is_its_own(flags) -> None:
    """Rotary: the same roundings as PyTorch's three ops, on the q and k heads of a strided qkv view. SiLU and
    multiply: another exp than PyTorch's, so a rounding's near-tie may land one bfloat16 step apart (rarely)."""
    fns = bound("layer_ops", flags, native_layer_ops)
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(40, 15, 64, generator=gen).bfloat16()
    angles = torch.rand(40, 1, 32, generator=gen) * 500
    cos = torch.cat([angles.cos()] * 2, -1).bfloat16()
    sin = torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()
    got = native_layer_ops.rotary_(qkv.clone()[:, :12], cos, sin, fns=fns)
    assert torch.equal(got, rotate_with_ops_(qkv.clone()[:, :12], cos, sin))
    for inner in (1536, 19):  # vector lanes only; a remainder
        gate_up = (torch.randn(33, 2 * inner, generator=gen) * 4).bfloat16()
        out = native_layer_ops.silu_mul(gate_up, inner, fns=fns)
        expected = native_layer_ops.reference_silu_mul(gate_up, inner)
        assert (out != expected).float().mean() < 1e-3
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-30)
        alone = torch.cat([native_layer_ops.silu_mul(gate_up[r : r + 1], inner, fns=fns) for r in range(0, 33, 8)])
        assert torch.equal(alone, out[::8])


@pytest.fixture(scope="module")
def int4_model(tiny_llama_path: str):
    if native_decode.kernel() is None:
        pytest.skip("no fused decode kernel here (no AVX512-BF16, or no C compiler)")
    return quantize_model(load_model(tiny_llama_path, torch.bfloat16), "int4")


@pytest.mark.parametrize("lengths", [(9, 14, 3), (9, 14, 3, 17, 6, 11)])  # within and beyond a 4-row pass
def test_a_decode_step_in_one_call_computes_the_layers_bits(int4_model, monkeypatch, lengths) -> None:
    """Decodes of different lengths (partial last blocks) after their prefills: the fused call's logits and every
    layer's cache equal the layers' own forwards bit for bit, on one thread or two, and the fused call is what
    ran."""
    block = 4
    tokens = [list(range(5 + 7 * i, 5 + 7 * i + n)) for i, n in enumerate(lengths)]
    firsts = [1 + sum(-(-n // block) for n in lengths[:i]) for i in range(len(lengths))]
    tables = [list(range(first, first + -(-n // block))) for first, n in zip(firsts, lengths, strict=True)]

    def decode(fused: bool, threads: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = allocate_kv_cache(int4_model.config, 40, block, torch.bfloat16, "cpu")
        for t, table in zip(tokens, tables, strict=True):
            run_batch(int4_model, caches, block, [Chunk(t, 0, len(t) - 1, table)])
        with monkeypatch.context() as patch, thread_count(threads):
            if not fused:
                patch.setattr(native_decode.DecodeStep, "of", lambda *args: None)
            calls = []
            run = native_decode.DecodeStep.run
            patch.setattr(native_decode.DecodeStep, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
            steps = [Chunk(t, len(t) - 1, 1, b) for t, b in zip(tokens, tables, strict=True)]
            logits = run_batch(int4_model, caches, block, steps)
        assert len(calls) == fused
        return logits, [c.kv.clone() for c in caches]

    (fused_logits, fused_caches), (logits, caches) = decode(True), decode(False)
    two_threads_logits, two_threads_caches = decode(True, threads=2)
    assert torch.equal(fused_logits, logits) and torch.equal(two_threads_logits, logits)
    assert all(torch.equal(a, b) and torch.equal(c, b)
               for a, b, c in zip(fused_caches, caches, two_threads_caches, strict=True))


def test_steps_or_layers_the_kernel_does_not_compute_take_the_layers_forwards(int4_model, tiny_llama_path) -> None:
    layer = int4_model.model.layers[0]
    assert native_decode.fusable(layer)
    caches = allocate_kv_cache(int4_model.config, 8, 4, torch.bfloat16, "cpu")
    layers = native_decode.stack(int4_model.model.layers, caches)
    assert layers.fusable and not layers.hooked()
    handle = layer.mlp.down_proj.register_forward_hook(lambda *args: None)  # as a LoRA adapter's
    assert layers.hooked()
    handle.remove()
    layer.self_attn.window = 8
    assert not native_decode.fusable(layer)
    layer.self_attn.window = None
    assert not native_decode.fusable(load_model(tiny_llama_path, torch.bfloat16).model.layers[0])  # dense weights
    meta, _ = AttentionMetadata.for_chunks([(3, 1, [1]), (0, 5, [2, 3])], 4)  # a prefill beside
    assert native_decode.DecodeStep.of(meta, int4_model.model.layers, caches, torch.zeros(6, 64).bfloat16()) is None
    for decodes in (16, 17):  # beyond 16 rows the int4 layers take their dense matmuls: so do these steps
        meta, _ = AttentionMetadata.for_chunks([(2, 1, [i % 8]) for i in range(decodes)], 4)
        x = torch.zeros(decodes, 64).bfloat16()
        step = native_decode.DecodeStep.of(meta, int4_model.model.layers, caches, x)
        assert (step is None) == (decodes > layer.mlp.down_proj.dense_above_rows)


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS[1:])
def test_the_fused_decode_has_no_portable_path(flags) -> None:
    """Its int4 projections need AVX512-BF16: elsewhere ``bind`` gives None and the layers run their forwards."""
    assert bound("decode_layer", flags, native_decode) is None


def test_no_compiler_or_a_failing_one_keeps_pytorchs_ops(monkeypatch, tmp_path, caplog) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert native_kernels.load.__wrapped__("decode_attention") is None
    assert "no C compiler" in caplog.text
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")  # runs, fails
    assert native_kernels.load.__wrapped__("decode_attention") is None
    assert "not built" in caplog.text and not list(tmp_path.rglob("*.so"))  # nothing half-written left


@needs_compiler
@pytest.mark.slow
def test_a_build_is_cached_and_a_damaged_one_rebuilt(tmp_path) -> None:
    """Each in a fresh process (one that holds a library loaded must not see it overwritten)."""
    code = "from kvprefix.model import native_kernels; print(native_kernels.load('decode_attention') is not None)"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}

    def loads() -> bool:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return out.stdout.split() == ["True"]

    assert loads()
    (built,) = tmp_path.rglob("decode_attention-*.so")
    stamp = built.stat().st_mtime_ns
    assert loads() and built.stat().st_mtime_ns == stamp  # cached: not compiled again
    built.write_bytes(b"not a shared library")
    assert loads() and built.read_bytes()[:4] == b"\x7fELF"  # rebuilt in its place


@pytest.mark.slow
def test_switched_off_the_model_takes_pytorchs_ops() -> None:
    """KVPREFIX_NATIVE_KERNELS=0: no kernel, and a model's norms, decode attention, int4 layers, rotary and SiLU go
    through PyTorch's ops, its decode steps through its layers' forwards, its int8 layers through fbgemm."""
    code = ("from kvprefix.model import native_attention, native_decode, native_int4, native_int8, native_kernels,"
            " native_layer_ops, native_norm\n"
            "print(native_kernels.load('decode_attention'), native_attention.kernel(), native_norm.kernel(),"
            " native_int4.kernel(), native_layer_ops.kernels(), native_decode.kernel(), native_int8.kernel())")
    env = {**os.environ, "KVPREFIX_NATIVE_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None"] * 7


def test_a_cache_folder_that_cannot_be_made_falls_back_to_the_temp_directory(monkeypatch, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # its kvprefix/kernels cannot be made under a file
    folder = native_kernels.cache_dir()
    assert not str(folder).startswith(str(blocker)) and folder.name.startswith("kvprefix-kernels-")
