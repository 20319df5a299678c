"""Gated MLPs: ``y = (act(x @ w_gate) * (x @ w_up)) @ w_down`` as one operator.

``swiglu`` (act = silu) and ``geglu`` (act = gelu) share one set of rules; the activation
is a static argument. The forward keeps the two ``[..., F]`` pre-activations
``a = x @ w_gate`` and ``b = x @ w_up`` (and the inputs, which exist anyway); the
backward and the tangent rule recompute the hidden ``h = act(a) * b``. Plain autodiff of
the same three products keeps, besides ``a`` and ``b``, the activation's own
intermediates (values inside ``act``) and ``h``: four more ``[..., F]`` arrays for silu.

Matrix products run in the inputs' dtype with accumulation in at least float32
(``preferred_element_type``); the elementwise part (``act``, its derivative, the
products with ``b`` and the cotangent) runs in at least float32 and is rounded to the
inputs' dtype before each product. Every batch axis of ``x`` is folded into rows, and the
backward's products take the forms of :func:`cannjax.ops.linear`: ``g @ w^T`` ("NT") for
input cotangents and :func:`~cannjax._src.ops.linalg.weight_grad` (one dot contracting
the rows of both operands) for weight cotangents.

Higher orders: ``act(a)`` and ``act'(a)`` inside the rules are the elementwise operators
of :mod:`cannjax._src.ops.elementwise` and their derivative operators
(:mod:`cannjax._src.ops.unary`), so the second derivatives keep their edge conventions
(finite at huge ``|a|``, where the tanh form's ``a**3`` overflows).

Shape letters: ``D`` model width (``x``'s last axis), ``F`` hidden width, ``E`` output
width, ``...`` any leading axes (rows, ``N`` of them once folded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import compute_dtype, upcast
from cannjax._src.core.operator import Operator, defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float
from cannjax._src.ops.elementwise import (
    _gelu,
    _gelu_derivative,
    _gelu_value,
    _silu,
    _silu_derivative,
    _silu_value,
)
from cannjax._src.ops.linalg import nn_product as _nn
from cannjax._src.ops.linalg import normal_samples as _normal
from cannjax._src.ops.linalg import nt_product as _nt
from cannjax._src.ops.linalg import rows as _rows
from cannjax._src.ops.linalg import weight_grad
from cannjax._src.ops.unary import _derivative_op


# ------------------------------------------------------------------------------ activations
@dataclasses.dataclass(frozen=True)
class _Activation:
    """An activation as the rules use it.

    ``value`` is the plain forward (``_silu_value``); ``op`` the elementwise operator
    with its own rules (for ``act(a)`` inside the tangent and backward, so an outer
    transform differentiates it by those rules); ``name`` and ``derivative`` identify
    its derivative operator, shared with the elementwise op's (``silu_d1``).
    """

    name: str
    value: Callable[..., jax.Array]
    op: Operator
    derivative: Callable[..., jax.Array]
    static: tuple = ()

    def __call__(self, a: jax.Array) -> jax.Array:
        return self.op(a, **dict(self.static))

    def grad(self, a: jax.Array) -> jax.Array:
        return _derivative_op(self.name, self.derivative, self.static, 0)(a)

    def plain(self, a: jax.Array) -> jax.Array:
        return self.value(a, **dict(self.static))


_ACTIVATIONS = {
    "silu": _Activation("silu", _silu_value, _silu, _silu_derivative),
    "gelu_tanh": _Activation(
        "gelu", _gelu_value, _gelu, _gelu_derivative, (("approximate", True),)
    ),
    "gelu_erf": _Activation(
        "gelu", _gelu_value, _gelu, _gelu_derivative, (("approximate", False),)
    ),
}


# ------------------------------------------------------------------------------ rules
def _forward(x, w_gate, w_up, w_down, *, act):
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    x2 = _rows(x)
    a = _nn(x2, w_gate, acc).astype(dtype)
    b = _nn(x2, w_up, acc).astype(dtype)
    h = (_ACTIVATIONS[act].plain(upcast(a)) * upcast(b)).astype(dtype)
    y = _nn(h, w_down, acc).astype(dtype).reshape(*x.shape[:-1], w_down.shape[1])
    lead = x.shape[:-1]
    return y, {
        "x": x,
        "w_gate": w_gate,
        "w_up": w_up,
        "w_down": w_down,
        "a": a.reshape(*lead, a.shape[1]),
        "b": b.reshape(*lead, b.shape[1]),
    }


def _tangent(res, dx, dw_gate, dw_up, dw_down, *, act):
    # da = dx w_gate + x dw_gate,  db = dx w_up + x dw_up,
    # dh = act'(a) b da + act(a) db,  dy = dh w_down + h dw_down.
    x, w_gate, w_up, w_down = res["x"], res["w_gate"], res["w_up"], res["w_down"]
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    x2, dx2 = _rows(x), _rows(dx)
    a, b = upcast(_rows(res["a"])), upcast(_rows(res["b"]))
    da = _nn(dx2, w_gate, acc) + _nn(x2, dw_gate, acc)
    db = _nn(dx2, w_up, acc) + _nn(x2, dw_up, acc)
    f = _ACTIVATIONS[act]
    s = f(a)
    h = (s * b).astype(dtype)
    dh = (f.grad(a) * b * da + s * db).astype(dtype)
    dy = _nn(dh, w_down, acc) + _nn(h, dw_down, acc)
    return dy.astype(dtype).reshape(*x.shape[:-1], w_down.shape[1])


def _backward(res, g, *, act):
    # h = act(a) b recomputed;  dw_down = h^T g,  dh = g w_down^T,
    # da = dh b act'(a),  db = dh act(a),  dx = da w_gate^T + db w_up^T,
    # dw_gate = x^T da,  dw_up = x^T db.
    x, w_gate, w_up, w_down = res["x"], res["w_gate"], res["w_up"], res["w_down"]
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    x2, g2 = _rows(x), _rows(g)
    a, b = upcast(_rows(res["a"])), upcast(_rows(res["b"]))
    f = _ACTIVATIONS[act]
    s = f(a)
    h = (s * b).astype(dtype)
    dw_down = weight_grad(h, g2, acc).astype(dtype)
    dh = _nt(g2, w_down, acc)
    da = (dh * b * f.grad(a)).astype(dtype)
    db = (dh * s).astype(dtype)
    dx = (_nt(da, w_gate, acc) + _nt(db, w_up, acc)).astype(dtype).reshape(x.shape)
    dw_gate = weight_grad(x2, da, acc).astype(dtype)
    dw_up = weight_grad(x2, db, acc).astype(dtype)
    return dx, dw_gate, dw_up, dw_down


_RESIDUALS = {
    "x": "the input x, [..., D] (an input)",
    "w_gate": "the gate weight, [D, F] (an input)",
    "w_up": "the up weight, [D, F] (an input)",
    "w_down": "the down weight, [F, E] (an input)",
    "a": "the gate pre-activation x @ w_gate, [..., F]",
    "b": "the up projection x @ w_up, [..., F]",
}


def _gated_op(name: str) -> Operator:
    return defop(
        name,
        forward=_forward,
        tangent=_tangent,
        backward=_backward,
        residuals=_RESIDUALS,
        level=Level.DERIVED,
        reuse=(),
    )


_swiglu = _gated_op("swiglu")
_geglu = _gated_op("geglu")


# ------------------------------------------------------------------------------ checks
def _check(fn: str, x, w_gate, w_up, w_down) -> list[jax.Array]:
    x = as_float(fn, "x", x)
    ws = [as_float(fn, n, w) for n, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))]
    w_gate, w_up, w_down = ws
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 (shape [..., D]), got a scalar")
    D = x.shape[-1]
    if w_gate.ndim != 2 or w_gate.shape[0] != D:
        raise ValueError(
            f"{fn}: w_gate must have shape (D, F) with D == x.shape[-1] == {D}, got "
            f"{tuple(w_gate.shape)}"
        )
    if w_up.shape != w_gate.shape:
        raise ValueError(
            f"{fn}: w_up must have the shape of w_gate, (D, F) == {tuple(w_gate.shape)}, got "
            f"{tuple(w_up.shape)}"
        )
    F = w_gate.shape[1]
    if w_down.ndim != 2 or w_down.shape[0] != F:
        raise ValueError(
            f"{fn}: w_down must have shape (F, E) with F == w_gate.shape[1] == {F}, got "
            f"{tuple(w_down.shape)}"
        )
    dtype = jnp.result_type(x, *ws)
    return [v.astype(dtype) for v in (x, *ws)]


# ------------------------------------------------------------------------------ samples
def _sample(key):
    # x [2, 3, 8], w_gate and w_up [8, 12], w_down [12, 6]: pre-activations of order 1
    # (the tails are edge points).
    return _normal(key, (2, 3, 8), (8, 12), (8, 12), (12, 6))


def _edges():
    x, wg, wu, wd = _normal(jax.random.key(5), (4, 6), (6, 5), (6, 5), (5, 3))
    rows = jnp.concatenate([jnp.zeros((1, 6)), x[1:]])  # a zero row: a = b = 0
    return [
        EdgeCase((rows, wg, wu, wd)),
        EdgeCase((x[0], wg, wu, wd)),  # rank-1 x
        EdgeCase((jnp.stack([x, -x]), wg, wu, wd)),  # rank-3 x
        # Pre-activations from +-6 to +-200: the activation's tails, where silu and
        # gelu approach 0 and the identity.
        EdgeCase((x * 300.0, wg, wu, wd)),
        # |a| ~ 1e20: act'(a) and act''(a) are evaluated where they are exactly
        # saturated (plain autodiff of gelu's tanh form squares a: inf * 0 = NaN). The
        # weights are scaled, not x, so that h and every gradient stay inside float32.
        EdgeCase((x, wg * 1e20, wu, wd), finite_differences=False, reference_grad=False),
        EdgeCase((x, wg[:, :1], wu[:, :1], wd[:1])),  # F = 1
        EdgeCase((x, wg, wu, jnp.zeros_like(wd))),  # w_down = 0: only dw_down is nonzero
        EdgeCase((jnp.zeros((0, 6)), wg, wu, wd), finite_differences=False),  # no rows
    ]


# ------------------------------------------------------------------------------ swiglu
def _swiglu_reference(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


@registered(_swiglu, reference=_swiglu_reference, sample=_sample, edges=_edges)
def swiglu(x: ArrayLike, w_gate: ArrayLike, w_up: ArrayLike, w_down: ArrayLike) -> jax.Array:
    """SwiGLU feed-forward block, ``y = (silu(x @ w_gate) * (x @ w_up)) @ w_down``.

    With ``a = x @ w_gate``, ``b = x @ w_up``, ``h = silu(a) * b`` and ``g`` the output
    cotangent (``silu'(a) = s (1 + a (1 - s))``, ``s = sigmoid(a)``)::

      dw_down = h^T g,   dh = g w_down^T
      da = dh * b * silu'(a),   db = dh * silu(a)
      dx = da w_gate^T + db w_up^T,   dw_gate = x^T da,   dw_up = x^T db

    Tangent: ``dy = (silu'(a) b da + silu(a) db) w_down + h dw_down`` with
    ``da = dx w_gate + x dw_gate``, ``db = dx w_up + x dw_up``. Keeps ``x``, the weights
    (inputs) and ``a``, ``b`` (two ``[..., F]`` arrays); ``h`` is recomputed in the
    backward. Plain autodiff of the same formula also keeps ``sigmoid(a)``, ``silu(a)``
    and ``h``. Finite at huge ``|a|``: ``silu'`` is evaluated where it is exactly 0 or
    1. Every batch axis of ``x`` is folded into rows; products run in the inputs' dtype
    with at least float32 accumulation, the elementwise part in at least float32.

    Shape letters: ``D`` model width, ``F`` hidden width, ``E`` output width.

    Args:
      x: ``[..., D]``, rank >= 1.
      w_gate: gate projection, ``[D, F]``.
      w_up: up projection, ``[D, F]``.
      w_down: down projection, ``[F, E]``.

    Returns:
      ``[..., E]``, in the promoted dtype of the arguments.

    Raises:
      TypeError: if an argument is not a floating-point array.
      ValueError: if ``x`` is a scalar or the weights' shapes do not chain
        (``w_gate``, ``w_up`` ``[D, F]``, ``w_down`` ``[F, E]``).

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.25)
      >>> y = cannjax.ops.swiglu(x, w, w, jnp.ones((3, 5)))
      >>> y.shape, round(float(y[0, 0]), 4)  # 3 * silu(1) * 1
      ((2, 5), 2.1932)

    References:
      Shazeer, "GLU Variants Improve Transformer", 2020. https://arxiv.org/abs/2002.05202
    """
    return _swiglu(*_check("cannjax.ops.swiglu", x, w_gate, w_up, w_down), act="silu")


# ------------------------------------------------------------------------------ geglu
def _geglu_reference(x, w_gate, w_up, w_down, approximate=True):
    return (jax.nn.gelu(x @ w_gate, approximate=approximate) * (x @ w_up)) @ w_down


@registered(
    _geglu,
    reference=_geglu_reference,
    sample=_sample,
    edges=_edges,
    configs=({"approximate": True}, {"approximate": False}),
)
def geglu(
    x: ArrayLike, w_gate: ArrayLike, w_up: ArrayLike, w_down: ArrayLike, *, approximate: bool = True
) -> jax.Array:
    """GeGLU feed-forward block, ``y = (gelu(x @ w_gate) * (x @ w_up)) @ w_down``.

    The rules of :func:`swiglu` with ``gelu`` for ``silu``: with ``a = x @ w_gate``,
    ``b = x @ w_up``, ``h = gelu(a) * b``::

      dw_down = h^T g,   dh = g w_down^T
      da = dh * b * gelu'(a),   db = dh * gelu(a)
      dx = da w_gate^T + db w_up^T,   dw_gate = x^T da,   dw_up = x^T db

    ``gelu`` is :func:`cannjax.ops.gelu`: the tanh approximation
    ``a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3))) / 2`` when ``approximate`` (the default,
    as ``jax.nn.gelu``'s), else the exact ``a Phi(a)``. Keeps ``x``, the weights and
    ``a``, ``b``; ``h`` is recomputed in the backward. Finite at huge ``|a|``, where
    plain autodiff of the tanh form overflows ``a^3`` and gives NaN.

    Shape letters: ``D`` model width, ``F`` hidden width, ``E`` output width.

    Args:
      x: ``[..., D]``, rank >= 1.
      w_gate: gate projection, ``[D, F]``.
      w_up: up projection, ``[D, F]``.
      w_down: down projection, ``[F, E]``.
      approximate: the tanh form of gelu (True) or the exact erf form (False).

    Returns:
      ``[..., E]``, in the promoted dtype of the arguments.

    Raises:
      TypeError: if an argument is not a floating-point array, or ``approximate`` not a
        bool.
      ValueError: if ``x`` is a scalar or the weights' shapes do not chain
        (``w_gate``, ``w_up`` ``[D, F]``, ``w_down`` ``[F, E]``).

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> x, w = jnp.ones((2, 4)), jnp.full((4, 3), 0.25)
      >>> y = cannjax.ops.geglu(x, w, w, jnp.ones((3, 5)), approximate=False)
      >>> y.shape, round(float(y[0, 0]), 4)  # 3 * gelu(1) * 1
      ((2, 5), 2.524)

    References:
      Shazeer, "GLU Variants Improve Transformer", 2020. https://arxiv.org/abs/2002.05202

      Hendrycks and Gimpel, "Gaussian Error Linear Units (GELUs)", 2016.
      https://arxiv.org/abs/1606.08415
    """
    fn = "cannjax.ops.geglu"
    if not isinstance(approximate, bool):
        raise TypeError(
            f"{fn}: approximate must be True (tanh form) or False (exact erf form), got "
            f"{approximate!r}"
        )
    act = "gelu_tanh" if approximate else "gelu_erf"
    return _geglu(*_check(fn, x, w_gate, w_up, w_down), act=act)
