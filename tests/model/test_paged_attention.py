"""Paged attention: chunking, block placement and batch composition must not change the logits."""

import pytest
import torch
from support.paged import Chunk, run_batch

from kvprefix.model import (
    AttentionMetadata,
    allocate_kv_cache,
    attention,
    load_model,
    native_attention,
    native_prefill,
)
from kvprefix.model.attention import (
    CASCADE_MIN_TOKENS,
    SPLIT_MIN_NEW,
    TILE_TOKENS,
    TILED_MIN_KEYS,
    LayerKV,
    paged_attention,
)

BLOCK = 4
TOL = 1e-5
TOL_BF16 = 0.05  # logits of the tiny model in bfloat16 (a missing causal mask moves them by ~1)


@pytest.fixture(scope="module")
def model(tiny_llama_path: str):
    return load_model(tiny_llama_path)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_cache(model, num_blocks: int = 160):
    return allocate_kv_cache(model.config, num_blocks, BLOCK, torch.float32, "cpu")


def full_pass(model, tokens: list[int]) -> torch.Tensor:
    blocks = list(range(1, 1 + -(-len(tokens) // BLOCK)))
    return run_batch(model, fresh_cache(model), BLOCK, [Chunk(tokens, 0, len(tokens), blocks)])[0]


@pytest.mark.parametrize("splits", [[6], [8], [1, 10], [3, 7, 12]])
def test_chunked_prefill_with_scattered_blocks_equals_one_pass(model, splits: list[int]) -> None:
    tokens = prompt(0, 19)
    blocks = [9, 2, 30, 5, 17]  # non-contiguous and out of order
    kv = fresh_cache(model)
    done = 0
    for end in [*splits, len(tokens)]:  # the first chunk is the "cached prefix"; later chunks split blocks mid-way
        logits = run_batch(model, kv, BLOCK, [Chunk(tokens, done, end - done, blocks)])[0]
        done = end
    assert (logits - full_pass(model, tokens)).abs().max().item() <= TOL


@pytest.mark.parametrize("chunks", [[100, 300], [21, 259, 260]])
def test_long_chunks_after_context_equal_one_pass(model, chunks: list[int]) -> None:
    """A chunk of SPLIT_MIN_NEW tokens or more after earlier context attends in two calls (the context unmasked,
    its own keys causally) merged by log-sum-exp: the same logits as one causal pass."""
    assert all(n >= SPLIT_MIN_NEW for n in chunks[1:])
    tokens = prompt(11, sum(chunks))
    blocks = list(range(159, 159 - -(-len(tokens) // BLOCK), -1))  # descending: out of order
    kv = fresh_cache(model)
    done = 0
    for n in chunks:
        logits = run_batch(model, kv, BLOCK, [Chunk(tokens, done, n, blocks)])[0]
        done += n
    assert (logits - full_pass(model, tokens)).abs().max().item() <= TOL


@pytest.fixture(params=["native", "tiled"])
def bfloat16_prefill(request, monkeypatch) -> str:
    """bfloat16 CPU prefill on the native kernel (where this CPU has it) or, with it off, in PyTorch's query tiles
    (chunks over TILED_MIN_KEYS positions)."""
    if request.param == "native" and native_prefill.kernel() is None:
        pytest.skip("no native prefill attention here (it needs AVX512-BF16 and a C compiler)")
    if request.param == "tiled":
        monkeypatch.setattr(native_prefill, "supports", lambda query: False)
    return request.param


def flash_only(monkeypatch) -> None:
    """From here on, bfloat16 prefill takes PyTorch's flash kernel (neither the native kernel nor the tiles)."""
    monkeypatch.setattr(native_prefill, "supports", lambda query: False)
    monkeypatch.setattr(attention, "TILED_MIN_NEW", 1 << 30)


@pytest.mark.parametrize("chunks", [[TILED_MIN_KEYS + 37], [150, TILED_MIN_KEYS + TILE_TOKENS + 9]])
def test_bfloat16_chunks_give_the_logits_of_the_flash_kernel(tiny_llama_path: str, monkeypatch, bfloat16_prefill,
                                                            chunks: list[int]) -> None:
    """A bfloat16 chunk over TILED_MIN_KEYS positions or more (cold, or after earlier context) on the native kernel
    or in query tiles of plain matmuls (the last one partial): the logits of the flash kernel's path, to bfloat16's
    rounding."""
    model = load_model(tiny_llama_path, dtype=torch.bfloat16)
    tokens = prompt(14, sum(chunks))
    blocks = list(range(1, 1 + -(-len(tokens) // BLOCK)))

    def logits() -> torch.Tensor:
        kv, done = allocate_kv_cache(model.config, len(blocks) + 1, BLOCK, torch.bfloat16, "cpu"), 0
        for n in chunks:
            out = run_batch(model, kv, BLOCK, [Chunk(tokens, done, n, blocks)])[0]
            done += n
        return out

    got = logits()
    flash_only(monkeypatch)
    flash = logits()
    assert (got - flash).abs().max().item() <= TOL_BF16, (got - flash).abs().max().item()


@pytest.mark.parametrize(("context", "new"), [(0, TILED_MIN_KEYS + 50), (TILED_MIN_KEYS, 2 * TILE_TOKENS + 7)])
def test_bfloat16_prefill_is_as_close_to_exact_as_the_flash_kernel(monkeypatch, bfloat16_prefill, context: int,
                                                                   new: int) -> None:
    """bfloat16 queries and cache on the built-in model's heads (9 query heads on 3 KV heads, dim 64): the native
    kernel's or the tiles' output against float64 attention, within bfloat16's rounding and no further off than
    the flash kernel's."""
    gen = torch.Generator().manual_seed(15)
    heads, kv_heads, dim, block = 9, 3, 64, 16
    blocks = list(range(-(-(context + new) // block)))
    earlier = torch.randn(context, 2 * kv_heads, dim, generator=gen).bfloat16()
    q = torch.randn(new, heads, dim, generator=gen).bfloat16()
    kv = torch.randn(new, 2 * kv_heads, dim, generator=gen).bfloat16()

    def attend() -> torch.Tensor:
        cache = LayerKV(torch.zeros(len(blocks), block, 2 * kv_heads, dim, dtype=torch.bfloat16))
        cache.kv.view(-1, 2 * kv_heads, dim)[:context] = earlier
        meta, _ = AttentionMetadata.for_chunks([(context, new, blocks)], block)
        with torch.inference_mode():  # as the model runs it (its scratch buffers are inference tensors)
            return paged_attention(q, kv, cache, meta, dim**-0.5).double()

    keys, values = (torch.cat([earlier, kv])[:, part].double().repeat_interleave(heads // kv_heads, 1)
                    for part in (slice(0, kv_heads), slice(kv_heads, None)))
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * dim**-0.5
    scores.masked_fill_(torch.arange(context + new)[None, :] > torch.arange(context, context + new)[:, None],
                        -torch.inf)
    exact = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    got = (attend() - exact).norm() / exact.norm()
    flash_only(monkeypatch)
    flash = (attend() - exact).norm() / exact.norm()
    assert got <= 2**-8 and got <= 1.5 * flash, (got, flash)


@pytest.fixture(params=["native", "pytorch"])
def decode_path(request, monkeypatch) -> str:
    """Decodes on the native kernel (where built; in float32 too, which the engine keeps on PyTorch's path) or on
    PyTorch's gather and masked attention."""
    if request.param == "native" and native_attention.kernel() is None:
        pytest.skip("the native decode attention is not built here (no C compiler)")
    if request.param == "native":
        monkeypatch.setattr(native_attention, "DTYPES", (torch.bfloat16, torch.float32))
    if request.param == "pytorch":
        monkeypatch.setattr(native_attention, "supports", lambda q, cache: False)
    return request.param


def test_decode_reads_context_from_cache(model, decode_path) -> None:
    tokens = prompt(1, 13)
    blocks = [7, 3, 11, 1]
    kv = fresh_cache(model)
    run_batch(model, kv, BLOCK, [Chunk(tokens, 0, 12, blocks)])
    logits = run_batch(model, kv, BLOCK, [Chunk(tokens, 12, 1, blocks)])[0]
    assert (logits - full_pass(model, tokens)).abs().max().item() <= TOL


def test_mixed_batch_equals_each_alone(model, decode_path) -> None:
    """A prefill chunk after a cached prefix, a fresh prefill and decodes of different lengths in one batch."""
    specs = [  # (tokens, cached before this step, new this step, blocks)
        (prompt(2, 15), 6, 9, [40, 12, 33, 8]),
        (prompt(3, 9), 0, 9, [21, 22, 23]),
        (prompt(4, 5), 4, 1, [50, 2]),
        (prompt(5, 17), 16, 1, [1, 60, 14, 27, 36]),
        (prompt(6, 8), 7, 1, [44, 45]),
        (prompt(9, 1), 0, 1, [6]),  # a one-token prompt: a prefill that looks like a decode
    ]

    def prepared_cache():
        kv = fresh_cache(model)
        for tokens, cached, _, blocks in specs:
            if cached:
                run_batch(model, kv, BLOCK, [Chunk(tokens, 0, cached, blocks)])
        return kv

    alone = [run_batch(model, prepared_cache(), BLOCK, [Chunk(*spec)])[0] for spec in specs]
    together = run_batch(model, prepared_cache(), BLOCK, [Chunk(*spec) for spec in specs])
    for i, logits in enumerate(alone):
        assert (together[i] - logits).abs().max().item() <= TOL
        assert (logits - full_pass(model, specs[i][0])).abs().max().item() <= TOL


def test_decodes_sharing_their_first_blocks_equal_each_alone(model) -> None:
    """Decodes whose block tables open with the same CASCADE_MIN_TOKENS+ tokens of blocks attend to them in one
    call and to the rest apart (cascade attention): the logits of each, alone and against one full pass."""
    shared = -(-CASCADE_MIN_TOKENS // BLOCK)  # blocks
    prefix = prompt(12, shared * BLOCK)
    seqs = [prefix + prompt(13 + i, n) for i, n in enumerate((5, 9, 2))]
    own = [[shared + 1 + 4 * i + b for b in range(4)] for i in range(len(seqs))]  # after the shared blocks 1..shared
    tables = [list(range(1, shared + 1)) + blocks for blocks in own]

    def prepared_cache():
        kv = fresh_cache(model)
        run_batch(model, kv, BLOCK, [Chunk(prefix, 0, len(prefix), tables[0])])
        for tokens, table in zip(seqs, tables, strict=True):
            run_batch(model, kv, BLOCK, [Chunk(tokens, len(prefix), len(tokens) - 1 - len(prefix), table)])
        return kv

    decodes = [Chunk(tokens, len(tokens) - 1, 1, table) for tokens, table in zip(seqs, tables, strict=True)]
    meta, _ = AttentionMetadata.for_chunks([(c.num_computed, 1, c.block_ids) for c in decodes], BLOCK)
    assert meta.plan(BLOCK).shared is not None  # the batch takes the cascade; one decode alone does not
    together = run_batch(model, prepared_cache(), BLOCK, decodes)
    for i, chunk in enumerate(decodes):
        alone = run_batch(model, prepared_cache(), BLOCK, [chunk])[0]
        assert (together[i] - alone).abs().max().item() <= TOL
        assert (alone - full_pass(model, seqs[i])).abs().max().item() <= TOL


def test_new_kv_is_written_by_slot(model) -> None:
    tokens = prompt(7, 6)
    kv = fresh_cache(model, 8)
    run_batch(model, kv, BLOCK, [Chunk(tokens, 0, 6, [5, 2])])
    written = [(kv[0][0][b].abs().sum(dim=(-1, -2)) > 0).tolist() for b in range(8)]
    assert written[5] == [True] * 4 and written[2] == [True, True, False, False]
    assert not any(any(row) for b, row in enumerate(written) if b not in (2, 5))


def test_metadata_contract_shapes(model) -> None:
    # The engine builds this directly; a plain dataclass with the documented fields.
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([4, 5, 6]),
        query_start_loc=torch.tensor([0, 3]),
        seq_lens=[3],
        block_tables=torch.tensor([[1, 0]]),
        logits_indices=torch.tensor([2]),
    )
    kv = fresh_cache(model, 4)
    hidden = model(torch.tensor(prompt(8, 3)), torch.arange(3), meta, kv)
    assert hidden.shape == (3, model.config.hidden_size)
    assert model.compute_logits(hidden[meta.logits_indices]).shape == (1, model.config.vocab_size)


def test_one_cache_tensor_holds_the_projections_k_and_v(model) -> None:
    """K and V of a layer are the two halves of one tensor (one write, one gather per layer); what lands in them is
    the layer's v projection and its k projection rotated as the reference does (x cos + rotate_half(x) sin)."""
    tokens = prompt(10, 5)
    kv = fresh_cache(model, 8)
    run_batch(model, kv, BLOCK, [Chunk(tokens, 0, 5, [3, 6])])
    k_cache, v_cache = kv[0]
    assert k_cache.data_ptr() == kv[0].kv.data_ptr() and v_cache.data_ptr() > k_cache.data_ptr()
    assert k_cache.shape == v_cache.shape == (8, BLOCK, model.config.num_key_value_heads, model.config.head_dim)
    layer, config = model.model.layers[0], model.config
    with torch.inference_mode():
        qkv = layer.self_attn.qkv_proj(layer.input_layernorm(model.model.embed_tokens(torch.tensor(tokens))))
    kv_size, dim = config.num_key_value_heads * config.head_dim, config.head_dim
    k = qkv[:, -2 * kv_size : -kv_size].view(5, -1, dim)
    v = qkv[:, -kv_size:].view(5, -1, dim)
    angles = torch.arange(5).float()[:, None, None] * model.model.rotary_emb._inv_freq
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = k * cos + torch.cat([-k[..., dim // 2 :], k[..., : dim // 2]], -1) * sin
    slots = [3 * BLOCK + i for i in range(BLOCK)] + [6 * BLOCK]
    assert torch.equal(v_cache.flatten(0, 1)[slots], v)
    assert (k_cache.flatten(0, 1)[slots] - rotated).abs().max().item() <= 1e-6
