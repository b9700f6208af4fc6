"""`lorax.load_safetensors` on checkpoints the real libraries wrote (tests/data/checkpoints,
made by scripts/make_checkpoints.py: transformers' `save_pretrained`, bitsandbytes on CPU,
compressed-tensors' compressors, torch's float8; GPTQ / AWQ as their reference.json says),
against the values those libraries compute (`reference.safetensors` beside each; kept
equal to the libraries by scripts/test-checkpoints).

Every quantized weight loads as its codes, dequantizes bit for bit like its library, and
trains: the QLoRA step on the codes equals the step on the dequantized weights, with no
dense weight formed or kept for the backward pass, and the compiled step's arguments
are the codes' size."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import lorax
from lorax._formats._safetensors_files import open_checkpoint
from lorax._quant._permuted import RowOrdered
from tests.conftest import assert_close

FIXTURES = Path(__file__).resolve().parent.parent / "data" / "checkpoints"
CASES = sorted(p.name for p in FIXTURES.glob("*") if (p / "reference.json").is_file())
# The lorax qtype each case's quantized weights come as.
QTYPES = {
    "bnb_nf4": "bnb_nf4", "bnb_nf4_dq": "bnb_nf4", "bnb_fp4": "bnb_fp4", "bnb_fp4_dq": "bnb_fp4",
    "bnb_nf4_dq_wide": "bnb_nf4", "bnb_int8": "bnb_int8", "fp8_block": "fp8_e4m3",
    "ct_fp8_channel": "fp8_e4m3", "ct_fp8_tensor": "fp8_e4m3", "ct_int4_group": "int4",
    "ct_int4_asym": "int4_zp", "ct_int8_channel": "int8", "ct_int8_intq": "int8",
    "gptq_sym": "int4_zp", "gptq_asym": "int4_zp", "gptq_desc_act": "int4_zp",
    "awq_gemm": "int4_zp",
}
LAYER = "model.layers.0."
# A bare file (no config.json): one wide weight, several blocks per row and two groups of
# double quantization; the other cases are whole models (one layer of 64 wide).
BARE = {"bnb_nf4_dq_wide"}
MODELS = [c for c in CASES if c in QTYPES and c not in BARE]


def _reference(case: str) -> tuple[dict, dict[str, np.ndarray]]:
    meta = json.loads((FIXTURES / case / "reference.json").read_text())
    ref = open_checkpoint(FIXTURES / case / "reference.safetensors", "test")
    return meta, {name: ref.read(name) for name in ref.entries}


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.fixture(scope="module", params=CASES)
def case(request):
    tensors, config = lorax.load_safetensors(FIXTURES / request.param)
    meta, ref = _reference(request.param)
    return request.param, tensors, config, meta, ref


def test_every_format_the_issue_names_has_a_fixture():
    assert {"bf16_sharded", *QTYPES} <= set(CASES), sorted(CASES)


def _codes(x):
    """The `QuantizedArray` holding a weight's codes (an act-order weight's inner one)."""
    return x.inner if isinstance(x, RowOrdered) else x


def test_act_order_keeps_its_groups_consecutive_and_its_rows_in_place():
    """GPTQ act-order: a group's rows are far apart in the file (`g_idx`); stored sorted
    by group (consecutive blocks, as any GPTQ weight), with the row order around them."""
    t, _ = lorax.load_safetensors(FIXTURES / "gptq_desc_act")
    q = t[LAYER + "mlp.up_proj.weight"]
    assert isinstance(q, RowOrdered) and q.inner.block_size == 32 and q.axis == -1
    g_idx = open_checkpoint(FIXTURES / "gptq_desc_act", "test").read(LAYER + "mlp.up_proj.g_idx")
    assert not (np.diff(g_idx) >= 0).all()  # the fixture is act-order
    assert (np.diff(g_idx[np.asarray(q.order)]) >= 0).all()
    assert (np.asarray(q.order)[np.asarray(q.perm)] == np.arange(g_idx.size)).all()


def test_quantized_weights_dequantize_bit_for_bit_like_their_library(case):
    name, tensors, _, meta, ref = case
    assert meta["quantized"] or name == "bf16_sharded"
    for w in meta["quantized"]:
        q = tensors[w]
        assert isinstance(_codes(q), lorax.QuantizedArray) and q.qtype == QTYPES[name], (w, q)
        assert _bits_equal(q.dequantize(jnp.float32), ref[w]), w
        if w + "@native" in ref:  # the library's own dtype: one rounding of the same values
            native = ref[w + "@native"]
            assert _bits_equal(q.dequantize(jnp.dtype(native.dtype)), native), w


def test_dense_tensors_come_as_stored(case):
    """Embeddings, norms and `lm_head` stay the bf16 values the dense model saved."""
    name, tensors, config, meta, _ = case
    _, dense = _reference("bf16_sharded")
    assert config == {} if name in BARE else config.get("model_type") == "llama"
    kept = [n for n in tensors if n not in meta["quantized"]]
    assert kept and all(isinstance(tensors[n], jax.Array) for n in kept)
    if name == "fp8_block" or name in BARE:  # models of their own (partial 128-blocks; wide)
        return
    for n in (n for n in kept if n in dense):  # (W8A8's `input_scale`s are not the model's)
        x, want = np.asarray(tensors[n]), dense[n]
        if x.dtype != want.dtype:  # GPTQ / AWQ models are float16: bf16 values, exactly
            x, want = x.astype(np.float32), want.astype(np.float32)
        assert _bits_equal(x, want), n


def test_transpose_gives_the_kernels_with_the_same_bytes(case):
    name, tensors, _, meta, _ = case
    t, _ = lorax.load_safetensors(FIXTURES / name, transpose=True)
    for n, x in tensors.items():
        y = t[n]
        if isinstance(_codes(x), lorax.QuantizedArray):
            assert y.shape == x.shape[::-1] and y.axis == -2 and _codes(y).axis == -2
            assert all(_bits_equal(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)))
        elif x.ndim >= 2:
            assert _bits_equal(y, jnp.swapaxes(x, -1, -2))


def test_the_weights_cost_their_codes_not_a_dense_copy(case):
    name, tensors, _, meta, _ = case
    for w in meta["quantized"]:
        q = _codes(tensors[w])
        bits = 8 * q.nbytes / q.size
        # 8-bit: a scale per row (or per block: FP8's in blocks of gcd(in, 128), which is
        # 8 for the fixture's in = 136); 4-bit: scales and zero points of groups of 32.
        most = {"bnb_int8": 8.6, "int8": 8.6, "fp8_e4m3": 8.1 + 32 / q.block_size}
        assert bits <= most.get(q.qtype, 5.6), (w, bits)


def _layer_weights(case_name: str) -> dict:
    t, _ = lorax.load_safetensors(FIXTURES / case_name, transpose=True)
    return {k.removeprefix(LAYER): v for k, v in t.items()
            if k.startswith(LAYER) and isinstance(_codes(v), lorax.QuantizedArray)}


def _qlora(weights: dict, rank: int = 4) -> dict:
    out = {}
    for i, (k, q) in enumerate(sorted(weights.items())):
        ka, kb = jax.random.split(jax.random.PRNGKey(i))
        out[k] = lorax.LoraWeight(q, a=0.1 * jax.random.normal(ka, (rank, q.shape[1])),
                                  b=0.1 * jax.random.normal(kb, (q.shape[0], rank)), alpha=8.0)
    return out


def _loss(p: dict, x: jax.Array) -> jax.Array:
    """Layer 0's attention projections and MLP, as a Llama block reads them (no
    attention mixing: the products are what is tested)."""
    q, k, v = (x @ p[f"self_attn.{n}_proj.weight"] for n in "qkv")
    h = x + (q * jnp.tile(k * v, (1, q.shape[-1] // k.shape[-1]))) @ p["self_attn.o_proj.weight"]
    g, u = h @ p["mlp.gate_proj.weight"], h @ p["mlp.up_proj.weight"]
    h = h + (jax.nn.silu(g) * u) @ p["mlp.down_proj.weight"]
    return jnp.mean(h.astype(jnp.float32) ** 2)


def _dequantized(params: dict) -> dict:
    return {k: dataclasses.replace(v, w=v.w.dequantize()) for k, v in params.items()}


def _step(params: dict, x: jax.Array):
    trainable, frozen = lorax.partition(params, {k: 4 for k in params})
    fn = jax.value_and_grad(lambda t, f: lorax.lora(_loss, on_materialize="error")(
        lorax.combine(t, f), x))
    return jax.jit(fn), trainable, frozen


@pytest.mark.parametrize("name", MODELS)
def test_qlora_trains_on_the_codes_as_on_the_dequantized_weights(name):
    params = _qlora(_layer_weights(name))
    assert len(params) == 7
    x = jax.random.normal(jax.random.PRNGKey(9), (6, params["self_attn.q_proj.weight"].shape[0]))
    f, t, fr = _step(params, x)
    (v, g) = f(t, fr)
    f_d, t_d, fr_d = _step(_dequantized(params), x)
    v_d, g_d = f_d(t_d, fr_d)
    assert_close(v, v_d)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_d), strict=True):
        assert_close(a, b)
    # The compiled step's arguments are the codes (and factors and batch), not dense weights.
    args = f.lower(t, fr).compile().memory_analysis().argument_size_in_bytes
    codes = sum(p.w.nbytes for p in params.values())
    small = sum(x.nbytes for x in jax.tree.leaves(t)) + x.nbytes
    assert args <= codes + small + 1024, (args, codes, small)


@pytest.mark.parametrize("name", MODELS)
def test_no_dense_weight_is_kept_for_the_backward_pass(name):
    params = _qlora(_layer_weights(name))
    x = jnp.ones((6, params["self_attn.q_proj.weight"].shape[0]))
    trainable, frozen = lorax.partition(params, {k: 4 for k in params})
    shapes = {tuple(p.shape) for p in params.values()}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_saved_residuals(lambda t: lorax.lora(_loss)(lorax.combine(t, frozen), x), trainable)
    saved = buf.getvalue().splitlines()
    dense = [ln for ln in saved if any(f"[{a},{b}]" in ln.split(" ")[0] for a, b in shapes)]
    assert saved and not dense, dense


def test_a_flipped_code_changes_the_values(tmp_path):
    """Negative control: the bit-for-bit check reads the codes."""
    src = FIXTURES / "bnb_nf4_dq"
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    ck = open_checkpoint(dst, "test")
    w = LAYER + "mlp.up_proj.weight"
    e = ck.entries[w]
    with open(e.file, "r+b") as f:
        f.seek(e.begin + 10)
        byte = f.read(1)
        f.seek(e.begin + 10)
        f.write(bytes([byte[0] ^ 0x10]))
    _, ref = _reference("bnb_nf4_dq")
    got = lorax.load_safetensors(dst)[0][w].dequantize(jnp.float32)
    assert not _bits_equal(got, ref[w])
    assert (np.asarray(got) != ref[w]).sum() == 1


def test_the_dynamic_map_and_code_books_are_the_files(case):
    from lorax._quant import _formats as F

    name = case[0]
    if not name.startswith("bnb_") or name == "bnb_int8":
        pytest.skip("bitsandbytes 4-bit only")
    ck = open_checkpoint(FIXTURES / name, "test")
    base = LAYER + "mlp.up_proj.weight."
    table = F.NF4_CODE if "nf4" in name else F.FP4_CODE
    assert _bits_equal(ck.read(base + "quant_map"), table)
    if name.endswith("_dq"):
        assert _bits_equal(ck.read(base + "nested_quant_map"), F.BNB_DYNAMIC_CODE)


def test_quantize_on_load_equals_quantizing_the_loaded_weights():
    dense, _ = lorax.load_safetensors(FIXTURES / "bf16_sharded", transpose=True)
    q, _ = lorax.load_safetensors(FIXTURES / "bf16_sharded", transpose=True, quantize="bnb_nf4",
                                  quantize_options={"double_quant": True})
    for n, x in q.items():
        if isinstance(x, lorax.QuantizedArray):
            want = lorax.QuantizedArray.from_dense(dense[n], "bnb_nf4", double_quant=True)
            assert x.dtype == jnp.bfloat16 and _bits_equal(x.dequantize(jnp.float32),
                                                           want.dequantize(jnp.float32)), n
        else:
            assert _bits_equal(x, dense[n]), n
    assert {n for n, x in q.items() if isinstance(x, lorax.QuantizedArray)} == {
        n for n in dense if n.endswith("proj.weight")}


def test_a_sharded_checkpoint_reads_every_shard_in_index_order():
    index = json.loads((FIXTURES / "bf16_sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    tensors, config = lorax.load_safetensors(FIXTURES / "bf16_sharded")
    assert list(tensors) == list(index["weight_map"]) and config["model_type"] == "llama"
    assert tensors[LAYER + "mlp.up_proj.weight"].dtype == ml_dtypes.bfloat16
