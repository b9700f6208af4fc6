"""Many adapters over one base (lorax/_stack.py): stacks, mixed-adapter batches, and
adapters trained side by side.

Every mixed-batch output is checked against the same example run alone with its
adapter (or the base model for id -1); side-by-side training against N separate
trainings, step for step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lorax
from conftest import assert_close
from lora_testing import tiny_llama as make_tiny_llama


def _is_lora(x):
    return isinstance(x, lorax.LoraWeight)


def _nudged(lp, seed):
    """Non-zero b (init_lora's is zero), as after training."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 64))
    return jax.tree.map(lambda w: lorax.LoraWeight(w.w, w.a, 0.2 * jax.random.normal(next(keys), w.b.shape),
                                                   w.alpha) if _is_lora(w) else w, lp, is_leaf=_is_lora)


# -- the main job's Llama (llama.py: scanned layers, tied embedding) ---------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from examples.shakespeare import llama

    cfg, params = make_tiny_llama(jax.random.PRNGKey(0), dim=32, hidden=64, vocab=64, scale=0.2,
                             embed_scale=0.3)
    tokens = jax.random.randint(jax.random.split(jax.random.PRNGKey(0), 12)[8], (6, 9), 0, cfg.vocab)
    logits = lambda p, t: llama.logits(cfg, p, t)  # noqa: E731
    spec = lorax.simple_spec(params, targets=r"^layers/(q|k|v|o|gate|up|down)$", rank=4)
    spec = lorax.infer_layout(logits, params, spec, tokens)
    # Three adapters with different ranks and alphas over one base.
    adapters = []
    for i, (rank, alpha) in enumerate([(4, 8.0), (2, 3.0), (4, 1.0)]):
        s = jax.tree.map(lambda v: lorax.LoraSpec(rank, alpha, v.batch_ndim, v.m_ndim)
                         if isinstance(v, lorax.LoraSpec) else v, spec,
                         is_leaf=lambda v: isinstance(v, lorax.LoraSpec))
        adapters.append(_nudged(lorax.init_lora(params, s, jax.random.PRNGKey(10 + i)), i))
    return llama, cfg, params, spec, tokens, adapters


def test_stack_shares_the_base_and_keeps_each_update(tiny_llama):
    _, _, params, _, _, adapters = tiny_llama
    stack = lorax.stack_adapters(adapters)
    q = stack["layers"]["q"]
    assert q.w is params["layers"]["q"] and q.a.shape == (3, 2, 4, 32) and q.b.shape == (3, 2, 32, 4)
    assert stack["embed"] is params["embed"]
    for adapter, back in zip(adapters, lorax.unstack_adapters(stack)):
        for name in ("q", "down"):
            assert_close(back["layers"][name].materialize(), adapter["layers"][name].materialize(),
                         rtol=1e-6, atol=1e-6)


def test_mixed_batch_through_the_llama_equals_each_example_alone(tiny_llama):
    llama, cfg, params, _, tokens, adapters = tiny_llama
    stack = lorax.stack_adapters(adapters)
    ids = jnp.array([2, 0, -1, 1, 0, 2])
    one = lambda p, t: llama.logits(cfg, p, t[None])[0]  # noqa: E731  (one example: (T,))
    got = jax.jit(lorax.mixed_batch(one, on_materialize="error"))(stack, ids, tokens)
    for i, a in enumerate(ids.tolist()):
        want = one(params, tokens[i]) if a == -1 else lorax.lora(one)(adapters[a], tokens[i])
        assert_close(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"example {i}, adapter {a}")
    # The adapters do differ from each other and from the base on these inputs.
    assert float(jnp.abs(got[0] - got[1]).max()) > 1e-2 and float(jnp.abs(got[2] - got[1]).max()) > 1e-2


def test_generation_with_a_different_adapter_per_prompt(tiny_llama):
    llama, cfg, params, _, tokens, adapters = tiny_llama
    stack = lorax.stack_adapters(adapters)
    gen = functools.partial(llama.generate, cfg, n_new=5, temperature=0.0)
    prompts, ids = tokens[:4, :6], jnp.array([1, -1, 0, 2])
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    got = jax.jit(lorax.mixed_batch(lambda p, t, k: gen(p, t, key=k)))(stack, ids, prompts, keys)
    for i, a in enumerate(ids.tolist()):
        want = (gen(params, prompts[i], key=keys[i]) if a == -1
                else lorax.lora(lambda p, t: gen(p, t, key=keys[i]))(adapters[a], prompts[i]))
        np.testing.assert_array_equal(got[i], want, err_msg=f"prompt {i}, adapter {a}")


def test_mixed_batch_errors_and_out_of_range_ids(tiny_llama):
    llama, cfg, params, spec, tokens, adapters = tiny_llama
    stack = lorax.stack_adapters(adapters)
    one = lambda p, t: llama.logits(cfg, p, t[None])[0]  # noqa: E731
    with pytest.raises(ValueError, match=r"adapter id 3 is out of range for 3 stacked adapters"):
        lorax.mixed_batch(one)(stack, jnp.array([0, 3, 1, 1, 1, 1]), tokens)
    # Under jit the ids are unknown: the bad example's output is NaN, the others are right.
    got = jax.jit(lorax.mixed_batch(one))(stack, jnp.array([0, 3, -1, 1, 1, 1]), tokens)
    assert bool(jnp.isnan(got[1]).all()) and not bool(jnp.isnan(got[jnp.array([0, 2, 3])]).any())
    with pytest.raises(ValueError, match=r"1-D integer"):
        lorax.select_adapters(stack, jnp.zeros((2, 3), jnp.int32))

    # Different targets.
    fewer = lorax.simple_spec(params, targets=r"^layers/(q|v)$", rank=4)
    fewer = lorax.infer_layout(lambda p, t: llama.logits(cfg, p, t), params, fewer, tokens)
    other = lorax.init_lora(params, fewer, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"adapter 1 has a different structure or different "
                                         r"targets.*layers/down"):
        lorax.stack_adapters([adapters[0], other])
    # A different base.
    moved = jax.tree.map(lambda w: lorax.LoraWeight(w.w + 1.0, w.a, w.b, w.alpha) if _is_lora(w) else w,
                         adapters[1], is_leaf=_is_lora)
    with pytest.raises(ValueError, match=r"frozen weight of 'layers/down' differs between adapter 0 "
                                         r"and adapter 1"):
        lorax.stack_adapters([adapters[0], moved])
    # DoRA.
    dora = lorax.init_lora(params, spec, jax.random.PRNGKey(0), dora=True)
    with pytest.raises(ValueError, match=r"'layers/down' in adapter 0 is a DoraWeight"):
        lorax.stack_adapters([dora, dora])


def _intermediate_sizes(jaxpr):
    """Element counts of every value a jaxpr (and its sub-jaxprs) computes."""
    sizes = []
    for eqn in jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None:
                sizes += _intermediate_sizes(getattr(inner, "jaxpr", inner))
    return sizes


def _conv_embed_model(params, t):
    """One example: token ids `(T,)` -> embedding (gather) -> 1-D conv -> dense head."""
    h = params["embed"][t]                                          # (T, D)
    h = jax.lax.conv_general_dilated(h[None], params["conv"], (1,), "SAME",
                                     dimension_numbers=("NWC", "WIO", "NWC"))[0]
    return jnp.tanh(h) @ params["head"]


def test_mixed_batch_through_gather_conv_and_dot_values_and_gradients():
    """Each rule's rank gate (embedding lookup, conv, dot): every example equals itself
    alone, and gradients with respect to the stack equal the per-example-gather form's."""
    keys = jax.random.split(jax.random.PRNGKey(0), 8)
    params = {"embed": jax.random.normal(keys[0], (20, 16)), "conv": 0.3 * jax.random.normal(keys[1], (3, 16, 12)),
              "head": 0.3 * jax.random.normal(keys[2], (12, 5))}
    spec = {"embed": 3, "conv": lorax.LoraSpec(2, m_ndim=2), "head": 4}
    adapters = [_nudged(lorax.init_lora(params, spec, jax.random.PRNGKey(i), alpha=2.0 + i), i)
                for i in range(3)]
    stack = lorax.stack_adapters(adapters)
    tokens = jax.random.randint(keys[3], (5, 7), 0, 20)
    ids = jnp.array([2, -1, 0, 1, 2])
    got = jax.jit(lorax.mixed_batch(_conv_embed_model, on_materialize="error"))(stack, ids, tokens)
    base, one = jax.jit(_conv_embed_model), jax.jit(lorax.lora(_conv_embed_model))
    for i, a in enumerate(ids.tolist()):
        want = base(params, tokens[i]) if a == -1 else one(adapters[a], tokens[i])
        assert_close(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"example {i}, adapter {a}")

    r = jax.random.normal(keys[4], got.shape)
    mixed = lambda st: jnp.sum(r * lorax.mixed_batch(_conv_embed_model)(st, ids, tokens))  # noqa: E731

    def gathered(st):
        sel = lorax.select_adapters(st, ids)
        f = jax.vmap(lorax.lora(_conv_embed_model), in_axes=(lorax.adapter_axes(sel), 0))
        return jnp.sum(r * f(sel, tokens))

    trainable, frozen = lorax.partition(stack, spec)
    g1 = jax.jit(jax.grad(lambda t: mixed(lorax.combine(t, frozen))))(trainable)
    g2 = jax.jit(jax.grad(lambda t: gathered(lorax.combine(t, frozen))))(trainable)
    for name in params:
        for f in ("a", "b"):
            assert_close(getattr(g1[name], f), getattr(g2[name], f), rtol=1e-4, atol=1e-5,
                         err_msg=f"{name}.{f}")
    # Adapter 1 is used by example 3 only; its gradient is not zero, and the gradient of an
    # adapter no example uses would be (none here: each of 0, 1, 2 appears).
    assert float(jnp.abs(g1["head"].b[1]).max()) > 0


def test_mixed_batch_copies_no_factors_per_example():
    """The gather form copies each example's factors (`batch * d * k` per weight); the
    mixed batch has no intermediate that large (negative control: the gather has)."""
    d, k, batch = 64, 8, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    params = {f"l{i}": jax.random.normal(kk, (d, d)) / d**0.5 for i, kk in enumerate(keys)}
    adapters = [_nudged(lorax.init_lora(params, {n: k for n in params}, jax.random.PRNGKey(i)), i)
                for i in range(4)]
    stack = lorax.stack_adapters(adapters)
    x = jnp.ones((batch, d))
    ids = jnp.arange(batch) % 4
    model = lambda p, x: jnp.tanh(x @ p["l0"]) @ p["l1"]  # noqa: E731

    def gathered(st, ids, x):
        sel = lorax.select_adapters(st, ids)
        return jax.vmap(lorax.lora(model), in_axes=(lorax.adapter_axes(sel), 0))(sel, x)

    copy = batch * d * k
    mixed = jax.make_jaxpr(lorax.mixed_batch(model, on_materialize="error"))(stack, ids, x)
    assert max(_intermediate_sizes(mixed.jaxpr)) < copy
    control = jax.make_jaxpr(gathered)(stack, ids, x)
    assert max(_intermediate_sizes(control.jaxpr)) >= copy


def test_mixed_batch_on_a_quantized_base(tiny_llama):
    llama, cfg, params, spec, tokens, _ = tiny_llama
    qparams = lorax.quantize(params, spec, "int8", min_size=0)
    adapters = [_nudged(lorax.init_lora(qparams, spec, jax.random.PRNGKey(20 + i)), i) for i in range(2)]
    stack = lorax.stack_adapters(adapters)
    ids = jnp.array([1, 0, -1, 1, 0, 0])
    one = lambda p, t: llama.logits(cfg, p, t[None])[0]  # noqa: E731
    got = jax.jit(lorax.mixed_batch(one, on_materialize="error"))(stack, ids, tokens)
    for i, a in enumerate(ids.tolist()):
        want = (lorax.lora(one)(qparams, tokens[i]) if a == -1
                else lorax.lora(one)(adapters[a], tokens[i]))
        assert_close(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"example {i}, adapter {a}")


# -- training side by side --------------------------------------------------------------------


def _mlp(params, x):
    for name in ("l0", "l1", "l2"):
        x = jnp.tanh(x @ params[name])
    return x


def _mlp_setup(n, d=32, batch=8, rank=4):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {f"l{i}": jax.random.normal(k, (d, d)) / d**0.5 for i, k in enumerate(keys)}
    spec = {name: rank for name in params}
    adapters = [lorax.init_lora(params, spec, jax.random.PRNGKey(100 + i), alpha=2.0 * rank)
                for i in range(n)]
    xs = jax.random.normal(jax.random.PRNGKey(1), (n, batch, d))
    ys = jax.random.normal(jax.random.PRNGKey(2), (n, batch, d))
    lrs = jnp.geomspace(1e-3, 1e-1, n)
    return params, spec, adapters, xs, ys, lrs


def _train_step(spec):
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    f = lorax.lora(_mlp, on_materialize="error")

    def step(trainable, opt_state, frozen, x, y):
        loss, grads = jax.value_and_grad(
            lambda t: jnp.mean((f(lorax.combine(t, frozen), x) - y) ** 2))(trainable)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    def init(trainable, lr):
        state = opt.init(trainable)
        state.hyperparams["learning_rate"] = jnp.asarray(lr)
        return state

    return step, init


def test_side_by_side_training_equals_separate_trainings():
    n = 4
    params, spec, adapters, xs, ys, lrs = _mlp_setup(n)
    step, init = _train_step(spec)

    # N adapters in one jitted step: vmap over the adapter axis, the base unbatched.
    trainable, frozen = lorax.partition(lorax.stack_adapters(adapters), spec)
    axes = lorax.adapter_axes(trainable)
    states = jax.vmap(init, in_axes=(axes, 0))(trainable, lrs)
    together = jax.jit(jax.vmap(step, in_axes=(axes, 0, None, 0, 0), out_axes=(axes, 0, 0)))

    # The same N trainings one by one.
    separate = []
    for i in range(n):
        t, f_ = lorax.partition(adapters[i], spec)
        separate.append((t, init(t, lrs[i]), f_))
    one_step = jax.jit(step)

    for it in range(5):
        trainable, states, losses = together(trainable, states, frozen, xs, ys)
        for i in range(n):
            t, s, f_ = separate[i]
            t, s, loss = one_step(t, s, f_, xs[i], ys[i])
            separate[i] = (t, s, f_)
            assert_close(losses[i], loss, rtol=1e-5, err_msg=f"step {it}, adapter {i}")
    for i, tree in enumerate(lorax.unstack_adapters(trainable)):
        for name in params:
            got = lorax.combine(tree, frozen)[name].materialize()
            want = lorax.combine(separate[i][0], separate[i][2])[name].materialize()
            assert_close(got, want, rtol=1e-5, atol=1e-6, err_msg=f"adapter {i}, {name}")
    assert float(jnp.abs(lorax.combine(lorax.unstack_adapters(trainable)[0], frozen)["l0"].b).max()) > 0


def test_side_by_side_step_holds_the_base_once():
    """The compiled side-by-side step takes the base once and holds no per-adapter copy
    of it: its buffers grow with N by the factors and activations only."""
    d, n = 256, 8
    params, spec, adapters, xs, ys, lrs = _mlp_setup(n, d=d, batch=4)
    step, init = _train_step(spec)
    trainable, frozen = lorax.partition(lorax.stack_adapters(adapters), spec)
    axes = lorax.adapter_axes(trainable)
    states = jax.vmap(init, in_axes=(axes, 0))(trainable, lrs)
    together = jax.jit(jax.vmap(step, in_axes=(axes, 0, None, 0, 0), out_axes=(axes, 0, 0)))
    m = together.lower(trainable, states, frozen, xs, ys).compile().memory_analysis()
    base = sum(x.nbytes for x in jax.tree.leaves(frozen))
    factors = sum(x.nbytes for x in jax.tree.leaves(trainable))
    per_adapter_data = xs.nbytes + ys.nbytes
    # Arguments: the base once, the factors, 3x them in Adam's state (mu, nu) and data.
    assert m.argument_size_in_bytes < base + 3.5 * factors + per_adapter_data + 4096
    # Temporaries: nowhere near N copies of the base.
    assert m.temp_size_in_bytes < base, (m.temp_size_in_bytes, base)


# -- bad input: trees that are not stacks, stacks where single adapters go -------------------------


def _one_adapter():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w": jax.random.normal(k[0], (8, 4)), "layers": jax.random.normal(k[1], (3, 6, 6)),
              "bias": jnp.zeros(4)}
    spec = {"w": 2, "layers": lorax.LoraSpec(3, batch_ndim=1), "bias": lorax.LORA_FULL}
    return params, spec, _nudged(lorax.init_lora(params, spec, k[2]), 1)


def test_a_tree_that_was_never_stacked_has_no_adapter_axis():
    """The rank axis (or a batch axis of w) was read as the adapter axis: unstack gave
    `rank` "adapters" with 1-D factors, select_adapters a (batch, N) `a`."""
    params, spec, lp = _one_adapter()
    match = (r"{}: '(w|layers)' has no adapter axis \(its factors a: .* fit w: .* as one "
             r"adapter\); pass a tree from lorax\.stack_adapters")
    with pytest.raises(ValueError, match=match.format("unstack_adapters")):
        lorax.unstack_adapters(lp)
    with pytest.raises(ValueError, match=match.format("select_adapters")):
        lorax.select_adapters(lp, jnp.array([0, 1, 1]))
    with pytest.raises(ValueError, match=match.format("mixed_batch")):
        lorax.mixed_batch(lambda p, x: x @ p["w"])(lp, jnp.array([0, 1]), jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=match.format("adapter_axes")):
        lorax.adapter_axes(lp)
    with pytest.raises(ValueError, match=r"unstack_adapters: expected a stack of adapters "
                                         r"\(lorax\.stack_adapters\); it has no LoraWeight"):
        lorax.unstack_adapters(params)
    # The same tree stacked: every function takes it, and either half of partition.
    stack = lorax.stack_adapters([lp, _nudged(lp, 2)])
    trainable, frozen = lorax.partition(stack, spec)
    assert len(lorax.unstack_adapters(stack)) == len(lorax.unstack_adapters(trainable)) == 2
    assert lorax.select_adapters(stack, jnp.array([1, 0, -1]))["layers"].a.shape == (3, 3, 3, 6)
    lorax.adapter_axes(trainable), lorax.adapter_axes(frozen)


def test_stack_adapters_takes_a_sequence_of_single_adapters():
    """A dict was iterated as its keys (`data type 'bias' not understood`); a stack of
    stacks failed in LoraWeight with no key path; trees without LoraWeights made a
    "stack" with no adapter axis."""
    params, spec, lp = _one_adapter()
    for bad in (lp, lp["w"], None):
        with pytest.raises(TypeError, match=r"stack_adapters: adapters must be a sequence \(a "
                                            r"list\) of LoRA parameter trees, got a"):
            lorax.stack_adapters(bad)
    stack = lorax.stack_adapters([lp, lp])
    with pytest.raises(ValueError, match=r"stack_adapters: '(w|layers)' in adapter 0 is a stack of "
                                         r"2 adapters.*lorax\.unstack_adapters splits a stack"):
        lorax.stack_adapters([stack, stack])
    with pytest.raises(ValueError, match=r"stack_adapters: the adapters have no LoraWeight"):
        lorax.stack_adapters([params, params])
    assert lorax.stack_adapters(iter([lp, lp]))["w"].a.shape == (2, 2, 4)
