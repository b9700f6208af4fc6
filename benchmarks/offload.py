"""Host offload at Llama shapes, compile-only: where a QLoRA step keeps its frozen codes and
where it moves them, read from the step exported for `cuda` (no GPU needed).

The step is `benchmarks._llama`'s (QLoRA nf4 with double quantization, bf16, per-layer
remat, one 2048-token window), its frozen weights placed in host memory by
`lorax.offload_frozen`. From the exported module: the step's arguments in host and in
device memory; every move to the device (`annotate_device_placement`), inside a loop body
or not, and its bytes (a layer's codes moved inside the layer loop is streaming; a move
outside any loop, or one as large as a stack, is the whole stack crossing at once); and
how many times a step moves every layer's codes (once forward, once backward, whose
per-layer recomputation reads the same moves).

    python -m benchmarks.offload [--models llama-3-8b,llama-3-70b] [--out DIR] [--quick]
    python -m benchmarks.offload --check    # host codes against on-device codes: the values

`--check` runs the tiny QLoRA step both ways on the default device and compares the loss,
gradients and updated factors (a card's run checks XLA's GPU flags with it: `scripts/card`).
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax._src.interpreters import mlir as jmlir
from jax._src.lib.mlir import ir

import lorax
from lorax import _engine

from . import _common as C
from . import _llama as L

GiB = 2**30
# `--check`: float32 values of the same arithmetic. Kernels a GPU compiler picks per
# program (autotuning) round differently, far below this; codes of the wrong layer, or
# half copied, change values at order one.
CHECK_TOLERANCE = 1e-3


# -- reading an exported module -------------------------------------------------------------


class Move(NamedTuple):
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    to: str  # "device" or a host memory kind
    in_loop: bool  # inside a `while` body, in the function itself or in one it is called from


class Argument(NamedTuple):
    name: str
    nbytes: int
    memory_kind: str


_BYTES = {"i1": 1, "ui8": 1, "i8": 1, "ui16": 2, "i16": 2, "bf16": 2, "f16": 2, "ui32": 4,
          "i32": 4, "f32": 4, "ui64": 8, "i64": 8, "f64": 8}


def _tensor(t: Any) -> tuple[tuple[int, ...], str, int]:
    rt = ir.RankedTensorType(t)
    dtype = str(rt.element_type)
    shape = tuple(rt.shape)
    return shape, dtype, math.prod(shape) * _BYTES.get(dtype, 4)


def _walk(op: Any, in_loop: bool = False) -> Any:
    """Every operation nested in `op`, with whether a `while` encloses it (within `op`)."""
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                yield child, in_loop
                yield from _walk(child.operation, in_loop or child.operation.name == "stablehlo.while")


def placements(module_text: str) -> tuple[list[Argument], list[Move]]:
    """The entry function's arguments (bytes, memory kind) and every placement op of an
    exported StableHLO module, each with whether it runs inside a loop body."""
    module = ir.Module.parse(module_text, context=jmlir.make_ir_context())
    funcs = {ir.StringAttr(f.attributes["sym_name"]).value: f for f in module.body.operations
             if f.operation.name == "func.func"}
    found: dict[str, list] = {name: [] for name in funcs}
    for name, f in funcs.items():
        for op, in_loop in _walk(f.operation):
            kind = op.operation.name
            if kind == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                found[name].append(("call", callee, in_loop))
            elif kind == "stablehlo.custom_call" and "annotate_device_placement" in str(
                    op.attributes["call_target_name"]):
                to = str(op.attributes["mhlo.frontend_attributes"]).split('"')[1]
                found[name].append(("move", (*_tensor(op.operands[0].type), to), in_loop))
    main = "main" if "main" in funcs else next(iter(funcs))
    contexts: dict[str, set] = {main: {False}}
    todo = [main]
    while todo:  # which functions run inside a loop (a function may run in both)
        name = todo.pop()
        for what, callee, local in found[name]:
            if what != "call":
                continue
            new = {c or local for c in contexts[name]} - contexts.setdefault(callee, set())
            if new:
                contexts[callee] |= new
                todo.append(callee)
    moves = [Move(*info, in_loop=c or local) for name, ctxs in contexts.items() for c in ctxs
             for what, info, local in found[name] if what == "move"]
    return _arguments(funcs[main]), moves


def _arguments(main: Any) -> list[Argument]:
    attrs = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
    types = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value).inputs
    out = []
    for i, t in enumerate(types):
        entry = ir.DictAttr(attrs[i]) if attrs is not None else None
        kind = (ir.StringAttr(entry["mhlo.memory_kind"]).value
                if entry is not None and "mhlo.memory_kind" in entry else "device")
        out.append(Argument(f"arg{i}", _tensor(t)[2], kind))
    return out


# -- the step at model shapes ---------------------------------------------------------------


def exported_step(model: str, method: str = "qlora-nf4", offload: bool = True,
                  remat: str = "layer") -> Any:
    """`_llama.abstract_step`'s step exported for `cuda`."""
    step, args = L.abstract_step(model, method, offload, remat)
    return export_for_cuda(step, *args)


def export_for_cuda(fn: Any, *args: Any) -> Any:
    """`jax.export` of `jax.jit(fn)` for `cuda` (no GPU needed), host-placed arguments
    (concrete or abstract) typed and laid out in host memory."""
    return jax.export.export(jax.jit(fn, in_shardings=jax.tree.map(L.sharding, args)),
                             platforms=["cuda"])(*jax.tree.map(L.typed, args))


def measure(model: str, offload: bool) -> dict[str, Any]:
    # Every rule traced anew, so each product's moves are ops of their own in the module
    # (a cached body is one function called from several places): counted per call.
    with _engine.trace_uncached():
        text = exported_step(model, offload=offload).mlir_module()
    args, moves = placements(text)
    host = sum(a.nbytes for a in args if a.memory_kind != "device")
    looped = [m for m in moves if m.to == "device" and m.in_loop]
    outside = [m for m in moves if m.to == "device" and not m.in_loop]
    # Moves of one layer's slice of a stack run once per layer; "passes": how many times
    # a step moves all of the layers' frozen bytes.
    cfg = L.config(model, "xla", "layer")
    frozen = lorax.offload_frozen(lorax.partition(*L.build(cfg, "qlora-nf4", jnp.bfloat16))[1])
    stacks = [x for x in jax.tree.leaves(frozen["layers"]) if L.in_host(x)]  # (not the norms)
    slices = {tuple(x.shape[1:]) for x in stacks}
    per_layer = sum(m.nbytes for m in looped if m.shape in slices)
    stack_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in stacks)
    return dict(model=model, placement="host" if offload else "device",
                host_args_gib=host / GiB,
                device_args_gib=sum(a.nbytes for a in args if a.memory_kind == "device") / GiB,
                moves_in_loops=len(looped),
                largest_loop_move_mib=max((m.nbytes for m in looped), default=0) / 2**20,
                moves_outside_loops=len(outside),
                bytes_outside_loops_gib=sum(m.nbytes for m in outside) / GiB,
                layer_passes=cfg.n_layers * per_layer / stack_bytes if offload else 0.0)


# -- the values: host codes against the device's ----------------------------------------------


def llama_step_values(cfg: Any, method: str, offload: bool, state_on_host: bool = False) -> tuple:
    """(loss, factor gradients, updated factors) of one Adam step of the example Llama
    `cfg` in float32 (random values made the same way for either placement), its frozen
    weights in host memory if `offload`, Adam's state if `state_on_host`."""
    abstract, spec = L.build(cfg, method, jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
    values = [jax.random.randint(k, s.shape, 0, 255).astype(s.dtype)
              if jnp.issubdtype(s.dtype, jnp.integer)
              else 0.02 * jax.random.normal(k, s.shape, s.dtype) + (0.01 if s.ndim < 2 else 0)
              for k, s in zip(keys, leaves)]
    trainable, frozen = lorax.partition(jax.tree_util.tree_unflatten(treedef, values), spec)
    if offload:
        frozen = lorax.offload_frozen(frozen)
    windows = jax.random.randint(jax.random.PRNGKey(1), (2, 33), 0, cfg.vocab)
    apply = lorax.lora(lambda p, w: L.LLAMA.loss(cfg, p, w), on_materialize="error")
    opt = lorax.offload_state(optax.adam(1e-3)) if state_on_host else optax.adam(1e-3)

    @jax.jit
    def step(t: Any, f: Any, state: Any) -> tuple:
        value, g = jax.value_and_grad(lambda t: apply(lorax.combine(t, f), windows))(t)
        updates, state = opt.update(g, state, t)
        return value, g, optax.apply_updates(t, updates)

    return step(trainable, frozen, opt.init(trainable))


def check_values(remat: str = "layer") -> dict[str, Any]:
    """The tiny example Llama's QLoRA step (nf4, double quantization) with its codes in
    host memory, and with Adam's state there too, against the same step all on the
    device, on the default device: the largest difference of the loss, the gradients and
    the updated factors, relative to the largest value of each (0.0: bit for bit)."""
    cfg = L.LLAMA.Config(2, 128, 256, 4, 2, 5e5, 1e-5, 512, attention="xla", remat=remat)
    device = jax.tree_util.tree_leaves(llama_step_values(cfg, "qlora-nf4", offload=False))
    out = dict(device=str(jax.devices()[0].device_kind), remat=remat)
    for name, state_on_host in (("codes", False), ("codes_and_state", True)):
        host = jax.tree_util.tree_leaves(
            llama_step_values(cfg, "qlora-nf4", offload=True, state_on_host=state_on_host))
        rel = max(float(jnp.max(jnp.abs(h - d)) / jnp.maximum(jnp.max(jnp.abs(d)), 1e-30))
                  for h, d in zip(host, device))
        out[f"{name}_relative_difference"] = rel
        out[f"{name}_finite"] = all(bool(jnp.all(jnp.isfinite(x))) for x in host)
    out["max_relative_difference"] = max(out["codes_relative_difference"],
                                         out["codes_and_state_relative_difference"])
    out["finite"] = out["codes_finite"] and out["codes_and_state_finite"]
    out["bit_for_bit"] = out["max_relative_difference"] == 0.0
    return out


COLUMNS = [("model", "model"), ("placement", "frozen codes"), ("host_args_gib", "host GiB"),
           ("device_args_gib", "device args GiB"), ("moves_in_loops", "moves in loop bodies"),
           ("largest_loop_move_mib", "largest move in a loop, MiB"),
           ("moves_outside_loops", "moves outside loops"),
           ("bytes_outside_loops_gib", "GiB moved outside loops"),
           ("layer_passes", "moves of every layer's codes a step")]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = C.parser(__doc__, rounds=False)
    parser.add_argument("--models", default="llama-3-8b,llama-3-70b")
    parser.add_argument("--check", action="store_true",
                        help="run the tiny step both ways on this device and compare its values")
    args = C.parse(parser, argv)
    if args.check:
        result = check_values()
        print("CHECK " + json.dumps(result), flush=True)
        if not (result["finite"] and result["max_relative_difference"] <= CHECK_TOLERANCE):
            raise SystemExit("host-resident codes changed the step's values")
        return [result]
    models = ["tiny"] if args.quick else args.models.split(",")
    rows = [measure(m, offload) for m in models for offload in (False, True)]
    C.write_table(args.out, "offload", rows, C.column_table(rows, COLUMNS) + "\n")
    return rows


if __name__ == "__main__":
    main()
