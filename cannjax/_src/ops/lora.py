"""LoRA: a frozen dense layer plus a trained low-rank update, ``y = x w + s (x a) b``.

Fine-tuning with LoRA trains the rank-``r`` factors ``a [D, r]`` and ``b [r, E]`` and
freezes the base weight ``w [D, E]``. Plain autodiff of the same formula keeps ``x`` and
``x a``, as this operator does, but builds the product of the scaled cotangent: ``s g``
(or ``s (x a) b`` before the add) is one more ``[..., E]`` array, and where ``w`` reaches
the differentiated function as an input its ``[D, E]`` weight gradient ``x^T g`` is
built too. The rules here scale at rank ``r`` (``xa = s (x a)`` is what the forward keeps)
and never form a ``[D, E]`` product:

* forward: ``xa = s (x a)`` (``[N, r]``), ``y = x w + xa b (+ bias)``;
* backward: ``dxa = s (g b^T)`` (``[N, r]``), ``db = xa^T g``, ``da = x^T dxa``,
  ``dx = g w^T + dxa a^T``, ``dbias = sum_rows(g)``;
* tangent: ``dy = dx w + s (dx a + x da) b + xa db (+ dbias)``.

``w`` is a non-differentiable argument of :func:`lora_linear` (the operator computes
``x @ stop_gradient(w) + ...``): its cotangent is never computed, and ``jax.grad`` with
respect to it returns zeros. ``cannjax.optimize``, which cannot know whether the caller
differentiates ``w``, substitutes :func:`lora_linear_with_w_grad`: the same rules plus
``dw = x^T g``, which XLA removes as dead code when nobody reads it.

Products run in the inputs' dtype with at least float32 accumulation; every batch axis
of ``x`` is folded into rows, and the backward's products take the forms of
:func:`cannjax.ops.linear`: ``g @ w^T`` ("NT") for input cotangents and
:func:`~cannjax._src.ops.linalg.weight_grad` (one dot contracting the rows of both
operands) for weight cotangents.

Shape letters: ``D`` input width (``x``'s last axis), ``E`` output width, ``r`` the LoRA
rank, ``...`` any leading axes (``N`` rows once folded).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float
from cannjax._src.ops.linalg import nn_product as _nn
from cannjax._src.ops.linalg import normal_samples as _normal
from cannjax._src.ops.linalg import nt_product as _nt
from cannjax._src.ops.linalg import rows as _rows
from cannjax._src.ops.linalg import weight_grad


# ------------------------------------------------------------------------------ rules
# Arguments: x, w, a, b and, with ``bias``, the bias. Static: the scale ``s``, ``bias``
# (whether a bias is given) and ``w_grad`` (whether w is a differentiable argument, as in
# lora_linear_with_w_grad, or not, as in lora_linear).
def _forward(x, w, a, b, *c, scale, bias, w_grad):
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    x2 = _rows(x)
    # The scale is applied at rank r, once, before xa is rounded to the dtype: xa is
    # what the backward keeps, and db = xa^T g then needs no scaling.
    xa = (_nn(x2, a, acc) * scale).astype(dtype)
    y = _nn(x2, w, acc) + _nn(xa, b, acc)
    if bias:
        y = y + c[0].astype(acc)[None, :]
    lead = x.shape[:-1]
    y = y.astype(dtype).reshape(*lead, w.shape[1])
    return y, {"x": x, "w": w, "a": a, "b": b, "xa": xa.reshape(*lead, a.shape[1])}


def _frozen(w, w_grad):
    """``w`` as the rules read it: without w_grad it is stop_gradient(w), so that no
    order of differentiation reaches it (an outer transform differentiating these rules
    sees it as a constant, as the reference's ``stop_gradient`` is)."""
    return w if w_grad else lax.stop_gradient(w)


def _tangent(res, *ts, scale, bias, w_grad):
    # dy = dx w (+ x dw) + s (dx a + x da) b + xa db (+ dbias): the product rule of the
    # forward, with dxa = s (dx a + x da) the tangent of xa.
    x, w, a, b = res["x"], _frozen(res["w"], w_grad), res["a"], res["b"]
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    ts = list(ts)
    dx = ts.pop(0)
    dw = ts.pop(0) if w_grad else None
    da, db = ts.pop(0), ts.pop(0)
    x2, dx2, xa = _rows(x), _rows(dx), _rows(res["xa"])
    dxa = ((_nn(dx2, a, acc) + _nn(x2, da, acc)) * scale).astype(dtype)
    dy = _nn(dx2, w, acc) + _nn(dxa, b, acc) + _nn(xa, db, acc)
    if w_grad:
        dy = dy + _nn(x2, dw, acc)
    if bias:
        dy = dy + ts.pop(0).astype(acc)[None, :]
    return dy.astype(dtype).reshape(*x.shape[:-1], w.shape[1])


def _backward(res, g, *, scale, bias, w_grad):
    # dxa = s g b^T (rank r), db = xa^T g, da = x^T dxa, dx = g w^T + dxa a^T,
    # dbias = sum_rows g; with w_grad also dw = x^T g. No other [D, E] product.
    x, w, a, b = res["x"], _frozen(res["w"], w_grad), res["a"], res["b"]
    dtype, acc = x.dtype, compute_dtype(x.dtype)
    x2, g2, xa = _rows(x), _rows(g), _rows(res["xa"])
    dxa = (_nt(g2, b, acc) * scale).astype(dtype)
    dx = (_nt(g2, w, acc) + _nt(dxa, a, acc)).astype(dtype).reshape(x.shape)
    cts = [dx]
    if w_grad:
        cts.append(weight_grad(x2, g2, acc).astype(dtype))
    cts.append(weight_grad(x2, dxa, acc).astype(dtype))  # da
    cts.append(weight_grad(xa, g2, acc).astype(dtype))  # db
    if bias:
        cts.append(g2.astype(acc).sum(0).astype(dtype))
    return tuple(cts)


_RESIDUALS = {
    "x": "the input x, [..., D] (an input)",
    "w": "the frozen weight w, [D, E] (an input)",
    "a": "the factor a, [D, r] (an input)",
    "b": "the factor b, [r, E] (an input)",
    "xa": "the scaled rank-r projection s * (x @ a), [..., r]",
}

_lora = defop(
    "lora_linear",
    forward=_forward,
    tangent=_tangent,
    backward=_backward,
    nondiff_argnums=(1,),  # w: no cotangent, ever (x @ stop_gradient(w))
    residuals=_RESIDUALS,
    level=Level.DERIVED,
)

# The same rules with w differentiable: what cannjax.optimize substitutes when it cannot
# prove that w is constant (optimization/finders/lora.py). One name for both, so that remat
# policies and reports see cannjax.lora_linear.xa either way; a platform kernel
# registered for "lora_linear" tells them apart by the static w_grad.
_lora_w_grad = defop(
    "lora_linear",
    forward=_forward,
    tangent=_tangent,
    backward=_backward,
    residuals=_RESIDUALS,
    level=Level.DERIVED,
)


# ------------------------------------------------------------------------------ checks
def _static_scale(fn: str, scale) -> float:
    """``scale`` as a Python float, or TypeError / ValueError naming ``fn``."""
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"{fn}: scale must be a real number, got {scale!r}")
    if isinstance(scale, jax.core.Tracer):
        raise TypeError(
            f"{fn}: scale must be a Python number (it is static: part of the compiled "
            f"program), got a traced {jax.typeof(scale)}; pass it as a Python float, e.g. "
            f"scale=alpha / rank"
        )
    if isinstance(scale, (int, float, np.integer, np.floating)) or (
        isinstance(scale, (np.ndarray, jax.Array)) and np.ndim(scale) == 0
    ):
        value = float(scale)
    else:
        raise TypeError(f"{fn}: scale must be a real number, got {type(scale).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{fn}: scale must be finite, got {value}")
    return value


def _check(fn: str, x, w, a, b, bias, scale) -> tuple[list[jax.Array], float]:
    x, w, a, b = (as_float(fn, n, v) for n, v in (("x", x), ("w", w), ("a", a), ("b", b)))
    if x.ndim < 1:
        raise ValueError(f"{fn}: x must have rank >= 1 (shape [..., D]), got a scalar")
    D = x.shape[-1]
    if w.ndim != 2 or w.shape[0] != D:
        raise ValueError(
            f"{fn}: w must have shape (D, E) with D == x.shape[-1] == {D}, got {tuple(w.shape)}"
        )
    if a.ndim != 2 or a.shape[0] != D:
        raise ValueError(
            f"{fn}: a must have shape (D, r) with D == x.shape[-1] == {D}, got {tuple(a.shape)}"
        )
    r, E = a.shape[1], w.shape[1]
    if b.shape != (r, E):
        raise ValueError(
            f"{fn}: b must have shape (r, E) == ({r}, {E}), the rank r of a (a.shape = "
            f"{tuple(a.shape)}) and the output width E of w (w.shape = {tuple(w.shape)}), "
            f"got {tuple(b.shape)}"
        )
    args = [x, w, a, b]
    if bias is not None:
        bias = as_float(fn, "bias", bias)
        if bias.shape != (E,):
            raise ValueError(
                f"{fn}: bias must have shape (E,) == ({E},) to match w.shape = "
                f"{tuple(w.shape)}, got {tuple(bias.shape)}"
            )
        args.append(bias)
    dtype = jnp.result_type(*args)
    return [v.astype(dtype) for v in args], _static_scale(fn, scale)


# ------------------------------------------------------------------------------ samples
def _sample(key):
    # x [2, 3, 8], w [8, 6], a [8, 2], b [2, 6], bias [6]: rank 2. b is random, not
    # LoRA's zero initialization (an edge point), so every gradient is nonzero.
    return _normal(key, (2, 3, 8), (8, 6), (8, 2), (2, 6), (6,))


def _edges():
    x, w, a, b, c = _normal(jax.random.key(3), (4, 6), (6, 5), (6, 3), (3, 5), (5,))
    ones = jnp.ones((2, 4), jnp.float32)
    return [
        EdgeCase((jnp.stack([x, -x]), w, a, b)),  # rank-3 x, no bias
        EdgeCase((x[0], w, a, b, c)),  # rank-1 x
        EdgeCase((x, w, a, jnp.zeros_like(b), c)),  # LoRA's initialization: b = 0, da = 0
        EdgeCase((x, w, jnp.zeros_like(a), b)),  # a = 0: xa = 0, db = 0
        EdgeCase((x, w, a[:, :1], b[:1], c)),  # rank 1
        # A zero row, large inputs and bias, small weights; and xa of order 1e8 against
        # b of 1e-8 (a product of order 1 from huge and tiny factors).
        EdgeCase((jnp.concatenate([jnp.zeros((1, 6)), x[1:] * 1e4]), w * 1e-4, a, b, c * 1e4)),
        EdgeCase((x, w, a * 1e8, b * 1e-8, c), kwargs={"scale": 1e-3}),
        EdgeCase((jnp.zeros((0, 6), jnp.float32), w, a, b, c), finite_differences=False),
        # y = 4 + s 4 = 6; d sum(y): dx = 3 + s 3 = 4.5, dxa = s 3 = 1.5 per row,
        # da = 2 rows * 1.5 = 3, xa = s 4 = 2, db = 2 rows * 2 = 4, dbias = 2.
        EdgeCase(
            (ones, jnp.ones((4, 3)), jnp.ones((4, 1)), jnp.ones((1, 3)), jnp.zeros(3)),
            kwargs={"scale": 0.5},
            expected_value=jnp.full((2, 3), 6.0),
            expected_grad=(
                jnp.full((2, 4), 4.5),
                jnp.full((4, 1), 3.0),
                jnp.full((1, 3), 4.0),
                jnp.full(3, 2.0),
            ),
        ),
    ]


def _reference(x, w, a, b, bias=None, *, scale=1.0):
    y = x @ lax.stop_gradient(w) + scale * ((x @ a) @ b)
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + bias.shape)


# ------------------------------------------------------------------------------ lora_linear
@registered(
    _lora,
    reference=_reference,
    sample=_sample,
    edges=_edges,
    configs=({"scale": 1.0}, {"scale": 2.0}),
)
def lora_linear(
    x: ArrayLike,
    w: ArrayLike,
    a: ArrayLike,
    b: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    scale: float = 1.0,
) -> jax.Array:
    """LoRA layer with a frozen base weight, ``y = x @ w + scale * (x @ a) @ b + bias``.

    ``w`` is frozen: the operator is ``x @ stop_gradient(w) + ...``, so ``jax.grad``
    with respect to ``w`` gives zeros and no ``[D, E]`` weight gradient is ever
    computed. ``a``, ``b``, ``bias`` and ``x`` are differentiated. With
    ``xa = scale * (x @ a)`` (rank ``r``) and ``g`` the output cotangent::

      dxa = scale * (g @ b^T)                  [..., r]
      db = xa^T g,   da = x^T dxa,   dbias = sum_rows(g)
      dx = g @ w^T + dxa @ a^T

    Tangent: ``dy = dx @ w + scale * (dx @ a + x @ da) @ b + xa @ db + dbias``. Keeps
    ``x``, the weights (inputs, which exist anyway) and ``xa``, one ``[..., r]`` array;
    the scale is applied at rank ``r``, never to an ``[..., E]`` array. Every batch axis
    of ``x`` is folded into rows; products run in the inputs' dtype with at least
    float32 accumulation. ``bias`` belongs to the base layer (flax.nnx's
    ``LoRALinear``): it is differentiated, which costs a row sum when it is not.

    ``flax.nnx.LoRALinear(D, E, lora_rank=r)`` computes this with ``scale=1.0`` (its
    ``kernel``, ``lora.lora_a``, ``lora.lora_b`` and ``bias`` are ``w``, ``a``, ``b``
    and ``bias``); the LoRA paper and PEFT use ``scale = alpha / r``. To train ``w``
    too, let ``cannjax.optimize`` rewrite the plain formula: it substitutes these rules
    plus ``dw = x^T g`` where ``w`` may be differentiated (``docs/optimize.md``).

    Shape letters: ``D`` input width, ``E`` output width, ``r`` LoRA rank.

    Args:
      x: input, ``[..., D]``, rank >= 1.
      w: frozen base weight, ``[D, E]``.
      a: down factor, ``[D, r]``.
      b: up factor, ``[r, E]``.
      bias: optional base bias, ``[E]``.
      scale: the factor of the low-rank update (static: a Python number).

    Returns:
      ``[..., E]``, in the promoted dtype of the arguments.

    Raises:
      TypeError: if an array argument is not floating point, or ``scale`` is not a
        real number (a traced value included: it is static).
      ValueError: if ``x`` is a scalar, the shapes do not chain (``w [D, E]``,
        ``a [D, r]``, ``b [r, E]``, ``bias [E]``) or ``scale`` is not finite.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> x, w = jnp.ones((2, 3, 4)), jnp.ones((4, 5))
      >>> a, b = jnp.ones((4, 2)), jnp.full((2, 5), 0.5)
      >>> y = cannjax.ops.lora_linear(x, w, a, b, scale=0.5)
      >>> y.shape, float(y[0, 0, 0])  # 4 + 0.5 * (4 + 4) * 0.5
      ((2, 3, 5), 6.0)
      >>> float(jax.grad(lambda w: cannjax.ops.lora_linear(x, w, a, b).sum())(w).max())
      0.0

    References:
      Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
      https://arxiv.org/abs/2106.09685
    """
    args, s = _check("cannjax.ops.lora_linear", x, w, a, b, bias, scale)
    return _lora(*args, scale=s, bias=bias is not None, w_grad=False)


def lora_linear_with_w_grad(
    x: ArrayLike,
    w: ArrayLike,
    a: ArrayLike,
    b: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    scale: float = 1.0,
) -> jax.Array:
    """:func:`lora_linear` with ``w`` differentiated too: its backward adds
    ``dw = x^T g``. Under ``jit`` XLA drops that product when nobody reads ``dw`` (``w``
    not differentiated), so this is what ``cannjax.optimize`` substitutes for a LoRA
    layer whose ``w`` it cannot prove constant."""
    args, s = _check("cannjax.ops.lora_linear", x, w, a, b, bias, scale)
    return _lora_w_grad(*args, scale=s, bias=bias is not None, w_grad=True)
