"""Smoke tests of the benchmarks (`benchmarks/`): each runs with `--quick` and writes its
outputs. Nothing about time is asserted; the memory benchmark's structural facts are."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import lorax

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _models, blocks, dispatch, memory, qlora, speed, trace_time  # noqa: E402


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # CI time: the benchmark's smoke run
def test_speed_quick(tmp_path):
    speed.main(["--quick", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "speed.csv")
    md = (tmp_path / "speed.md").read_text()
    assert {r["impl"] for r in rows} == set(_models.IMPLS)
    assert {r["grid"] for r in rows} == {"mlp", "attn"}
    for impl in _models.IMPLS:
        assert f"`{impl}`" in md
    assert "lorax / hand-written" in md and "**cpu**" in md and "**jax**" in md
    assert "MISMATCH" not in md and "mismatches" not in md  # same first-step loss everywhere
    assert (tmp_path / "speed_rounds.csv").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "speed.png").stat().st_size > 0


def test_memory_quick(tmp_path):
    memory.main(["--quick", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "memory.csv")
    md = (tmp_path / "memory.md").read_text()
    assert {r["impl"] for r in rows} == set(_models.IMPLS)
    for impl in _models.IMPLS:
        assert f"`{impl}`" in md

    def get(case, impl, donated):
        (r,) = [r for r in rows if r["case"] == case and r["impl"] == impl and r["donated"] == donated]
        return r

    for case in ("mlp4",):
        w = float(get(case, "hand_lora", "False")["w_mib"]) * memory.MiB
        for donated in ("False", "True"):
            part, hand = get(case, "lorax_partition", donated), get(case, "hand_lora", donated)
            # The partition step returns no frozen weight and allocates no W-shaped buffer...
            assert float(part["largest_output_mib"]) * memory.MiB < w
            assert part["w_shaped_ops"] == "0"
            # ...and needs no more than the hand-written split step.
            assert int(part["total_bytes"]) <= int(hand["total_bytes"]) + memory.TUPLE_SLACK
        # Donated, the lorax 0.3 path aliases every output (W included) to its input...
        wrap = get(case, "lorax_wrap", "True")
        assert int(wrap["out_minus_alias_bytes"]) < memory.TUPLE_SLACK
        assert wrap["w_shaped_ops"] == "0"
        assert int(wrap["total_bytes"]) <= int(get(case, "hand_lora", "True")["total_bytes"]) + memory.TUPLE_SLACK
        # ...undonated it must return a fresh copy of W; naive LoRA materialises W + BA.
        assert get(case, "lorax_wrap", "False")["w_sized_output"] == "True"
        assert int(get(case, "naive_lora", "False")["w_shaped_ops"]) > 0


@pytest.mark.slow  # CI time: the benchmark's smoke run
def test_trace_time_quick(tmp_path):
    trace_time.main(["--quick", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "trace_time.csv")
    assert {r["impl"] for r in rows} == set(trace_time.IMPLS)
    assert len(rows) == 2 * len(trace_time.IMPLS)  # two layer counts
    assert all(float(r["lower_ms"]) > 0 and float(r["compile_ms"]) > 0 for r in rows)
    assert (tmp_path / "trace_time.md").exists()


def test_dispatch_quick(tmp_path):
    dispatch.main(["--quick", "--out", str(tmp_path), "--weights", "8"])
    rows = _rows(tmp_path / "dispatch.csv")
    assert {(r["function"], r["container"]) for r in rows} == {
        (f, c) for f in ("args", "identity") for c in dispatch.CONTAINERS}
    assert all(float(r["us_per_call"]) > 0 for r in rows)
    assert "`lorax` / `dict`" in (tmp_path / "dispatch.md").read_text()


@pytest.mark.slow  # ~30 s: the block grid's own smoke run (structural checks: test_structure_backward.py)
def test_blocks_quick(tmp_path):
    blocks.main(["--quick", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "blocks.csv")
    md = (tmp_path / "blocks.md").read_text()
    assert {(r["model"], r["impl"]) for r in rows} == {
        (m, n) for m in blocks.MODELS for n in blocks.impls_for(m)}
    assert "MISMATCH" not in md  # every LoRA implementation: the same first-step loss
    assert "lorax <= 1.25x the floor in every cell" in md
    assert "lorax <= 0.7x hand-written einsum LoRA on the einsum d512 r8 8x128 block" in md
    assert "lorax <= 0.65x full FT" in md
    assert "**cpu**" in md and "**jax**" in md
    # HLO statistics come from every compiled step.
    assert all(float(r["gflops"]) > 0 and float(r["gb_accessed"]) > 0 for r in rows)
    assert (tmp_path / "blocks_rounds.csv").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "blocks.png").stat().st_size > 0


@pytest.mark.slow  # ~26 s (the naive-vs-lorax memory contrast: test_quant_memory.py)
def test_qlora_quick(tmp_path):
    qlora.main(["--quick", "--models", "mlp,scan", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "qlora.csv")
    # (K-quants need d divisible by 256: not at --quick's d = 128.)
    assert {r["impl"] for r in rows} == {"dense", "int8", "nf4", "q4_1", "q5_0", "naive_nf4"}
    by = {(r["model"], r["impl"]): r for r in rows}
    for model in ("mlp", "scan"):
        # The structural facts (deterministic): the arguments hold the quantized base only,
        # and lorax's temporaries stay near dense LoRA's while the naive version's do not.
        assert float(by[model, "nf4"]["args_vs_dense"]) < 0.5
        assert float(by[model, "nf4"]["extra_temp_layers"]) <= 1.5
        assert float(by[model, "naive_nf4"]["extra_temp_layers"]) > 1.5
    assert "`naive_nf4`" in (tmp_path / "qlora.md").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "qlora.png").stat().st_size > 0


def test_variants_quick(tmp_path):
    from benchmarks import variants

    variants.main(["--quick", "--models", "mlp", "--out", str(tmp_path)])
    rows = _rows(tmp_path / "variants.csv")
    assert {r["impl"] for r in rows} == {"lora", "dora", "hand_dora", "dropout"}
    by = {r["impl"]: r for r in rows}
    # Structural (deterministic): DoRA's compiled step holds no weight-sized temporary
    # beyond plain LoRA's.
    assert float(by["dora"]["extra_temp_layers"]) < 0.5
    assert "`dora` / lora" in (tmp_path / "variants.md").read_text()


@pytest.mark.slow  # CI time: the benchmark's smoke run (ragged_dot's claims: tests/test_ragged.py)
def test_moe_quick(tmp_path):
    from benchmarks import moe

    moe.main(["--quick", "--out", str(tmp_path)])
    (row,) = _rows(tmp_path / "moe.csv")
    # Structural (deterministic): lorax's step holds no more temporaries than hand-written
    # per-expert LoRA.
    assert float(row["temp_lorax_stacks"]) <= float(row["temp_hand_stacks"]) * 1.05
    assert "lorax / hand" in (tmp_path / "moe.md").read_text()


@pytest.mark.slow  # CI time: the benchmark's smoke run (the stacked adapters' claims: tests/test_stack.py)
def test_adapters_quick(tmp_path):
    from benchmarks import adapters

    adapters.main(["--quick", "--no-llama", "--out", str(tmp_path)])
    (row,) = _rows(tmp_path / "adapters_mixed.csv")
    assert row["cell"].startswith("mlp")
    (side,) = _rows(tmp_path / "adapters_side.csv")
    # (At this tiny size the batches and Adam state outweigh the base; the base-once
    # property is asserted at d=256 in tests/test_stack.py.)
    assert float(side["arguments_over_base"]) > 1 and float(side["together_over_separate"]) > 0
    # The same batch for every adapter: the first layer's base matmul is shared.
    assert float(side["flops_together_over_separate"]) < 0.95
    assert float(row["flops_mixed_over_one"]) >= 1
    assert "together / separate" in (tmp_path / "adapters.md").read_text()


@pytest.mark.slow  # CI time: the benchmark's smoke run
def test_checkpoint_load_quick(tmp_path):
    """A sharded bf16 checkpoint quantized on load, and read whole then quantized: each
    measured in its own process; the table and its columns are written."""
    from benchmarks import checkpoint_load

    checkpoint_load.main(["--quick", "--out", str(tmp_path)])
    rows = {r["case"]: r for r in _rows(tmp_path / "checkpoint_load_quick.csv")}
    assert set(rows) == {"nf4", "dense-then-quantize"}
    # The same codes either way (streamed, or quantized after a whole read).
    assert rows["nf4"]["result_mib"] == rows["dense-then-quantize"]["result_mib"]
    assert "peak / bound" in (tmp_path / "checkpoint_load_quick.md").read_text()


def test_offload_quick(tmp_path):
    """The tiny Llama's QLoRA step exported for `cuda`, on the device and in host memory:
    the same bytes of arguments, moved into loop bodies only when offloaded."""
    from benchmarks import offload

    on_device, host = offload.main(["--quick", "--out", str(tmp_path)])
    assert (tmp_path / "offload.csv").exists() and "| tiny | host |" in (tmp_path / "offload.md").read_text()
    assert on_device["moves_in_loops"] == on_device["host_args_gib"] == 0
    assert host["host_args_gib"] > 0 and host["moves_in_loops"] > 0
    # Per-layer remat: forward and backward each move every layer once (the recomputation
    # shares the backward pass's moves).
    # (Within 1e-3: a scalar moved in the loss's loop has a layer scale's shape.)
    assert host["layer_passes"] == pytest.approx(2.0, rel=1e-3)
    total = lambda r: r["host_args_gib"] + r["device_args_gib"]  # noqa: E731
    assert abs(total(host) - total(on_device)) < 1e-9


@pytest.mark.slow  # CI time: the benchmark's smoke run (weight_slices: tests/examples/test_llama_layers.py)
def test_layers_quick(tmp_path):
    """The tiny Llama compiled with stacked and with unrolled layers: the scanned step
    slices every layer's weights out of their stacks, the unrolled one none."""
    from benchmarks import layers

    rows = layers.main(["--quick", "--methods", "qlora-nf4", "--remats", "none",
                        "--out", str(tmp_path)])
    scan, unrolled = rows
    assert (scan["layers"], unrolled["layers"]) == ("scan", "unrolled")
    # Codes and scales (and the double quantization's scales) of 7 matrices, both passes.
    assert scan["weight_slices"] >= 2 * 7 * 2 and unrolled["weight_slices"] == 0
    assert scan["args_gib"] == unrolled["args_gib"]
    assert "| tiny | qlora-nf4 | none |" in (tmp_path / "layers.md").read_text()


# The dense-LoRA cells ask nothing the QLoRA ones do not, at three more compiles: slow.
@pytest.mark.parametrize("method", ["qlora-nf4", pytest.param("lora", marks=pytest.mark.slow)])
def test_scale_quick(tmp_path, method):
    """Compile-only, tiny Llama: the FSDP step's per-device arguments are 1/8 of the
    single-device step's plus what every device holds whole (norms, the step count)."""
    from benchmarks import scale

    rows = scale.main(["--quick", "--methods", method, "--dtypes", "f32",
                       "--out", str(tmp_path)])
    assert (tmp_path / "scale.csv").exists() and (tmp_path / "scale.md").exists()
    if jax.device_count() < 8:
        return
    by = {(r["devices"], r["batch"].split("x")[0]): r for r in rows}
    one = by[1, "1"]
    for batch in ("1", "8"):  # one window split by token, or a window per device
        eight = by[8, batch]
        assert eight["args_gib"] <= one["args_gib"] / 8 + eight["whole_gib"] + 1e-6
        assert eight["all-gather_gib"] > 0


@pytest.mark.slow  # ~110 s on 2 cores: the card cells' CPU smoke; their parts are tested below
def test_accelerator_quick(tmp_path):
    """The accelerator benchmark's smoke run on whatever device is here: every JAX cell runs
    in its own process, a real step with finite losses, XLA's memory figures and an MFU;
    PyTorch's cell runs where torch, transformers and peft import, else says so."""
    from benchmarks import accelerator

    rows = accelerator.main(["--quick", "--out", str(tmp_path), "--trace", "tiny:lora:1:layer:auto"])
    assert [r["cell"] for r in rows] == list(accelerator.QUICK_CELLS)
    for r in rows:
        if r["cell"].startswith("peft:") and accelerator.torch_missing():
            assert r["error"] == f"not run: {accelerator.torch_missing()} not installed"
            continue
        assert "error" not in r, r
        assert r["step_s"] > 0 and r["finite"] and len(r["losses"]) == 3
        assert r["model_tflops"] > 0  # no matrix rate measured in a --quick run: no MFU
        if not r["cell"].startswith("peft:"):
            assert r["xla_args_gib"] > 0 and r["attention_used"] in ("chunked", "xla")
    # The frozen codes made in host memory, and the step compared with the on-device one.
    host = next(r for r in rows if r["method"] == "qlora-nf4+host")
    on_device = next(r for r in rows if r["cell"] == "tiny:qlora-nf4:1:none:auto")
    # (All of the frozen bytes but the norms, which stay on the device.)
    assert 0.99 * host["frozen_gib"] < host["host_gib"] < host["frozen_gib"]
    assert on_device["host_gib"] == 0
    assert host["vs_device"] == host["step_s"] / on_device["step_s"]
    # Unrolled layers against hand-written LoRA with unrolled layers too.
    unrolled = [r for r in rows if r["cell"].endswith(":unrolled")]
    assert [r["layers"] for r in unrolled] == ["unrolled"] * 2
    assert unrolled[0]["vs_hand"] == unrolled[0]["step_s"] / unrolled[1]["step_s"]
    traces = (tmp_path / "accelerator_traces.json").read_text()
    assert "tiny:lora:1:layer:auto" in traces and "busy_ms" in traces
    md = (tmp_path / "accelerator.md").read_text()
    assert md.count("| tiny |") == sum("error" not in r for r in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "accelerator.png").stat().st_size > 0


def test_accelerator_flops_count_every_matrix_product():
    """N (the parameters of the matrix products) counted from the model's own parameter
    shapes, independently of the benchmark's formula; 4N + 12 L d T for LoRA."""
    import math

    from benchmarks import _llama as L, accelerator

    for model in ("tiny", "llama-3-8b", "llama-3-70b"):
        params = L.abstract_params(L.config(model), jax.numpy.bfloat16)
        kernels = [params["embed"], *(params["layers"][k] for k in L.TARGETS)]
        n = sum(math.prod(x.shape) for x in kernels)
        assert accelerator.matmul_params(model) == n
        layers, dim, *_, seq = L.MODELS[model]
        assert accelerator.flops_per_token(model, "lora", seq) == 4 * n + 12 * layers * dim * seq
        assert accelerator.flops_per_token(model, "full", seq) == 6 * n + 12 * layers * dim * seq
    # Llama-3-8B at 2048 tokens: 7.50e9 matrix parameters, 33.2 GFLOP a token for LoRA.
    assert abs(accelerator.flops_per_token("llama-3-8b", "lora", 2048) / 1e9 - 33.2) < 0.05


def test_accelerator_mfu_is_over_the_measured_and_the_datasheet_rate():
    from benchmarks import accelerator

    row = dict(model="llama-3-8b", method="lora", seq=2048, tokens_per_s=10_000.0,
               device="NVIDIA H200")
    out = accelerator.with_rates(dict(row), {"ceiling_tflops": 500.0})
    tflops = 10_000 * accelerator.flops_per_token("llama-3-8b", "lora", 2048) / 1e12
    assert out["model_tflops"] == pytest.approx(tflops)
    assert out["mfu"] == pytest.approx(tflops / 500)
    assert out["mfu_datasheet"] == pytest.approx(tflops / 989.4)
    assert "mfu" not in accelerator.with_rates(dict(row, device="cpu"), {})


def test_accelerator_ratios_pair_like_with_like():
    from benchmarks import accelerator

    row = lambda method, step, remat="none", batch=1: dict(  # noqa: E731
        model="m", method=method, batch=batch, remat=remat, attention="auto", step_s=step,
        tokens_per_s=batch * 1000 / step)
    rows = accelerator.with_ratios([
        row("lora", 1.0), row("hand", 0.8), row("qlora-nf4", 1.1), row("qlora-nf4", 2.0, "layer"),
        row("peft-eager", 2.0), row("peft-compiled", 1.25), row("lora", 3.0, batch=4)])
    lora, hand, q, q_layer, _, _, lora4 = rows
    assert lora["vs_hand"] == pytest.approx(1.25) and hand["vs_lora"] == pytest.approx(0.8)
    assert q["vs_lora"] == pytest.approx(1.1) and "vs_lora" not in q_layer  # no dense layer cell
    assert lora["vs_peft"] == pytest.approx(1.25) and "vs_peft" not in lora4  # no PEFT at batch 4
    # Unrolled layers pair with unrolled layers only (rows from before them: scan).
    u_lora, u_hand, u_q = accelerator.with_ratios([
        dict(row("lora", 0.9), layers="unrolled"), dict(row("hand", 0.6), layers="unrolled"),
        dict(row("qlora-nf4", 2.0), layers="unrolled"), row("hand", 5.0)])[:3]
    assert u_lora["vs_hand"] == pytest.approx(1.5) and u_q["vs_lora"] == pytest.approx(2.0 / 0.9)
    assert u_hand["vs_lora"] == pytest.approx(0.6 / 0.9)


def test_accelerator_cells_name_their_layer_loop():
    from benchmarks.accelerator import DEFAULT_CELLS, PENDING_CELLS, Cell, cell_args

    for text in (*DEFAULT_CELLS, *PENDING_CELLS):  # every listed cell is one a run takes
        assert cell_args(text, 1, None)[0] in ("benchmarks._device_step", "benchmarks._peft")

    assert Cell.parse("llama-3-8b:lora:1:none:auto").layers == "scan"
    cell = Cell.parse("llama-3-8b:qlora-nf4:4:none:auto:unrolled")
    assert (cell.batch, cell.layers, str(cell)) == (4, "unrolled", "llama-3-8b:qlora-nf4:4:none:auto:unrolled")
    assert str(Cell.parse("llama-3-8b:lora:1:none:auto:scan")) == "llama-3-8b:lora:1:none:auto"
    for bad in ("llama-3-8b:lora:1:none:auto:looped", "llama-3-8b:lora:1:none:auto:scan:x"):
        with pytest.raises(ValueError, match="LAYERS one of"):
            Cell.parse(bad)


def test_accelerator_cells_add_named_xla_flags_to_their_own_process(monkeypatch):
    from benchmarks import accelerator as A

    cell = A.Cell.parse("llama-3-8b:lora:1:layer:auto:unrolled@cublas")
    assert (cell.layers, cell.xla, str(cell)) == ("unrolled", "cublas",
                                                  "llama-3-8b:lora:1:layer:auto:unrolled@cublas")
    assert str(A.Cell.parse("llama-3-8b:lora:1:layer:auto:scan@cublas")) == (
        "llama-3-8b:lora:1:layer:auto@cublas")
    assert A.Cell.parse("llama-3-8b:lora:1:layer:auto").xla == ""
    for bad in ("llama-3-8b:lora:1:layer:auto@triton", "llama-3-8b:lora:1:layer:auto@"):
        with pytest.raises(ValueError, match="is not one of \\['cublas'\\]"):
            A.Cell.parse(bad)
    with pytest.raises(ValueError, match="for lorax's cells"):
        A.cell_args("peft:llama-3-8b:1:compiled:off@cublas", 1, None)
    assert A.timeout_for("llama-3-8b:lora:1:none:auto:unrolled@cublas") == 420
    # After the run's own flags, or a `+host` cell's (which come with the run's).
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    flags = A.CELL_XLA_FLAGS["cublas"]
    assert A.cell_xla_env("llama-3-8b:lora:1:layer:auto@cublas", {}) == {
        "XLA_FLAGS": "--xla_dump_to=/tmp/x " + flags}
    host = {"XLA_FLAGS": "--xla_dump_to=/tmp/x " + A.HOST_XLA_FLAGS}
    assert A.cell_xla_env("llama-3-8b:lora+host:1:layer:auto@cublas", host) == {
        "XLA_FLAGS": host["XLA_FLAGS"] + " " + flags}
    assert A.cell_xla_env("llama-3-8b:lora:1:layer:auto", {}) == {}
    # A flagged cell pairs with flagged cells only, and its row names its flags.
    row = lambda method, step, xla="": dict(  # noqa: E731
        model="m", method=method, batch=1, remat="layer", attention="auto", step_s=step,
        tokens_per_s=1000 / step, xla=xla, xla_flags=flags if xla else "")
    lora, hand, lora_cublas = A.with_ratios([row("lora", 1.0), row("hand", 0.8),
                                             row("lora", 0.9, "cublas")])
    assert lora["vs_hand"] == pytest.approx(1.25) and "vs_hand" not in lora_cublas
    assert A._method(lora_cublas, A.run_flags([lora, hand, lora_cublas])) == (
        "lora, XLA flags: every product through cuBLAS")


def test_device_step_fills_unrolled_layers_with_one_program_per_leaf_signature():
    """Unrolled layers' leaves are filled by programs shared across layers (one program for
    the whole tree did not compile in 5 minutes on a GPU), with the values a fill of that
    leaf's own key gives."""
    import jax.numpy as jnp

    from benchmarks import _llama as L

    cfg = L.config("tiny")
    counts = {}
    for n_layers in (2, 6):
        L._device_fill.clear_cache()
        abstract, _ = L.build(cfg._replace(n_layers=n_layers), "qlora-nf4", jnp.bfloat16, "unrolled")
        params = L.materialise(abstract)
        counts[n_layers] = L._device_fill._cache_size()
    assert counts[2] == counts[6] > 1  # per signature, not per layer
    paths = jax.tree_util.tree_flatten_with_path(
        abstract, is_leaf=lambda x: isinstance(x, lorax.QuantizedArray))[0]
    i, (path, node) = next((i, pn) for i, pn in enumerate(paths)
                           if isinstance(pn[1], lorax.QuantizedArray))
    made = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, lorax.QuantizedArray))[i]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), i), 0)
    want = L._fill(jax.tree.leaves(node)[0], key, True)
    assert jnp.array_equal(jax.tree.leaves(made)[0], want)
    block = np.arange(7, dtype=np.uint8)  # host codes: one random block repeated
    for n in (3, 7, 23):
        assert np.array_equal(L._repeated(block, n), np.resize(block, n))


def test_accelerator_host_cap_holds_only_host_cells_to_a_smaller_card(monkeypatch):
    from benchmarks import accelerator

    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    caps = accelerator.host_caps("llama-3-70b=22,llama-3-8b=4")
    assert caps == {"llama-3-70b": 22.0, "llama-3-8b": 4.0}
    card = {"device_memory_gib": 140.0}
    assert accelerator.cap_env("llama-3-70b:qlora-nf4+host:1:layer:auto", caps, card) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{22 / 140:.4f}"}
    # the same step on the device, a model without a cap, the CPU (no card size): no cap
    assert accelerator.cap_env("llama-3-70b:qlora-nf4:1:layer:auto", caps, card) == {}
    assert accelerator.cap_env("llama-3.2-1b:lora+host:1:layer:auto", caps, card) == {}
    assert accelerator.cap_env("llama-3-8b:qlora-nf4+host:1:layer:auto", caps, {}) == {}
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", ".9")  # JAX refuses both names set
    assert accelerator.cap_env("llama-3-8b:lora+host:1:layer:auto", caps, card) == {
        "XLA_CLIENT_MEM_FRACTION": f"{4 / 140:.4f}"}
    with pytest.raises(ValueError, match="--host-cap 'llama-3-70b:22': expected MODEL=GIB"):
        accelerator.host_caps("llama-3-70b:22")
    label = accelerator._method(dict(method="qlora-nf4+host", mem_cap_gib=22.0))
    assert label == "qlora-nf4+host (card held to 22 GiB)"


def test_accelerator_host_cells_get_the_offload_flags_on_a_gpu_only(monkeypatch):
    from benchmarks import accelerator as A

    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    gpu, cpu = {"device_memory_gib": 140.0, "platform": "gpu"}, {"platform": "cpu"}
    host, device = "llama-3-8b:qlora-nf4+host:1:layer:auto", "llama-3-8b:qlora-nf4:1:layer:auto"
    env = A.cap_env(host, {}, gpu, A.HOST_XLA_FLAGS)
    assert env == {"XLA_FLAGS": "--xla_dump_to=/tmp/x " + A.HOST_XLA_FLAGS}  # the run's kept
    assert "--xla_gpu_enable_command_buffer= " in env["XLA_FLAGS"]
    assert A.cap_env(device, {}, gpu, A.HOST_XLA_FLAGS) == {}  # its partner: as the run
    assert A.cap_env(host, {}, cpu, A.HOST_XLA_FLAGS) == {}
    assert A.cap_env(host, {}, gpu, "") == {}  # --host-xla-flags ''
    capped = A.cap_env(host, {"llama-3-8b": 4}, gpu, A.HOST_XLA_FLAGS)
    assert set(capped) == {"XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION"}


def test_accelerator_table_names_a_rows_own_xla_flags():
    from benchmarks import accelerator as A

    rows = [dict(method="qlora-nf4", xla_flags=""), dict(method="lora", xla_flags=""),
            dict(method="qlora-nf4+host", xla_flags="--a=1"), dict(method="peft", xla_flags="")]
    assert A.run_flags(rows) == ""
    assert A.run_flags([dict(method="lora", xla_flags="--b --a"), dict(method="hand", xla_flags="--a --b"),
                        dict(method="peft", xla_flags="")]) == "--a --b"
    assert [A._method(r, "") for r in rows] == [
        "qlora-nf4", "lora", "qlora-nf4+host, XLA flags: `--a=1`", "peft"]
    assert A._method(rows[0], "--a=1") == "qlora-nf4, XLA flags: none"
    recipe = dict(method="qlora-nf4+host", xla_flags=" " + A.HOST_XLA_FLAGS)
    assert A._method(recipe, "") == ("qlora-nf4+host, XLA flags: command buffers off + "
                                     "pipelined host offloading")
    assert A._method(recipe, " ".join(reversed(A.HOST_XLA_FLAGS.split()))) == "qlora-nf4+host"


def test_accelerator_trace_summary_reads_the_gpu_streams_only():
    """A Perfetto trace as JAX writes it on a GPU: the stream's kernels are counted, the
    per-op lines over them ("XLA Ops") and the host's are not."""
    from benchmarks import _device_step

    meta = lambda ph, pid, tid, name, kind: dict(ph=ph, pid=pid, tid=tid, name=kind,  # noqa: E731
                                                  args={"name": name})
    span = lambda pid, tid, name, dur: dict(ph="X", pid=pid, tid=tid, name=name, dur=dur, ts=0)  # noqa: E731
    trace = {"traceEvents": [
        meta("M", 1, 0, "/device:GPU:0", "process_name"), meta("M", 2, 0, "/host:CPU", "process_name"),
        meta("M", 1, 14, "Stream #14(Compute)", "thread_name"), meta("M", 1, 3, "XLA Ops", "thread_name"),
        span(1, 14, "nvjet_sm90_tst_128x128_NNT", 3000), span(1, 14, "gemm_fusion_dot_5", 1000),
        span(1, 14, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 500),
        span(1, 14, "memcpy128", 250), span(1, 14, "loop_add_fusion", 250),
        meta("M", 1, 70, "Stream #70(MemcpyH2D)", "thread_name"), span(1, 70, "MemcpyH2D", 500),
        span(1, 3, "fusion.12", 9999), span(2, 7, "PjitFunction(step)", 9999)]}
    s = _device_step.summarise(trace)
    assert s["device_events"] == "gpu streams" and s["busy_ms"] == 5.5
    assert s["by_kind_ms"] == {"matmul": 4.0, "attention": 0.5, "copy": 0.75, "other": 0.25}
    assert s["by_stream_ms"] == {  # a copy stream's copies apart from the compute stream's
        "Stream #14(Compute)": {"attention": 0.5, "copy": 0.25, "matmul": 4.0, "other": 0.25},
        "Stream #70(MemcpyH2D)": {"copy": 0.5}}
    assert s["longest_ms"][0] == ["nvjet_sm90_tst_128x128_NNT", 3.0]


@pytest.mark.slow  # the layouts' claims are tests/test_quant_tensor_parallel.py's
def test_scale_quick_tensor_parallel(tmp_path):
    """Compile-only, tiny Llama in Megatron's layout with FSDP over a 2 x 4 mesh: QLoRA's
    step gathers less than the dense LoRA step and holds less per device."""
    from benchmarks import scale

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    rows = scale.main(["--quick", "--methods", "lora,qlora-nf4", "--dtypes", "f32",
                       "--layouts", "fsdp-tp", "--name", "scale_tp", "--out", str(tmp_path)])
    dense, nf4 = rows
    assert nf4["layout"] == "FSDP 2 x TP 4" and nf4["batch"] == "2x64"
    assert 0 < nf4["all-gather_gib"] < dense["all-gather_gib"]
    assert nf4["args_gib"] < dense["args_gib"]
    assert "FSDP 2 x TP 4" in (tmp_path / "scale_tp.md").read_text()


def test_scale_quick_under_explicit_axes(tmp_path):
    """The examples' Llama on a mesh of Explicit axes (`llama.Layout`), FSDP with a window
    per device: the same per-device arguments as the Auto mesh's step, collectives within
    1.05x its bytes; one window split along its tokens is refused by name."""
    from benchmarks import scale

    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    with pytest.raises(ValueError, match="layout 'fsdp'.*fsdp-batch"):
        scale.layouts("fsdp", None, "explicit")
    auto, explicit = scale.main(["--quick", "--methods", "lora", "--dtypes", "f32",
                                 "--layouts", "fsdp-batch", "--axes", "auto,explicit",
                                 "--name", "scale_explicit", "--out", str(tmp_path)])
    assert (auto["layout"], explicit["layout"]) == ("FSDP x8", "FSDP x8, Explicit")
    assert explicit["args_gib"] == auto["args_gib"]
    moved = [sum(r[f"{k}_gib"] for k in scale.KINDS) for r in (auto, explicit)]
    assert 0 < moved[1] <= 1.05 * moved[0]


def test_quant_error_quick(tmp_path):
    """Round-trip errors per format: s4 with its extreme at code -8 beats its first
    quantizer (absmax / 7) on both weight distributions, and bf16 scales cost it nothing."""
    from benchmarks import quant_error

    rows = {r["format"]: r for r in quant_error.main(["--quick", "--out", str(tmp_path)])}
    assert {"quant_error.csv", "quant_error.md", "quant_error.png"} <= {p.name for p in tmp_path.iterdir()}
    for dist in ("normal", "student_t4"):
        err = {k: r[f"rel_rms_error_{dist}"] for k, r in rows.items()}
        assert err["dense"] == 0 and 0 < err["int8"] < 0.05 < err["s4"]
        assert err["s4"] < 0.95 * err["s4, absmax / 7 (before)"]
        assert err["s4, bf16 scales"] == pytest.approx(err["s4"], rel=1e-2)
    assert rows["s4, bf16 scales"]["bytes_per_value"] < rows["s4"]["bytes_per_value"]


def test_remat_dots_recomputes_lorax_rank_expansions_where_hand_written_lora_keeps_them(
        monkeypatch):
    """docs/gpu.md: under remat `dots` the hand-written model keeps its rank-16 expansions
    `(x a) b` (outputs of matrix products), lorax's step recomputes them in the backward
    pass. Compiled here for the tiny Llama: the same products but for more rank-16
    products of full width in lorax's step, at most twice the hand-written step's."""
    import collections

    import optax

    from benchmarks import _llama as L, gpu_compile as G

    def expansions(method: str) -> tuple[float, collections.Counter]:
        monkeypatch.setattr(L.LLAMA, "block", L.LLAMA.block)  # `setup` swaps it for "hand"
        cfg, seq = L.config("tiny", "xla", "dots"), L.MODELS["tiny"][-1]
        trainable, frozen, loss = L.setup(cfg, method)
        opt = optax.adam(1e-4)

        def step(t, f, s, w):
            g = jax.grad(lambda t: loss(t, f, w))(t)
            u, s = opt.update(g, s, t)
            return optax.apply_updates(t, u), s

        hlo = jax.jit(step).lower(trainable, frozen, opt.init(trainable), jax.numpy.zeros(
            (1, seq + 1), jax.numpy.int32)).compile().as_text()
        found = collections.Counter()  # (tokens, out) products over the rank: by `out`
        for (out, k), n in G.products(hlo).items():
            if k == L.RANK and len(out) == 2 and out[0] == seq:
                found[out[1]] += n
        return G.product_tflop(hlo), found

    seq = L.MODELS["tiny"][-1]
    (lora, lora_x), (hand, hand_x) = expansions("lora"), expansions("hand")
    extra = sum(2 * seq * L.RANK * out * (lora_x[out] - hand_x[out]) for out in lora_x)
    assert extra > 0 and (lora - hand) * 1e12 == pytest.approx(extra)
    assert all(hand_x[out] <= lora_x[out] <= 2 * hand_x[out] for out in hand_x)


CARD_RAW = ROOT / "benchmarks" / "results" / "gpu_raw"


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in CARD_RAW.glob("*/assemble.py")))
def test_card_tables_are_the_cards_outputs_assembled(folder, tmp_path):
    """The tables of card figures that the docs include are what each `gpu_raw` folder's
    `assemble.py` makes from the card's outputs as they came back: no figure typed in."""
    spec = importlib.util.spec_from_file_location(f"_assemble_{folder.replace('-', '_')}",
                                                  CARD_RAW / folder / "assemble.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    made = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".md", ".csv"))
    assert any(name.endswith(".md") for name in made)
    for name in made:
        assert (tmp_path / name).read_text() == (ROOT / "benchmarks" / "results" / name).read_text(), name


def test_the_card_table_is_its_csv_rendered(tmp_path):
    """`benchmarks/results/accelerator.md` is `--plot-only`'s rendering of the card's CSV."""
    from benchmarks import accelerator

    results = ROOT / "benchmarks" / "results"
    (tmp_path / "accelerator.csv").write_bytes((results / "accelerator.csv").read_bytes())
    accelerator.write_tables(tmp_path)
    assert (tmp_path / "accelerator.md").read_text() == (results / "accelerator.md").read_text()
