"""Training that survives a kill: orbax checkpoints of the trainable state, resumed bit for bit.

    python examples/checkpointing.py --dir runs/mlp [--steps 30] [--every 5] [--keep 2]

Kill it at any point, during a save too, and run the same command again: it resumes
from the newest complete checkpoint and ends with the same adapter, byte for byte, as a
run that never stopped (CPU runs are deterministic).

A checkpoint holds what training changes and nothing else: the factors (the trainable
half of `lorax.partition`), the optimizer state, the step, the RNG key and the data
position. The frozen base is never written; it comes back from where it came from (a
seed here, the model file in a real job). orbax-checkpoint does the rest, as in any JAX
training loop: saves run in the background and are atomic (written to a temporary
directory, renamed when complete, so a kill mid-save leaves the previous checkpoint the
newest), sharded arrays are written by the processes that hold them, and only the
newest `--keep` are kept. `open_manager`, `save` and `restore` below are the recipe;
the Shakespeare job (`--checkpoint-dir`) uses them as they are.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp

import lorax


def open_manager(directory: str | pathlib.Path, every: int, keep: int) -> ocp.CheckpointManager:
    """Checkpoints every `every` steps under `directory`, the newest `keep` kept."""
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep)
    return ocp.CheckpointManager(pathlib.Path(directory).absolute(), options=options)


def save(manager: ocp.CheckpointManager, step: int, state: Any, force: bool = False) -> bool:
    """Save `state` (trainable arrays only) as step `step`, if the interval says so."""
    return manager.save(step, args=ocp.args.StandardSave(state), force=force)


def restore(manager: ocp.CheckpointManager, state: Any) -> Any:
    """The newest complete checkpoint, with `state`'s shapes, dtypes and shardings (each
    process reads its own shards), or `state` itself when there is none."""
    step = manager.latest_step()
    if step is None:
        return state
    like = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    return manager.restore(step, args=ocp.args.StandardRestore(like))


def model(params: list, x: jax.Array) -> jax.Array:
    for w in params[:-1]:
        x = jax.nn.relu(x @ w)
    return x @ params[-1]


def batch_at(position: int, batch: int, dim: int) -> tuple[jax.Array, jax.Array]:
    """The data stream: batch number `position`, the same on every run."""
    x = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(7), position), (batch, dim))
    return x, jnp.sin(x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoints and the final adapter go here")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--keep", type=int, default=2, help="keep the newest N checkpoints")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rank", type=int, default=4)
    args = p.parse_args(argv)

    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    base = [jax.random.normal(k, (args.dim, args.dim)) / args.dim**0.5 for k in keys]
    spec = lorax.simple_spec(base, decision_fn=lambda path, w: args.rank)
    trainable, frozen = lorax.partition(lorax.init_lora(base, spec, jax.random.PRNGKey(1)), spec)
    optimizer = optax.adam(1e-2)
    lora_model = lorax.lora(model, on_materialize="error")

    @jax.jit
    def train_step(state, frozen, x, y):
        rng, drop_key = jax.random.split(jax.random.wrap_key_data(state["rng"]))

        def loss(t):  # LoRA dropout: the RNG key is part of what must resume exactly
            p = lorax.dropout(lorax.combine(t, frozen), drop_key, 0.1)
            return jnp.mean((lora_model(p, x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(state["trainable"])
        updates, opt_state = optimizer.update(grads, state["opt_state"])
        return {"trainable": optax.apply_updates(state["trainable"], updates),
                "opt_state": opt_state, "step": state["step"] + 1,
                "rng": jax.random.key_data(rng), "position": state["position"] + 1}, value

    state = {"trainable": trainable, "opt_state": optimizer.init(trainable),
             "step": jnp.int32(0), "rng": jax.random.key_data(jax.random.PRNGKey(2)),
             "position": jnp.int32(0)}
    manager = open_manager(args.dir, args.every, args.keep)
    state = restore(manager, state)
    start = int(state["step"])
    print(f"starting at step {start}" + (" (resumed)" if start else ""), flush=True)
    for step in range(start, args.steps):
        x, y = batch_at(int(state["position"]), 32, args.dim)
        state, loss = train_step(state, frozen, x, y)
        print(f"step {step:4d}  loss {float(loss):.5f}", flush=True)
        save(manager, step + 1, state, force=step + 1 == args.steps)
    manager.wait_until_finished()
    manager.close()
    adapter = pathlib.Path(args.dir) / "adapter.safetensors"
    lorax.save_adapter(adapter, lorax.combine(state["trainable"], frozen), spec)
    print(f"adapter: {adapter}", flush=True)
    return {"adapter": adapter, "start": start, "loss": float(loss) if args.steps > start else None}


if __name__ == "__main__":
    main()
