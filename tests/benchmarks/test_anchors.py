"""`benchmarks.accelerator`'s PyTorch anchors (PEFT + Liger-Kernel, Unsloth; issue 52) and
the batch every stack trains on, the parts a CPU can check: the cells' grammar and the
processes they name, the shared tokens, norm weights at 1, quantized weights as spread as
dense ones, the table's loss and anchor columns, the anchor module's command line, and the
folder Unsloth loads (a saved random Llama with an offline tokenizer). Liger's and
Unsloth's kernels need a GPU (`scripts/card-anchors`); the tests that need torch skip where
it is absent (it is not part of the lock).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _batch as B  # noqa: E402
from benchmarks import _torch_anchors as T  # noqa: E402

HAS_TORCH = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft", "tokenizers"))
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch, transformers, peft and tokenizers "
                                 "are not installed here (not part of the lock)")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


# -- the tokens every stack trains on -----------------------------------------------------------


def test_each_window_repeats_one_random_sequence_the_same_on_every_call():
    w = B.learning_windows(2, 2048, 128_256)
    p = B.period(2048)
    assert w.shape == (2, 2049) and w.dtype == np.int32 and p == 256
    assert w.min() >= B.LOW and w.max() < 128_256
    np.testing.assert_array_equal(w[:, p:], w[:, :-p])  # periodic: there is something to learn
    assert len(np.unique(w[0, :p])) > 0.99 * p and not np.array_equal(w[0], w[1])
    np.testing.assert_array_equal(B.learning_windows(2, 2048, 128_256), w)  # a fixed seed
    np.testing.assert_array_equal(B.learning_windows(1, 2048, 128_256)[0], w[0])  # batch 1 = row 0
    assert B.learning_windows(1, 64, 4096).shape == (1, 65) and B.period(64) == 8


def test_lorax_cells_train_on_the_shared_tokens_and_report_first_and_last_loss(monkeypatch):
    from benchmarks import _device_step as D
    from benchmarks.accelerator import Cell

    calls = []

    def spy(*args):
        calls.append(args)
        return B.learning_windows(*args)

    monkeypatch.setattr(D, "learning_windows", spy)
    row = D.run(Cell.parse("tiny:lora:1:layer:auto"), 2, None)
    assert calls == [(1, 64, 4096)]
    assert row["first_loss"] == pytest.approx(row["losses"][0], abs=1e-3)
    assert row["last_loss"] == pytest.approx(row["losses"][-1], abs=1e-3) and row["finite"]


@needs_torch
def test_pytorch_cells_train_on_the_same_tokens():
    from benchmarks import _peft as P

    np.testing.assert_array_equal(P.windows(2, 64, 4096, "cpu").numpy(), B.learning_windows(2, 64, 4096))


# -- the parameters: norms at 1, quantized weights spread as dense ones ---------------------------


# nf4 stands for the quantized formats by default (CI time); the others are slow.
@pytest.mark.parametrize("method,layers,host", [
    ("lora", "scan", False), ("lora", "unrolled", False), ("hand", "scan", False),
    ("qlora-nf4", "scan", False), ("qlora-nf4", "scan", True),
    *(pytest.param(m, "scan", False, marks=pytest.mark.slow)
      for m in ("qlora-bnb_nf4", "qlora-int8", "qlora-q4_k"))])
def test_norm_weights_are_ones_and_quantized_weights_are_spread_as_dense_ones(method, layers, host):
    import jax
    import jax.numpy as jnp

    import lorax
    from benchmarks import _llama as L

    cfg = L.config("tiny")
    if method == "hand":
        abstract = L.abstract_params(cfg, jnp.bfloat16, layers)
    else:
        abstract, _ = L.build(cfg, method, jnp.bfloat16, layers)
    scale = L.quant_scale_for(method) if method.startswith("qlora") else L.SCALE
    params = L.materialise(abstract, seed=1, frozen_on_host=host, quant_scale=scale)
    is_q = lambda x: isinstance(x, lorax.QuantizedArray)  # noqa: E731
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]
    norms = [x for path, x in leaves if L.is_norm(path)]
    assert len(norms) == 1 + 2 * (cfg.n_layers if layers == "unrolled" else 1)
    assert all(bool(jnp.all(x == 1)) for x in norms)
    others = [x for path, x in leaves if not L.is_norm(path) and not is_q(x)]
    assert not any(bool(jnp.all(x == 1)) for x in others)
    quantized = [float(jnp.std(q.dequantize().astype(jnp.float32))) for _, q in leaves if is_q(q)]
    assert bool(quantized) == method.startswith("qlora")
    if quantized:  # (calibrated on seed 0's draw; this is seed 1's)
        assert 0.8 * L.WEIGHT_STD < np.mean(quantized) < 1.2 * L.WEIGHT_STD, quantized


@pytest.mark.parametrize("method", ["lora", "qlora-nf4"])
def test_lorax_cells_scale_their_adapters_as_the_pytorch_cells_do(method):
    # PEFT's `lora_alpha / r` (B.LORA_ALPHA / B.RANK) is the lorax cells' `alpha / k`: at
    # lorax's default alpha=1 the same steps learned 16 times slower (issue 52).
    import jax
    import jax.numpy as jnp

    import lorax
    from benchmarks import _llama as L

    abstract, _ = L.build(L.config("tiny"), method, jnp.bfloat16)
    is_lw = lambda x: isinstance(x, lorax.LoraWeight)  # noqa: E731
    weights = [x for x in jax.tree_util.tree_leaves(abstract, is_leaf=is_lw) if is_lw(x)]
    assert len(weights) == 7 and B.LORA_ALPHA / B.RANK == 1
    assert all(w.a.shape[-2] == B.RANK and w.scale == B.LORA_ALPHA / B.RANK for w in weights)


# -- the cells ----------------------------------------------------------------------------------


def test_pytorch_cells_name_the_process_and_arguments_they_run():
    from benchmarks import accelerator as A

    assert A.cell_args("peft:llama-3-8b:1:compiled:off", 8, None) == [
        "benchmarks._peft", "llama-3-8b", "--batch", "1", "--steps", "8", "--compile",
        "--no-checkpointing"]
    assert A.cell_args("liger:llama-3-8b:4:eager:on", 12, None) == [
        "benchmarks._torch_anchors", "liger", "llama-3-8b", "--batch", "4", "--steps", "12"]
    assert A.cell_args("unsloth:llama-3-8b:1:nf4:unsloth", 12, None) == [
        "benchmarks._torch_anchors", "unsloth", "llama-3-8b", "--batch", "1", "--steps", "12",
        "--quant", "nf4", "--checkpointing", "unsloth"]
    # Every anchor cell's arguments are ones the anchor module takes.
    for text in A.ANCHOR_CELLS:
        args = A.cell_args(text, 12, None)
        if args[0] == "benchmarks._torch_anchors":
            a = T.parser().parse_args(args[1:])
            assert (a.stack, a.model, a.batch, a.steps) == (
                text.split(":")[0], "llama-3-8b", int(text.split(":")[2]), 12)
    assert A.timeout_for("unsloth:llama-3-8b:1:16bit:off") == 300
    assert A.timeout_for("liger:llama-3-8b:1:compiled:off") == 420
    assert A.timeout_for("liger:llama-3-8b:1:eager:off") == 240
    # A compiled cell starts only with time for its first step's compile left.
    assert A.least_for("peft:llama-3-8b:1:compiled:off") == 200
    assert A.least_for("liger:llama-3-8b:1:eager:off") == A.least_for("llama-3-8b:lora:1:dots:auto") == 45


@pytest.mark.parametrize("bad,match", [
    ("liger:llama-3-8b:1:eager", "STACK:MODEL:BATCH:A:B"),
    ("torchtune:llama-3-8b:1:eager:off", "MODEL:METHOD:BATCH"),  # not a stack: a lorax cell
    ("unsloth:llama-3-8b:1:8bit:off", "16bit|nf4"),
    ("unsloth:llama-3-8b:1:16bit:maybe", "unsloth|on|off"),
    ("liger:llama-3-9b:1:eager:off", "MODEL one of"),
    ("liger:llama-3-8b:0:eager:off", "BATCH >= 1"),
    ("peft:llama-3-8b:x:eager:off", "BATCH >= 1"),
    ("liger:llama-3-8b:1:eager:off@cublas", "for lorax's cells")])
def test_a_bad_pytorch_cell_says_what_such_a_cell_takes(bad, match):
    from benchmarks import accelerator as A

    with pytest.raises(ValueError, match=match):
        A.cell_args(bad, 1, None)


def test_the_anchor_cells_put_the_targets_pairs_first_and_the_minutes_long_compiles_last():
    from benchmarks import accelerator as A

    # What fits the few minutes one card call has left after the context tries: lorax's
    # LoRA and its QLoRA at Unsloth's memory, beside the fastest PyTorch rows measured
    # (Unsloth without checkpointing, Unsloth QLoRA) and PEFT + Liger.
    assert set(A.ANCHOR_CELLS[:5]) == {
        "llama-3-8b:lora:1:dots:auto", "llama-3-8b:qlora-nf4:1:layer:auto",
        "unsloth:llama-3-8b:1:16bit:off", "unsloth:llama-3-8b:1:nf4:unsloth",
        "liger:llama-3-8b:1:eager:off"}
    assert A.ANCHOR_CELLS[:2] == ("llama-3-8b:lora:1:dots:auto",
                                  "llama-3-8b:qlora-nf4:1:layer:auto")
    assert all(":compiled:" in c for c in A.ANCHOR_CELLS[-2:])
    assert not any(":compiled:" in c for c in A.ANCHOR_CELLS[:-2])
    assert len(set(A.ANCHOR_CELLS)) == len(A.ANCHOR_CELLS)
    assert set(A.MODEL_NAMES) == set(T.MODEL_NAMES)


def test_a_stack_that_is_not_installed_is_listed_as_not_run(tmp_path, monkeypatch):
    from benchmarks import accelerator as A

    real = importlib.util.find_spec
    gone = {"liger_kernel", "unsloth", "bitsandbytes"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in gone else real(name, *a))
    assert "liger_kernel" in A.torch_missing("liger:llama-3-8b:1:eager:off")
    assert "bitsandbytes" in A.torch_missing("unsloth:llama-3-8b:1:nf4:off")
    assert "bitsandbytes" not in A.torch_missing("unsloth:llama-3-8b:1:16bit:off")
    rows = A.main(["--quick", "--out", str(tmp_path),
                   "--cells", "liger:tiny:1:eager:off,unsloth:tiny:1:nf4:off"])
    assert [r["error"].split(":")[0] for r in rows] == ["not run"] * 2
    assert "liger_kernel" in rows[0]["error"] and "unsloth" in rows[1]["error"]
    assert (tmp_path / "accelerator.md").read_text().count("not run") == 2


# -- the table ----------------------------------------------------------------------------------


def _row(method: str, tokens: float, **extra) -> dict:
    return dict(model="m", method=method, batch=1, seq=2048, remat="dots", attention="auto",
                step_s=2048 / tokens, tokens_per_s=tokens, **extra)


def test_lorax_rows_are_compared_with_the_fastest_pytorch_row_on_the_same_kind_of_base():
    from benchmarks import accelerator as A

    rows = A.with_ratios([
        _row("lora", 14000), _row("qlora-nf4", 13000), _row("peft-compiled-nockpt", 10000),
        _row("liger-eager-nockpt", 11000), _row("unsloth-16bit", 12000),
        _row("unsloth-nf4", 6500)])
    lora, qlora, *torch_rows = rows
    assert lora["vs_torch"] == pytest.approx(14000 / 12000)
    assert qlora["vs_torch"] == pytest.approx(2.0)  # against Unsloth's QLoRA only
    assert lora["vs_peft"] == pytest.approx(1.4)
    assert not any("vs_torch" in r or "vs_peft" in r for r in torch_rows)
    assert [A.is_torch(r["method"]) for r in rows] == [False, False, True, True, True, True]


def test_the_table_shows_losses_and_the_anchor_column_only_where_rows_have_them():
    from benchmarks import accelerator as A

    old = A.markdown([_row("lora", 14000), _row("peft-eager", 10000)])[0]
    assert "first loss" not in old and "vs fastest PyTorch" not in old  # earlier runs as they were
    rows = A.with_ratios([_row("lora", 14000, first_loss=12.5, last_loss=11.75),
                          _row("unsloth-16bit", 12000, first_loss=12.51, last_loss=11.2),
                          {"cell": "liger:m:1:eager:off", "error": "not run: liger_kernel"}])
    table = A.markdown(rows)[0]
    header, _, lora, unsloth, error = table.splitlines()
    assert header.endswith("| vs fastest PyTorch | first loss | last loss |")
    assert lora.endswith("| 1.17 | 12.500 | 11.750 |") and unsloth.endswith("|  | 12.510 | 11.200 |")
    assert error.count("|") == header.count("|")


# -- the anchor module --------------------------------------------------------------------------


def test_the_anchor_module_imports_no_torch_until_a_cell_runs():
    """(Unsloth must be imported before transformers and peft.)"""
    code = ("import sys, benchmarks._torch_anchors as T; T.parser(); "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'jax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(),
                         cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_the_anchor_command_line():
    p = T.parser()
    a = p.parse_args(["unsloth", "llama-3-8b", "--quant", "nf4", "--checkpointing", "off"])
    assert (a.quant, a.checkpointing, a.batch, a.steps, a.model_dir) == ("nf4", "off", 1, 8, None)
    assert T.CHECKPOINTING[a.checkpointing] is False and T.CHECKPOINTING["unsloth"] == "unsloth"
    assert (a.seq, a.layers, a.memory_gib) == (None, None, None)
    a = p.parse_args(["unsloth", "llama-3-8b", "--quant", "nf4", "--seq", "344064", "--layers",
                      "2", "--memory-gib", "74.27"])  # one try of Unsloth's longest context
    assert (a.seq, a.layers, a.memory_gib) == (344_064, 2, 74.27)
    a = p.parse_args(["liger", "tiny", "--compile", "--no-checkpointing", "--batch", "4"])
    assert (a.compile, a.no_checkpointing, a.batch) == (True, True, 4)
    for bad in (["unsloth", "llama-3-8b", "--quant", "int8"], ["liger", "llama-3-8b", "--quant", "nf4"],
                ["deepspeed", "llama-3-8b"], ["liger", "llama-3-9b"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_the_saved_model_goes_to_shared_memory_only_where_it_fits(monkeypatch, tmp_path):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100, 0, 100))
    assert T.default_model_dir(10 ** 9).parent != Path("/dev/shm")
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 0, 10**12))
        assert T.default_model_dir(10 ** 9) == Path("/dev/shm/lorax-anchors")


@needs_torch
def test_the_folder_unsloth_loads_is_a_random_llama_with_an_offline_tokenizer(tmp_path):
    import torch
    import transformers

    folder, seconds = T.saved_model("tiny", tmp_path, "cpu")
    assert (folder / "DONE").exists() and seconds > 0
    assert T.saved_model("tiny", tmp_path, "cpu") == (folder, 0.0)  # made once, then reused
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings,
            cfg.pad_token_id) == (4096, 256, 2, True, 0)
    assert model.dtype == torch.bfloat16
    assert bool((model.model.norm.weight == 1).all()) and bool(
        (model.model.layers[1].post_attention_layernorm.weight == 1).all())
    assert 0.015 < float(model.model.layers[0].mlp.up_proj.weight.detach().float().std()) < 0.025
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert T.model_bytes("tiny") <= weights < 1.01 * T.model_bytes("tiny")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert len(tok) == 4096 and tok.pad_token_id == 0 and tok.eos_token_id == 2
    assert [i for i in tok("t5 t4095")["input_ids"] if i >= B.LOW] == [5, 4095]


@needs_torch
def test_a_long_context_cells_folder_has_its_layers_and_positions(tmp_path):
    import transformers

    folder, _ = T.saved_model("tiny", tmp_path, "cpu", layers=1, seq=3000)
    assert folder.name == "tiny-1l-4096p-random-bf16"
    cfg = transformers.AutoConfig.from_pretrained(folder)
    assert (cfg.num_hidden_layers, cfg.max_position_embeddings) == (1, 4096)
    assert T.positions_for(4096) == 4096 and T.positions_for(4097) == 8192
    assert T.model_bytes("tiny", 1) < T.model_bytes("tiny")


@needs_torch
def test_the_peft_cell_reports_its_losses():
    from benchmarks import _peft as P

    row = P.run("tiny", 1, 3, False, False)
    assert row["cell"] == "peft:tiny:1:eager:off" and row["remat"] == "none"
    assert row["first_loss"] == pytest.approx(row["losses"][0], abs=1e-4)
    assert row["last_loss"] < row["first_loss"] and row["finite"]


@pytest.mark.skipif(not HAS_TORCH or importlib.util.find_spec("unsloth") is None,
                    reason="Unsloth is not installed here (its wheels travel to the card)")
def test_the_unsloth_cell_runs_its_cpu_fallback(tmp_path):
    """Unsloth falls back to the CPU without a GPU: the cell's loading, offline, and its
    step (a process of its own: `import unsloth` patches transformers)."""
    p = subprocess.run([sys.executable, "-m", "benchmarks._torch_anchors", "unsloth", "tiny",
                        "--steps", "3", "--checkpointing", "off", "--model-dir", str(tmp_path)],
                       capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, p.stderr[-2000:]
    row = json.loads(line[len("RESULT "):])
    assert row["method"] == "unsloth-16bit-nockpt" and row["unsloth"] != "missing"
    assert row["last_loss"] < row["first_loss"]


def test_the_card_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "card-anchors")], check=True)
    text = (ROOT / "scripts" / "card-anchors").read_text()
    assert "--cells \"$cells\"" in text and "timeout -k 5" in text
    # One card call: the context tries that decide issue 52's 1.25x, then the cells.
    assert text.index("--versus") < text.index("benchmarks.accelerator")
    assert "budget=${2:-570}" in text  # under the device's 600 s a command


def test_the_card_script_runs_the_context_tries_then_the_cells_within_its_budget(tmp_path):
    """The one card call's order and clocks, with `python3` stubbed (it records its
    arguments): the wheels, the smoke, `context --versus 78` for 230 s, then the cells
    with the benchmark's deadline inside what is left."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               LORAX_SITE=str(tmp_path / "site"))
    for key in ("UNSLOTH_CONTEXT", "CONTEXT_SECONDS", "CELLS", "TRACE", "STEPS"):
        env.pop(key, None)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "card-anchors"), str(tmp_path / "out")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("-m pip install") and lines[1].endswith(".py")  # the smoke
    context, cells = lines[2].split(), lines[3].split()
    assert context[:2] == ["-m", "benchmarks.context"]
    assert context[context.index("--versus") + 1] == "78"
    assert context[context.index("--seconds") + 1] == "230"
    assert cells[:2] == ["-m", "benchmarks.accelerator"]
    assert cells[cells.index("--cells") + 1] == "anchors"
    assert 500 <= int(cells[cells.index("--deadline") + 1]) <= 570 - 20
    assert "done in" in (tmp_path / "out" / "log.txt").read_text()


def test_out_of_memory_is_torchs_error_or_a_kernels_cuda_error_saying_so():
    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name, no torch needed
        pass

    assert T.is_out_of_memory(OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB"))
    assert T.is_out_of_memory(RuntimeError("Triton Error [CUDA]: out of memory"))
    assert not T.is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
