"""Data-parallel training: gradient all-reduce over a named mesh axis, on one host or many.

The step is ``jax.jit(jax.shard_map(...))`` over a :class:`jax.sharding.Mesh` axis
(``"data"`` by default): every device takes ``B / D`` examples of the batch (``B`` batch,
``D`` devices on the axis), computes the gradient of its local mean loss, and the
gradients are averaged with collectives,

.. math::  g = \\frac{1}{D} \\sum_{d=1}^{D} \\nabla_\\theta \\, \\frac{D}{B} \\sum_{i \\in d}
   \\ell_i(\\theta) = \\nabla_\\theta \\frac{1}{B} \\sum_{i=1}^{B} \\ell_i(\\theta),

which is the full-batch gradient whenever ``loss_fn`` is a mean over the examples. The same
code runs on one process (``jax_num_cpu_devices`` or several accelerators) and on many,
after :func:`initialize` (``jax.distributed`` with gloo collectives on CPU).

Bucketing: gradient leaves are packed (in reverse order, the order backprop produces
them) into flat buffers of at most ``bucket_bytes``; one collective moves a whole bucket.
XLA merges independent all-reduce instructions into one variadic instruction, but the
runtime still issues one collective per operand (XLA:CPU's AllReduceThunk loops over its
buffers), so the figure that matters is the number of all-reduced *buffers*:
:func:`collective_counts` reports both.

Reduced-precision communication (``comm_dtype=jnp.bfloat16``): each bucket is cast to
bfloat16, reduce-scattered with an all-to-all, summed in float32, cast to bfloat16 and
all-gathered. Error (``u = 2**-8``, bfloat16's unit roundoff): the inputs and the result
are each rounded once, the sum is exact to float32, so per element
``|g_hat - g| <= 2u * mean_d |g_d| + O(u^2)`` (about 0.8% of the mean magnitude),
independent of ``D`` (a bfloat16 ``psum`` would round ``D - 1`` partial sums). Note:
XLA:CPU upcasts bfloat16 collectives to float32, so on CPU the wire carries float32 and
only the rounding is bfloat16's; GPU and Ascend collectives move bfloat16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DataParallelStep",
    "StepOutput",
    "all_reduce_mean",
    "collective_counts",
    "data_mesh",
    "data_parallel",
    "initialize",
    "plan_buckets",
    "replicate",
    "shard_batch",
]

DEFAULT_BUCKET_BYTES = 4 * 2**20
"""Default bucket size for gradient all-reduce: 4 MiB."""

_FN = "cannjax.parallel"


# ---------------------------------------------------------------- meshes and placement
def data_mesh(axis_name: str = "data", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-dimensional mesh over ``devices`` (default: all global devices).

    Args:
      axis_name: the mesh axis name the batch is sharded over.
      devices: the devices, in order; default ``jax.devices()`` (every process's devices
        after :func:`initialize`).

    Returns:
      ``jax.sharding.Mesh(devices, (axis_name,))``.

    Raises:
      ValueError: an empty ``axis_name`` or device list.

    Example:
      >>> import cannjax
      >>> mesh = cannjax.parallel.data_mesh("data")
      >>> mesh.axis_names
      ('data',)
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"{_FN}.data_mesh: axis_name must be a non-empty str, got {axis_name!r}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError(f"{_FN}.data_mesh: devices must not be empty")
    return Mesh(np.array(devices), (axis_name,))


def shard_batch(batch: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """Places this process's part of a batch as global arrays sharded over ``axis_name``.

    On one process ``batch`` is the whole batch. On ``N`` processes each passes its own
    ``B / N`` examples (process ``p`` holds rows ``p*B/N ... (p+1)*B/N - 1`` of the global
    batch when the mesh lists devices in process order, as :func:`data_mesh` does) and the
    result is a global array of leading size ``B``.

    Args:
      batch: a pytree of arrays with a common leading (batch) dimension.
      mesh: the mesh; ``axis_name`` must be one of its axes.
      axis_name: the axis the batch is split over.

    Returns:
      The batch as global ``jax.Array`` s sharded ``PartitionSpec(axis_name)``.

    Raises:
      ValueError: unknown axis, leaves with different leading sizes, or a local batch not
        divisible by this process's device count on the axis.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> mesh = cannjax.parallel.data_mesh()
      >>> x = cannjax.parallel.shard_batch(jnp.ones((8, 3)), mesh)
      >>> x.shape, x.sharding.spec
      ((8, 3), P('data',))
    """
    _check_axis(f"{_FN}.shard_batch", mesh, axis_name)
    sizes = _leading_sizes(f"{_FN}.shard_batch", batch)
    local_devices = _local_device_count(mesh, axis_name)
    if sizes and sizes[0][1] % local_devices:
        raise ValueError(
            f"{_FN}.shard_batch: this process's batch has {sizes[0][1]} examples, not "
            f"divisible by its {local_devices} devices on mesh axis {axis_name!r}; "
            "pad or drop examples so each device gets the same number"
        )
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
    )


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places a pytree (parameters, optimizer state) replicated on every device of ``mesh``.

    Every process must pass the same values (for example from the same seed).

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> w = cannjax.parallel.replicate({"w": jnp.ones(3)}, cannjax.parallel.data_mesh())
      >>> w["w"].sharding.is_fully_replicated
      True
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )


def _local_device_count(mesh: Mesh, axis_name: str) -> int:
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.devices.shape[axis], -1)
    me = jax.process_index()
    return sum(any(d.process_index == me for d in row) for row in devs)


def _check_axis(fn: str, mesh: Any, axis_name: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: axis_name {axis_name!r} is not an axis of the mesh (axes "
            f"{mesh.axis_names}); pass one of them or build the mesh with "
            f"cannjax.parallel.data_mesh({axis_name!r})"
        )


def _leading_sizes(fn: str, batch: Any) -> list[tuple[str, int]]:
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    sizes = []
    for path, x in leaves:
        shape = np.shape(x)
        if len(shape) == 0:
            raise ValueError(
                f"{fn}: batch leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar; "
                "every batch leaf needs a leading batch dimension"
            )
        sizes.append((jax.tree_util.keystr(path) or "<root>", shape[0]))
    if len({s for _, s in sizes}) > 1:
        raise ValueError(
            f"{fn}: batch leaves have different leading (batch) sizes "
            f"{dict(sizes)}; every leaf must hold the same examples"
        )
    return sizes


# ---------------------------------------------------------------- bucketing
def plan_buckets(
    leaves: Sequence[Any], bucket_bytes: int | None, comm_dtype: Any = None
) -> tuple[tuple[int, ...], ...]:
    """Groups gradient leaves into all-reduce buckets.

    Leaves are taken in reverse order (the order backprop produces them); consecutive leaves
    of one communication dtype share a bucket while its size stays <= ``bucket_bytes``. A
    leaf of ``bucket_bytes`` or more travels alone (no copy into a flat buffer).
    ``bucket_bytes=None`` or ``0`` gives one bucket per leaf (no bucketing).

    Args:
      leaves: arrays or shape/dtype structs.
      bucket_bytes: bucket capacity in bytes of the communication dtype, or None/0.
      comm_dtype: the dtype on the wire; None keeps each leaf's dtype.

    Returns:
      A tuple of buckets, each a tuple of leaf indices.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> leaves = [jnp.zeros(10), jnp.zeros(10), jnp.zeros(1000)]
      >>> cannjax.parallel.plan_buckets(leaves, bucket_bytes=1024)
      ((2,), (1, 0))
      >>> cannjax.parallel.plan_buckets(leaves, bucket_bytes=None)
      ((2,), (1,), (0,))
    """
    if bucket_bytes is not None and (
        not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 0
    ):
        raise ValueError(f"{_FN}: bucket_bytes must be an int >= 0 or None, got {bucket_bytes!r}")
    order = list(reversed(range(len(leaves))))
    if not bucket_bytes:
        return tuple((i,) for i in order)
    buckets: list[list[int]] = []
    cur: list[int] = []
    cur_bytes, cur_dtype = 0, None
    for i in order:
        dtype = jnp.dtype(comm_dtype or leaves[i].dtype)
        nbytes = math.prod(leaves[i].shape) * dtype.itemsize
        if nbytes >= bucket_bytes:
            buckets.append([i])
            continue
        if cur and (cur_dtype != dtype or cur_bytes + nbytes > bucket_bytes):
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nbytes
        cur_dtype = dtype
    if cur:
        buckets.append(cur)
    return tuple(tuple(b) for b in buckets)


def all_reduce_mean(
    grads: Any,
    axis_name: str = "data",
    *,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    comm_dtype: Any = None,
) -> Any:
    """Averages a gradient pytree over a bound mesh axis, bucketed.

    Call it inside ``jax.shard_map`` with ``axis_name`` bound, on *local* gradients: with
    shard_map's default ``check_vma=True``, differentiate with respect to
    ``jax.lax.pcast(params, axis_name, to="varying")`` (otherwise jax.grad has already
    summed the gradient of replicated parameters, leaf by leaf). Computes
    ``mean_d g_d`` for every leaf: float32 buckets with one ``psum``; with
    ``comm_dtype=jnp.bfloat16`` an all-to-all reduce-scatter in bfloat16, a float32 sum and
    a bfloat16 all-gather (error bound in the module docstring). Results keep each leaf's
    dtype.

    Args:
      grads: a pytree of floating arrays (identical structure on every device).
      axis_name: the mesh axis to average over.
      bucket_bytes: bucket capacity (see :func:`plan_buckets`); None or 0: one collective
        per leaf.
      comm_dtype: None (each leaf's dtype) or ``jnp.bfloat16``.

    Returns:
      The averaged gradients, same structure, invariant over ``axis_name``.

    Raises:
      ValueError: ``axis_name`` is not bound (called outside shard_map), or a bad option.
      TypeError: a non-floating leaf.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = cannjax.parallel.data_mesh()
      >>> f = jax.shard_map(lambda g: cannjax.parallel.all_reduce_mean(g, "data"),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> n = len(jax.devices())
      >>> float(f(jnp.arange(float(n)))[0]) == (n - 1) / 2
      True
    """
    fn = f"{_FN}.all_reduce_mean"
    comm = _check_comm_dtype(fn, comm_dtype)
    try:
        n = jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"{fn}: axis name {axis_name!r} is not bound here; call it inside "
            f"jax.shard_map(..., mesh=mesh) with {axis_name!r} among the mesh axes "
            "(or use cannjax.parallel.data_parallel, which does)"
        ) from e
    leaves, treedef = jax.tree.flatten(grads)
    checks_vma = axis_name in _varying(jax.lax.axis_index(axis_name))
    for path, x in jax.tree_util.tree_leaves_with_path(grads):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise TypeError(
                f"{fn}: gradient leaf {jax.tree_util.keystr(path)} has dtype "
                f"{jnp.result_type(x)}; only floating gradients can be averaged"
            )
        if checks_vma and axis_name not in _varying(x):
            raise ValueError(
                f"{fn}: gradient leaf {jax.tree_util.keystr(path)} is already invariant over "
                f"{axis_name!r}: jax.grad inside shard_map sums the gradient of replicated "
                "parameters itself (one psum per leaf, unbucketed). Differentiate with respect "
                f"to jax.lax.pcast(params, {axis_name!r}, to='varying') to get local gradients"
            )
    out: list[Any] = [None] * len(leaves)
    for bucket in plan_buckets(leaves, bucket_bytes, comm):
        parts = [leaves[i] for i in bucket]
        if comm is None:
            if len(parts) == 1:
                reduced = [jax.lax.psum(parts[0], axis_name) / n]
            else:
                flat = jnp.concatenate([p.reshape(-1) for p in parts])
                reduced = _split(jax.lax.psum(flat, axis_name) / n, parts)
        else:
            flat = jnp.concatenate([p.reshape(-1).astype(comm) for p in parts])
            reduced = _split(_reduce_mean_lowp(flat, axis_name, n, comm), parts)
        for i, r in zip(bucket, reduced):
            out[i] = r.astype(leaves[i].dtype)
    return jax.tree.unflatten(treedef, out)


def _varying(x: Any) -> frozenset:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()))


def _split(flat: jax.Array, like: Sequence[jax.Array]) -> list[jax.Array]:
    out, start = [], 0
    for p in like:
        out.append(flat[start : start + p.size].reshape(p.shape))
        start += p.size
    return out


def _reduce_mean_lowp(flat: jax.Array, axis_name: str, n: int, comm: Any) -> jax.Array:
    # Reduce-scatter as an all-to-all in the wire dtype: device j receives chunk j of every
    # device and sums those in float32 (exact to float32 rounding); the mean is rounded to
    # the wire dtype once more and all-gathered. Two roundings in all, whatever n is.
    size = flat.shape[0]
    pad = (-size) % n
    x = jnp.pad(flat, (0, pad)).reshape(n, -1)
    recv = jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)
    mine = (recv.astype(jnp.float32).sum(0) / n).astype(comm)
    full = jax.lax.all_gather(mine, axis_name, tiled=True, to="invarying")
    return full[:size].astype(jnp.float32)


def _check_comm_dtype(fn: str, comm_dtype: Any) -> Any:
    if comm_dtype is None:
        return None
    try:
        dt = jnp.dtype(comm_dtype)
    except TypeError as e:
        raise ValueError(f"{fn}: comm_dtype must be None or bfloat16, got {comm_dtype!r}") from e
    if dt != jnp.bfloat16:
        raise ValueError(
            f"{fn}: comm_dtype must be None (communicate in the gradient's dtype) or "
            f"jnp.bfloat16, got {dt}"
        )
    return dt


# ---------------------------------------------------------------- the training step
class StepOutput(NamedTuple):
    """What a data-parallel step returns.

    Attributes:
      params: updated parameters (unchanged on a skipped non-finite step).
      opt_state: updated optimizer state (unchanged on a skipped step).
      loss_scale: the adjusted loss scale, or None when none was passed.
      metrics: dict of scalars, identical on every device: ``loss`` (unscaled mean over
        the global batch), ``grad_norm`` (global L2 norm of the averaged gradient),
        ``grads_finite`` (bool, agreed by every device), plus the averaged ``aux`` entries
        when ``has_aux``.
    """

    params: Any
    opt_state: Any
    loss_scale: Any
    metrics: dict


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """A jitted data-parallel training step; build it with :func:`data_parallel`.

    Call ``step(params, opt_state, batch, loss_scale=None) -> StepOutput``. ``batch`` is
    the global batch (on several processes: global arrays from :func:`shard_batch`).

    The loss-scale hook is any pytree with ``scale(loss) -> loss``,
    ``unscale(grads) -> grads`` and ``adjust(grads_finite) -> new loss scale`` (the jmp /
    ``cannjax.amp`` protocol). The finite flag passed to ``adjust`` is reduced with
    ``pmin`` over the axis, so every device skips or applies the same step.
    """

    loss_fn: Callable
    optimizer: optax.GradientTransformation
    mesh: Mesh
    axis_name: str
    bucket_bytes: int | None
    comm_dtype: Any
    has_aux: bool
    skip_nonfinite: bool
    _jitted: Callable = dataclasses.field(repr=False, compare=False)

    def __call__(self, params: Any, opt_state: Any, batch: Any, loss_scale: Any = None):
        """Runs one step; see the class docstring."""
        self._validate(params, opt_state, batch, loss_scale)
        return self._jitted(params, opt_state, batch, loss_scale)

    def lower(self, params: Any, opt_state: Any, batch: Any, loss_scale: Any = None):
        """``jax.jit(...).lower`` of the step, for HLO inspection."""
        self._validate(params, opt_state, batch, loss_scale)
        return self._jitted.lower(params, opt_state, batch, loss_scale)

    def _validate(self, params, opt_state, batch, loss_scale):
        fn = f"{_FN}.data_parallel"
        sizes = _leading_sizes(fn, batch)
        if not sizes:
            raise ValueError(f"{fn}: batch has no array leaves")
        n = self.mesh.shape[self.axis_name]
        if sizes[0][1] % n:
            raise ValueError(
                f"{fn}: batch size {sizes[0][1]} is not divisible by the {n} devices on "
                f"mesh axis {self.axis_name!r}; pad or drop examples to a multiple of {n}"
            )
        if jax.process_count() > 1:
            for path, x in jax.tree_util.tree_leaves_with_path((params, opt_state, batch)):
                if not isinstance(x, jax.Array):
                    raise TypeError(
                        f"{fn}: with {jax.process_count()} processes every input must be a "
                        f"global jax.Array, got {type(x).__name__} at {jax.tree_util.keystr(path)}"
                        "; use cannjax.parallel.shard_batch / replicate"
                    )
        _check_opt_state(fn, self.optimizer, params, opt_state)
        if loss_scale is not None:
            missing = [m for m in ("scale", "unscale", "adjust") if not hasattr(loss_scale, m)]
            if missing:
                raise TypeError(
                    f"{fn}: loss_scale must provide scale(loss), unscale(grads) and "
                    f"adjust(grads_finite); {type(loss_scale).__name__} lacks {missing}"
                )


def _check_opt_state(fn: str, optimizer, params, opt_state) -> None:
    expected = jax.tree.structure(jax.eval_shape(optimizer.init, params))
    got = jax.tree.structure(opt_state)
    if expected != got:
        raise ValueError(
            f"{fn}: opt_state does not match optimizer.init(params) (the pytrees differ: "
            f"expected {expected}, got {got}); initialise it with optimizer.init(params) "
            "for these params"
        )


def data_parallel(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    comm_dtype: Any = None,
    has_aux: bool = False,
    skip_nonfinite: bool = False,
    donate: bool = False,
) -> DataParallelStep:
    """Builds a data-parallel training step: shard, local grads, all-reduce mean, update.

    Per device (``shard_map`` over ``axis_name``; params and optimizer state replicated)::

        loss, g = value_and_grad(scale(loss_fn))(params, local_batch)
        finite  = pmin(all(isfinite(g)), axis)            # every device agrees
        g       = unscale(all_reduce_mean(g, axis))       # bucketed
        params, opt_state = optimizer update, kept as they were if skipping and not finite
        loss_scale = loss_scale.adjust(finite); metrics = pmean(loss, aux), grad_norm

    ``loss_fn(params, batch)`` must return the *mean* loss over the examples in ``batch``
    (``(loss, aux)`` with ``has_aux``; ``aux`` a dict of float scalars, averaged over
    devices); then the averaged gradient equals the full-batch gradient.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)``).
      optimizer: an optax GradientTransformation.
      mesh: the mesh (default: :func:`data_mesh` over all devices).
      axis_name: the mesh axis the batch is split over.
      bucket_bytes: all-reduce bucket capacity in bytes; None or 0 disables bucketing.
      comm_dtype: None or ``jnp.bfloat16`` (float32 accumulation; see the module docs).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      skip_nonfinite: skip the update on a non-finite gradient even without a loss scale
        (with a loss scale the step always skips).
      donate: donate params and optimizer state buffers to the step.

    Returns:
      A :class:`DataParallelStep`.

    Raises:
      ValueError: ``axis_name`` not in the mesh, bad bucket size or comm dtype; at call
        time: batch not divisible by the devices, batch leaves of different sizes,
        optimizer state not built for these params.
      TypeError: ``loss_fn`` not callable, ``optimizer`` not a GradientTransformation, a
        loss scale without ``scale``/``unscale``/``adjust``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, cannjax
      >>> def loss_fn(w, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ w - y) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> step = cannjax.parallel.data_parallel(loss_fn, opt)
      >>> w = jnp.zeros(3)
      >>> x = jnp.ones((8, 3)); y = jnp.ones(8)
      >>> out = step(w, opt.init(w), (x, y))
      >>> float(out.metrics["loss"]), bool(out.metrics["grads_finite"])
      (1.0, True)
    """
    fn = f"{_FN}.data_parallel"
    if not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{fn}: optimizer must be an optax.GradientTransformation, got "
            f"{type(optimizer).__name__}"
        )
    mesh = data_mesh(axis_name) if mesh is None else mesh
    _check_axis(fn, mesh, axis_name)
    plan_buckets([], bucket_bytes)  # validates bucket_bytes
    comm = _check_comm_dtype(fn, comm_dtype)
    sync = functools.partial(
        all_reduce_mean, axis_name=axis_name, bucket_bytes=bucket_bytes, comm_dtype=comm
    )

    def local_step(params, opt_state, batch, loss_scale):
        def scaled(p):
            out = loss_fn(p, batch)
            loss, aux = out if has_aux else (out, {})
            if not isinstance(aux, dict):
                raise TypeError(f"{fn}: with has_aux, aux must be a dict, got {type(aux).__name__}")
            s = loss if loss_scale is None else loss_scale.scale(loss)
            return s, (loss, aux)

        # Varying copies: jax.grad then returns local gradients (no implicit psum per
        # leaf), and all_reduce_mean does the communication, bucketed.
        local = jax.tree.map(lambda p: jax.lax.pcast(p, axis_name, to="varying"), params)
        (_, (loss, aux)), grads = jax.value_and_grad(scaled, has_aux=True)(local)
        local_finite = _all_finite(grads)
        grads = sync(grads)
        if loss_scale is not None:
            grads = loss_scale.unscale(grads)
        finite = jax.lax.pmin(local_finite.astype(jnp.int32), axis_name).astype(bool)
        finite = finite & _all_finite(grads)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        if loss_scale is not None or skip_nonfinite:
            new_params = _select(finite, new_params, params)
            new_opt = _select(finite, new_opt, opt_state)
        new_scale = None if loss_scale is None else loss_scale.adjust(finite)
        for k in sorted(aux):
            if jnp.shape(aux[k]) != ():
                raise ValueError(
                    f"{fn}: aux[{k!r}] has shape {jnp.shape(aux[k])}; has_aux metrics must "
                    "be scalars (they are averaged over devices)"
                )
        # One collective for every scalar metric.
        names = ["loss", *sorted(aux)]
        vals = jnp.stack([jnp.asarray(loss, jnp.float32)] + [aux[k] for k in sorted(aux)])
        vals = jax.lax.pmean(vals.astype(jnp.float32), axis_name)
        metrics = dict(zip(names, list(vals)))
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["grads_finite"] = finite
        return StepOutput(new_params, new_opt, new_scale, metrics)

    def step(params, opt_state, batch, loss_scale):
        body = jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(P(), P(), P(axis_name), P()),
            out_specs=P(),
        )
        return body(params, opt_state, batch, loss_scale)

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return DataParallelStep(
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        axis_name=axis_name,
        bucket_bytes=bucket_bytes,
        comm_dtype=comm,
        has_aux=has_aux,
        skip_nonfinite=skip_nonfinite,
        _jitted=jitted,
    )


def _all_finite(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def _select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


# ---------------------------------------------------------------- HLO inspection
_COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")


def collective_counts(lowered_or_compiled: Any) -> dict[str, dict[str, int]]:
    """Counts collectives in compiled HLO: instructions and the buffers they move.

    Args:
      lowered_or_compiled: a ``jax.stages.Lowered`` (it is compiled) or ``Compiled``, or
        the compiled HLO text.

    Returns:
      ``{kind: {"ops": instructions, "buffers": operands}}`` for all-reduce, all-to-all,
      all-gather, reduce-scatter and collective-permute (asynchronous ``-start`` forms
      counted once). The runtime issues one collective per buffer.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = cannjax.parallel.data_mesh()
      >>> f = jax.jit(jax.shard_map(lambda a, b: (jax.lax.psum(a, "data"),
      ...     jax.lax.psum(b, "data")), mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> n = len(jax.devices())
      >>> c = cannjax.parallel.collective_counts(f.lower(jnp.ones(n), jnp.ones(n)))
      >>> c["all-reduce"]["buffers"]
      2
    """
    obj = lowered_or_compiled
    if hasattr(obj, "compile"):
        obj = obj.compile()
    text = obj if isinstance(obj, str) else obj.as_text()
    counts = {k: {"ops": 0, "buffers": 0} for k in _COLLECTIVES}
    for line in text.splitlines():
        m = re.search(r"=\s*(.*?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(([^)]*)\)", line)
        if not m:
            continue
        kind = m.group(2)
        counts[kind]["ops"] += 1
        counts[kind]["buffers"] += len([a for a in m.group(4).split(",") if a.strip()])
    return counts


# ---------------------------------------------------------------- many processes
def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_device_count: int | None = None,
    init_timeout_s: int = 60,
    heartbeat_timeout_s: int = 10,
    cpu_collectives: str | None = "gloo",
) -> None:
    """Joins this process to a multi-process JAX job (``jax.distributed``), with timeouts.

    Call it first, before any other JAX call. Process 0 runs the coordinator at
    ``coordinator_address``; the others connect to it. Afterwards ``jax.devices()`` lists
    every process's devices and :func:`data_parallel` steps span them all.

    Failure behaviour (all bounded):

    * a coordinator that cannot be reached: processes other than 0 probe the address first
      and raise ``TimeoutError`` after ``init_timeout_s``; process 0 waiting for peers that
      never come is aborted by JAX after ``init_timeout_s`` (``DEADLINE_EXCEEDED``);
    * a process that dies later: the coordination service misses its heartbeats and
      terminates every other process after about ``heartbeat_timeout_s`` with "Terminating
      process because the JAX distributed service detected fatal errors ... another task
      died" (a process abort, exit status != 0, even when blocked in a collective).

    Args:
      coordinator_address: ``"host:port"`` of process 0 (``127.0.0.1:port`` on one host).
      num_processes: the number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: on CPU, the number of devices this process exposes
        (``jax_num_cpu_devices``); None leaves the setting alone.
      init_timeout_s: seconds to wait for every process to connect.
      heartbeat_timeout_s: seconds without heartbeats after which a process counts as dead.
      cpu_collectives: ``jax_cpu_collectives_implementation`` (``"gloo"``, ``"mpi"``) or
        None to leave it alone.

    Raises:
      ValueError: a malformed address or out-of-range ids/timeouts.
      TimeoutError: the coordinator did not accept a connection within ``init_timeout_s``.
      RuntimeError: JAX was already used in this process (initialize must come first).

    Example:
      >>> import cannjax
      >>> cannjax.parallel.initialize("127.0.0.1:notaport", 2, 1)
      Traceback (most recent call last):
      ...
      ValueError: cannjax.parallel.initialize: coordinator_address must be 'host:port' ...
    """
    fn = f"{_FN}.initialize"
    host, port = _parse_address(fn, coordinator_address)
    for name, v, lo in (("num_processes", num_processes, 1), ("init_timeout_s", init_timeout_s, 1),
                        ("heartbeat_timeout_s", heartbeat_timeout_s, 1)):  # fmt: skip
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{fn}: {name} must be an int >= {lo}, got {v!r}")
    if not isinstance(process_id, (int, np.integer)) or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{fn}: process_id must be an int in [0, {num_processes}), got {process_id!r}"
        )
    if local_device_count is not None and (
        not isinstance(local_device_count, int) or local_device_count < 1
    ):
        raise ValueError(
            f"{fn}: local_device_count must be an int >= 1, got {local_device_count!r}"
        )
    if process_id != 0:
        _wait_for_coordinator(fn, host, port, init_timeout_s)
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes=int(num_processes),
            process_id=int(process_id),
            initialization_timeout=int(init_timeout_s),
            heartbeat_timeout_seconds=int(heartbeat_timeout_s),
            shutdown_timeout_seconds=int(max(heartbeat_timeout_s, 5)),
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"{fn}: jax.distributed could not start ({e}); call "
            "cannjax.parallel.initialize before any other JAX computation, once per process"
        ) from e


def _parse_address(fn: str, address: Any) -> tuple[str, int]:
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d{1,5})", address) if isinstance(address, str) else None
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(
            f"{fn}: coordinator_address must be 'host:port' with a port in 1..65535 "
            f"(e.g. '127.0.0.1:12345'), got {address!r}"
        )
    return m.group(1), int(m.group(2))


def _wait_for_coordinator(fn: str, host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(1.0, left)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.1, max(left, 0)))
    raise TimeoutError(
        f"{fn}: the coordinator at {host}:{port} did not accept a connection within "
        f"{timeout_s} s (last error: {last}); start process 0 first, check the address and "
        "port, or raise init_timeout_s"
    )
