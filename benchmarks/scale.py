"""What fits where: compiled memory of a Llama-3 training step at real shapes, compile only.

`benchmarks._llama`'s Llama (the main job's model at Llama 3 shapes) on abstract parameters
(`jax.ShapeDtypeStruct`: nothing is allocated or run), its jitted Adam step with the
trainable state donated. For each model, method and compute dtype, on one device and with
FSDP over 8 (simulated) devices:

- `args` / `temps` / `peak` (= args + temps + outputs - aliased): XLA's
  `memory_analysis()` of the compiled step, per device; `whole`: the arguments each
  device holds whole (replicated: norms, the step count; on one device, everything);
- FSDP: the bytes each collective moves per step (all-gather, reduce-scatter,
  all-reduce, all-to-all), read from the compiled HLO, the layer body counted once per
  layer (`while` loops' known trip counts).

Methods: `full` (every weight trained), `lora` (dense frozen base), `qlora-nf4` (QLoRA's
recipe: NF4 with double-quantized absmax values) and `qlora-int8` (the frozen weights
quantized: every `(in, out)` kernel and the embedding; norms stay dense), rank 16 on q,
k, v, o, gate, up, down. Dtypes: `f32` (everything float32), `bf16` (the base and
activations bf16, factors and optimizer state float32; full FT in bf16 with bf16 Adam
moments). On one device the job is one 1 x seq window. FSDP over 8 devices shards every
weight (and its codes) along its last axis, each factor along the weight's axis or else
its own largest one (ZeRO-3: no device holds all the factors or moments), and runs
either the same window, each layer's activations split along the sequence (`batch`
1 x seq), or a window per device, split along the batch (`batch` 8 x seq).

Attention is the main job's, queries in chunks of 512 (`llama.QUERY_CHUNK`; what
`Config.attention="auto"` runs off a GPU), so no `(T, T)` score matrix per head is whole.
The same steps run for real on an accelerator in `benchmarks.accelerator`. XLA:CPU has
no bf16 arithmetic: a bf16 step
holds float32 copies of bf16 values that bf16 hardware does not (the dequantized weight
a dot reads; the scan's saved layer inputs, which a bf16 `dynamic-update-slice` turns
into one float32 copy of the whole stack).

    python -m benchmarks.scale [--quick] [--models llama-3.2-1b,llama-3-8b,llama-3-70b]
                               [--methods full,lora,qlora-nf4,qlora-int8] [--out DIR]
                               [--layouts 1,fsdp,fsdp-batch,tp,fsdp-tp] [--name scale]
                               [--target h100|h200] [--axes auto,explicit]

`--layouts tp,fsdp-tp` compiles Megatron's tensor-parallel layout over the 8 devices (q,
k, v, gate, up split along their outputs, o and down along their inputs; activations
whole on every device) and the same with FSDP on the other weight axis over a 2 x 4
(`fsdp`, `tp`) mesh, a window per `fsdp` group.

`--axes explicit` builds the meshes with Explicit axes (sharding in types, `jax.make_mesh`'s
default), the model stating its layout (`llama.Layout`: weights regathered per layer with
`reshard`, row-parallel products given their `out_sharding`); `--axes auto,explicit` runs
each layout under both. One window split along its tokens (`fsdp`) has no such layout.

`--target h100` (or `h200`) compiles the same steps with XLA's GPU compiler for one and
for 8 such cards on one host (`benchmarks._cuda`: deviceless, JAX's CUDA plugin
needed, no GPU), with cuDNN's fused attention: bf16 stays bf16, so these are the figures
a card's compile gives (within 1.2% of an H200's own compile, `docs/gpu.md`). Written as
`<name>_<target>` beside the CPU's table.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""):  # FSDP over 8 simulated CPU devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import lorax  # noqa: E402
from lorax._sharding import factor_specs  # noqa: E402

from . import _common as C  # noqa: E402
from ._cuda import TARGETS as GPUS, gpu_devices  # noqa: E402
from ._llama import LLAMA, MODELS, adam_step, build, config, lora_loss  # noqa: E402

GiB = 2**30


# -- FSDP layouts ----------------------------------------------------------------------------


def _on_axis(d: int, ndim: int) -> P:
    return P(*[("fsdp" if i == d else None) for i in range(ndim)])


def _weight_spec(shape: tuple[int, ...], ways: int) -> P:
    """Shard the last axis that splits evenly (FSDP), or replicate."""
    axes = [d for d in range(len(shape)) if shape[d] % ways == 0] if len(shape) >= 2 else []
    return _on_axis(axes[-1], len(shape)) if axes else P()


def _largest_axis_spec(shape: tuple[int, ...], ways: int) -> P:
    """Shard the largest axis that splits evenly, or replicate."""
    axes = [d for d in range(len(shape)) if shape[d] % ways == 0]
    return _on_axis(max(axes, key=lambda d: shape[d]), len(shape)) if axes else P()


def _place(x: Any, mesh: Mesh) -> Any:
    ways = mesh.size
    if isinstance(x, lorax.LoraWeight):
        spec = _weight_spec(x.shape, ways)
        a_spec, b_spec = factor_specs(spec, x.ndim, x.structure[0], x.axes.m)
        # ZeRO-3: a factor the weight's layout leaves whole is sharded on its own
        # largest axis, so no device holds every layer's factors and moments.
        a_spec, b_spec = (s if any(s) else _largest_axis_spec(f.shape, ways)
                          for s, f in ((a_spec, x.a), (b_spec, x.b)))
        w = _place_dense_or_quantized(x.w, spec, mesh)
        sds = lambda y, s: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
        return lorax.LoraWeight(w, sds(x.a, a_spec), sds(x.b, b_spec), alpha=x.alpha)
    return _place_dense_or_quantized(x, _weight_spec(x.shape, ways), mesh)


def _place_dense_or_quantized(x: Any, spec: P, mesh: Mesh) -> Any:
    if isinstance(x, lorax.QuantizedArray):
        return x.with_sharding(NamedSharding(mesh, spec))
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))


def placed(tree: Any, mesh: Mesh | None) -> Any:
    if mesh is None:
        return tree
    is_leaf = lambda x: isinstance(x, (lorax.LoraWeight, lorax.QuantizedArray))  # noqa: E731
    return jax.tree.map(lambda x: _place(x, mesh), tree, is_leaf=is_leaf)


# -- tensor-parallel layouts (Megatron), optionally with FSDP on the other weight axis -----

COLUMN, ROW = ("q", "k", "v", "gate", "up"), ("o", "down")  # split along `out`, along `in`


def _tp_spec(path: str, mesh: Mesh) -> P:
    """Column-parallel q/k/v/gate/up, row-parallel o/down over `tp`; the other weight axis
    (and the embedding's `dim`) over `fsdp` where the mesh has it; norms replicated."""
    fsdp = "fsdp" if "fsdp" in mesh.axis_names else None
    name = path.split("'")[-2] if "'" in path else path
    if "layers" in path and name in COLUMN:
        return P(None, fsdp, "tp")
    if "layers" in path and name in ROW:
        return P(None, "tp", fsdp)
    return P(None, fsdp) if name == "embed" else P()


def _tp_place(path: Any, x: Any, mesh: Mesh) -> Any:
    spec = _tp_spec(jax.tree_util.keystr(path), mesh)
    if isinstance(x, lorax.LoraWeight):
        a_spec, b_spec = factor_specs(spec, x.ndim, x.structure[0], x.axes.m)
        sds = lambda y, s: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
        return lorax.LoraWeight(_place_dense_or_quantized(x.w, spec, mesh), sds(x.a, a_spec),
                                sds(x.b, b_spec), alpha=x.alpha)
    return _place_dense_or_quantized(x, spec, mesh)


def tp_placed(tree: Any, mesh: Mesh) -> Any:
    is_leaf = lambda x: isinstance(x, (lorax.LoraWeight, lorax.QuantizedArray))  # noqa: E731
    return jax.tree_util.tree_map_with_path(lambda p, x: _tp_place(p, x, mesh), tree,
                                            is_leaf=is_leaf)


# -- the step --------------------------------------------------------------------------------


def compile_step(cfg: Any, method: str, dtype: Any, mesh: Mesh | None, seq: int,
                 per_device: bool = False, layers: str = "scan",
                 platforms: tuple[str, ...] | None = None) -> Any:
    """The jitted Adam step on abstract parameters, compiled. `per_device`: a window per
    device (FSDP's usual batch, split along the batch); else one window, whatever the
    mesh (the single-device job spread over the devices, split along its tokens). A mesh
    with a `tp` axis: Megatron's layout (`tp_placed`), the activations whole along `tp`
    and a window per `fsdp` group. `layers`: one of `LAYER_LOOPS`. `platforms`: lower for
    these (`("cuda",)` for a mesh of compile-only GPUs) instead of the default backend."""
    params, spec = build(cfg, method, dtype, layers)
    tp = mesh is not None and "tp" in mesh.axis_names
    trainable, frozen = lorax.partition(tp_placed(params, mesh) if tp else placed(params, mesh), spec)
    optimizer = optax.adam(1e-4)
    state = jax.eval_shape(optimizer.init, trainable)
    if mesh is not None:  # the moments follow their parameters' layout
        state = optax.tree_utils.tree_map_params(
            optimizer, lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
            state, trainable, transform_non_params=lambda s: jax.ShapeDtypeStruct(
                s.shape, s.dtype, sharding=NamedSharding(mesh, P())))
    n = mesh.size if per_device and mesh is not None else 1
    if tp:
        n = dict(mesh.shape).get("fsdp", 1)
    windows = jax.ShapeDtypeStruct(
        (n, seq + 1), jnp.int32,
        sharding=None if mesh is None else NamedSharding(mesh, P("fsdp" if n > 1 else None)))
    if explicit(mesh):  # the model states its layout (`llama.Layout`), as Explicit axes ask
        cfg = cfg._replace(layout=LLAMA.Layout(batch="fsdp" if n > 1 else None,
                                               tp="tp" if tp else None))
    jitted = jax.jit(adam_step(lora_loss(cfg), optimizer), donate_argnums=(0, 2))
    with _activations_pinned(mesh, per_device) if not explicit(mesh) else jax.set_mesh(mesh):
        traced = jitted.trace(trainable, frozen, state, windows)
        compiled = traced.lower(lowering_platforms=platforms).compile()
    return compiled, _whole_bytes((trainable, frozen, state, windows))


@contextlib.contextmanager
def _activations_pinned(mesh: Mesh | None, per_device: bool):
    """Each layer's activations pinned to the batch axis (a window per device) or to the
    sequence axis (one window: its tokens are what the devices split), as MaxText's
    logical-axis rules pin them, or XLA's propagation may keep them whole per device."""
    block = LLAMA.block
    if mesh is not None:
        if "tp" in mesh.axis_names:  # whole along `tp`, a window per `fsdp` group
            tokens = NamedSharding(mesh, P("fsdp") if "fsdp" in mesh.axis_names else P())
        else:
            tokens = NamedSharding(mesh, P("fsdp") if per_device else P(None, "fsdp"))
        LLAMA.block = lambda cfg, x, layer: jax.lax.with_sharding_constraint(
            block(cfg, jax.lax.with_sharding_constraint(x, tokens), layer), tokens)
    try:
        yield
    finally:
        LLAMA.block = block


def _whole_bytes(tree: Any) -> int:
    """Bytes of the arguments every device holds whole (replicated, or no mesh)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        if sharding is None or sharding.is_fully_replicated:
            total += int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
    return total


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")


def collective_bytes(text: str) -> dict[str, int]:
    times = {name.lstrip("%"): n for name, n in C.hlo_executions(text)[1].items()}
    out = dict.fromkeys(KINDS, 0)
    current = None
    for line in text.splitlines():
        # A tuple of six or more shapes carries `/*index=5*/` comments, whose `=` would
        # end the shape's match before it reaches the collective.
        line = re.sub(r"/\*.*?\*/", "", line)
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            current = head.group(1)
        for kind in KINDS:
            m = re.search(r"= (\(?[^=]*?) %s(-start)?\(" % kind, line)
            if m:
                moved = _started_results(m.group(1)) if m.group(2) else m.group(1)
                n = C.hlo_bytes(re.findall(r"(\w+)\[([\d,]*)\]", moved))
                out[kind] += n * times.get(current, 1)
    return out


def _started_results(shape: str) -> str:
    """The results of an asynchronous collective's `-start` (XLA:GPU's): its shape is
    `((operands...), results...)`, and only the results are what the collective makes."""
    if not shape.startswith("(("):
        return shape
    depth, parts, start = 0, [], 1
    for i, ch in enumerate(shape[1:-1], 1):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(shape[start:i])
            start = i + 1
    parts.append(shape[start:-1])
    return ",".join(parts[1:])


def explicit(mesh: Mesh | None) -> bool:
    """`mesh`'s axes are Explicit (sharding in types; `--axes explicit`)."""
    return mesh is not None and all(t == AxisType.Explicit for t in mesh.axis_types)


def layout_name(mesh: Mesh | None) -> str:
    """`1 device`, `FSDP x8`, `TP x8`, `FSDP 2 x TP 4`; `, Explicit` on such a mesh."""
    if mesh is None or mesh.size == 1:
        return "1 device"
    if len(mesh.shape) == 1:
        ((axis, n),) = mesh.shape.items()
        name = f"{axis.upper()} x{n}"
    else:
        name = " x ".join(f"{axis.upper()} {n}" for axis, n in mesh.shape.items())
    return name + (", Explicit" if explicit(mesh) else "")


def measure(name: str, method: str, dtype_name: str, mesh: Mesh | None,
            per_device: bool = False, target: str | None = None) -> dict:
    """One cell; `target`: `mesh` is of compile-only GPUs of that kind (`layouts`), and
    attention is cuDNN's, but where one window's tokens are split over the devices:
    cuDNN's partitioner refuses a split sequence, so the query-chunked XLA attention."""
    tokens_split = mesh is not None and mesh.size > 1 and not per_device \
        and "tp" not in mesh.axis_names
    cfg = config(name, attention=("chunked" if tokens_split else "cudnn") if target else "auto")
    seq = MODELS[name][-1]
    dtype = jnp.bfloat16 if dtype_name == "bf16" else jnp.float32
    t0 = time.perf_counter()
    compiled, whole = compile_step(cfg, method, dtype, mesh, seq, per_device,
                                   platforms=("cuda",) if target else None)
    m = C.memory_gib(compiled.memory_analysis())
    devices = 1 if mesh is None else mesh.size
    windows = dict(mesh.shape).get("fsdp", 1) if mesh is not None and "tp" in mesh.axis_names \
        else devices if per_device else 1
    row = dict(model=name, method=method, dtype=dtype_name, devices=devices,
               layout=layout_name(mesh), batch=f"{windows}x{seq}",
               args_gib=m["args"], temps_gib=m["temps"], peak_gib=m["peak"],
               whole_gib=whole / GiB, compile_s=time.perf_counter() - t0)
    if mesh is not None and mesh.size > 1:
        for kind, n in collective_bytes(compiled.as_text()).items():
            row[f"{kind}_gib"] = n / GiB
    return row


def markdown(rows: list[dict]) -> str:
    return C.md_table(
        ["model", "method", "dtype", "layout", "batch", "args GiB", "temps GiB", "peak GiB",
         "all-gather GiB", "reduce-scatter GiB", "all-reduce GiB"],
        [[r["model"], r["method"], r["dtype"], r.get("layout") or f"{r['devices']} devices",
          r["batch"], f"{r['args_gib']:.2f}", f"{r['temps_gib']:.2f}", f"{r['peak_gib']:.2f}",
          *(f"{r[f'{k}_gib']:.2f}" if r.get(f"{k}_gib", "") != "" else "" for k in KINDS[:3])]
         for r in rows])


METHODS = {"full": "full", "lora": "LoRA", "qlora-nf4": "nf4", "qlora-int8": "int8"}
CARD_GIB = ((24e9 / GiB, "24 GB"), (80e9 / GiB, "80 GB"))


def plot(rows: list[dict], path: Path) -> None:
    """A panel per model: GiB per device (arguments, temporaries stacked) of each method,
    on one device and under FSDP over 8, bf16 compute; GPU memory sizes drawn."""
    rows = [r for r in rows if str(r.get("batch", "1x")).startswith("1x")]  # the same job
    rows = [r for r in rows if r["dtype"] == "bf16"] or rows
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = C.small_multiples(len(models), len(models), 3.0, sharey=True)
    for ax, model in zip(axes[0], models):
        methods = [m for m in METHODS if any(r["model"] == model and r["method"] == m for r in rows)]
        pos = dict(zip(methods, C.group_ticks(ax, [("", [METHODS[m]]) for m in methods if "q" not in m]
                                              + [("QLoRA", [METHODS[m] for m in methods if "q" in m])])))
        for i, devices in enumerate((1, 8)):
            got = {r["method"]: r for r in rows if r["model"] == model and r["devices"] == devices}
            xs = [pos[m] + (i - 0.5) * 0.38 for m in methods if m in got]
            args = [got[m]["args_gib"] for m in methods if m in got]
            temps = [got[m]["temps_gib"] for m in methods if m in got]
            color, where = ("C0", "1 device") if devices == 1 else ("C1", "FSDP x8, per device")
            ax.bar(xs, args, 0.36, color=color, label=f"arguments, {where}")
            ax.bar(xs, temps, 0.36, bottom=args, color=color, alpha=0.45, label=f"temporaries, {where}")
            for m in (m for m in methods if m not in got):  # 70B full FT on one device: not run
                ax.annotate("not run", xy=(pos[m] + (i - 0.5) * 0.38, 0), xycoords=("data", "axes fraction"),
                            xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                            rotation=90, fontsize=9, color="0.4")
        ax.set_title(model)
    for ax in axes[0]:
        for gib, label in CARD_GIB:
            C.target_line(ax, gib, label, color="0.3", style=":",
                          place="right" if ax is axes[0][-1] else "")
    axes[0][0].set_yscale("log")
    axes[0][0].set_ylim(bottom=0.5 * min(r["args_gib"] for r in rows))  # the smallest bar shows
    C.ratio_axis(axes, ticks=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000))
    C.finish(fig, axes, path, "GiB per device (bf16)", ncol=2, legend_rows=2)


LAYOUTS = ("1", "fsdp", "fsdp-batch", "tp", "fsdp-tp")


def layouts(names: str, target: str | None = None,
            axes: str = "auto") -> list[tuple[Mesh | None, bool]]:
    """(mesh, a window per device) for each named layout (`LAYOUTS`); the multi-device
    ones need 8 devices and are left out with fewer. `target`: over 8 compile-only GPUs
    of that kind (one device: a mesh of the first). `axes="explicit"`: the meshes' axes
    Explicit, the model stating its layout; one window split along its tokens (`fsdp`)
    has no such layout in the examples' Llama and is refused."""
    if axes == "explicit" and "fsdp" in names.split(","):
        raise ValueError("--axes explicit: layout 'fsdp' (one window split along its tokens) "
                         "has no Explicit-axes layout in the examples' Llama; use fsdp-batch, "
                         "tp or fsdp-tp")
    kind = (AxisType.Explicit if axes == "explicit" else AxisType.Auto,)
    if target:
        devices = gpu_devices(target, count=8)
        one = Mesh(np.array(devices[:1]), ("fsdp",))
    else:
        devices, one = jax.devices()[:8], None
    meshes = {} if len(devices) < 8 else {
        "fsdp": (Mesh(np.array(devices), ("fsdp",), axis_types=kind), False),
        "fsdp-batch": (Mesh(np.array(devices), ("fsdp",), axis_types=kind), True),
        "tp": (Mesh(np.array(devices), ("tp",), axis_types=kind), False),
        "fsdp-tp": (Mesh(np.array(devices).reshape(2, 4), ("fsdp", "tp"),
                         axis_types=kind * 2), False)}
    if not meshes:
        print("[scale] fewer than 8 devices: single-device cells only", flush=True)
    return [(one, False) if n == "1" else meshes[n] for n in names.split(",")
            if n == "1" or n in meshes]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = C.parser(__doc__, rounds=False, plot=True)
    parser.add_argument("--models", default="llama-3.2-1b,llama-3-8b,llama-3-70b")
    parser.add_argument("--methods", default="full,lora,qlora-nf4,qlora-int8")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--layouts", default="1,fsdp,fsdp-batch",
                        help=f"comma-separated subset of {','.join(LAYOUTS)}")
    parser.add_argument("--name", default="scale", help="the results' file name")
    parser.add_argument("--target", default=None, choices=("h100", "h200"),
                        help="compile for this GPU, deviceless (one and 8 of them)")
    parser.add_argument("--axes", default="auto",
                        help="the meshes' axis types, auto and/or explicit (sharding in "
                             "types), comma-separated: each layout under each")
    args = parser.parse_args(argv)
    out = C.out_dir(args.out)
    if args.target:
        args.name = f"{args.name}_{args.target}"
    draw = plot if args.name == "scale" else None  # the plot reads the default layouts
    if args.plot_only:
        C.replot(out, args.name, plot)
        return C.read_csv(out / f"{args.name}.csv")
    models = ["tiny"] if args.quick else args.models.split(",")
    rows = []
    for name in models:
        for method in args.methods.split(","):
            for dtype_name in args.dtypes.split(","):
                for m, per_device in (cell for axes in args.axes.split(",")
                                      for cell in layouts(args.layouts, args.target, axes)):
                    if name == "llama-3-70b" and method == "full" and layout_name(m) == "1 device":
                        continue  # 70B full FT on one device: ~1.1 TiB, nothing to learn
                    row = measure(name, method, dtype_name, m, per_device, args.target)
                    rows.append(row)
                    print(f"[scale] {name} {method} {dtype_name} {row['layout']} "
                          f"{row['batch']}: "
                          f"args {row['args_gib']:.2f} + temps {row['temps_gib']:.2f} GiB "
                          f"({row['compile_s']:.0f} s)", flush=True)
    md = [markdown(rows)]
    if args.target:
        counts = sorted({r["devices"] for r in rows})
        how_many = " and for ".join("one" if n == 1 else str(n) for n in counts)
        md.append(f"Compiled for {how_many} {GPUS[args.target]['description']} (on one host) "
                  f"by jax {jax.__version__}'s CUDA plugin, deviceless: XLA's plan for the "
                  "card, not a run.")
    C.write_results(out, args.name, rows, md, plot=draw)
    return rows


if __name__ == "__main__":
    main()
