"""Matrix products whose backward stays on XLA:CPU's fast dot path.

Plain JAX autodiff of ``x @ w`` with ``x`` of rank 3 or more contracts the weight
gradient over two axes at once (``dot_general`` with ``lhs_contracting_dims={0}`` after
XLA's rewrites) and copies a transposed cotangent first; XLA:CPU runs such dots outside
its fast (YNNPACK) matrix kernel. The rules here fold every batch axis into the row axis
(``x2 = x.reshape(N, in)``), compute ``dx = g2 @ w^T`` (a plain "NT" product) and
``dw = x2^T @ g2`` with ``x2^T`` materialized behind an ``optimization_barrier``, so
XLA cannot fold the transpose back into the dot: every dot in the backward is a
row-major product with the left operand contracted on its last axis.

Shape letters: ``N`` rows (all batch axes folded), ``B...`` batch axes, ``M``, ``K``,
``P`` matrix axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from cannjax._src.core import dots
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.symbolic import less
from cannjax._src.core.validate import as_float, dense_operands


def _dot(a: jax.Array, b: jax.Array, ca: int, cb: int, nbatch: int = 0) -> jax.Array:
    """``dot_general`` of ``a`` and ``b`` contracting ``a[ca]`` with ``b[cb]``.

    The first ``nbatch`` axes of both are batch axes (canonical order, so XLA keeps the
    product on its batched fast path). Half-precision operands take the platform's dot
    form (:mod:`cannjax._src.core.dots`: float32 accumulation).
    """
    batch = tuple(range(nbatch))
    return dots.dot_general(a, b, (((ca,), (cb,)), (batch, batch)))


def _transposed(a: jax.Array) -> jax.Array:
    """``a`` with its last two axes swapped, materialized.

    The barrier keeps XLA's algebraic simplifier from folding the transpose into the
    following dot (which would turn it into a ``lhs_contracting_dims={0}`` dot, off the
    fast path); the copy costs one pass over ``a``, a few percent of the product.
    """
    return lax.optimization_barrier(jnp.swapaxes(a, -1, -2))


def _rows(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _row_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w`` for ``x [..., K]``, ``w [K, P]``, as one 2-D product ``[N, K] @ [K, P]``."""
    return _dot(_rows(x), w, 1, 0).reshape(*x.shape[:-1], w.shape[1])


def _row_product_grads(x: jax.Array, w: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cotangents of ``x @ w`` (``x [..., K]``, ``w [K, P]``) for the output cotangent ``g``.

    ``dx = g2 @ w^T`` ("NT" product) and ``dw = x2^T @ g2`` (:func:`weight_grad`), with
    ``x2``, ``g2`` the 2-D row views.
    """
    x2, g2 = _rows(x), _rows(g)
    dx = _dot(g2, w, 1, 1).reshape(x.shape)
    return dx, weight_grad(x2, g2)


def rows(v: jax.Array) -> jax.Array:
    """``v [..., K]`` with its leading axes folded into rows: ``[N, K]``."""
    return v.reshape(-1, v.shape[-1])


def nn_product(a: jax.Array, w: jax.Array, acc) -> jax.Array:
    """``a @ w`` (``a [N, K]``, ``w [K, P]``), accumulated in ``acc``."""
    return dots.matmul(a, w, out_dtype=acc)


def nt_product(g: jax.Array, w: jax.Array, acc) -> jax.Array:
    """``g @ w^T`` (``g [N, P]``, ``w [K, P]``): the "NT" product of an input cotangent."""
    return dots.matmul_t(g, w, out_dtype=acc)


def normal_samples(key, *shapes):
    """Standard normal float32 arrays of ``shapes``; a matrix ``[K, P]`` divided by
    ``sqrt(K)``, so that products with it stay of order 1 (the layers' samples)."""
    keys = jax.random.split(key, len(shapes))
    return tuple(
        jax.random.normal(k, s, jnp.float32) / math.sqrt(s[-2] if len(s) == 2 else 1.0)
        for k, s in zip(keys, shapes)
    )


def weight_grad(x2: jax.Array, g2: jax.Array, acc=None) -> jax.Array:
    """``x2^T @ g2`` for ``x2 [N, K]``, ``g2 [N, P]``: one dot contracting the rows of both.

    This is the form plain autodiff emits. Two reasons to keep it, measured in
    ``benchmarks/xla_cpu_facts.py``: a materialized transpose of either operand is a
    second layout of an array the input cotangent also reads, and under a sharded batch
    the partitioner gathers each layout separately (one extra activation-sized
    all-gather per layer under FSDP); and on this XLA:CPU build the whole GPT step is no
    slower with it than with the smaller operand copied transposed. ``acc``: the
    dtype of the result (default: the operands'). Half-precision operands take the
    platform's weight-gradient form (:func:`cannjax._src.core.dots.weight_grad`).
    """
    return dots.weight_grad(x2, g2, out_dtype=acc)


def _bcast_bias(b: jax.Array, ndim: int) -> jax.Array:
    return b.reshape((1,) * (ndim - 1) + b.shape)


def _normal(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return tuple(
        jax.random.normal(k, s, jnp.float32) / math.sqrt(s[0] if len(s) == 1 else s[-2])
        for k, s in zip(keys, shapes)
    )


# ------------------------------------------------------------------------------ linear
def _linear_forward(x, w, *b, bias):
    y = _row_product(x, w)
    if bias:
        y = y + _bcast_bias(b[0], y.ndim)
    return y, {"x": x, "w": w}


def _linear_tangent(res, dx, dw, *db, bias):
    dy = _row_product(dx, res["w"]) + _row_product(res["x"], dw)
    if bias:
        dy = dy + _bcast_bias(db[0], dy.ndim)
    return dy


def _linear_backward(res, g, *, bias):
    dx, dw = _row_product_grads(res["x"], res["w"], g)
    return (dx, dw, _rows(g).sum(0)) if bias else (dx, dw)


_linear = defop(
    "linear",
    forward=_linear_forward,
    tangent=_linear_tangent,
    backward=_linear_backward,
    residuals={"x": "the input x, [..., in]", "w": "the weight w, [in, out]"},
    level=Level.RECOMPUTE,
    reuse=(2,),
)


def _linear_reference(x, w, b=None):
    y = x @ w
    return y if b is None else y + _bcast_bias(b, y.ndim)


def _linear_edges():
    k = jax.random.key(7)
    x3, w, b = _normal(k, (2, 3, 4), (4, 5), (5,))
    ones = jnp.ones((2, 4), jnp.float32)
    return [
        EdgeCase((x3, w)),  # no bias
        EdgeCase((x3[0, 0], w, b)),  # rank-1 x
        # A zero row (dw gets nothing from it), large inputs and bias, small weights.
        EdgeCase((jnp.concatenate([jnp.zeros((1, 4)), x3[0] * 1e4]), w * 1e-4, b * 1e4)),
        EdgeCase((jnp.zeros((0, 4), jnp.float32), w, b), finite_differences=False),  # no rows
        EdgeCase(
            (ones, jnp.ones((4, 3), jnp.float32), jnp.zeros(3, jnp.float32)),
            expected_value=jnp.full((2, 3), 4.0),
            expected_grad=(jnp.full((2, 4), 3.0), jnp.full((4, 3), 2.0), jnp.full(3, 2.0)),
        ),
    ]


@registered(
    _linear,
    reference=_linear_reference,
    sample=lambda key: _normal(key, (2, 3, 8), (8, 6), (6,)),
    edges=_linear_edges,
)
def linear(x: ArrayLike, w: ArrayLike, b: ArrayLike | None = None) -> jax.Array:
    """Affine map over the last axis, ``y = x @ w + b``.

    ``x [..., K]``, ``w [K, P]``, ``b [P]`` (optional), ``y [..., P]``. All batch axes of
    ``x`` are folded into rows, so forward and backward are 2-D products:

    * ``dx = g @ w^T``, ``dw = x2^T @ g2``, ``db = sum_rows(g2)`` (``x2``, ``g2``: ``x``
      and ``g`` reshaped to ``[N, K]``, ``[N, P]``);
    * tangent: ``dy = dx @ w + x @ dw + db``.

    Keeps ``x`` and ``w`` (nothing for ``b``): the same residuals plain autodiff keeps,
    but every backward dot stays on XLA:CPU's fast path for ``x`` of any rank. Inputs of
    different float dtypes are promoted as ``jnp.matmul`` does.

    Args:
      x: input, ``[..., K]``, rank >= 1.
      w: weight, ``[K, P]``.
      b: optional bias, ``[P]``.

    Returns:
      ``[..., P]``.

    Raises:
      TypeError: if an argument is not a floating-point array.
      ValueError: if ``x`` is a scalar, ``w`` is not ``[x.shape[-1], P]`` or ``b`` not
        ``[P]``.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> y = cannjax.ops.linear(jnp.ones((2, 3, 4)), jnp.ones((4, 5)), jnp.zeros(5))
      >>> y.shape, float(y[0, 0, 0])
      ((2, 3, 5), 4.0)

    References:
      Huawei CANN operator MatMul
    """
    fn = "cannjax.ops.linear"
    x, w = dense_operands(fn, x, w)
    args = [x, w]
    if b is not None:
        b = as_float(fn, "b", b)
        if b.shape != (w.shape[1],):
            raise ValueError(
                f"{fn}: b must have shape (out,) == ({w.shape[1]},) to match w.shape = "
                f"{tuple(w.shape)}, got {tuple(b.shape)}"
            )
        args.append(b)
    dtype = jnp.result_type(*args)
    return _linear(*(a.astype(dtype) for a in args), bias=b is not None)


# ------------------------------------------------------------------------------ matmul
def _batch_shapes(a, b):
    """Full batch shape and the batch shapes of ``a``, ``b`` left-padded with ones."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    pad = lambda s: (1,) * (len(batch) - len(s)) + s  # noqa: E731
    return batch, pad(a.shape[:-2]), pad(b.shape[:-2])


def _batched_product(a, b):
    """``a @ b`` for ``a [..., M, K]``, ``b [..., K, P]`` (rank >= 2, batch broadcasts)."""
    if b.ndim == 2:
        return _row_product(a, b)
    batch, _, _ = _batch_shapes(a, b)
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    return _dot(a, b, a.ndim - 1, b.ndim - 2, len(batch))


def _unbroadcast(ct, batch_of_arg, shape):
    """Sums ``ct [batch..., R, C]`` over the batch axes the argument was broadcast along."""
    axes = tuple(
        i for i, (n, m) in enumerate(zip(batch_of_arg, ct.shape[:-2])) if n == 1 and m != 1
    )
    return ct.sum(axes, keepdims=True).reshape(shape) if axes else ct.reshape(shape)


def _matmul_forward(a, b):
    return _batched_product(a, b), {"a": a, "b": b}


def _matmul_tangent(res, da, db):
    return _batched_product(da, res["b"]) + _batched_product(res["a"], db)


def _matmul_backward(res, g):
    a, b = res["a"], res["b"]
    if b.ndim == 2:  # a matrix on the right: fold a's batch axes into rows
        return _row_product_grads(a, b, g)
    batch, batch_a, batch_b = _batch_shapes(a, b)
    nb = len(batch)
    af = jnp.broadcast_to(a, batch + a.shape[-2:])
    bf = jnp.broadcast_to(b, batch + b.shape[-2:])
    da = _dot(g, bf, nb + 1, nb + 1, nb)  # g @ b^T: "NT", batched
    M, K, P = a.shape[-2], a.shape[-1], b.shape[-1]
    if jnp.dtype(af.dtype).itemsize < 4:
        # a^T @ g in half precision: the platform's dot form places the transpose
        # (cannjax._src.core.dots: a row-major a^T where XLA:CPU would upcast).
        db = _dot(af, g, nb, nb, nb)
    # Undecided for a symbolic size (jax.export): the product as plain autodiff emits
    # it, right at every size (only large ones run slower).
    elif less(M * K * P, _SMALL_BATCHED, undecided=True):
        # a^T @ g as XLA emits it (contracting a's row axis): for small matrices XLA:CPU's
        # generic batched dot beats copying a^T for its YNNPACK path, which is slow on
        # batched products (benchmarks/xla_cpu_facts.py, "batched a^T g").
        db = _dot(af, g, nb, nb, nb)
    else:
        db = _dot(_transposed(af), g, nb + 1, nb, nb)  # a^T @ g: "NN", a^T materialized
    return _unbroadcast(da, batch_a, a.shape), _unbroadcast(db, batch_b, b.shape)


# Per-matrix multiply-adds below which the batched a^T @ g is left as emitted: for small
# matrices XLA:CPU's generic batched dot beats copying a^T, for large ones the copy pays
# (benchmarks/xla_cpu_facts.py, "batched a^T g"; the figures are in docs/performance.md).
_SMALL_BATCHED = 2**23


_matmul = defop(
    "matmul",
    forward=_matmul_forward,
    tangent=_matmul_tangent,
    backward=_matmul_backward,
    residuals={"a": "the left operand a", "b": "the right operand b"},
    level=Level.RECOMPUTE,
)


def _matmul_edges():
    k = jax.random.split(jax.random.key(11), 7)
    return [
        EdgeCase(_normal(k[0], (4,), (4,))),  # vector . vector -> scalar
        EdgeCase(_normal(k[1], (4,), (4, 3))),  # vector @ matrix
        EdgeCase(_normal(k[2], (3, 4), (4,))),  # matrix @ vector
        EdgeCase(_normal(k[3], (2, 3, 4), (4, 5))),  # batch @ matrix (folded rows)
        EdgeCase(_normal(k[5], (2, 1, 3, 4), (5, 4, 2))),  # broadcast batch axes
        EdgeCase(_normal(k[6], (4,), (2, 4, 3))),  # vector @ batch
    ]


@registered(
    _matmul,
    reference=jnp.matmul,
    sample=lambda key: _normal(key, (3, 4, 6), (3, 6, 5)),
    edges=_matmul_edges,
)
def matmul(a: ArrayLike, b: ArrayLike) -> jax.Array:
    """Matrix product with ``jnp.matmul``'s semantics, batched and broadcasting.

    ``a [..., M, K] @ b [..., K, P] -> [..., M, P]``; the batch axes broadcast against
    each other; a 1-D ``a`` is a row vector and a 1-D ``b`` a column vector (the
    promoted axis is dropped from the result).

    Backward: ``da = sum_bcast(g @ b^T)``,
    ``db = sum_bcast(a^T @ g)``, summing over the batch axes an argument was broadcast
    along. When ``b`` is a matrix, ``a``'s batch axes fold into rows (as in
    :func:`linear`); otherwise the products are batched ``dot_general`` calls with the
    batch axes leading, the contraction on the left operand's last axis and ``a^T``
    materialized, which is XLA:CPU's fast batched layout. Tangent:
    ``dy = da @ b + a @ db``. Keeps ``a`` and ``b``.

    Args:
      a: ``[..., M, K]`` or ``[K]``.
      b: ``[..., K, P]`` or ``[K]``.

    Returns:
      ``[..., M, P]`` (without ``M`` if ``a`` is 1-D, without ``P`` if ``b`` is 1-D).

    Raises:
      TypeError: if an argument is not a floating-point array.
      ValueError: if an argument is a scalar, the contracted sizes differ or the batch
        shapes do not broadcast.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> cannjax.ops.matmul(jnp.ones((4, 1, 2, 3)), jnp.ones((5, 3, 6))).shape
      (4, 5, 2, 6)

    References:
      Huawei CANN operator MatMul
    """
    fn = "cannjax.ops.matmul"
    a, b = as_float(fn, "a", a), as_float(fn, "b", b)
    for name, v in (("a", a), ("b", b)):
        if v.ndim < 1:
            raise ValueError(f"{fn}: {name} must have rank >= 1, got a scalar")
    ka = a.shape[-1]
    kb = b.shape[-2] if b.ndim >= 2 else b.shape[0]
    if ka != kb:
        raise ValueError(
            f"{fn}: contracted sizes differ: a.shape[-1] == {ka} but b.shape"
            f"{'[-2]' if b.ndim >= 2 else '[0]'} == {kb} (a.shape={tuple(a.shape)}, "
            f"b.shape={tuple(b.shape)})"
        )
    try:
        jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except ValueError:
        raise ValueError(
            f"{fn}: batch shapes {tuple(a.shape[:-2])} (a.shape={tuple(a.shape)}) and "
            f"{tuple(b.shape[:-2])} (b.shape={tuple(b.shape)}) do not broadcast"
        ) from None
    dtype = jnp.result_type(a, b)
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    y = _matmul(a2.astype(dtype), b2.astype(dtype))
    if b.ndim == 1:
        y = y[..., 0]
    if a.ndim == 1:
        y = y[..., 0, :] if b.ndim > 1 else y[..., 0]
    return y
