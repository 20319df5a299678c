"""Softmax-family reductions: logsumexp, softmax, log_softmax, with an optional mask.

Signatures and defaults are those of ``jax.nn``: ``axis`` is an int, a tuple of ints or
None (every axis), and ``logsumexp`` reduces every axis by default and takes ``b``,
``keepdims`` and ``return_sign``. The reduction runs over ``axis`` of ``x``. Each op is one
operator with hand-written tangent and backward; the ``where`` mask, when given, is a
second, non-differentiable argument of the same operator (op arguments are arrays, so
``where=None`` binds the operator with one argument instead of two).

Edge conventions (plain JAX autodiff gives NaN at each of them):

* A row that is all ``-inf`` or fully masked has ``logsumexp = -inf`` (the log of an
  empty sum) and gradient 0: the softmax of such a row is taken as 0, the value that
  makes every masked entry get no gradient and keeps ``sum(softmax) <= 1``.
* ``softmax`` of such a row is 0 (not 0/0 = NaN), gradient 0; ``log_softmax`` is
  ``-inf`` there. Masked entries never receive gradient. Rows with only some ``-inf``
  entries are exact.
* The max is subtracted before ``exp``, so logits of magnitude 1e4 give exact results.

Half-precision inputs are reduced in float32 and the result cast back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level, written_for
from cannjax._src.core.validate import as_inexact, check_axis
from cannjax._src.ops.rowwise import (
    broadcast_pair,
    float_input,
    inv_sum,
    mask_of,
    reduction,
    shifted_exp,
)

INF = float("inf")
_CONFIGS = ({}, {"axis": 0})
# What logsumexp and log_softmax keep: the forward's own exp(x - m) and 1 / s per row.
_EXP = "exp(x - max(x)), 0 at masked entries, same shape and dtype as x"
_INV_SUM = "1 / sum(exp(x - max(x))) per row (0 for an empty row), float32"
# The operators take the mask as a second positional argument (nondiff_argnums=(1,)); the
# public functions take it by keyword, so none of their positional arguments is nondiff.
_PUBLIC_NONDIFF = ()


def _axes(fn: str, axis: Any, ndim: int) -> tuple[int, ...]:
    """``axis`` (None, an int or a sequence of ints, as in jax.nn) as a sorted tuple of
    distinct axes in ``[0, ndim)``; None is every axis."""
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (tuple, list)):
        axes = tuple(check_axis(fn, a, ndim, "axis") for a in axis)
        if len(set(axes)) != len(axes):
            raise ValueError(f"{fn}: axis must not repeat an axis, got {tuple(axis)!r}")
        return tuple(sorted(axes))
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{fn}: axis must be None, an int or a tuple of ints, got {axis!r}")
    return (check_axis(fn, axis, ndim),)


def _op_axis(axes: tuple[int, ...]) -> int | tuple[int, ...]:
    # The operators' static axis: an int for one axis (the common case, and the
    # parameter kernel tables see), else the tuple (jnp reductions take either).
    return axes[0] if len(axes) == 1 else axes


def _args(
    name: str, x: ArrayLike, axis, where, *, rank0: bool = False, arg: str = "x"
) -> tuple[tuple, Any]:
    fn = f"cannjax.ops.{name}"
    x = as_inexact(fn, arg, x) if rank0 else float_input(fn, arg, x)
    axis = _op_axis(_axes(fn, axis, x.ndim))
    return ((x,) if where is None else (x, mask_of(fn, where, x))), axis


def _log_pos(s):
    """``log(s)`` for ``s >= 0``, ``-inf`` at 0 with derivatives that stay finite there;
    NaN stays NaN."""
    empty = s == 0
    return jnp.where(empty, -INF, jnp.log(jnp.where(empty, 1, s)))


def _kept_softmax(res):
    # The softmax from the kept exp(x - m) and 1 / s (0 on an empty row).
    return upcast(res["exp"]) * res["inv_sum"]


# Samples and edge points (numpy: expected values in float64).
def _sample(key):
    return (jax.random.normal(key, (3, 5), jnp.float32) * 2,)


_BIG = [[1e4, -1e4, 0.0, 3.0], [-1e4, -1e4, -1e4, -1e4 + 1], [1e4, 1e4 - 2, -1e4, 0.0]]
_PART_INF = [[0.0, -INF, 1.0, -INF], [2.0, -1.0, -INF, 0.5]]
_ALL_INF = [[-INF, -INF, -INF, -INF], [0.0, -INF, 1.0, 2.0]]
_MASK = [[True, False, True, True], [False, False, False, False], [True, True, False, True]]
_MX = [[0.3, 5.0, -1.0, 2.0], [1.0, 2.0, 3.0, 4.0], [-2.0, 0.0, 9.0, 1.0]]


def _f32(v):
    return jnp.asarray(v, jnp.float32)


def _softmax_rows(x):
    # Exact softmax of the rows of x with the empty-row convention, in float64 numpy.
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)  # the float32 inputs, exactly
    m = np.max(x, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    s = e.sum(-1, keepdims=True)
    return e / np.where(s > 0, s, 1.0)


# ------------------------------------------------------------------------------ logsumexp
def _lse_forward(x, where=None, *, axis):
    # e is the forward's own intermediate (0 at masked entries), kept.
    _, m, e, s = shifted_exp(upcast(x), where, axis)
    y = _log_pos(s) + m
    return jnp.squeeze(y, axis).astype(x.dtype), {"exp": e.astype(x.dtype), "inv_sum": inv_sum(s)}


# d logsumexp(x) = <softmax(x), dx>.
_logsumexp = reduction(
    "logsumexp",
    _lse_forward,
    _kept_softmax,
    nondiff_argnums=(1,),
    residuals={"exp": _EXP, "inv_sum": _INV_SUM},
    level=Level.DERIVED,
    reuse=(0,),
)


# logsumexp(a, b=b): log |sum_i b_i exp(a_i)| and its sign, as jax.nn.logsumexp with b.
# Entries with b_i = 0 are left out (as in jax.nn: a_i is taken as -inf there, so they get
# no gradient in a and none in b). With e_i = exp(a_i - m) and s = sum_i b_i e_i (signed):
# d log|s| = sum_i (b_i e_i da_i + e_i db_i) / s; the sign is piecewise constant.
def _lse_b_forward(x, b, where=None, *, axis):
    x32, b32 = upcast(x), upcast(b)
    keep = b32 != 0 if where is None else (b32 != 0) & where
    _, m, e, _ = shifted_exp(x32, keep, axis)
    s = jnp.sum(b32 * e, axis, keepdims=True)
    y = jnp.squeeze(_log_pos(jnp.abs(s)) + m, axis).astype(x.dtype)
    sign = jnp.squeeze(jnp.sign(s), axis).astype(x.dtype)
    return (y, sign), {"exp": e.astype(x.dtype), "b": b, "inv_sum": inv_sum(s)}


def _lse_b_partials(res):
    # (d log|s| / da, d log|s| / db) per entry: b e / s and e / s.
    p = upcast(res["exp"]) * res["inv_sum"]
    return upcast(res["b"]) * p, p


def _lse_b_tangent(res, tx, tb, *, axis):
    da, db = _lse_b_partials(res)
    dy = jnp.sum(da * upcast(tx) + db * upcast(tb), axis).astype(tx.dtype)
    return dy, jnp.zeros_like(dy)


def _lse_b_backward(res, g, *, axis):
    da, db = _lse_b_partials(res)
    g = jnp.expand_dims(upcast(g[0]), axis)
    return (g * da).astype(res["exp"].dtype), (g * db).astype(res["b"].dtype)


_logsumexp_b = defop(
    "logsumexp_b",
    forward=_lse_b_forward,
    tangent=_lse_b_tangent,
    backward=_lse_b_backward,
    nondiff_argnums=(2,),
    num_outputs=2,
    residuals={"exp": _EXP + " and where b = 0", "b": "the input b", "inv_sum": _INV_SUM},
    level=Level.DERIVED,
)


def _is_complex(v: Any) -> bool:
    return isinstance(v, complex) or jnp.issubdtype(
        getattr(v, "dtype", np.float32), jnp.complexfloating
    )


# logsumexp of complex a or b, as jax.nn.logsumexp: y = m + log(s) on the principal
# branch, s = sum_i b_i exp(a_i - m) with m the row max of Re(a) (a real shift, which
# cancels); with return_sign (log_abs), y = m + log|s| and sign = s / |s|, which has no
# gradient (as in jax.nn). Entries with b_i = 0 are left out, as for real inputs. With
# u = ds / s = sum_i (b_i e_i da_i + e_i db_i) / s, complex-linear in the tangents:
# dy = u, or Re(u) for log|s|. The backward transposes both in JAX's pairing of a
# cotangent c with a tangent t, Re(c t), as c -> c: da_i = c b_i e_i / s, db_i = c e_i / s.
def _lse_c_forward(x, b, where=None, *, axis, log_abs):
    keep = b != 0 if where is None else (b != 0) & where
    zero = jnp.zeros((), x.dtype)
    top = jnp.max(jnp.real(x), axis, keepdims=True, where=keep, initial=-INF)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, jnp.zeros((), top.dtype)))
    e = jnp.where(keep, jnp.exp(jnp.where(keep, x, zero) - m.astype(x.dtype)), zero)
    s = jnp.sum(b * e, axis, keepdims=True)
    empty = s == 0
    r = jnp.abs(s) if log_abs else s
    log_r = jnp.where(empty, -INF, jnp.log(jnp.where(empty, 1, r)))
    y = jnp.squeeze(log_r + m.astype(log_r.dtype), axis)
    sign = jnp.squeeze(jax.lax.sign(s), axis)
    inv = jnp.where(empty, zero, 1 / jnp.where(empty, 1, s))
    return (y, sign), {"exp": e, "b": b, "inv_sum": inv}


def _lse_c_tangent(res, tx, tb, *, axis, log_abs):
    da, db = _lse_b_partials(res)
    u = jnp.sum(da * tx + db * tb, axis)
    return (u.real if log_abs else u), jnp.zeros_like(u)


def _lse_c_backward(res, g, *, axis, log_abs):
    da, db = _lse_b_partials(res)
    c = jnp.expand_dims(g[0].astype(da.dtype), axis)
    return c * da, c * db


_logsumexp_c = defop(
    "logsumexp_complex",
    forward=_lse_c_forward,
    tangent=_lse_c_tangent,
    backward=_lse_c_backward,
    nondiff_argnums=(2,),
    num_outputs=2,
    residuals={
        "exp": "exp(a - max(Re a)), 0 where b = 0 or masked, complex",
        "b": "the input b",
        "inv_sum": "1 / s per row (0 for an empty row), complex",
    },
    level=Level.DERIVED,
)


def _lse_edges():
    p = _softmax_rows(_ALL_INF)
    return [
        EdgeCase((_f32(_BIG),)),
        EdgeCase((_f32(_BIG),), kwargs={"axis": 0}),
        EdgeCase((_f32(_PART_INF),), finite_differences=False),
        # All -inf row: value -inf (reference agrees), gradient 0 (reference: NaN).
        EdgeCase((_f32(_ALL_INF),), finite_differences=False, reference_grad=False,
                 expected_grad=(p,)),
        # Fully masked middle row: -inf, gradient 0; masked entries get no gradient.
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK)}, finite_differences=False),
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK)[:, :1], "axis": 0}),
    ]  # fmt: skip


@registered(
    _logsumexp,
    nondiff_argnums=_PUBLIC_NONDIFF,
    reference=jax.nn.logsumexp,
    sample=_sample,
    edges=written_for({"axis": -1}, _lse_edges),
    configs=_CONFIGS,
    doc="Log of the sum of exponentials over an axis, with an optional mask.",
)
def logsumexp(
    a: ArrayLike,
    axis: int | tuple[int, ...] | None = None,
    b: ArrayLike | None = None,
    keepdims: bool = False,
    return_sign: bool = False,
    where: ArrayLike | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Log of the sum of exponentials over ``axis``, as ``jax.nn.logsumexp``.

    ``y = log(sum_i exp(a_i)) = m + log(sum_i exp(a_i - m))`` with ``m = max_i a_i``;
    entries where ``where`` is False are left out of the sum. Same signature and defaults
    as ``jax.nn.logsumexp``: ``axis=None`` reduces every axis (pass ``axis=-1`` for the
    last one); with ``b``, ``y = log |sum_i b_i exp(a_i)|``, NaN where that sum is
    negative unless ``return_sign``, which returns ``(y, sign)`` instead.

    Backward: ``dx_i = softmax(x)_i dy = exp(x_i - m) / s dy`` (0 at masked entries),
    ``m`` the row max and ``s = sum_i exp(x_i - m)``. The minimum a backward must keep is
    one full-size array (the softmax depends on every entry) plus one number per row.
    Two choices reach it: the input ``x`` with ``log(s)`` (the backward then recomputes
    ``m`` and one ``exp`` per entry), or ``e = exp(x - m)``, which the forward computes
    anyway, with ``1/s``. We keep ``e`` (masked entries 0, so the mask is not kept) and
    ``1/s``: recomputing costs a second ``exp`` pass, which made the fwd+bwd of
    cross-entropy slower than plain JAX's (``docs/performance.md``), while keeping ``e``
    matches plain JAX's time at fewer bytes. (``exp(x - y)`` from the output ``y`` would
    be cheaper still in bytes, but ``y`` rounds to an ulp of ``|m|``: a 5e-4 relative
    error at logits of 1e4.)

    Complex ``a`` or ``b`` give ``jax.nn.logsumexp``'s result: ``y = m + log(s)`` on the
    principal branch (``m`` the row max of ``Re(a)``), or with ``return_sign``
    ``y = m + log|s|`` and ``sign = s / |s|``; the derivatives are the holomorphic ones,
    ``dy = sum_i (b_i e_i da_i + e_i db_i) / s``, and ``sign`` has no gradient.

    Edge conventions: a row that is all ``-inf`` or fully masked gives ``-inf`` (the log of
    an empty sum) and gradient 0 (plain autodiff gives NaN for the all ``-inf`` row).
    Logits of magnitude 1e4 are exact. A row holding ``+inf`` gives ``+inf`` with the
    gradient of the limit, uniform over its ``+inf`` entries (plain: NaN); NaN
    propagates.

    With ``b`` the backward is ``da_i = b_i exp(a_i - m) / s dy`` and
    ``db_i = exp(a_i - m) / s dy`` with the signed ``s = sum_i b_i exp(a_i - m)``; it
    keeps ``exp(a - m)``, ``b`` and ``1/s``. Entries with ``b_i = 0`` are left out of the
    sum and get no gradient in ``a`` or ``b``, as in ``jax.nn.logsumexp``.

    Args:
      a: float or complex array (integer arrays are promoted as in ``jax.nn``); any rank.
      axis: the axis or tuple of axes to reduce (static; negative counts from the end);
        None (the default, as in ``jax.nn.logsumexp``) reduces every axis.
      b: optional weights broadcastable with ``a``; may be negative or complex.
      keepdims: keep the reduced axes, with size 1.
      return_sign: return ``(y, sign)``, ``sign`` the sign (-1, 0 or 1) of the sum, and
        ``y`` the log of its absolute value; ``sign`` has no gradient.
      where: optional boolean mask broadcastable to the input's shape; False entries are
        excluded and receive no gradient.

    Returns:
      The input's shape without ``axis`` (with size-1 axes if ``keepdims``), in the
      promoted dtype of ``a`` and ``b``; with ``return_sign``, a pair of such arrays
      (for complex inputs ``y`` is real there, as in ``jax.nn``).

    Raises:
      TypeError: if ``a`` or ``b`` is not numeric, ``where`` not boolean, or ``axis`` not
        None, an int or a tuple of ints.
      ValueError: if an axis is out of range or repeated, ``b`` does not broadcast with
        ``a``, or ``where`` does not broadcast to it.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> x = jnp.array([[0.0, 0.0], [-jnp.inf, -jnp.inf]])
      >>> cannjax.ops.logsumexp(x, axis=-1)
      Array([0.6931472,      -inf], dtype=float32)
      >>> jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1)[0])(x)[0]
      Array([0.5, 0.5], dtype=float32)
      >>> cannjax.ops.logsumexp(x)  # every axis, as jax.nn.logsumexp
      Array(0.6931472, dtype=float32)
      >>> cannjax.ops.logsumexp(jnp.array([0.0, 0.0]), b=jnp.array([1.0, -2.0]), return_sign=True)
      (Array(0., dtype=float32), Array(-1., dtype=float32))
    """
    fn = "cannjax.ops.logsumexp"
    for flag, value in (("keepdims", keepdims), ("return_sign", return_sign)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{fn}: {flag} must be a Python bool, got {value!r}")
    if b is None and not _is_complex(a):
        args, op_axis = _args("logsumexp", a, axis, where, rank0=True, arg="a")
        y = _logsumexp(*args, axis=op_axis)
        # The sum is positive, 0 for an empty row, NaN with a NaN: its sign has no gradient.
        sign = (
            jax.lax.stop_gradient(jnp.where(jnp.isnan(y), y, (y > -INF).astype(y.dtype)))
            if return_sign
            else None
        )
    else:
        # Complex a without b: b = 1, which leaves no entry out.
        x, bw = broadcast_pair(fn, ("a", "b"), a, 1.0 if b is None else b, complex_ok=True)
        axes = _axes(fn, axis, x.ndim)
        args = (x, bw) if where is None else (x, bw, mask_of(fn, where, x))
        if jnp.iscomplexobj(x):
            y, sign = _logsumexp_c(*args, axis=_op_axis(axes), log_abs=return_sign)
        else:
            y, sign = _logsumexp_b(*args, axis=_op_axis(axes))
            if not return_sign:
                # A negative sum has no real log: NaN (gradient 0), as jax.nn.logsumexp.
                # The NaN is log(-1), made only where the result holds it: a NaN literal
                # is an array of its own without jit, which jax.debug_nans rejects.
                y = jnp.where(sign < 0, jax.lax.stop_gradient(y + jnp.log(sign)), y)
    if keepdims:
        axes = _axes(fn, axis, args[0].ndim)
        y = jnp.expand_dims(y, axes)
        sign = None if sign is None else jnp.expand_dims(sign, axes)
    return (y, sign) if return_sign else y


# ------------------------------------------------------------------------------ softmax
def _softmax_forward(x, where=None, *, axis):
    _, _, e, s = shifted_exp(upcast(x), where, axis)
    # An empty row has e = 0 everywhere; dividing by 1 instead of 0 gives 0, not NaN.
    y = (e / jnp.where(s == 0, jnp.ones((), s.dtype), s)).astype(x.dtype)
    return y, {"out": y}


def _softmax_tangent(res, t, *, axis):
    y, t32 = upcast(res["out"]), upcast(t)
    return (y * (t32 - jnp.sum(y * t32, axis, keepdims=True))).astype(t.dtype)


def _softmax_backward(res, g, *, axis):
    y, g32 = upcast(res["out"]), upcast(g)
    return ((y * (g32 - jnp.sum(y * g32, axis, keepdims=True))).astype(g.dtype),)


_softmax = defop(
    "softmax",
    forward=_softmax_forward,
    tangent=_softmax_tangent,
    backward=_softmax_backward,
    nondiff_argnums=(1,),
    residuals={"out": "the output softmax(x), same shape as x"},
    level=Level.OUTPUT,
    reuse=(0,),
)


def _ref_softmax(x, axis=-1, where=None):
    return jax.nn.softmax(x, axis=axis, where=where)


def _softmax_edges():
    return [
        EdgeCase((_f32(_BIG),)),
        EdgeCase((_f32(_PART_INF),), finite_differences=False),
        # All -inf row: 0 with gradient 0 (reference: NaN value and gradient).
        EdgeCase((_f32(_ALL_INF),), finite_differences=False, reference_value=False,
                 reference_grad=False, expected_value=_softmax_rows(_ALL_INF),
                 expected_grad=(jnp.zeros((2, 4), jnp.float32),)),
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK)}),
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK), "axis": 0}),
    ]  # fmt: skip


@registered(
    _softmax,
    nondiff_argnums=_PUBLIC_NONDIFF,
    reference=_ref_softmax,
    sample=_sample,
    edges=written_for({"axis": -1}, _softmax_edges),
    configs=_CONFIGS,
    doc="Softmax over an axis, with an optional mask.",
)
def softmax(
    x: ArrayLike, axis: int | tuple[int, ...] | None = -1, where: ArrayLike | None = None
) -> jax.Array:
    """Softmax over ``axis``, as ``jax.nn.softmax``: ``y_i = exp(x_i) / sum_j exp(x_j)``.

    Entries where ``where`` is False are left out of the sum and are 0 in the output.

    Backward: ``dx = y * (dy - sum(y * dy))``; keeps only the output ``y``, which the
    forward makes anyway (masked entries have ``y = 0``, so they get no gradient and the
    mask need not be kept).

    Edge conventions: a fully masked row (or an all ``-inf`` row) is 0 with gradient 0,
    where ``jax.nn.softmax`` gives 0/0 = NaN for the all ``-inf`` row: an empty
    distribution puts no mass anywhere. A row holding ``+inf`` is uniform over its
    ``+inf`` entries (the limit as they grow together) with gradient 0, where
    ``jax.nn.softmax`` gives NaN. Rows with some ``-inf`` entries are exact (those
    entries are 0). Logits of magnitude 1e4 are exact.

    Args:
      x: float array, rank >= 1 (integer arrays are promoted as in ``jax.nn``).
      axis: the axis or tuple of axes to normalize over (static; None: every axis), as
        in ``jax.nn``.
      where: optional boolean mask broadcastable to ``x.shape``.

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      TypeError: if ``x`` is not real, ``where`` not boolean, or ``axis`` not None, an
        int or a tuple of ints.
      ValueError: if an axis is out of range or repeated, or ``where`` does not broadcast
        to ``x``.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> cannjax.ops.softmax(jnp.array([0.0, 0.0]), where=jnp.array([True, False]))
      Array([1., 0.], dtype=float32)
      >>> cannjax.ops.softmax(jnp.array([1.0, 2.0]), where=jnp.array([False, False]))
      Array([0., 0.], dtype=float32)

    References:
      Huawei CANN operators Softmax and SoftmaxGrad.
    """
    args, axis = _args("softmax", x, axis, where)
    return _softmax(*args, axis=axis)


# ------------------------------------------------------------------------------ log_softmax
def _log_softmax_forward(x, where=None, *, axis):
    z, _, e, s = shifted_exp(upcast(x), where, axis)
    # An empty row has z = -inf and s = 0: use log(s) = 0 there, so y = -inf, not NaN.
    y = (z - jnp.where(s == 0, 0, jnp.log(jnp.where(s == 0, 1, s)))).astype(x.dtype)
    res = {"exp": e.astype(x.dtype), "inv_sum": inv_sum(s)}
    if where is not None:
        res["where"] = where
    return y, res


def _masked(res, v):
    return v if "where" not in res else jnp.where(res["where"], v, jnp.zeros((), v.dtype))


def _log_softmax_tangent(res, t, *, axis):
    p, t32 = _kept_softmax(res), upcast(t)
    return _masked(res, t32 - jnp.sum(p * t32, axis, keepdims=True)).astype(t.dtype)


def _log_softmax_backward(res, g, *, axis):
    p, g32 = _kept_softmax(res), _masked(res, upcast(g))
    return ((g32 - p * jnp.sum(g32, axis, keepdims=True)).astype(g.dtype),)


_log_softmax = defop(
    "log_softmax",
    forward=_log_softmax_forward,
    tangent=_log_softmax_tangent,
    backward=_log_softmax_backward,
    nondiff_argnums=(1,),
    residuals={
        "exp": _EXP,
        "inv_sum": _INV_SUM,
        "where": "the boolean mask, when given (an input)",
    },
    level=Level.DERIVED,
    reuse=(0,),
)


def _ref_log_softmax(x, axis=-1, where=None):
    return jax.nn.log_softmax(x, axis=axis, where=where)


def _log_softmax_edges():
    # Gradient of sum(log_softmax) is 1 - n p: for the all -inf row p = 0, so 1.
    p = _softmax_rows(_ALL_INF)
    want = 1.0 - 4 * p
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    return [
        EdgeCase((_f32(_BIG),)),
        EdgeCase((_f32(_PART_INF),), finite_differences=False),
        EdgeCase((_f32(_ALL_INF),), finite_differences=False, reference_value=False,
                 reference_grad=False,
                 expected_value=logp,
                 expected_grad=(want,)),
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK)}, finite_differences=False),
        EdgeCase((_f32(_MX),), kwargs={"where": jnp.asarray(_MASK), "axis": 0},
                 finite_differences=False),
    ]  # fmt: skip


@registered(
    _log_softmax,
    nondiff_argnums=_PUBLIC_NONDIFF,
    reference=_ref_log_softmax,
    sample=_sample,
    edges=written_for({"axis": -1}, _log_softmax_edges),
    configs=_CONFIGS,
    doc="Log-softmax over an axis, with an optional mask.",
)
def log_softmax(
    x: ArrayLike, axis: int | tuple[int, ...] | None = -1, where: ArrayLike | None = None
) -> jax.Array:
    """Log-softmax over ``axis``, as ``jax.nn.log_softmax``: ``y = x - logsumexp(x)``.

    Computed as ``(x - m) - log(sum(exp(x - m)))`` with ``m`` the row max, so logits of
    magnitude 1e4 are exact. Masked entries (``where`` False) are ``-inf``.

    Backward: ``dx = dy_w - softmax(x) * sum(dy_w)`` with ``dy_w = dy`` at included
    entries and 0 at masked ones. Keeps ``e = exp(x - m)`` (which the forward computes
    anyway) and ``1/s`` per row, ``s = sum(e)``, so the backward has no ``exp``: keeping
    only the output ``y`` (and ``exp(y)`` in the backward) saves one number per row but
    made the fwd+bwd slower than plain JAX's (the extra ``exp`` pass,
    ``docs/performance.md``); this choice keeps the same bytes as plain autodiff at its
    speed. When ``where`` is given the mask (an input) is kept too: a masked entry and an
    included ``-inf`` logit both have ``e = 0`` but only the latter gets gradient
    (``d(x_i - lse)/dx_i = 1``).

    Edge conventions: a fully masked row is ``-inf`` with gradient 0; an all ``-inf`` row
    (no mask) is ``-inf`` (plain JAX gives ``-inf - (-inf) = NaN``) and, its softmax being
    taken as 0, has gradient ``dy``. Rows with some ``-inf`` entries are exact. A row
    holding ``k`` entries at ``+inf`` is ``-log(k)`` there and ``-inf`` elsewhere (the
    limit; plain JAX gives NaN), with the finite gradient of that limit.

    Args:
      x: float array, rank >= 1 (integer arrays are promoted as in ``jax.nn``).
      axis: the axis or tuple of axes to normalize over (static; None: every axis), as
        in ``jax.nn``.
      where: optional boolean mask broadcastable to ``x.shape``.

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      TypeError: if ``x`` is not real, ``where`` not boolean, or ``axis`` not None, an
        int or a tuple of ints.
      ValueError: if an axis is out of range or repeated, or ``where`` does not broadcast
        to ``x``.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> cannjax.ops.log_softmax(jnp.array([1e4, 0.0]))
      Array([    0., -10000.], dtype=float32)
    """
    args, axis = _args("log_softmax", x, axis, where)
    return _log_softmax(*args, axis=axis)
