"""FSDP LoRA fine-tuning of a small transformer on 8 simulated CPU devices.

    python examples/fsdp.py [--devices 8] [--layers 2] [--dim 128] [--rank 8] [--steps 20]

On several processes (hosts), each starts the same command with its own id; the mesh
spans every process's devices and each process feeds its own slice of the batch:

    python examples/fsdp.py --processes 2 --process-id 0 --coordinator 127.0.0.1:PORT &
    python examples/fsdp.py --processes 2 --process-id 1 --coordinator 127.0.0.1:PORT

Every weight matrix is sharded along its first axis over all devices (FSDP), the
batch along the same mesh axis. `lorax.init_lora` derives the factors' shardings
from the weights' (`b` sharded like `W`'s rows, `a` replicated, both tiny), the
jitted step states its in/out shardings, and each device holds 1/n of every `W`.
The frozen weights are all-gathered for the forward pass exactly as without
LoRA; the only extra communication is on rank-k factors and activations.
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count"


def _flag(argv: list[str], name: str, default: int) -> int:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith(name + "="):
            return int(arg.split("=", 1)[1])
    return default


def _simulate_devices(argv: list[str]) -> None:
    # XLA reads the device count once, when JAX initialises its backend: set it
    # before jax is imported (and keep a count someone already chose). Each process
    # has its share of the mesh's devices.
    n = _flag(argv, "--devices", 8) // _flag(argv, "--processes", 1)
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}={n}".strip()


if __name__ == "__main__":
    _simulate_devices(sys.argv[1:])
    # `examples.checkpointing` (the checkpoint recipe) from the repository root.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import lorax  # noqa: E402

HEADS = 4


def block(p: dict, x: jax.Array) -> jax.Array:
    """One pre-norm transformer block in plain jnp, written with no LoRA in mind."""
    b, t, d = x.shape

    def norm(v):
        return v * jax.lax.rsqrt(jnp.mean(v**2, axis=-1, keepdims=True) + 1e-6)

    h = norm(x)
    q, k, v = (jnp.einsum("btd,de->bte", h, p[n]).reshape(b, t, HEADS, -1) for n in "qkv")
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
    causal = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ p["o"]
    return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]


def model(params: list[dict], x: jax.Array) -> jax.Array:
    for p in params:
        x = block(p, x)
    return x


def loss_fn(params: list[dict], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(params, x) - y) ** 2)


def nbytes_per_device(arrays) -> int:
    return sum(a.addressable_shards[0].data.nbytes for a in arrays)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--qtype", default=None,
                        help="quantize the frozen base (QLoRA), e.g. int8 or nf4")
    parser.add_argument("--out", default=None,
                        help="write the adapter here (adapter.safetensors and peft/)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resumable: checkpoints here (orbax), resumed when present")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default=None, help="host:port of process 0")
    args = parser.parse_args(argv)
    if args.coordinator:
        start_processes(args)
    if jax.device_count() < args.devices:
        raise SystemExit(f"need {args.devices} devices, JAX sees {jax.device_count()}; set "
                         f"XLA_FLAGS={_FLAG}={args.devices} before JAX starts")

    mesh = Mesh(np.array(jax.devices()[: args.devices]), ("fsdp",))
    # FSDP: each device holds 1/n of every weight: of its rows, or of its columns for a
    # quantized base, whose blocks run down the rows (input axis) and must stay whole.
    rows = NamedSharding(mesh, P(None, "fsdp") if args.qtype else P("fsdp", None))
    batch = NamedSharding(mesh, P("fsdp"))

    # The base model, created on the host and placed shard by shard.
    d, f = args.dim, 4 * args.dim
    rng = np.random.default_rng(0)

    def weight(shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    shapes = dict(q=(d, d), k=(d, d), v=(d, d), o=(d, d), up=(d, f), down=(f, d))
    host = [{n: weight(s) for n, s in shapes.items()} for _ in range(args.layers)]
    params = jax.tree.map(lambda w: place(w, rows), host)

    # A task the base model does not solve: match a teacher whose weights differ
    # by a low-rank change, on random inputs.
    teacher = [{n: w + 0.5 * weight((w.shape[0], 2)) @ weight((2, w.shape[1]))
                for n, w in p.items()} for p in host]
    x = rng.standard_normal((args.batch, args.seq, d)).astype(np.float32)
    y = np.asarray(jax.jit(model)(teacher, x))
    x, y = (local_batch(v, batch, args) for v in (x, y))

    spec = lorax.simple_spec(params, decision_fn=lambda path, w: args.rank)
    if args.qtype:  # QLoRA: codes and scales sharded like W; the step gathers codes, not floats
        params = lorax.quantize(params, spec, args.qtype, min_size=0)
    lora_params = lorax.init_lora(params, spec, jax.random.PRNGKey(1))
    trainable, frozen = lorax.partition(lora_params, spec)
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(trainable)
    lora_loss = lorax.lora(loss_fn, on_materialize="error")

    def step(trainable, frozen, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda t: lora_loss(lorax.combine(t, frozen), x, y))(trainable)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return loss, optax.apply_updates(trainable, updates), opt_state

    def shardings(tree):
        # Adam's step count is a scalar made on one device: replicate it.
        return jax.tree.map(lambda a: a.sharding if a.ndim else NamedSharding(mesh, P()), tree)

    t_sh, o_sh = shardings(trainable), shardings(opt_state)
    opt_state = jax.device_put(opt_state, o_sh)  # as the step takes it (and a restore gives it)
    compiled = jax.jit(
        step,
        in_shardings=(t_sh, shardings(frozen), o_sh, batch, batch),
        out_shardings=(NamedSharding(mesh, P()), t_sh, o_sh),
        donate_argnums=(0, 2),
    ).lower(trainable, frozen, opt_state, x, y).compile()

    ws = [lw.w.codes if args.qtype else lw.w for layer in lora_params for lw in layer.values()]
    factors = [m for layer in lora_params for lw in layer.values() for m in (lw.a, lw.b)]
    w_dev, w_all = nbytes_per_device(ws), sum(w.nbytes for w in ws)
    f_dev, f_all = nbytes_per_device(factors), sum(m.nbytes for m in factors)
    print(f"mesh: {args.devices} devices, axis 'fsdp'; W sharded {rows.spec}, "
          f"b like W's rows, a replicated")
    print(f"per-device W bytes: {w_dev} of {w_all} (1/{w_all // w_dev})")
    print(f"per-device factor bytes: {f_dev} of {f_all}")
    mem = compiled.memory_analysis()
    if mem is not None:
        print(f"compiled memory per device: arguments {mem.argument_size_in_bytes}, "
              f"outputs {mem.output_size_in_bytes}, temporaries {mem.temp_size_in_bytes}, "
              f"aliased {mem.alias_size_in_bytes}")

    trainable, opt_state, losses = train(args, compiled, trainable, frozen, opt_state, x, y)
    print(f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    if args.out:  # every process calls these (shards are gathered); process 0 writes
        tuned = lorax.combine(trainable, frozen)
        os.makedirs(args.out, exist_ok=True)
        lorax.save_adapter(os.path.join(args.out, "adapter.safetensors"), tuned, spec)
        lorax.save_peft(os.path.join(args.out, "peft"), tuned, layout="in_out",
                        module_name=lambda path, layer: path.replace("/", "."),
                        base_model_name_or_path="lorax-examples/fsdp")
        print(f"adapter written to {args.out} by process {jax.process_index()}")
    return dict(losses=losses, w_bytes_per_device=w_dev, w_bytes=w_all,
                factor_bytes_per_device=f_dev, factor_bytes=f_all)


def train(args, compiled, trainable, frozen, opt_state, x, y):
    """The loop; with --checkpoint-dir, resumable (examples/checkpointing.py's recipe:
    every process writes and reads its own shards)."""
    state = {"trainable": trainable, "opt_state": opt_state,
             "losses": np.zeros(args.steps, np.float32)}
    manager, start = None, 0
    if args.checkpoint_dir:
        from examples import checkpointing

        manager = checkpointing.open_manager(args.checkpoint_dir, args.checkpoint_every, keep=2)
        state = checkpointing.restore(manager, state)
        start = manager.latest_step() or 0
        if start:
            print(f"resumed from step {start}")
    trainable, opt_state = state["trainable"], state["opt_state"]
    losses = [float(v) for v in np.asarray(state["losses"])[:start]]
    for i in range(start, args.steps):
        loss, trainable, opt_state = compiled(trainable, frozen, opt_state, x, y)
        losses.append(float(loss))
        print(f"step {i:3d} loss {losses[-1]:.6f}", flush=True)
        if manager is not None:
            state = {"trainable": trainable, "opt_state": opt_state,
                     "losses": np.array(losses + [0.0] * (args.steps - i - 1), np.float32)}
            checkpointing.save(manager, i + 1, state, force=i + 1 == args.steps)
    if manager is not None:
        manager.wait_until_finished()
        manager.close()
    return trainable, opt_state, losses


def start_processes(args: argparse.Namespace) -> None:
    """Join the other processes: CPU collectives through gloo, one global mesh."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.processes, process_id=args.process_id)


def place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds whole, as a global array: each process
    puts only its own devices' shards."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def local_batch(host: np.ndarray, sharding: NamedSharding, args: argparse.Namespace) -> jax.Array:
    """The global batch, each process feeding its own slice of the rows (here cut from
    one host batch, as each process would read its own shard of the data)."""
    rows = host.shape[0] // args.processes
    mine = host[args.process_id * rows:(args.process_id + 1) * rows]
    return jax.make_array_from_process_local_data(sharding, mine)


if __name__ == "__main__":
    main()
