"""The main job: train a small GPT (or Llama-style decoder) on a synthetic task with
cannjax, then the same model in plain JAX, as written and through ``cannjax.optimize``,
and compare them side by side.

``python -m cannjax demo [--model M] [--steps N] [--precision P] [--remat R]
[--variable-length] [--out DIR]``

``--model llama`` trains the Llama-style decoder of :mod:`cannjax.models` instead (RMS
norm, RoPE, grouped-query attention with ``--kv-heads`` key/value heads, SwiGLU) beside
its plain-JAX twin.

``--variable-length`` adds a run of the cannjax model on sequences of random lengths
through :func:`cannjax.dynamic.geared` with planned gears, and prints its compile count
and padding overhead beside the fixed-length run.

It prints a table (with a legend of its columns) and writes, in ``--out``,
``report.json`` (every figure), ``loss.png`` and ``memory.png`` (with matplotlib) and
``report.html``, a page that holds the table and the plots.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from cannjax import amp
from cannjax._src.backend.host_memory import keep_freed_memory
from cannjax._src.core.tables import render, render_html
from cannjax._src.dynamic.gears import fixed_gears, plan_gears
from cannjax._src.dynamic.step import geared
from cannjax._src.fuse.transform import fuse
from cannjax._src.inspect import residuals
from cannjax._src.models import gpt, llama
from cannjax._src.models.tasks import SortTask
from cannjax._src.optimization.transform import optimize

# The row of the plain-JAX model trained through cannjax.optimize (level 2).
OPTIMIZED = "plain JAX + cannjax.optimize"
# The float32 run shown beside a half-precision cannjax run (--precision).
F32_RUN = "cannjax (float32)"
MIB = 2**20
# Gears (compiled programs) of the --variable-length run.
GEARS = 4


def lognormal_lengths(
    rng: np.random.Generator, n: int, *, low: int, high: int, median: float, sigma: float = 0.8
) -> np.ndarray:
    """``n`` sequence lengths from a log-normal, rounded and clipped to ``[low, high]``.

    A skewed distribution: most lengths near ``median``, a long tail of long ones. The
    demo's ``--variable-length`` run and ``benchmarks/dynamic.py`` draw their lengths so
    (the benchmark with ``low=16, high=512, median=64``).
    """
    x = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.round(x), low, high).astype(np.int64)


class DemoError(Exception):
    """A user-facing problem with the demo's options (reported without a traceback)."""


class Model(NamedTuple):
    """One model the demo trains: its name and its functions, cannjax and plain JAX."""

    title: str
    init: Callable[..., Any]  # (key, cfg) -> params
    loss: Callable[..., jax.Array]  # (params, tokens, targets, cfg, weights) -> loss
    plain_loss: Callable[..., jax.Array]
    logits: Callable[..., jax.Array]  # (params, tokens, cfg) -> logits


MODELS = {
    "gpt": Model("GPT", gpt.init_gpt, gpt.gpt_loss, gpt.plain_gpt_loss, gpt.gpt_logits),
    "llama": Model(
        "Llama", llama.init_llama, llama.llama_loss, llama.plain_llama_loss, llama.llama_logits
    ),
}
"""The models of ``--model``, by name."""


def llama_hidden(width: int, multiple: int = 32) -> int:
    """The SwiGLU hidden width of the demo's Llama: ``8 * width / 3`` rounded up to
    ``multiple``, as Llama sizes its MLP (704 for ``width=256``).

    Example:
      >>> llama_hidden(256), llama_hidden(128)
      (704, 352)
    """
    return multiple * -(-8 * width // (3 * multiple))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declares the demo's command-line options on ``p``."""
    p.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="gpt",
        help="the model to train: gpt (layer norm, learned positions, GELU MLP) or llama "
        "(RMS norm, RoPE, grouped-query attention, SwiGLU MLP, tied embeddings)",
    )
    p.add_argument("--steps", type=int, default=1000, help="cannjax training steps")
    p.add_argument(
        "--plain-steps",
        type=int,
        default=20,
        help="plain-JAX steps for the side-by-side comparison",
    )
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--width", type=int, default=128, help="model width D")
    p.add_argument("--heads", type=int, default=4, help="attention heads; must divide --width")
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="--model llama: key/value heads of grouped-query attention; must divide "
        "--heads (default: --heads/2 when --heads is even, else 1)",
    )
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--digits", type=int, default=16, help="sort task: digits per sequence")
    p.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="peak Adam learning rate, reached after a warm-up, then decayed (cosine) to "
        "1/10 of it",
    )
    p.add_argument(
        "--remat",
        choices=("none", "layer"),
        default="layer",
        help="recompute each block in the backward (layer) or not (none)",
    )
    p.add_argument(
        "--precision",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="compute dtype of the cannjax run (params stay float32); float16 trains with "
        "dynamic loss scaling; bfloat16 and float16 also train cannjax in float32 beside it "
        "and compare loss, accuracy and step time",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument(
        "--variable-length",
        action="store_true",
        help=f"also train the cannjax model for --steps steps on sort tasks of random "
        f"lengths (digits log-normal, median --digits/2, clipped to [--digits/4, --digits]) "
        f"through cannjax.dynamic.geared with {GEARS} planned gears; prints its compile "
        "count and padding overhead beside the fixed-length run",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("cannjax-demo"),
        metavar="DIR",
        help="output folder for report.html (the table and the plots in one page), "
        "report.json (every figure) and the plots loss.png and memory.png",
    )
    p.add_argument(
        "--mesh",
        nargs="?",
        const="4x2",
        default=None,
        metavar="DATAxMODEL",
        help="also train the cannjax model for --plain-steps steps sharded over a DATAxMODEL "
        "mesh (the batch and FSDP over DATA, tensor parallel over MODEL; on CPU, the host "
        "split into DATA*MODEL devices) and print its per-device memory and collective "
        "bytes beside the single-device run (default: no sharded run; 4x2 when --mesh is "
        "given without a value)",
    )
    p.add_argument(
        "--allocator",
        choices=("keep-freed", "default"),
        default="keep-freed",
        help="host memory of this process: keep-freed makes glibc keep freed memory for "
        "the next step (cannjax.backend.keep_freed_memory: no page faults on each step's "
        "fresh temp buffer), default leaves the C library's allocator as it is",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")


def _check(args: argparse.Namespace) -> gpt.GPTConfig | llama.LlamaConfig:
    model, kv_heads = args.model, args.kv_heads
    names = ["steps", "plain_steps", "batch", "width", "heads", "layers", "digits"]
    for name in names + (["kv_heads"] if kv_heads is not None else []):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.width % args.heads:
        raise DemoError(f"--heads={args.heads} must divide --width={args.width}")
    if model != "llama" and kv_heads is not None:
        raise DemoError(
            f"--kv-heads applies to --model llama only (--model {model} has as many key/value "
            "heads as query heads)"
        )
    if model == "llama":
        if kv_heads is None:
            kv_heads = args.heads // 2 if args.heads % 2 == 0 else 1
        if args.heads % kv_heads:
            raise DemoError(f"--kv-heads={kv_heads} must divide --heads={args.heads}")
        if (args.width // args.heads) % 2:
            raise DemoError(
                f"--model llama needs an even head dim --width/--heads for RoPE, got "
                f"{args.width}/{args.heads} = {args.width // args.heads}"
            )
    if args.mesh is not None:
        args.mesh_shape = _mesh_shape(args.mesh, args.batch)
    if args.out.exists() and not args.out.is_dir():
        raise DemoError(
            f"--out {args.out} is a file; --out names a folder for report.json and the "
            "plots (created if missing), e.g. --out cannjax-demo"
        )
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DemoError(f"--out {args.out}: cannot write there ({e.strerror or e})") from None
    task = SortTask(digits=args.digits)
    if model == "llama":
        return llama.LlamaConfig(
            vocab=task.vocab,
            width=args.width,
            heads=args.heads,
            kv_heads=kv_heads,
            layers=args.layers,
            seq_len=task.seq_len,
            hidden=llama_hidden(args.width),
            remat=args.remat,
        )
    return gpt.GPTConfig(
        vocab=task.vocab,
        width=args.width,
        heads=args.heads,
        layers=args.layers,
        seq_len=task.seq_len,
        remat=args.remat,
    )


def _mesh_shape(text: str, batch: int) -> tuple[int, int]:
    """``"4x2"`` -> ``(4, 2)``; on CPU, splits the host into that many devices."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise DemoError(f"--mesh must be DATAxMODEL with two ints >= 1 (4x2), got {text!r}")
    data, model = int(parts[0]), int(parts[1])
    if batch % data:
        raise DemoError(f"--mesh {text}: its data axis ({data}) must divide --batch={batch}")
    from jax._src import xla_bridge  # whether a backend has started (the count is fixed then)

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", data * model)
    if len(jax.devices()) < data * model:
        raise DemoError(
            f"--mesh {text} needs {data * model} devices; this process has "
            f"{len(jax.devices())} ({jax.default_backend()})"
        )
    return data, model


class Progress:
    """Training progress on ``stream``: a tqdm bar on a terminal, plain lines elsewhere.

    On a terminal (``stream.isatty()``) a tqdm bar redraws one line in place. In a log
    file, a pipe or CI, where a redrawn line would pile up into one very long line, it
    prints a plain line each time another tenth of the run is done: ten lines at most.

    Args:
      name: what is training (the bar's label).
      steps: the number of steps of the run.
      stream: where to write (``sys.stderr`` by default, read when the run starts).
      enabled: False prints nothing (``--quiet``).

    Example:
      >>> import io
      >>> log = io.StringIO()  # not a terminal: plain lines
      >>> with Progress("cannjax", 20, stream=log) as bar:
      ...     for i in range(20):
      ...         bar.update(i + 1, loss=1.0 / (i + 1), tok_s=1000.0)
      >>> lines = log.getvalue().splitlines()
      >>> len(lines), lines[-1]
      (10, 'cannjax: step 20/20 (100%), loss 0.0500, 1,000 tok/s')
    """

    def __init__(self, name: str, steps: int, *, stream: Any = None, enabled: bool = True):
        self.name, self.steps, self.enabled = name, steps, enabled
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        isatty = getattr(self.stream, "isatty", None)
        self.bar = None
        if enabled and isatty is not None and isatty():
            self.bar = tqdm(
                total=steps, desc=name, unit="step", file=self.stream, dynamic_ncols=True
            )

    def update(self, step: int, *, loss: float, tok_s: float) -> None:
        """Reports that ``step`` steps (of ``steps``) are done, with the latest loss."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tok_s:,.0f} tok/s", refresh=False)
            self.bar.update(step - self.done)
        elif 10 * step // self.steps > 10 * self.done // self.steps:  # a new tenth
            self.stream.write(
                f"{self.name}: step {step}/{self.steps} ({100 * step // self.steps}%), "
                f"loss {loss:.4f}, {tok_s:,.0f} tok/s\n"
            )
            self.stream.flush()
        self.done = step

    def close(self) -> None:
        """Ends the bar (leaving its last state on screen)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step(loss_fn: Callable[..., jax.Array], cfg, opt) -> Callable[..., Any]:
    def step(params, opt_state, loss_scale, batch):
        def loss(p):
            return loss_fn(p, batch.tokens, batch.targets, cfg, batch.weights)

        value, grads, loss_scale, finite = amp.value_and_grad(loss, loss_scale)(params)
        updates, opt_state = opt.update(grads, opt_state, params, grads_finite=finite)
        return optax.apply_updates(params, updates), opt_state, loss_scale, value

    return step


def _make_step(loss_fn: Callable[..., jax.Array], cfg, opt) -> Callable[..., Any]:
    return jax.jit(_step(loss_fn, cfg, opt))


def _with_precision(loss_fn, precision: str):
    """``loss_fn`` computing in ``precision`` (params stay float32, the loss is float32)."""
    if precision == "float32":
        return loss_fn
    policy = amp.get_policy(f"params=float32,compute={precision},output=float32")
    return amp.with_policy(loss_fn, policy=policy)


def _optimizer(args):
    # Warm-up then cosine decay, and global-norm clipping: without them Adam at 3e-3
    # spiked the loss now and then (the schedule spans --steps for both runs, so the
    # plain-JAX run follows the cannjax run's first steps exactly). optax needs a decay
    # longer than the warm-up, which --steps 1 would not give.
    warmup = max(1, args.steps // 20)
    lr = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=warmup, decay_steps=max(args.steps, warmup + 1),
        end_value=args.lr / 10,
    )  # fmt: skip
    return amp.skip_nonfinite(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(lr)))


def _train(name, loss_fn, params, cfg, task, args, steps, precision="float32"):
    opt = _optimizer(args)
    loss_fn = _with_precision(loss_fn, precision)
    step = _make_step(loss_fn, cfg, opt)
    loss_scale = amp.DynamicLossScale() if precision == "float16" else amp.NoOpLossScale()
    opt_state = opt.init(params)
    key = jax.random.key(args.seed + 1)
    batch = task.batch(key, args.batch)
    t0 = time.perf_counter()
    compiled = step.lower(params, opt_state, loss_scale, batch).compile()
    compile_s = time.perf_counter() - t0
    # The memory of the step this run executes: its precision, remat and optimizer.
    memory = {
        "precision": precision,
        "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "residual_bytes": _residual_bytes(loss_fn, params, cfg, batch),
    }
    losses, times = [], []
    tokens_per_step = args.batch * cfg.seq_len
    with Progress(name, steps, enabled=not args.quiet) as progress:
        for i in range(steps):
            batch = task.batch(jax.random.fold_in(key, i), args.batch)
            t = time.perf_counter()
            params, opt_state, loss_scale, loss = step(params, opt_state, loss_scale, batch)
            loss = float(loss)
            times.append(time.perf_counter() - t)
            losses.append(loss)
            tok_s = tokens_per_step / statistics.median(times[-10:])  # the recent rate
            progress.update(i + 1, loss=loss, tok_s=tok_s)
    run = {"name": name, "losses": losses, "step_s": times, "compile_s": compile_s}
    return params, run, memory


def _train_sharded(loss_fn, params, cfg, task, args, steps, precision, single_losses):
    """The cannjax run's first ``steps`` steps on the same batches, sharded over the
    ``--mesh``: FSDP over its data axis, tensor parallel over its model axis
    (:func:`cannjax.parallel.param_shardings`), the batch over data. Returns the figures
    per device of that step and of the same step on one device."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cannjax import parallel

    data, model = args.mesh_shape
    mesh = parallel.model_mesh(data, model, devices=jax.devices()[: data * model])
    opt = _optimizer(args)
    loss_fn = _with_precision(loss_fn, precision)
    loss_scale = amp.DynamicLossScale() if precision == "float16" else amp.NoOpLossScale()
    opt_state = opt.init(params)
    key = jax.random.key(args.seed + 1)
    batch = task.batch(key, args.batch)
    rules = {"fsdp": "data", "tensor": "model"}
    shardings = (
        parallel.param_shardings(params, mesh, **rules),
        parallel.param_shardings(opt_state, mesh, **rules),
        jax.tree.map(lambda _: NamedSharding(mesh, P()), loss_scale),
        jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.ndim else P()), batch),
    )
    sharded = jax.jit(_step(loss_fn, cfg, opt), in_shardings=shardings,
                      out_shardings=(*shardings[:3], NamedSharding(mesh, P())))  # fmt: skip

    def figures(compiled):
        m = compiled.memory_analysis()
        return {
            "state_bytes": int(m.argument_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "collective_bytes": parallel.collective_bytes(compiled)["total"],
        }

    compiled = sharded.lower(params, opt_state, loss_scale, batch).compile()
    one = figures(
        _make_step(loss_fn, cfg, opt).lower(params, opt_state, loss_scale, batch).compile()
    )
    losses = []
    with Progress(f"cannjax on {data}x{model}", steps, enabled=not args.quiet) as progress:
        for i in range(steps):
            batch = task.batch(jax.random.fold_in(key, i), args.batch)
            params, opt_state, loss_scale, loss = compiled(params, opt_state, loss_scale, batch)
            losses.append(float(loss))
            progress.update(i + 1, loss=losses[-1], tok_s=0.0)
    diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, single_losses))
    return {
        "mesh": [data, model],
        "devices": data * model,
        "sharded": figures(compiled),
        "one_device": one,
        "losses": losses,
        "one_device_losses": list(single_losses[:steps]),
        "loss_max_rel_difference": diff,
    }


def _sharded_table(sh: dict, n: int) -> tuple[list[str], list[list[str]]]:
    head = ["run", "devices", "params+state MiB", "temp MiB", "collectives MiB", f"loss@{n}"]
    data, model = sh["mesh"]
    rows = []
    runs = [("cannjax", 1, sh["one_device"], sh["one_device_losses"]),
            (f"cannjax {data}x{model}", sh["devices"], sh["sharded"], sh["losses"])]  # fmt: skip
    for name, devices, f, losses in runs:
        rows.append([name, str(devices), f"{f['state_bytes'] / MIB:.2f}",
                     f"{f['temp_bytes'] / MIB:.2f}", f"{f['collective_bytes'] / MIB:.2f}",
                     f"{losses[n - 1]:.4f}"])  # fmt: skip
    return head, rows


def _variable_digits(args: argparse.Namespace) -> np.ndarray:
    """Digits per batch of the --variable-length run: skewed, in [digits/4, digits]."""
    k = args.digits
    rng = np.random.default_rng(args.seed)
    return lognormal_lengths(rng, args.steps, low=max(1, k // 4), high=k, median=max(1, k / 2))


def _train_variable(loss_fn, params, cfg, task, args, precision="float32"):
    """Trains on sort tasks of random lengths through ``geared`` with planned gears.

    Every batch sorts its own number of digits (sequence length twice that); the gears
    are planned on the run's lengths, drawn ahead, and each batch is padded to its gear
    with the task's weights padded by zeros and multiplied by the padding weights.
    """
    digits = _variable_digits(args)
    lengths = 2 * digits
    gears = plan_gears(lengths, GEARS, max_length=cfg.seq_len)
    opt = _optimizer(args)
    step = _step(_with_precision(loss_fn, precision), cfg, opt)

    def weighted(params, opt_state, loss_scale, batch, weights):
        return step(params, opt_state, loss_scale, batch._replace(weights=batch.weights * weights))

    run = geared(weighted, gears, argnum=3)
    loss_scale = amp.DynamicLossScale() if precision == "float16" else amp.NoOpLossScale()
    opt_state = opt.init(params)
    key = jax.random.key(args.seed + 1)
    losses, times = [], []
    name = "cannjax, variable length"
    with Progress(name, len(digits), enabled=not args.quiet) as progress:
        for i, d in enumerate(digits):
            batch = SortTask(int(d), task.base).batch(jax.random.fold_in(key, i), args.batch)
            t = time.perf_counter()
            params, opt_state, loss_scale, loss = run(params, opt_state, loss_scale, batch)
            loss = float(loss)
            times.append(time.perf_counter() - t)  # the first step of a gear compiles it
            losses.append(loss)
            tok_s = args.batch * 2 * int(d) / statistics.median(times[-10:])
            progress.update(i + 1, loss=loss, tok_s=tok_s)
    return {
        "lengths": [int(lengths.min()), int(lengths.max())],
        "distinct_lengths": len(np.unique(lengths)),
        "gears": list(run.sizes),
        "compiled": run.compiled,
        "overhead": run.overhead,
        "pad_all_overhead": fixed_gears([cfg.seq_len], lengths).overhead,
        "wall_s": sum(times),
        "losses": losses,
    }


def _variable_table(run_c: dict, var: dict, seq_len: int) -> tuple[list[str], list[list]]:
    """The fixed-length cannjax run beside the variable-length one."""
    head = ["run", "steps", "lengths", "programs compiled", "padding overhead", "wall s",
            "loss, last 10"]  # fmt: skip
    lo, hi = var["lengths"]
    rows = [
        [
            "fixed length",
            len(run_c["losses"]),
            str(seq_len),
            "1",
            "0",
            f"{run_c['compile_s'] + sum(run_c['step_s']):.1f}",
            f"{statistics.mean(run_c['losses'][-10:]):.4f}",
        ],
        [
            f"variable, {len(var['gears'])} gears",
            len(var["losses"]),
            f"{lo}-{hi}",
            f"{var['compiled']} ({var['distinct_lengths']} without gears)",
            f"{var['overhead']:.4f} ({var['pad_all_overhead']:.4f} all to {seq_len})",
            f"{var['wall_s']:.1f}",
            f"{statistics.mean(var['losses'][-10:]):.4f}",
        ],
    ]
    return head, rows


def _residual_bytes(loss_fn, params, cfg, batch) -> int:
    """Bytes the backward of ``loss_fn`` keeps from its forward (in its precision)."""
    res = residuals(lambda p: loss_fn(p, batch.tokens, batch.targets, cfg, batch.weights), params)
    return res.total_bytes


def _accuracy(logits_fn, params, cfg, task, key, n=256):
    batch = task.batch(key, n)
    return float(
        task.accuracy(jax.jit(logits_fn, static_argnums=2)(params, batch.tokens, cfg), batch)
    )


def _held_out_loss(loss_fn, params, cfg, task, key, n=1024) -> float:
    """The float32 loss of ``params`` on ``n`` held-out sequences.

    One fixed batch, larger than a training batch and seen by neither run: two trained
    models are compared on the same data, without the batch-to-batch noise of a single
    training step's loss.
    """
    batch = task.batch(key, n)
    return float(
        jax.jit(loss_fn, static_argnums=3)(params, batch.tokens, batch.targets, cfg, batch.weights)
    )


LEGEND = (
    (
        "model",
        "cannjax: its operators, fuse and remat; plain JAX: jax.numpy and autodiff; "
        f"{OPTIMIZED}: the same plain-JAX code, rewritten by cannjax.optimize (level 2)",
    ),
    ("precision", "compute dtype of the training step (parameters stay float32)"),
    ("step ms", "median wall time of one training step (forward, backward, Adam), ms"),
    ("temp MiB", "XLA's scratch memory of the compiled training step, MiB (2**20 bytes)"),
    ("residual MiB", "arrays the backward keeps from the forward (inspect.residuals), MiB"),
    ("loss@N", "training loss at step N, the last step both runs made (same data)"),
)
"""What each column of the demo's table means, with its unit (N: a step number)."""


def _legend(n: int) -> list[tuple[str, str]]:
    """:data:`LEGEND` with ``N`` replaced by ``n`` in the loss column's row."""
    return [(c, m) if c != "loss@N" else (f"loss@{n}", m.replace("N", str(n))) for c, m in LEGEND]


def _median_ms(run: dict) -> float:
    # The first step is left out: it may still pay for dispatch set-up.
    return 1e3 * statistics.median(run["step_s"][1:] or run["step_s"])


def _table(runs: dict, mem: dict, n: int) -> tuple[list[str], list[list[str]]]:
    """The headers and rows of the comparison table."""
    head = ["model", "precision", "step ms", "temp MiB", "residual MiB", f"loss@{n}"]
    rows = [
        [
            name,
            mem[name]["precision"],
            f"{_median_ms(r):.1f}",
            f"{mem[name]['temp_bytes'] / 2**20:.2f}",
            f"{mem[name]['residual_bytes'] / 2**20:.2f}",
            f"{r['losses'][n - 1]:.4f}",
        ]
        for name, r in runs.items()
    ]
    return head, rows


def _plots(out: Path, runs: dict, mem: dict) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return []
    styles = {
        "cannjax": {"color": "tab:blue", "ls": "-", "lw": 1.5},
        "plain JAX": {"color": "tab:orange", "ls": "--", "lw": 1.5, "marker": "o", "ms": 3},
        OPTIMIZED: {"color": "tab:green", "ls": ":", "lw": 1.5, "marker": "x", "ms": 4},
    }
    shortest = min(len(r["losses"]) for r in runs.values())
    longest = max(len(r["losses"]) for r in runs.values())
    # When plain JAX stops early, a second panel shows the steps both runs made, where
    # its curve is not a sliver at the left edge of the first.
    panels = [longest, shortest] if shortest < longest else [longest]
    # Legends sit outside the axes (below them, or to the right), never on the curves or
    # bars: constrained layout makes room for them ("outside" locations).
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False, layout="constrained"
    )
    for ax, upto in zip(axes[0], panels):
        for name, r in runs.items():
            losses = r["losses"][:upto]
            style = dict(styles.get(name, {}))
            if "marker" in style:
                style["markevery"] = max(1, len(losses) // 25)
            label = f"{name} ({mem[name]['precision']})"
            ax.plot(np.arange(1, len(losses) + 1), losses, label=label, **style)
        ax.set_xlabel("training step")
        if upto == longest:  # the whole run spans decades of loss
            ax.set_ylabel("loss (cross-entropy, log scale)")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ticker.LogFormatter())  # 0.01, not 10^-2
        else:
            ax.set_ylabel("loss (cross-entropy)")
        ax.set_title(f"steps 1-{upto}" + (" (both runs)" if upto < longest else ""))
        ax.grid(alpha=0.3)
    fig.suptitle("Training loss on the sort task: cannjax vs plain JAX")
    # One legend for the panels (they draw the same runs), below them.
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncols = min(len(runs), 3) if len(panels) > 1 else 1
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols)
    fig.savefig(out / "loss.png", dpi=90)

    fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(mem) + 1.5), 3.6), layout="constrained")
    names = list(mem)
    x = np.arange(len(names))
    for dx, key, label in (
        (-0.2, "temp_bytes", "compiled temp"),
        (0.2, "residual_bytes", "residuals"),
    ):
        bars = ax.bar(x + dx, [mem[n][key] / 2**20 for n in names], 0.4, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=2)
    ticks = {n: n.replace(" + ", "\n+ ") for n in names}  # "plain JAX\n+ cannjax.optimize"
    ax.set_xticks(x, [f"{ticks[n]}\n({mem[n]['precision']})" for n in names])
    ax.set_ylabel("MiB")
    ax.set_title("Memory of one training step")
    ax.margins(y=0.25)
    fig.legend(loc="outside right upper")  # off the bars and their value labels
    fig.savefig(out / "memory.png", dpi=90)
    plt.close("all")
    return ["loss.png", "memory.png"]


def _write_html(out: Path, facts: list[str], table: tuple, n: int, plots: list[str]) -> Path:
    """Writes ``report.html``: the facts, the table with its legend and the plots inline."""
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:1em 0}"
        "th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}"
        "caption{text-align:left;font-weight:bold;padding:.3em 0}img{max-width:100%}"
    )
    parts = [
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">',
        f"<title>cannjax demo</title><style>{style}</style></head><body>",
        "<h1>cannjax demo</h1>",
        *(f"<p>{html.escape(line)}</p>" for line in facts),
        render_html(*table, "cannjax vs plain JAX", right=(2, 3, 4, 5)),
        render_html(["column", "meaning"], _legend(n), "what the columns mean"),
    ]
    for name in plots:
        data = base64.b64encode((out / name).read_bytes()).decode("ascii")
        alt = html.escape(name)
        parts.append(f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">')
        parts.append(f"<figcaption>{alt}</figcaption></figure>")
    parts.append('<p>All figures: <a href="report.json">report.json</a>.</p></body></html>\n')
    path = out / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _host_allocator(choice: str) -> str:
    """Sets this process's allocator as ``--allocator`` asks; says what it is."""
    if choice == "default":
        return "the C library's default"
    try:
        kept = keep_freed_memory()
    except RuntimeError:  # called in a process whose JAX backend had already started
        return "the C library's default (JAX had started before the demo)"
    return "glibc keeping freed memory" if kept else "the C library's default (not glibc)"


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns the exit code."""
    allocator = _host_allocator(args.allocator)  # before --mesh may start the backend
    cfg = _check(args)
    model = MODELS[args.model]
    task = SortTask(digits=args.digits)
    params = model.init(jax.random.key(args.seed), cfg)
    sizes = f"L={cfg.layers}, D={cfg.width}, N={cfg.heads}"
    if args.model == "llama":
        sizes += f", K={cfg.kv_heads} kv heads, F={cfg.hidden}"
    facts = [
        f"cannjax demo: {model.title} ({sizes}, T={cfg.seq_len}, V={cfg.vocab}) on the sort "
        f"task, batch {args.batch}, {jax.default_backend()}; host allocator: {allocator}"
    ]
    print(facts[-1])
    # Same initial gradients (to float32 rounding) before any training.
    b0 = task.batch(jax.random.key(args.seed + 2), args.batch)
    g_c = jax.jit(jax.grad(model.loss), static_argnums=3)(
        params, b0.tokens, b0.targets, cfg, b0.weights
    )
    g_p = jax.jit(jax.grad(model.plain_loss), static_argnums=3)(
        params, b0.tokens, b0.targets, cfg, b0.weights
    )
    num = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(g_c), jax.tree_util.tree_leaves(g_p))
    )
    den = max(float(jnp.max(jnp.abs(b))) for b in jax.tree_util.tree_leaves(g_p))
    optimized_loss = optimize(model.plain_loss)
    g_o = jax.jit(jax.grad(optimized_loss), static_argnums=3)(
        params, b0.tokens, b0.targets, cfg, b0.weights
    )
    num_o = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(g_o), jax.tree_util.tree_leaves(g_p))
    )
    facts.append(
        f"gradient agreement with plain JAX at init: max rel. difference {num / den:.2e} "
        f"(cannjax), {num_o / den:.2e} ({OPTIMIZED})"
    )
    print(facts[-1])

    # The cannjax run: cannjax operators, elementwise work fused, each block recomputed in
    # the backward (--remat layer), compute in --precision with loss scaling for float16.
    cannjax_loss = fuse(model.loss)
    print(f"training with cannjax ({args.precision}, remat={args.remat}) for {args.steps} steps")
    trained, run_c, mem_c = _train(
        "cannjax", cannjax_loss, params, cfg, task, args, args.steps, args.precision
    )
    var = None
    if args.variable_length:
        print(f"training cannjax on variable lengths for {args.steps} steps")
        var = _train_variable(cannjax_loss, params, cfg, task, args, args.precision)
    sharded = None
    if args.mesh is not None:
        n_sh = min(args.steps, args.plain_steps)
        print(f"training cannjax sharded over a {args.mesh} mesh for {n_sh} steps")
        sharded = _train_sharded(
            cannjax_loss, params, cfg, task, args, n_sh, args.precision, run_c["losses"]
        )
    run_f32 = None
    if args.precision != "float32":
        # The same run in float32 beside it: same data, same steps, same optimizer.
        print(f"training cannjax (float32) for {args.steps} steps, to compare")
        trained_f32, run_f32, mem_f32 = _train(
            F32_RUN, cannjax_loss, params, cfg, task, args, args.steps
        )
    print(f"training plain JAX for {args.plain_steps} steps")
    _, run_p, mem_p = _train(
        "plain JAX", model.plain_loss, params, cfg, task, args, args.plain_steps
    )
    print(f"training {OPTIMIZED} for {args.plain_steps} steps")
    _, run_o, mem_o = _train(OPTIMIZED, optimized_loss, params, cfg, task, args, args.plain_steps)
    runs = {"cannjax": run_c, "plain JAX": run_p, OPTIMIZED: run_o}
    mem = {"cannjax": mem_c, "plain JAX": mem_p, OPTIMIZED: mem_o}
    acc = _accuracy(model.logits, trained, cfg, task, jax.random.key(args.seed + 3))
    if run_f32 is not None:
        runs = {"cannjax": run_c, F32_RUN: run_f32, **{k: runs[k] for k in runs if k != "cannjax"}}
        mem[F32_RUN] = mem_f32
        acc_f32 = _accuracy(model.logits, trained_f32, cfg, task, jax.random.key(args.seed + 3))
        final, final_f32 = run_c["losses"][-1], run_f32["losses"][-1]
        held_out = [
            _held_out_loss(model.loss, p, cfg, task, jax.random.key(args.seed + 3))
            for p in (trained, trained_f32)
        ]
        precision_report = {
            "held_out_loss": held_out[0],
            "held_out_loss_float32": held_out[1],
            "accuracy_float32": acc_f32,
        }
        facts.append(
            f"{args.precision} against float32 (cannjax, {args.steps} steps, same data): "
            f"held-out loss {held_out[0]:.4f} vs {held_out[1]:.4f} "
            f"({abs(held_out[0] - held_out[1]) / abs(held_out[1]):.2%} apart; last training "
            f"step {final:.4f} vs {final_f32:.4f}), sort accuracy "
            f"{acc:.3f} vs {acc_f32:.3f}, step time {_median_ms(run_c):.1f} vs "
            f"{_median_ms(run_f32):.1f} ms ({_median_ms(run_f32) / _median_ms(run_c):.2f}x)"
        )
    n = min(args.steps, args.plain_steps)
    table = _table(runs, mem, n)
    ratio = _median_ms(run_p) / _median_ms(run_c)
    print()
    print(render(*table, right=(2, 3, 4, 5)))
    print()
    print(render(["column", "meaning"], _legend(n)))
    if run_f32 is not None:
        print("\n" + facts[-1])
    if var is not None:
        print()
        print(render(*_variable_table(run_c, var, cfg.seq_len), right=(1, 5, 6)))
        facts.append(
            f"variable length: {args.steps} steps on lengths {var['lengths'][0]}-"
            f"{var['lengths'][1]} ({var['distinct_lengths']} distinct), gears "
            f"{tuple(var['gears'])}: {var['compiled']} programs compiled, padding overhead "
            f"{var['overhead']:.4f} (padding all to {cfg.seq_len}: "
            f"{var['pad_all_overhead']:.4f}); wall time {var['wall_s']:.1f} s against "
            f"{run_c['compile_s'] + sum(run_c['step_s']):.1f} s at fixed length "
            "(compiles included)"
        )
        print("\n" + facts[-1])
    if sharded is not None:
        n_sh = len(sharded["losses"])
        print()
        print("per device, one step (params+state: parameters, optimizer state and batch):")
        print(render(*_sharded_table(sharded, n_sh), right=(1, 2, 3, 4, 5)))
        data, model = sharded["mesh"]
        facts.append(
            f"sharded over {data}x{model} devices (FSDP over {data}, tensor parallel over "
            f"{model}): per device {sharded['sharded']['temp_bytes'] / MIB:.2f} MiB temp and "
            f"{sharded['sharded']['state_bytes'] / MIB:.2f} MiB of parameters, state and "
            f"batch against {sharded['one_device']['temp_bytes'] / MIB:.2f} and "
            f"{sharded['one_device']['state_bytes'] / MIB:.2f} MiB on one device, "
            f"{sharded['sharded']['collective_bytes'] / MIB:.2f} MiB of collectives per step; "
            f"losses within {sharded['loss_max_rel_difference']:.1e} (relative) of the "
            f"single-device run over {n_sh} steps"
        )
        print("\n" + facts[-1])
    facts.append(
        f"plain JAX step time / cannjax step time = {ratio:.2f}, "
        f"/ {OPTIMIZED} step time = {_median_ms(run_p) / _median_ms(run_o):.2f}; "
        f"final loss {run_c['losses'][-1]:.4f}, "
        f"sort accuracy {acc:.3f} after {args.steps} steps"
    )
    print("\n" + facts[-1])
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model": cfg.__dict__,
        "backend": jax.default_backend(),
        "grad_max_rel_difference": num / den,
        "grad_max_rel_difference_optimized": num_o / den,
        "speedup": ratio,
        "accuracy": acc,
        "memory": mem,
        "runs": {
            k: {
                "losses": v["losses"],
                "step_ms_median": _median_ms(v),
                "compile_s": v["compile_s"],
            }
            for k, v in runs.items()
        },
    }
    if run_f32 is not None:
        report["precision_comparison"] = precision_report
    if var is not None:
        report["variable_length"] = var
    if sharded is not None:
        report["sharded"] = sharded
    report["plots"] = _plots(args.out, runs, mem)
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    page = _write_html(args.out, facts, table, n, report["plots"])
    written = [args.out / "report.json", page, *(args.out / p for p in report["plots"])]
    print("wrote " + ", ".join(map(str, written)))
    return 0
