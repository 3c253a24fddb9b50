"""kvprefix's GGUF reader against the `gguf` package's GGUFReader on real files: the same metadata values and
the same tensors (type, shape, bytes), on files the tests write and on the built-in default model."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from kvprefix.cache.default_model import default_model_path
from kvprefix.tokenizer.gguf_file import GGUFFile


def assert_reads_like_gguf_reader(path: str) -> None:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields == expected
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert np.array_equal(mine.data, t.data, equal_nan=True)


def test_every_value_and_tensor_type_reads_like_gguf_reader(tmp_path) -> None:
    from gguf import quants

    path = str(tmp_path / "all.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -3)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1.5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 🙂")
    writer.add_array("t.strs", ["a", "", "ü" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 64)).astype(np.float32)
    writer.add_tensor("f32", w)
    writer.add_tensor("f16", w.astype(np.float16))
    writer.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    writer.add_tensor("vec", w[0])
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.BF16):
        writer.add_tensor(kind.name, quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_like_gguf_reader(path)
    assert GGUFFile(path).get("t.strs") == ["a", "", "ü" * 300]


@pytest.mark.slow
def test_the_default_model_reads_like_gguf_reader() -> None:
    assert_reads_like_gguf_reader(default_model_path())


def test_a_corrupt_file_is_unmapped_when_it_raises(tmp_path) -> None:
    """The error keeps the reader's frame (and its map) alive as long as the caller holds it: the map is closed first."""
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (10**9).to_bytes(8, "little") + b"\0" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF file") as held:
        GGUFFile(str(path))
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read(), held.traceback
