"""Operators whose plain-JAX gradients are NaN at points that occur in practice.

``norm``, ``normalize``, ``cosine_similarity``, ``xlogy``, ``entropy`` and ``arctan2``,
each with a hand-written backward that is finite (or an honest ``inf``) at the points
where plain autodiff produces ``0 * inf`` or ``0 / 0``. Each docstring states its edge
convention and the reason; ``docs/ops_safe.md`` lists them together.

Binary operators (``xlogy``, ``arctan2``, ``cosine_similarity``) broadcast their inputs
like ``jnp`` (numpy rules, after which both have the broadcast shape); incompatible shapes
raise ValueError naming the op and both shapes. Half-precision inputs are computed in
float32 and the result cast back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import downcast, upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level, written_for
from cannjax._src.ops.elementwise import _log
from cannjax._src.ops.rowwise import axis_of, broadcast_pair, float_input, reduction, safe_mul

INF = float("inf")
_CONFIGS = ({}, {"axis": 0})


def _zero(x):
    return jnp.zeros((), x.dtype)


def _inv_pos(n):
    """``1 / n`` where ``n > 0``, else 0 (and finite derivatives at ``n = 0``)."""
    pos = n > 0
    return jnp.where(pos, 1 / jnp.where(pos, n, 1), _zero(n))


def _row_norm(x32, axis):
    # sqrt of a sum taken only where it is positive: on a zero row the derivative of the
    # kept norm is 0 in both modes (sqrt'(0) = inf would make 0 * inf = NaN in the
    # second derivatives that differentiate this residual).
    s = jnp.sum(x32 * x32, axis, keepdims=True)
    pos = s > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, s, 1)), _zero(s))


def _check_eps(fn: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"{fn}: eps must be a positive Python float, got {eps!r}")
    return float(eps)


# Samples and edge points (numpy: expected values in float64).
def _f32(v):
    return jnp.asarray(v, jnp.float32)


def _f64(v):
    # The float32 values of v, exactly, in float64: expected results are computed from
    # what the op actually receives.
    return np.asarray(_f32(v), np.float64)


def _normal(key, shape=(3, 5)):
    return (jax.random.normal(key, shape, jnp.float32),)


def _pair(key):
    k1, k2 = jax.random.split(key)
    return _normal(k1)[0], _normal(k2)[0]


_ROWS = [[0.0, 0.0, 0.0, 0.0], [3.0, -4.0, 0.0, 12.0], [1e-3, 2e-3, -1e-3, 0.0]]


# ------------------------------------------------------------------------------ norm
def _norm_forward(x, *, axis):
    n = _row_norm(upcast(x), axis)
    return jnp.squeeze(n, axis).astype(x.dtype), {"x": x, "norm": n}


def _norm_grad(res):
    # d|x| = <x / |x|, dx>; on a zero row the subgradient of minimal norm, 0.
    return upcast(res["x"]) * _inv_pos(res["norm"])


_norm = reduction(
    "norm",
    _norm_forward,
    _norm_grad,
    residuals={"x": "the input x", "norm": "|x| per row, float32, reduced axis kept"},
    level=Level.RECOMPUTE,
)


def _ref_norm(x, axis=-1):
    return jnp.linalg.norm(x, axis=axis)


def _norm_edges():
    x = _f64(_ROWS)
    n = np.sqrt((x * x).sum(-1, keepdims=True))
    want = np.where(n > 0, x / np.where(n > 0, n, 1), 0.0)
    return [
        EdgeCase((_f32([[1e18, -1e18, 3e17], [1e-15, 2e-15, -1e-15]]),)),
        # Zero row: value 0, gradient 0 (plain autodiff: NaN).
        EdgeCase((_f32(_ROWS),), finite_differences=False, reference_grad=False,
                 expected_grad=(want,)),
    ]  # fmt: skip


@registered(
    _norm,
    reference=_ref_norm,
    sample=_normal,
    edges=written_for({"axis": -1}, _norm_edges),
    configs=_CONFIGS,
)
def norm(x: ArrayLike, axis: int = -1) -> jax.Array:
    """Euclidean (L2) norm over ``axis``: ``y = sqrt(sum_i x_i^2)``, as ``jnp.linalg.norm``.

    Backward: ``dx = x / y * dy``; keeps ``x`` (an input) and the per-row ``y``.

    Edge convention: at ``x = 0`` the value is 0 and the gradient 0, the subgradient of
    minimal norm (plain autodiff gives ``0 / 0 = NaN``). This is what makes weight decay
    on a norm, or a norm penalty, safe on rows that are exactly zero.

    Args:
      x: float array, rank >= 1.
      axis: the axis to reduce (static int).

    Returns:
      ``x``'s shape without ``axis``, in ``x``'s dtype.

    Raises:
      TypeError: if ``x`` is not floating point.
      ValueError: if ``axis`` is out of range.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> jax.grad(lambda x: cannjax.ops.norm(x))(jnp.zeros(3))
      Array([0., 0., 0.], dtype=float32)
    """
    fn = "cannjax.ops.norm"
    x = float_input(fn, "x", x)
    return _norm(x, axis=axis_of(fn, axis, x))


# ------------------------------------------------------------------------------ normalize
def _normalize_forward(x, *, axis, eps):
    x32 = upcast(x)
    n = _row_norm(x32, axis)
    y = (x32 / jnp.maximum(n, eps)).astype(x.dtype)
    return y, {"out": y, "norm": n}


def _normalize_map(res, v, *, axis, eps):
    # (v - [|x| > eps] y <y, v>) / max(|x|, eps): both the tangent and the backward (the
    # Jacobian is symmetric).
    n, y = res["norm"], upcast(res["out"])
    proj = jnp.where(n > eps, jnp.sum(y * v, axis, keepdims=True), _zero(n))
    return (v - y * proj) / jnp.maximum(n, eps)


def _normalize_tangent(res, t, *, axis, eps):
    return _normalize_map(res, upcast(t), axis=axis, eps=eps).astype(t.dtype)


def _normalize_backward(res, g, *, axis, eps):
    return (_normalize_map(res, upcast(g), axis=axis, eps=eps).astype(g.dtype),)


_normalize = defop(
    "normalize",
    forward=_normalize_forward,
    tangent=_normalize_tangent,
    backward=_normalize_backward,
    residuals={"out": "the output x / max(|x|, eps)", "norm": "|x| per row, float32"},
    level=Level.OUTPUT,
    reuse=(0,),
)


def _ref_normalize(x, axis=-1, eps=1e-12):
    return x / jnp.maximum(jnp.linalg.norm(x, axis=axis, keepdims=True), eps)


def _normalize_edges():
    # With an all-ones cotangent: rows above eps get (1 - y sum(y)) / |x|, zero rows 1/eps.
    x = _f64(_ROWS)
    n = np.sqrt((x * x).sum(-1, keepdims=True))
    y = x / np.maximum(n, 1e-12)
    want = np.where(n > 1e-12, (1 - y * y.sum(-1, keepdims=True)) / np.maximum(n, 1e-12), 1e12)
    with np.errstate(invalid="ignore"):
        y_half = x / n
    tiny = _f32([[1e-14, -2e-14, 0.0], [3.0, 4.0, 0.0]])
    return [
        EdgeCase((_f32([[1e18, -1e18, 3e17], [1e-5, 2e-5, -3e-5]]),)),
        EdgeCase((_f32(_ROWS),), finite_differences=False, reference_grad=False,
                 expected_grad=(want,)),
        # Below eps the map is x / eps; the reference's gradient is right there.
        EdgeCase((tiny,), finite_differences=False),
        EdgeCase((_f32(_ROWS),), kwargs={"eps": 0.5}, finite_differences=False,
                 reference_grad=False, expected_grad=((np.where(
                     n > 0.5, (1 - y_half * y_half.sum(-1, keepdims=True)) / np.maximum(n, 0.5),
                     2.0)),)),
    ]  # fmt: skip


@registered(
    _normalize,
    reference=_ref_normalize,
    sample=_normal,
    edges=written_for({"axis": -1}, _normalize_edges),
    configs=_CONFIGS,
)
def normalize(x: ArrayLike, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """``y = x / max(|x|, eps)`` over ``axis`` (L2), as in ``torch.nn.functional.normalize``.

    Backward, with ``d = max(|x|, eps)``: where ``|x| > eps``,
    ``dx = (dy - y <y, dy>) / d`` (the projection off ``y``); where ``|x| <= eps`` the map
    is ``x / eps``, so ``dx = dy / eps``. Keeps the output ``y`` and the per-row ``|x|``.

    Edge convention: at ``x = 0`` the value is 0 and the gradient ``dy / eps``, the exact
    derivative of ``x / eps`` (finite: ``1e12`` for the default ``eps``). Plain autodiff
    gives NaN there (it differentiates ``|x|`` at 0 even though ``max`` discards it).

    Args:
      x: float array, rank >= 1.
      axis: the axis to normalize over (static int).
      eps: positive floor of the norm (static Python float).

    Returns:
      An array of ``x``'s shape and dtype.

    Raises:
      TypeError: if ``x`` is not floating point.
      ValueError: if ``axis`` is out of range or ``eps`` is not positive.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> cannjax.ops.normalize(jnp.array([[3.0, 4.0], [0.0, 0.0]]))
      Array([[0.6, 0.8],
             [0. , 0. ]], dtype=float32)
    """
    fn = "cannjax.ops.normalize"
    x = float_input(fn, "x", x)
    return _normalize(x, axis=axis_of(fn, axis, x), eps=_check_eps(fn, eps))


# ------------------------------------------------------------------------------ cosine
def _cosine_forward(a, b, *, axis, eps):
    a32, b32 = upcast(a), upcast(b)
    na, nb = _row_norm(a32, axis), _row_norm(b32, axis)
    c = jnp.sum(a32 * b32, axis, keepdims=True) / (jnp.maximum(na, eps) * jnp.maximum(nb, eps))
    return jnp.squeeze(c, axis).astype(a.dtype), {"a": a, "b": b, "na": na, "nb": nb, "c": c}


def _cosine_partials(res, *, eps):
    a, b, na, nb, c = upcast(res["a"]), upcast(res["b"]), res["na"], res["nb"], res["c"]
    da, db = jnp.maximum(na, eps), jnp.maximum(nb, eps)
    ca = jnp.where(na > eps, c / (da * da), _zero(c))
    cb = jnp.where(nb > eps, c / (db * db), _zero(c))
    inv = 1 / (da * db)
    return b * inv - ca * a, a * inv - cb * b


def _cosine_tangent(res, ta, tb, *, axis, eps):
    pa, pb = _cosine_partials(res, eps=eps)
    out = jnp.sum(pa * upcast(ta) + pb * upcast(tb), axis)
    return out.astype(ta.dtype)


def _cosine_backward(res, g, *, axis, eps):
    pa, pb = _cosine_partials(res, eps=eps)
    g = jnp.expand_dims(upcast(g), axis)
    return (g * pa).astype(res["a"].dtype), (g * pb).astype(res["b"].dtype)


_cosine = defop(
    "cosine_similarity",
    forward=_cosine_forward,
    tangent=_cosine_tangent,
    backward=_cosine_backward,
    residuals={
        "a": "the input a",
        "b": "the input b",
        "na": "|a| per row, float32",
        "nb": "|b| per row, float32",
        "c": "the output per row, float32",
    },
    level=Level.RECOMPUTE,
)


def _ref_cosine(a, b, axis=-1, eps=1e-8):
    na = jnp.maximum(jnp.linalg.norm(a, axis=axis), eps)
    nb = jnp.maximum(jnp.linalg.norm(b, axis=axis), eps)
    return jnp.sum(a * b, axis=axis) / (na * nb)


def _cosine_edges():
    a = _f64([[0.0, 0.0, 0.0], [1.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    b = _f64([[1.0, -2.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    eps = 1e-8
    na = np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), eps)
    nb = np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), eps)
    # c = 0 on every row here, so dc/da = b / (da db), dc/db = a / (da db).
    return [
        EdgeCase((_f32([[1e15, 2e15, -1e15], [1e-3, 2e-3, 0.0]]),
                  _f32([[3e15, -1e15, 1e15], [-1e-3, 1e-3, 2e-3]]))),
        EdgeCase((_f32(a), _f32(b)), finite_differences=False, reference_grad=False,
                 expected_grad=(b / (na * nb), a / (na * nb))),
    ]  # fmt: skip


@registered(
    _cosine,
    reference=_ref_cosine,
    sample=_pair,
    edges=written_for({"axis": -1}, _cosine_edges),
    configs=_CONFIGS,
)
def cosine_similarity(a: ArrayLike, b: ArrayLike, axis: int = -1, eps: float = 1e-8) -> jax.Array:
    """Cosine similarity over ``axis``: ``c = <a, b> / (max(|a|, eps) max(|b|, eps))``.

    ``a`` and ``b`` broadcast like ``jnp`` (e.g. ``a`` ``[B, D]`` against ``b`` ``[D]``).

    Backward, with ``da = max(|a|, eps)``, ``db = max(|b|, eps)``:
    ``dc/da = b / (da db) - [|a| > eps] c a / da^2`` (and symmetrically for ``b``). Keeps
    ``a`` and ``b`` (inputs; the gradient depends on both) and per-row ``|a|``, ``|b|``,
    ``c``.

    Edge convention: if ``a = 0`` the value is 0 and ``dc/da = b / (eps db)``, the exact
    derivative of ``<a, b> / (eps db)`` near 0 (finite); ``dc/db = 0``. Plain autodiff
    gives NaN (from ``|a|`` at 0).

    Args:
      a: float array, rank >= 1.
      b: float array, broadcast-compatible with ``a``.
      axis: the axis to reduce (static int), of the broadcast shape.
      eps: positive floor of each norm (static Python float).

    Returns:
      The broadcast shape without ``axis``, in the promoted dtype.

    Raises:
      TypeError: if ``a`` or ``b`` is not floating point.
      ValueError: on incompatible shapes, an out-of-range ``axis`` or ``eps <= 0``.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> a = jnp.array([[1.0, 0.0], [0.0, 0.0]])
      >>> cannjax.ops.cosine_similarity(a, jnp.array([1.0, 1.0]))
      Array([0.70710677, 0.        ], dtype=float32)
    """
    fn = "cannjax.ops.cosine_similarity"
    a, b = broadcast_pair(fn, ("a", "b"), a, b)
    if a.ndim == 0:
        raise ValueError(f"{fn}: a and b must have at least one dimension, got scalars")
    return _cosine(a, b, axis=axis_of(fn, axis, a), eps=_check_eps(fn, eps))


# ------------------------------------------------------------------------------ xlogy
def _xlogy_value(x32, y32):
    # (A weak 0.0 keeps the dtype and weak type of x32.)
    return jnp.where(x32 == 0, 0.0, x32 * jnp.log(y32))


def _xlogy_forward(x, y):
    return downcast(_xlogy_value(upcast(x), upcast(y)), x.dtype), {"x": x, "y": y}


def _xlogy_partials(res):
    # d/dx = log y and d/dy = x / y, taken as 0 at x = y = 0 (only there: at x = 0 < y,
    # x / y is 0 with d/dx (x / y) = 1 / y, which the second derivatives need).
    x, y = upcast(res["x"]), upcast(res["y"])
    both0 = (x == 0) & (y == 0)
    return _log(y), both0, jnp.where(both0, _zero(x), x / jnp.where(both0, 1, y))


def _xlogy_tangent(res, tx, ty):
    logy, x0, x_over_y = _xlogy_partials(res)
    t = safe_mul(upcast(tx), logy) + jnp.where(x0, _zero(logy), safe_mul(upcast(ty), x_over_y))
    return t.astype(tx.dtype)


def _xlogy_backward(res, g):
    logy, x0, x_over_y = _xlogy_partials(res)
    g32 = upcast(g)
    dy = jnp.where(x0, _zero(logy), safe_mul(g32, x_over_y))
    return safe_mul(g32, logy).astype(g.dtype), dy.astype(g.dtype)


_xlogy = defop(
    "xlogy",
    forward=_xlogy_forward,
    tangent=_xlogy_tangent,
    backward=_xlogy_backward,
    residuals={"x": "the input x", "y": "the input y"},
    level=Level.RECOMPUTE,
)


def _xlogy_sample(key):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.normal(k1, (3, 5), jnp.float32),
        jax.random.uniform(k2, (3, 5), jnp.float32, 0.1, 3.0),
    )


def _xlogy_edges():
    def exact(x, y):
        # Gradients log y and x / y (0 where x == 0).
        x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(y64), np.where(x64 == 0, 0.0, x64 / y64)

    x, y = _f32([0.0, 0.0, 0.0, 2.0]), _f32([1.0, 3.0, INF, 0.0])
    x0, y0 = _f32([0.0]), _f32([0.0])
    # Checked to first order only: huge and tiny magnitudes, whose second derivatives
    # (x / y^2 up to 5e39) overflow float32, and (0, 0), where x log y has no second
    # derivative (its mixed partial 1 / y is infinite).
    return [
        EdgeCase((_f32([1e-30, 1e30, 0.5]), _f32([1e-30, 1e30, 1e-20])), second_order=False),
        EdgeCase((x, y), finite_differences=False, reference_grad=False,
                 expected_grad=exact(x, y)),
        EdgeCase((x0, y0), finite_differences=False, reference_grad=False,
                 expected_grad=exact(x0, y0), second_order=False),
    ]  # fmt: skip


@registered(_xlogy, reference=jax.scipy.special.xlogy, sample=_xlogy_sample, edges=_xlogy_edges)
def xlogy(x: ArrayLike, y: ArrayLike) -> jax.Array:
    """``x * log(y)``, defined as 0 where ``x == 0``, as ``jax.scipy.special.xlogy``.

    ``x`` and ``y`` broadcast like ``jnp``.

    Backward: ``dx = log(y) dz``, ``dy = x / y dz`` (0 where ``x == 0``: ``xlogy(0, y)``
    is 0 for every ``y``). Keeps ``x`` and ``y`` (inputs).

    Edge convention: ``xlogy(0, y) = 0`` for every ``y >= 0``, and gradients are never
    NaN: at ``x = 0, y = 0`` the ``x``-derivative is ``log(0) = -inf`` (reported as such)
    and the ``y``-derivative 0 (plain autodiff: ``0 / 0 = NaN``). A zero cotangent times an
    infinite derivative gives 0, not NaN.

    Args:
      x: float array.
      y: float array, broadcast-compatible with ``x``, ``y >= 0``.

    Returns:
      The broadcast shape, in the promoted dtype.

    Raises:
      TypeError: if ``x`` or ``y`` is not floating point.
      ValueError: if the shapes do not broadcast.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> float(jax.grad(lambda y: cannjax.ops.xlogy(0.0, y))(0.0))
      0.0
    """
    x, y = broadcast_pair("cannjax.ops.xlogy", ("x", "y"), x, y)
    return _xlogy(x, y)


# ------------------------------------------------------------------------------ entropy
def _entropy_forward(p, *, axis):
    p32 = upcast(p)
    h = -jnp.sum(_xlogy_value(p32, p32), axis)
    return h.astype(p.dtype), {"p": p}


def _entropy_grad(res):
    # d(-p log p) = -(log p + 1) dp: +inf at p = 0, where a zero (co)tangent gives 0.
    # The log operator's own derivative keeps that rule at the next order (jnp.log's
    # would give dp / p = 0 / 0 off the diagonal of a Hessian).
    return -(_log(upcast(res["p"])) + 1)


_entropy = reduction(
    "entropy",
    _entropy_forward,
    _entropy_grad,
    zero_safe=True,
    residuals={"p": "the input p"},
    level=Level.RECOMPUTE,
)


def _ref_entropy(p, axis=-1):
    return -jnp.sum(jax.scipy.special.xlogy(p, p), axis=axis)


def _prob_sample(key):
    return (jax.nn.softmax(jax.random.normal(key, (3, 5), jnp.float32)),)


def _entropy_edges():
    p = _f32([[1.0, 0.0], [0.5, 0.5], [0.25, 0.75]])
    p64 = np.asarray(p, np.float64)
    # H = -sum p log p (0 log 0 = 0) and dH/dp = -(log p + 1), +inf at p = 0.
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(p64)
        value = -np.where(p64 == 0, 0.0, p64 * logp).sum(-1)
    return [
        EdgeCase((_f32([[1e-30, 1.0], [1e-20, 1.0]]),)),
        EdgeCase((p,), finite_differences=False, reference_grad=False,
                 expected_value=value, expected_grad=(-(logp + 1),)),
    ]  # fmt: skip


@registered(
    _entropy,
    reference=_ref_entropy,
    sample=_prob_sample,
    edges=written_for({"axis": -1}, _entropy_edges),
    configs=_CONFIGS,
)
def entropy(p: ArrayLike, axis: int = -1) -> jax.Array:
    """Shannon entropy over ``axis``: ``H = -sum_i p_i log(p_i)`` (``0 log 0 = 0``).

    Same math as ``-sum(jax.scipy.special.xlogy(p, p), axis)``; ``p`` need not be
    normalized (the gradient is the partial derivative of this formula).

    Backward: ``dp_i = -(log(p_i) + 1) dH``; keeps ``p`` (an input).

    Edge convention: gradients are never NaN. At ``p_i = 0`` the derivative is ``+inf``
    (the true one-sided derivative of ``-p log p``) and reported as ``+inf`` times the
    sign of the cotangent (0 for a zero cotangent); plain autodiff gives NaN there (e.g.
    at ``p = [1, 0]``).

    Args:
      p: float array of probabilities, rank >= 1, ``p >= 0``.
      axis: the axis to reduce (static int).

    Returns:
      ``p``'s shape without ``axis``, in ``p``'s dtype.

    Raises:
      TypeError: if ``p`` is not floating point.
      ValueError: if ``axis`` is out of range.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> jax.grad(cannjax.ops.entropy)(jnp.array([1.0, 0.0]))
      Array([-1., inf], dtype=float32)
    """
    fn = "cannjax.ops.entropy"
    p = float_input(fn, "p", p)
    return _entropy(p, axis=axis_of(fn, axis, p))


# ------------------------------------------------------------------------------ arctan2
def _arctan2_forward(y, x):
    return downcast(jnp.arctan2(upcast(y), upcast(x)), y.dtype), {"y": y, "x": x}


def _arctan2_partials(res):
    # d/dy = x / r^2 and d/dx = -y / r^2, scaled by s = max(|x|, |y|): x/r^2 = xs / (s rs^2)
    # with xs = x / s, rs^2 = xs^2 + ys^2 in [1, 2]. At the origin both are 0, and at an
    # infinite input too (their limit as |(x, y)| grows: |d| <= 1 / r).
    y, x = upcast(res["y"]), upcast(res["x"])
    s = jnp.maximum(jnp.abs(x), jnp.abs(y))
    degenerate = (s == 0) | jnp.isinf(s)
    s = jnp.where(degenerate, 1, s)
    xs = jnp.where(degenerate, _zero(s), x / s)
    ys = jnp.where(degenerate, _zero(s), y / s)
    # rs^2 is 0 where degenerate: take 1 there, so no 1 / 0 is made (jax.debug_infs).
    rs2 = jnp.where(degenerate, jnp.ones((), s.dtype), xs * xs + ys * ys)
    inv = jnp.where(degenerate, _zero(s), 1 / s / rs2)
    return xs * inv, -ys * inv


def _arctan2_tangent(res, ty, tx):
    dy, dx = _arctan2_partials(res)
    return (dy * upcast(ty) + dx * upcast(tx)).astype(ty.dtype)


def _arctan2_backward(res, g):
    dy, dx = _arctan2_partials(res)
    g32 = upcast(g)
    return (g32 * dy).astype(g.dtype), (g32 * dx).astype(g.dtype)


_arctan2 = defop(
    "arctan2",
    forward=_arctan2_forward,
    tangent=_arctan2_tangent,
    backward=_arctan2_backward,
    residuals={"y": "the input y", "x": "the input x"},
    level=Level.RECOMPUTE,
)


def _arctan2_edges():
    def exact(y, x):
        y64, x64 = np.asarray(y, np.float64), np.asarray(x, np.float64)
        r2 = x64**2 + y64**2
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(r2 > 0, x64 / r2, 0.0), np.where(r2 > 0, -y64 / r2, 0.0)

    y, x = _f32([0.0, 1e20, -3.0]), _f32([0.0, 1e20, 0.0])
    # Second derivatives ~ 1 / r^2 = 1e60 overflow float32 at r ~ 1e-30: checked to first
    # order only.
    y_tiny, x_tiny = _f32([1e-30, 1e-30]), _f32([1e-30, -2e-30])
    # Infinite inputs: jnp.arctan2's value, gradient 0 (the limit).
    inf = np.inf
    yi, xi = _f32([inf, inf, 1.0, -1.0, -inf, inf]), _f32([inf, 1.0, inf, -inf, -inf, 0.0])
    zeros = np.zeros(6)
    return [
        EdgeCase((_f32([1.0, -1.0, 1e4, -1e-4]), _f32([-1.0, -1e-3, 1.0, 1e-4]))),
        EdgeCase((y, x), finite_differences=False, reference_grad=False,
                 expected_grad=exact(y, x)),
        EdgeCase((y_tiny, x_tiny), finite_differences=False, reference_grad=False,
                 expected_grad=exact(y_tiny, x_tiny), second_order=False),
        EdgeCase((yi, xi), finite_differences=False, reference_grad=False,
                 expected_grad=(zeros, zeros)),
    ]  # fmt: skip


@registered(_arctan2, reference=jnp.arctan2, sample=_pair, edges=_arctan2_edges)
def arctan2(y: ArrayLike, x: ArrayLike) -> jax.Array:
    """Angle of the point ``(x, y)``, ``atan2(y, x)``, as ``jnp.arctan2``.

    ``y`` and ``x`` broadcast like ``jnp``.

    Backward: ``dy = x / (x^2 + y^2) dz``, ``dx = -y / (x^2 + y^2) dz``, evaluated on
    ``(x, y) / max(|x|, |y|)`` so neither ``x^2 + y^2`` overflows (``|x| ~ 1e20`` in
    float32) nor underflows (``1e-30``). Keeps ``y`` and ``x`` (inputs).

    Edge convention: at the origin the value is 0 and the gradient 0 (plain autodiff gives
    ``0 / 0 = NaN``): the angle is undefined there and 0 is the value ``atan2(0, 0)``
    takes; a zero gradient does not push the point in an arbitrary direction. Signed zeros
    follow IEEE as ``jnp.arctan2`` (``arctan2(0, -0) = pi``), still with gradient 0. At an
    infinite input the value is ``jnp.arctan2``'s (``pi / 4`` at ``(inf, inf)``, 0 at
    ``(1, inf)``...) and the gradient 0, the limit of ``|d atan2| <= 1 / |(x, y)|``
    (plain autodiff gives ``inf / inf = NaN``).

    Args:
      y: float array.
      x: float array, broadcast-compatible with ``y``.

    Returns:
      The broadcast shape, in the promoted dtype.

    Raises:
      TypeError: if ``y`` or ``x`` is not floating point.
      ValueError: if the shapes do not broadcast.

    Example:
      >>> import jax, cannjax
      >>> [float(g) == 0 for g in jax.grad(cannjax.ops.arctan2, argnums=(0, 1))(0.0, 0.0)]
      [True, True]
    """
    y, x = broadcast_pair("cannjax.ops.arctan2", ("y", "x"), y, x)
    return _arctan2(y, x)
