"""`benchmarks.context`: the longest-context search and the card's confirming step, the parts
a CPU can check (the search's compiles need JAX's CUDA plugin; its figures are in
`benchmarks/results/gpu_compile_context_h200.md`), and `llama.Config.mlp_chunk`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lorax

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _llama as S  # noqa: E402
from benchmarks import context as X  # noqa: E402

L = S.LLAMA


# -- llama.Config.mlp_chunk -------------------------------------------------------------------


def _values_and_grads(cfg, method: str, seq: int):
    """Loss and gradients of the tiny model, f32, random values (the same for any cfg)."""
    abstract, spec = S.build(cfg, method, jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    values = [jax.random.randint(k, s.shape, 0, 255).astype(s.dtype)
              if jnp.issubdtype(s.dtype, jnp.integer)
              else 0.1 * jax.random.normal(k, s.shape, s.dtype) + (1.0 if s.ndim < 2 else 0)
              for k, s in zip(keys, leaves)]
    params = jax.tree_util.tree_unflatten(treedef, values)
    windows = jax.random.randint(jax.random.PRNGKey(1), (2, seq + 1), 0, cfg.vocab)
    if method == "dense":
        return jax.jit(jax.value_and_grad(lambda p: L.loss(cfg, p, windows)))(params)
    trainable, frozen = lorax.partition(params, spec)
    apply = lorax.lora(lambda p, w: L.loss(cfg, p, w), on_materialize="error")
    return jax.jit(jax.value_and_grad(
        lambda t: apply(lorax.combine(t, frozen), windows)))(trainable)


# 24: a last, shorter chunk (96 = 4 x 24; 100 not). Each method meets each kind of chunk
# by default; the other two pairings are slow (CI time).
@pytest.mark.parametrize("method,remat,chunk", [
    ("lora", "layer", 24), ("qlora-nf4", "none", 16),
    pytest.param("lora", "layer", 16, marks=pytest.mark.slow),
    pytest.param("qlora-nf4", "none", 24, marks=pytest.mark.slow)])
def test_mlp_chunk_gives_the_plain_mlps_values_and_gradients(method, remat, chunk):
    base = L.Config(2, 128, 256, 4, 2, 5e5, 1e-5, 256, attention="xla", remat=remat)
    plain = _values_and_grads(base, method, 100)
    chunked = _values_and_grads(base._replace(mlp_chunk=chunk), method, 100)
    np.testing.assert_allclose(chunked[0], plain[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked[1]), jax.tree.leaves(plain[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_mlp_chunk_never_makes_the_whole_intermediate():
    """The step's program has no (B, T, hidden) array with chunks on: each chunk's only."""
    cfg = L.Config(1, 64, 192, 4, 2, 5e5, 1e-5, 256, attention="xla", mlp_chunk=32)
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype),
                          S.abstract_params(cfg, jnp.float32))
    windows = jnp.zeros((1, 129), jnp.int32)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: L.loss(cfg, p, windows)))(params))
    assert "f32[1,32,192]" in jaxpr and "f32[1,128,192]" not in jaxpr
    plain = str(jax.make_jaxpr(jax.grad(lambda p: L.loss(cfg._replace(mlp_chunk=None), p,
                                                          windows)))(params))
    assert "f32[1,128,192]" in plain


def test_config_default_is_todays_mlp():
    assert L.Config(2, 64, 128, 4, 2, 5e5, 1e-5, 256).mlp_chunk is None


# -- the search ----------------------------------------------------------------------------------


def _counted(fn, asked: list[int]):
    def device_gib(seq: int) -> float:
        assert seq not in asked, "a length compiled twice"
        assert seq % 2048 == 0
        asked.append(seq)
        return fn(seq)
    return device_gib


ANSWER = 1_376_256  # the largest fitting multiple of 2048 in the fakes below
SHAPES = {
    "linear": lambda s: 4.0 + s * 80 / 2**20,
    "convex": lambda s: 4.0 + s * 60 / 2**20 + (s / 2**20) ** 2 * 18,
    # a fit function only: fits or not, nothing to interpolate
    "fits or not": lambda s: 0.0 if s <= ANSWER + 2047 else 1000.0,
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("guess", [300_000, 1_300_000, 1_500_000, 4_000_000])
def test_search_finds_the_largest_fitting_length(shape, guess):
    fn = SHAPES[shape]
    limit = fn(ANSWER + 1024) if shape != "fits or not" else 1.0
    asked: list[int] = []
    found = X.search(_counted(fn, asked), limit, guess, 2048)
    assert found == ANSWER
    assert ANSWER in asked and ANSWER + 2048 in asked  # both sides of the edge compiled
    assert len(asked) <= {"linear": 5, "convex": 8}.get(shape, 24)


def test_search_none_when_nothing_fits():
    assert X.search(lambda s: 100.0 + s, 50.0, 65536, 2048) is None


def test_predicted_is_the_line_through_the_two_longest():
    rows = [dict(seq=1000, device_gib=50.0), dict(seq=131072, device_gib=12.0),
            dict(seq=262144, device_gib=22.0)]
    assert X.predicted(rows, 102.0) == 262144 + 8 * 131072


def test_run_search_with_a_fake_compiler():
    """Device bytes linear in the length (4 GiB of weights, 80 KiB a token): each budget's
    answer, the per-layer rows, and every row's fit against its budget less the margin."""
    def measure(seq, layers, target):
        weights = 4.0 if layers == 32 else 0.5
        temps = seq * 80 / 2**20
        return dict(target=target, seq=seq, layers=layers, mlp_chunk=8192, args_gib=weights,
                    temps_gib=temps, outputs_gib=0.1, aliased_gib=0.1,
                    device_gib=weights + temps, host_gib=layers * seq * 8 / 2**20,
                    largest_buffer="bf16[1,4096]", largest_buffer_gib=0.0, logits_whole=False,
                    compile_s=0.0)
    rows, found = X.run_search({"h200": 139, "h100": 78}, 0.05, 2048, lambda _: None, measure)
    for target, budget in (("h200", 139), ("h100", 78)):
        limit_tokens = (budget * 0.95 - 4.0) * 2**20 / 80
        assert found[target] == int(limit_tokens) // 2048 * 2048
    assert {r["layers"] for r in rows if r["target"] == "h200"} == {2, 32}
    assert all(r["fits"] == (r["device_gib"] <= r["budget_gib"] * 0.95) for r in rows)
    text = X.markdown(rows, found, 0.05)
    assert f"{found['h200']:,} tokens" in text


# -- reading the compiled program ------------------------------------------------------------------

_MODULE = """\
%fused_loss (p0: bf16[4096,8016]) -> bf16[4096,128256] {
  %p0 = bf16[4096,8016]{1,0} parameter(0)
  ROOT %big = bf16[4096,128256]{1,0} broadcast(%p0), dimensions={}
}

ENTRY %main (a: bf16[4096,4096]) -> bf16[4096,8016] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %h = bf16[32,4096,4096]{2,1,0:S(5)} parameter(1)
  %f = bf16[4096,8016]{1,0} fusion(%a), kind=kLoop, calls=%fused_loss
  ROOT %z = bf16[4096,8016]{1,0} copy(%f)
}
"""


def test_logits_whole_and_the_largest_buffer():
    assert X.logits_whole(_MODULE, 4096)  # (inside a fusion too: a value, still whole)
    assert not X.logits_whole(_MODULE.replace("128256", "8016"), 4096)
    shape, gib = X.largest_buffer(_MODULE)  # the fusion's inside is no buffer; host aside
    assert shape == "bf16[4096,8016]" and gib == pytest.approx(4096 * 8016 * 2 / 2**30)


# -- the card's confirming step ------------------------------------------------------------------


@pytest.mark.slow  # CI time; mlp_chunk's values are checked above
def test_confirm_runs_end_to_end_on_the_tiny_model(capsys):
    result = X.confirm(256, 2, 64, 128, 2, 600, model="tiny")
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT ")]
    printed = json.loads(line[-1].removeprefix("RESULT "))
    assert "error" not in result, result.get("error")
    assert printed["phase"] == "done" and printed["timed_out"] is False
    for phase in ("banded", "causal"):
        assert len(printed[phase]["losses"]) == 2 and len(printed[phase]["step_s"]) == 2
        assert printed[phase]["memory_analysis"]["device_gib"] > 0
    assert printed["derived_32_layers"]["derived"] is True
    assert printed["derived_32_layers"]["tokens_per_s"] > 0


def test_deadline_prints_what_it_has_and_ends_the_process():
    code = ("import time; from benchmarks.context import Deadline; "
            "r = {'phase': 'banded: steps', 'banded': {'step_s': [1.5]}}; "
            "Deadline(0.5, r); time.sleep(30)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=25)
    assert p.returncode == 3
    printed = json.loads(p.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert printed["timed_out"] is True and printed["phase"] == "banded: steps"
    assert printed["banded"]["step_s"] == [1.5]


def test_attention_flops_causal_and_banded():
    assert X.attention_tflop(8192, 1, window=8192) == pytest.approx(
        2 * X.attention_tflop(8192, 1))
    assert X.attention_tflop(1 << 20, 2, window=4096) < X.attention_tflop(1 << 20, 2) / 100


# -- Unsloth's longest context (the card runs it; its search and rows are checked here) ---------


@pytest.mark.parametrize("answer", [8192, 100_000, 342_733, 1_000_000])
def test_bracket_search_ends_within_its_tolerance_around_the_answer(answer):
    asked = []

    def fits(seq):
        asked.append(seq)
        return seq <= answer

    lo, hi = X.bracket_search(fits, X.UNSLOTH_CLAIM, 8192, tries=12)
    assert lo <= answer < hi and hi - lo <= max(8192, 0.05 * lo)
    assert all(s % 8192 == 0 for s in asked) and len(set(asked)) == len(asked)


def test_bracket_search_stops_when_no_time_is_left_and_keeps_what_it_has():
    answers = iter([True, False, None])
    assert X.bracket_search(lambda s: next(answers), 344_064, 8192) == (344_064, 516_096)
    assert X.bracket_search(lambda s: None, 344_064, 8192) == (None, None)


def test_unsloth_addback_is_the_other_layers_nf4_weights_and_factor_state():
    per_layer = X.addback_gib(31)
    assert X.addback_gib(X.LAYERS) == 0
    assert X.addback_gib(2) == pytest.approx(30 * per_layer)
    # Llama-3-8B's 218 M weights a layer at just over half a byte (NF4 and its scales),
    # and 1.3 M float32 factor elements at 16 bytes: 0.125 GiB.
    assert 0.12 < per_layer < 0.13


def test_unsloth_search_holds_the_card_to_the_budget_less_the_addback(tmp_path):
    calls = []

    def attempt(seq, n_layers, cap, steps, timeout, model):
        assert model == X.MODEL
        calls.append((seq, n_layers, cap, steps))
        ok = seq <= 600_000
        return dict(seq=seq, layers=n_layers, memory_gib=cap, fits=ok, try_s=1.0,
                    peak_gib=cap - 1 if ok else cap, step_s=30.0 if ok else float("nan"),
                    tokens_per_s=seq / 30 if ok else float("nan"),
                    error=None if ok else "out of memory")

    found = X.unsloth_search(78, 600, 2, 2, attempt=attempt)
    assert found["cap_gib"] == pytest.approx(78 - X.addback_gib(2), abs=0.01)
    assert {c[2] for c in calls} == {78 - X.addback_gib(2)} and calls[0][0] == 344_064
    assert found["longest"] <= 600_000 < found["shortest_failing"]
    text = X.unsloth_markdown(found)
    assert f"{found['longest']:,} tokens fit" in text and "out of memory" in text
    assert "342,733" in text and "derived from the shapes" in text
    # Out of time before any length failed: the longest that fitted is a lower bound.
    found = X.unsloth_search(78, 600, 2, 2, attempt=lambda *a: dict(
        attempt(*a), fits=True if a[0] < 400_000 else None))
    assert found["longest"] == 344_064 and found["shortest_failing"] is None
    assert "a lower bound" in X.unsloth_markdown(found)


def test_unsloth_try_reads_the_cells_row_and_counts_out_of_memory_as_not_fitting(monkeypatch):
    rows = {100: dict(finite=True, error=None, peak_gib=70.0),
            200: dict(finite=False, error="out of memory", peak_gib=74.0),
            300: dict(finite=False, error="RuntimeError: CUDA error", peak_gib=1.0)}
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        seq = int(cmd[cmd.index("--seq") + 1])
        return subprocess.CompletedProcess(cmd, 0, "noise\nRESULT " + json.dumps(rows[seq]), "")

    monkeypatch.setattr(X.subprocess, "run", run)
    assert X.unsloth_try(100, 2, 74.27, 2, 60)["fits"] is True
    row = X.unsloth_try(200, 2, 74.27, 2, 60)
    assert row["fits"] is False and row["error"] == "out of memory" and row["seq"] == 200
    # A failure other than out of memory, or no row in the time, says nothing of the length.
    assert X.unsloth_try(300, 2, 74.27, 2, 60)["fits"] is None

    def late(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output="loading")

    monkeypatch.setattr(X.subprocess, "run", late)
    row = X.unsloth_try(400, 2, 74.27, 2, 60)
    assert row["fits"] is None and row["error"] == "timed out" and row["peak_gib"] is None
    assert seen[0][2:5] == ["benchmarks._torch_anchors", "unsloth", "llama-3-8b"]
    assert seen[0][seen[0].index("--memory-gib") + 1] == "74.27"
    assert seen[0][seen[0].index("--quant") + 1] == "nf4"


# -- lorax beside Unsloth on one card size ---------------------------------------------------------


def fake_card(lorax_longest: int, unsloth_longest: int, calls: list):
    """Tries on a pretend card: a stack's length fits up to its longest, else out of memory."""
    def make(stack: str, longest: int):
        def attempt(seq, n_layers, cap, steps, timeout, model):
            calls.append((stack, seq, cap, steps, timeout))
            ok = seq <= longest
            return dict(stack=stack, seq=seq, layers=n_layers, memory_gib=cap, fits=ok,
                        try_s=1.0, peak_gib=cap - 1, step_s=3.0, tokens_per_s=seq / 3.0,
                        error=None if ok else "out of memory")
        return attempt
    return {"lorax": make("lorax", lorax_longest), "unsloth": make("unsloth", unsloth_longest)}


def test_versus_tries_the_lengths_that_decide_the_target_on_the_same_cap():
    calls = []
    found = X.versus(78, 600, tries=fake_card(900_000, 400_000, calls))
    cap = 78 - X.addback_gib(2)
    assert [c[:2] for c in calls] == [("lorax", 819_200), ("unsloth", 655_360),
                                      ("unsloth", X.UNSLOTH_CLAIM)]
    assert {c[2] for c in calls} == {cap} and found["cap_gib"] == pytest.approx(cap, abs=0.01)
    assert [c[3] for c in calls] == [2, 1, 1]  # Unsloth's peak is in its first step
    assert all(c[4] <= 150 for c in calls)  # no one try takes the others' time
    assert 819_200 / 655_360 == X.TARGET
    text = X.versus_markdown(found)
    assert "lorax: 819,200 tokens fit" in text and "655,360 tokens do not fit" in text
    assert "at least 1.25x Unsloth's" in text and "published 342,733 tokens: fits" in text
    assert "banded to 4,096" in text and "derived from the shapes" in text


def test_versus_steps_lorax_down_once_and_says_when_unsloth_fits_too():
    calls = []
    found = X.versus(78, 600, tries=fake_card(700_000, 600_000, calls))
    assert [c[:2] for c in calls][:3] == [("lorax", 819_200), ("lorax", 679_936),
                                          ("unsloth", 540_672)]
    assert found["lorax"] == 679_936 and found["decisive"] == 540_672
    assert "540,672 tokens fit too: these tries do not show" in X.versus_markdown(found)
    # lorax fitting at neither length: Unsloth is tried only at its published figure.
    calls.clear()
    found = X.versus(78, 600, tries=fake_card(100_000, 400_000, calls))
    assert [c[:2] for c in calls] == [("lorax", 819_200), ("lorax", 679_936),
                                      ("unsloth", X.UNSLOTH_CLAIM)]
    assert "no length tried fits (679,936, 819,200)" in X.versus_markdown(found)


def test_versus_ends_when_its_time_is_spent():
    calls = []
    tries = fake_card(900_000, 400_000, calls)
    slow = tries["lorax"]
    tries["lorax"] = lambda *a: (time.sleep(0.3), slow(*a))[1]
    found = X.versus(78, 30.2, tries=tries)  # under 30 s left after lorax's try: no more
    assert [c[0] for c in calls] == ["lorax"] and found["decisive"] == 655_360
    text = X.versus_markdown(found)
    assert "Unsloth at 655,360 tokens: not decided" in text and "not tried in the time" in text


def test_lorax_try_holds_jax_to_the_cap_and_reads_out_of_memory(monkeypatch):
    printed = {
        100: dict(bytes_limit_gib=74.2, banded=dict(step_s=[9.0, 8.0], losses=[12.5, 12.4],
                                                    peak_gib=70.0, tokens_per_s=12.5)),
        200: dict(bytes_limit_gib=74.2, banded={}, error="XlaRuntimeError: RESOURCE_EXHAUSTED: "
                  "Out of memory while trying to allocate 80.1GiB"),
        300: dict(bytes_limit_gib=74.2, banded={}, error="ValueError: something else"),
        400: dict(bytes_limit_gib=74.2, banded=dict(step_s=[9.0], losses=[float("nan")])),
    }
    seen = []

    def run(cmd, **kw):
        seen.append((cmd, kw["env"]))
        seq = int(cmd[cmd.index("--confirm") + 1])
        return subprocess.CompletedProcess(cmd, 0, "RESULT " + json.dumps(printed[seq]), "")

    monkeypatch.setattr(X.subprocess, "run", run)
    monkeypatch.setattr(X, "card_gib", lambda: 140.0)
    row = X.lorax_try(100, 2, 74.27, 2, 120)
    assert row["fits"] is True and row["step_s"] == 8.0 and row["limit_gib"] == 74.2
    cmd, env = seen[0]
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert float(env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(74.27 / 140, abs=1e-4)
    assert cmd[cmd.index("--short") + 1] == "0" and cmd[cmd.index("--layers") + 1] == "2"
    assert X.lorax_try(200, 2, 74.27, 2, 120)["fits"] is False
    assert X.lorax_try(300, 2, 74.27, 2, 120)["fits"] is None
    row = X.lorax_try(400, 2, 74.27, 2, 120)  # a step, not finite: nothing of the length
    assert row["fits"] is None and row["error"] == "loss not finite"

    def late(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output="compiling")

    monkeypatch.setattr(X.subprocess, "run", late)
    row = X.lorax_try(500, 2, 74.27, 2, 120)
    assert row["fits"] is None and row["error"] == "timed out"


@pytest.mark.slow  # one real confirming step in its own process (~15 s)
def test_lorax_try_runs_the_confirming_step_in_a_process_of_its_own():
    row = X.lorax_try(256, 2, 10.0, 2, 300, model="tiny", window=64)
    assert row["fits"] is True, row["error"]
    assert len(row["losses"]) == 2 and row["step_s"] > 0
    assert row["derived_32_layers"]["derived"] is True
