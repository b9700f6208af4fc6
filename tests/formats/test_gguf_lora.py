"""save_gguf_lora: llama.cpp's adapter tensors, read back with the gguf package.

The update is recomputed the way llama.cpp applies it (`alpha / r · lora_b @ lora_a`
on the `(out, in)` tensor; the token embedding gathers rows of `lora_a`) and compared
with lorax's own. tests/examples/test_llamacpp.py runs llama.cpp itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import lorax
from conftest import assert_close

gguf = pytest.importorskip("gguf")

HEADS, KV_HEADS, DIM, KV_DIM, FFN, VOCAB, LAYERS = 4, 2, 16, 8, 24, 32, 2


@pytest.fixture
def base(tmp_path):
    """A tiny Llama GGUF: only the shapes and metadata the writer reads matter."""
    path = tmp_path / "base.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, DIM), np.float32))
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((DIM, DIM), np.float32))
        w.add_tensor(f"blk.{i}.attn_k.weight", np.zeros((KV_DIM, DIM), np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.zeros((DIM, FFN), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


NAMES = {"layers/q": "model.layers.{layer}.self_attn.q_proj",
         "layers/k": "model.layers.{layer}.self_attn.k_proj",
         "layers/down": "blk.{layer}.ffn_down.weight",  # a GGUF name works too
         "embed": "model.embed_tokens"}
LAYOUT = {"layers/q": "in_out", "layers/k": "in_out", "layers/down": "in_out",
          "embed": "embedding"}


def _lora(alphas=None, ranks=None):
    alphas = alphas or {}
    ranks = ranks or {}
    shapes = {"q": (LAYERS, DIM, DIM), "k": (LAYERS, DIM, KV_DIM), "down": (LAYERS, FFN, DIM)}
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    params = {"layers": {k: jax.random.normal(next(keys), s) for k, s in shapes.items()},
              "embed": jax.random.normal(next(keys), (VOCAB, DIM))}
    spec = {"layers": {k: lorax.LoraSpec(ranks.get(k, 4), alphas.get(k), batch_ndim=1)
                       for k in shapes},
            "embed": lorax.LoraSpec(ranks.get("embed", 4), alphas.get("embed"))}
    lp = lorax.init_lora(params, spec, next(keys), alpha=8.0)
    return jax.tree_util.tree_map(
        lambda x: x if not isinstance(x, lorax.LoraWeight) else lorax.LoraWeight(
            x.w, x.a, jax.random.normal(next(keys), x.b.shape), alpha=x.alpha),
        lp, is_leaf=lambda x: isinstance(x, lorax.LoraWeight))


def _read(path):
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: np.array(t.data) for t in r.tensors}


def _hf_to_gguf_rows(rows, n_head):
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _llamacpp_delta(tensors, name, alpha):
    a, b = tensors[name + ".lora_a"], tensors[name + ".lora_b"]
    if name == "token_embd.weight":  # rows of lora_a (vocab, r) times lora_b (dim, r)
        return alpha / a.shape[1] * a @ b.T
    return alpha / a.shape[0] * b @ a


@pytest.mark.parametrize("qk_rows", ["hf", "gguf"])
def test_tensors_metadata_and_update(tmp_path, base, qk_rows):
    lp = _lora()
    out = tmp_path / "adapter.gguf"
    lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows=qk_rows)
    meta, tensors = _read(out)
    assert meta["general.type"] == "adapter" and meta["adapter.type"] == "lora"
    assert meta["general.architecture"] == "llama" and meta["adapter.lora.alpha"] == 8.0
    assert len(tensors) == 2 * (3 * LAYERS + 1)
    assert tensors["blk.1.attn_k.weight.lora_a"].shape == (4, DIM)
    assert tensors["blk.1.attn_k.weight.lora_b"].shape == (KV_DIM, 4)
    assert tensors["token_embd.weight.lora_a"].shape == (VOCAB, 4)
    assert tensors["token_embd.weight.lora_b"].shape == (DIM, 4)
    assert all(t.dtype == np.float32 for t in tensors.values())

    for i in range(LAYERS):
        for mod, gname, heads in [("q", "attn_q", HEADS), ("k", "attn_k", KV_HEADS),
                                  ("down", "ffn_down", None)]:
            lw = lp["layers"][mod]
            delta = np.asarray(lw.scale * lw.b[i] @ lw.a[i]).T  # torch (out, in)
            if heads and qk_rows == "hf":
                delta = _hf_to_gguf_rows(delta, heads)
            assert_close(_llamacpp_delta(tensors, f"blk.{i}.{gname}.weight", 8.0), delta,
                         err_msg=f"{gname} {i}")
    e = lp["embed"]
    assert_close(_llamacpp_delta(tensors, "token_embd.weight", 8.0), e.scale * e.b @ e.a)


def test_alphas_and_ranks_that_differ_are_folded_into_b(tmp_path, base):
    """One alpha per file: rsLoRA or per-weight alphas must still give each update exactly."""
    lp = _lora(alphas={"k": 3.0 * 2.0, "down": 1.5}, ranks={"k": 2, "embed": 3})
    out = tmp_path / "adapter.gguf"
    lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="gguf")
    meta, tensors = _read(out)
    alpha = meta["adapter.lora.alpha"]
    assert alpha == 8.0  # the most common one
    for mod, gname in [("q", "attn_q"), ("k", "attn_k"), ("down", "ffn_down")]:
        lw = lp["layers"][mod]
        assert_close(_llamacpp_delta(tensors, f"blk.0.{gname}.weight", alpha),
                     np.asarray(lw.scale * lw.b[0] @ lw.a[0]).T, err_msg=gname)


def test_errors_name_the_module(tmp_path, base):
    lp = _lora()
    out = tmp_path / "adapter.gguf"
    with pytest.raises(ValueError, match=r"'llama' model.*module 'model\.layers\.0\.self_attn\.[qk]_proj'"
                                         r".*qk_rows='hf'"):
        lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT)
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.attn\.wq' maps to no tensor"):
        lorax.save_gguf_lora(out, lp, base, layout=LAYOUT, qk_rows="hf",
                             module_name={**NAMES, "layers/q": "model.layers.{layer}.attn.wq"})
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.self_attn\.q_proj' \('layers/k'\) "
                                         r"does not fit 'blk\.0\.attn_q\.weight' of '.*' \(ggml shape "
                                         r"\[16, 16\]\): lora_a \(4, 16\), lora_b \(8, 4\); "
                                         r"expected \(4, 16\) and \(16, 4\)"):
        lorax.save_gguf_lora(out, lp, base, layout=LAYOUT, qk_rows="hf",
                             module_name={**NAMES, "layers/q": NAMES["layers/k"],
                                          "layers/k": NAMES["layers/q"]})
    with pytest.raises(ValueError, match="qk_rows must be 'hf' or 'gguf'"):
        lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="HF")
    assert not out.exists()  # nothing half-written


def _metadata_set(base, key, value):
    """`base` with the u32 value of metadata `key` replaced (the file is otherwise the same)."""
    raw = bytearray(base.read_bytes())
    at = raw.index(key.encode()) + len(key) + 4  # after the key and its value type
    raw[at:at + 4] = value.to_bytes(4, "little")
    base.write_bytes(bytes(raw))


def test_base_metadata_the_file_cannot_be_is_named(tmp_path, base):
    """A base file's block count is bounded before gguf's name table is built for it (2^31
    blocks was 23 GB), and a head count that does not split q/k rows into halves per head
    is named (was numpy's reshape error, naming no file)."""
    lp, out = _lora(), tmp_path / "adapter.gguf"
    full = base.read_bytes()
    _metadata_set(base, "llama.block_count", 2**31)
    with pytest.raises(ValueError, match=r"base\.gguf': llama\.block_count is 2147483648, more "
                                         r"blocks than the file's 7 tensors"):
        lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="hf")
    base.write_bytes(full)
    _metadata_set(base, "llama.attention.head_count", 3)
    with pytest.raises(ValueError, match=r"base\.gguf': llama\.attention\.head_count is 3, which "
                                         r"does not split the 16 rows of 'blk\.0\.attn_q\.weight'"):
        lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="hf")
    lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="gguf")
    base.write_bytes(full)  # the control
    lorax.save_gguf_lora(out, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="hf")


def test_writing_over_the_base_model_is_refused(tmp_path, base):
    """`path` the same file as `base` (directly, or through another name) would replace
    the user's model with the adapter: refused before anything is written."""
    lp, full = _lora(), base.read_bytes()
    (tmp_path / "link.gguf").symlink_to(base)
    for path in (base, str(base), tmp_path / "." / "base.gguf", tmp_path / "link.gguf"):
        with pytest.raises(ValueError, match=r"path '.*' is the base model file '.*base\.gguf'"):
            lorax.save_gguf_lora(path, lp, base, module_name=NAMES, layout=LAYOUT, qk_rows="hf")
    assert base.read_bytes() == full


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float64, None, "banana"])
def test_dtype_must_be_one_llama_cpp_reads(tmp_path, base, dtype):
    """An integer dtype truncated the factors (I8 tensors of 0 and ±1): each is named,
    with the dtypes that work, before writing."""
    out = tmp_path / "adapter.gguf"
    with pytest.raises(ValueError, match=r"save_gguf_lora: dtype must be one of float32, float16, bfloat16"):
        lorax.save_gguf_lora(out, _lora(), base, module_name=NAMES, layout=LAYOUT, qk_rows="hf",
                             dtype=dtype)
    assert not out.exists()
    lorax.save_gguf_lora(out, _lora(), base, module_name=NAMES, layout=LAYOUT, qk_rows="hf",
                         dtype=np.float16)
    assert {t.dtype for t in _read(out)[1].values()} == {np.dtype(np.float16)}


@pytest.mark.parametrize("dtype", ["bfloat16", jnp.bfloat16, ml_dtypes.bfloat16])
def test_bfloat16_tensors_are_the_float32_ones_rounded(tmp_path, base, dtype):
    """BF16, as llama.cpp's converter writes with `--outtype bf16`: GGML type BF16 in the
    file, and each value the float32 export's rounded to nearest."""
    lp = _lora()
    f32, bf16 = tmp_path / "f32.gguf", tmp_path / "bf16.gguf"
    kw = dict(module_name=NAMES, layout=LAYOUT, qk_rows="hf")
    lorax.save_gguf_lora(f32, lp, base, **kw)
    lorax.save_gguf_lora(bf16, lp, base, dtype=dtype, **kw)
    reader = gguf.GGUFReader(str(bf16))
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.BF16}
    want = _read(f32)[1]
    got, meta = lorax.load_gguf(bf16)
    assert meta["adapter.lora.alpha"] == 8.0 and set(got) == set(want)
    for name, x in want.items():
        assert got[name].dtype == ml_dtypes.bfloat16 and got[name].shape == x.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint16),
                                      x.astype(ml_dtypes.bfloat16).view(np.uint16), err_msg=name)
    got32 = {name: x.astype(np.float32) for name, x in got.items()}
    assert_close(_llamacpp_delta(got32, "blk.1.attn_k.weight", 8.0),
                 _llamacpp_delta(want, "blk.1.attn_k.weight", 8.0), rtol=2e-2, atol=2e-2)
