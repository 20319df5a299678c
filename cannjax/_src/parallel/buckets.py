"""Gradient all-reduce over a named mesh axis: bucketed, optionally in bfloat16.

:func:`all_reduce_mean` averages local gradients over the axis,
``g = (1/D) sum_d g_d`` (``D`` devices on the axis).

Bucketing: gradient leaves are packed (in reverse order, the order backprop produces
them) into flat buffers of at most ``bucket_bytes``; one collective moves a whole bucket
(:func:`plan_buckets`). XLA merges independent all-reduce instructions into one variadic
instruction, but the runtime still issues one collective per operand (XLA:CPU's
AllReduceThunk loops over its buffers), so the figure that matters is the number of
all-reduced *buffers*: :func:`cannjax.parallel.collective_counts` reports both.

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

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_BUCKET_BYTES = 4 * 2**20
"""Default bucket size for gradient all-reduce: 4 MiB."""

_FN = "cannjax.parallel"


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
