"""Normalization over the last axis: layer norm (bias optional) and RMS norm (with
Gemma's ``offset + scale``).

Both keep per-row statistics and one full array: the input ``x`` (see
``docs/ops_nn.md`` for the measurement behind that choice over Apex-style saving of
the output). Statistics are computed and kept in float32 for half-precision inputs;
the backward also runs in float32 there and casts its cotangents back.

Shape letters: ``D`` the normalized (last) axis, ``...`` any leading axes (rows).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float


def _row_sum(v: jax.Array) -> jax.Array:
    """Sum over every axis but the last: the cotangent of a ``[D]`` parameter."""
    return v.reshape(-1, v.shape[-1]).sum(0)


def _mean(v: jax.Array) -> jax.Array:
    return jnp.mean(v, axis=-1, keepdims=True)


# A norm's backward sums products of the cotangent with the scale (per feature) or rstd
# (per row). Written as reductions of products with the vector broadcast, XLA:CPU reduces
# them in fusions (YNNPACK's) that take the broadcast vector, or ``xhat``, as a
# materialized [..., D] array: a value of the forward alone, which its scheduler computes
# in the forward and holds until the backward, one or more per norm (the compiled
# gradient of an unrolled flax.nnx GPT; docs/ops_nn.md). As matrix-vector products the
# sums read the vectors themselves. The elementwise products read the scale through
# ``broadcast_to`` of the same [D] vector the products read, so that the partitioner
# gathers an FSDP-sharded scale once for both (through ``_expand``'s reshape it gathered
# it twice).
def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` in float32 on every backend (``HIGHEST``: no TF32)."""
    return jnp.einsum(spec, a, b, precision=jax.lax.Precision.HIGHEST)


def _check_args(fn: str, x, params: dict, eps) -> tuple[jax.Array, list[jax.Array], float]:
    """``x``, the ``[D]`` parameters in ``params`` (name -> value) and ``eps``, checked
    and promoted to one dtype."""
    x = as_float(fn, "x", x)
    if x.ndim < 1:
        raise ValueError(
            f"{fn}: x must have rank >= 1 (normalized over its last axis), got a scalar"
        )
    out = []
    for name, p in params.items():
        p = as_float(fn, name, p)
        if p.shape != x.shape[-1:]:
            raise ValueError(
                f"{fn}: {name} must have shape x.shape[-1:] == {tuple(x.shape[-1:])} (one "
                f"value per feature), got {tuple(p.shape)}"
            )
        out.append(p)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(
            f"{fn}: eps must be a positive number (it keeps constant rows finite), got {eps!r}"
        )
    dtype = jnp.result_type(x, *out)
    return x.astype(dtype), [p.astype(dtype) for p in out], float(eps)


def _check_offset(fn: str, offset) -> float:
    if isinstance(offset, (bool, np.bool_)) or not isinstance(
        offset, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"{fn}: offset must be a Python float (static; the scale applied is "
            f"offset + scale, 1.0 for Gemma's (1 + scale)), got {offset!r}"
        )
    if not math.isfinite(offset):
        raise ValueError(f"{fn}: offset must be finite, got {offset!r}")
    return float(offset)


def _expand(p: jax.Array, ndim: int) -> jax.Array:
    return p.reshape((1,) * (ndim - 1) + p.shape)


def _sample(key, shape=(3, 8), bias=True):
    k = jax.random.split(key, 3)
    d = shape[-1]
    x = jax.random.normal(k[0], shape, jnp.float32)
    scale = 1 + 0.5 * jax.random.normal(k[1], (d,), jnp.float32)
    b = 0.1 * jax.random.normal(k[2], (d,), jnp.float32)
    return (x, scale, b) if bias else (x, scale)


def _norm_edges(bias: bool):
    def edges():
        x, scale, *b = _sample(jax.random.key(3), (4, 6), bias)
        rows = jnp.stack(
            [
                jnp.full(6, 2.5),  # constant row: variance 0
                x[0] * 1e3,  # large magnitude
                x[1] * 1e-3,  # small: variance below eps
            ]
        ).astype(jnp.float32)
        zeros = jnp.zeros((2, 6), jnp.float32)
        zero_scale = scale.at[::2].set(0.0)
        one_feature = (jnp.array([[1.5], [-2.0]], jnp.float32), scale[:1], *(p[:1] for p in b))
        return [
            EdgeCase((rows, scale, *b)),
            # Zero rows: the value is smooth, but on a scale of sqrt(eps) ~ 1e-3 for
            # rms_norm, below what the finite-difference step resolves; the gradient is
            # still checked against plain autodiff, which is finite there.
            EdgeCase((zeros, scale, *b), finite_differences=bias),
            EdgeCase((rows, scale, *b), kwargs={"eps": 0.1}),  # a large eps
            EdgeCase(one_feature),  # D = 1
            EdgeCase((x[0], scale, *b)),  # rank-1 x
            EdgeCase((jnp.stack([x, x * 2]), zero_scale, *b)),  # rank-3 x, zeros in scale
        ] + (without_bias(rows, zeros, scale) if bias else with_offset(rows, x, scale))

    def without_bias(rows, zeros, scale):
        # layer_norm(x, scale): no bias term, no bias gradient.
        return [EdgeCase((rows, scale)), EdgeCase((zeros, scale))]

    def with_offset(rows, x, scale):
        # Gemma's (1 + scale): a scale near 0, and offset + scale = 0 exactly (the output
        # is 0, dscale is still sum(g * xhat)).
        return [
            EdgeCase((rows, 0.1 * scale), kwargs={"offset": 1.0}),
            EdgeCase((x, -jnp.ones_like(scale)), kwargs={"offset": 1.0}),
        ]

    return edges


# ------------------------------------------------------------------------------ layer_norm
# ``bias`` (static): whether the bias argument is given (``*b`` holds it then).
def _layer_norm_forward(x, scale, *b, eps, bias):
    xf = upcast(x)
    m = _mean(xf)
    d = xf - m
    rstd = jax.lax.rsqrt(_mean(d * d) + eps)
    y = d * rstd * upcast(_expand(scale, x.ndim))
    if bias:
        y = y + upcast(_expand(b[0], x.ndim))
    # Per-row statistics drop their unit axis: [...] rather than [..., 1].
    return y.astype(x.dtype), {"x": x, "mean": m[..., 0], "rstd": rstd[..., 0], "scale": scale}


def _layer_norm_jacobian(res, v):
    """``(xhat, r P(v))``: ``r P`` is the Jacobian of ``xhat = (x - m) r`` in ``x``.

    ``P(v) = v - mean(v) - xhat mean(xhat v)`` removes the row mean and the component
    along ``xhat``. ``P`` is symmetric, so the same map gives the tangent
    (``v = dx``) and the backward (``v = g * scale``).
    """
    rstd = res["rstd"][..., None]
    xhat = (upcast(res["x"]) - res["mean"][..., None]) * rstd
    return xhat, rstd * (v - _mean(v) - xhat * _mean(xhat * v))


def _layer_norm_tangent(res, dx, dscale, *dbias, eps, bias):
    xhat, dxhat = _layer_norm_jacobian(res, upcast(dx))
    nd = dx.ndim
    scale, dscale = (upcast(_expand(p, nd)) for p in (res["scale"], dscale))
    dy = dxhat * scale + xhat * dscale
    if bias:
        dy = dy + upcast(_expand(dbias[0], nd))
    return dy.astype(dx.dtype)


def _layer_norm_backward(res, g, *, eps, bias):
    """The jacobian's ``r P(v)`` (``v = g s``) with ``xhat = d r``, ``d = x - m``:

      dx = r (v - mean(v)) - xhat (r^2 mean(g d s)),  dscale = sum_rows(r g d),

    every sum a matrix-vector product (:func:`_dot`): the backward reads no array made
    from the forward's values alone."""
    gf = upcast(g)
    r = res["rstd"][..., None]
    d = upcast(res["x"]) - res["mean"][..., None]
    s = upcast(res["scale"])
    gd, n = gf * d, g.shape[-1]
    mean_v, c = _dot("...d,d->...", gf, s)[..., None] / n, _dot("...d,d->...", gd, s)[..., None] / n
    dx = r * (gf * jnp.broadcast_to(s, g.shape) - mean_v) - (d * r) * (r * r * c)
    cts = dx.astype(g.dtype), _dot("...,...d->d", res["rstd"], gd)
    return (*cts, _row_sum(gf)) if bias else cts


_layer_norm = defop(
    "layer_norm",
    forward=_layer_norm_forward,
    tangent=_layer_norm_tangent,
    backward=_layer_norm_backward,
    residuals={
        "x": "the input x, [..., D]",
        "mean": "per-row mean, [...] (float32 for half inputs)",
        "rstd": "per-row 1/sqrt(var + eps), [...] (float32 for half inputs)",
        "scale": "the scale, [D]",
    },
    level=Level.DERIVED,
    reuse=(2,),
)


def _layer_norm_reference(x, scale, bias=None, eps=1e-5):
    m = jnp.mean(x, axis=-1, keepdims=True)
    v = jnp.mean((x - m) ** 2, axis=-1, keepdims=True)
    y = (x - m) / jnp.sqrt(v + eps) * _expand(scale, x.ndim)
    return y if bias is None else y + _expand(bias, x.ndim)


@registered(
    _layer_norm,
    reference=_layer_norm_reference,
    sample=_sample,
    edges=_norm_edges(bias=True),
)
def layer_norm(
    x: ArrayLike, scale: ArrayLike, bias: ArrayLike | None = None, eps: float = 1e-5
) -> jax.Array:
    """Layer normalization over the last axis.

    ``m = mean(x)``, ``v = mean((x - m)^2)``, ``r = 1 / sqrt(v + eps)``,
    ``xhat = (x - m) r``, ``y = xhat * scale + bias`` (statistics per row of ``D``);
    ``y = xhat * scale`` when ``bias`` is None (no bias term and no bias gradient, as
    ``flax.linen.LayerNorm(use_bias=False)``).

    The Jacobian of ``xhat`` is ``r P`` with ``P(v) = v - mean(v) - xhat mean(xhat v)``,
    a symmetric map, so with ``gs = g * scale``::

      dx     = r * P(gs) = r * (gs - mean(gs) - xhat * mean(gs * xhat))
      dscale = sum_rows(g * xhat),   dbias = sum_rows(g)

    Tangent: ``dy = r P(dx) scale + xhat dscale + dbias``. Keeps ``x``, the per-row
    ``mean`` and ``rstd`` (``r``) and ``scale``: one full array instead of the several
    plain autodiff keeps. Edge conventions: a constant (or zero) row has ``v = 0``, so
    ``r = eps^-1/2`` is finite and ``xhat = 0``: value ``bias`` (0 without one), gradient
    finite (``dx = r (gs - mean(gs))``). Zeros in ``scale`` are fine (``x``, not the
    output, is kept). Half-precision inputs are normalized in float32 and cast back.

    Args:
      x: ``[..., D]``.
      scale: ``[D]``.
      bias: ``[D]``, or None for no bias.
      eps: positive constant added to the variance.

    Returns:
      ``[..., D]``, in the promoted dtype of the arguments.

    Raises:
      TypeError: if an argument is not a floating-point array.
      ValueError: if ``x`` is a scalar, ``scale``/``bias`` are not ``[D]`` or ``eps <= 0``.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> y = cannjax.ops.layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2))
      >>> [round(float(v), 3) for v in y[0]]
      [-1.0, 1.0]
      >>> y = cannjax.ops.layer_norm(jnp.array([[1.0, 3.0]]), jnp.array([2.0, 1.0]))  # no bias
      >>> [round(float(v), 3) for v in y[0]]
      [-2.0, 1.0]

    References:
      Ba, Kiros and Hinton, "Layer Normalization", 2016. https://arxiv.org/abs/1607.06450
      Huawei CANN operator LayerNorm
      Huawei CANN operator LayerNormGrad
    """
    fn = "cannjax.ops.layer_norm"
    params = {"scale": scale} if bias is None else {"scale": scale, "bias": bias}
    x, params, eps = _check_args(fn, x, params, eps)
    return _layer_norm(x, *params, eps=eps, bias=bias is not None)


# ------------------------------------------------------------------------------ rms_norm
def _applied_scale(scale: jax.Array, offset: float, ndim: int) -> jax.Array:
    """``offset + scale`` broadcast against ``[..., D]``, in at least float32 (Gemma's
    ``1 + scale`` is formed in float32 for half-precision weights)."""
    s = upcast(_expand(scale, ndim))
    return s + offset if offset else s


def _rms_norm_forward(x, scale, *, eps, offset):
    xf = upcast(x)
    rstd = jax.lax.rsqrt(_mean(xf * xf) + eps)
    y = xf * rstd * _applied_scale(scale, offset, x.ndim)
    return y.astype(x.dtype), {"x": x, "rstd": rstd[..., 0], "scale": scale}


def _rms_norm_jacobian(res, v):
    """``(xhat, r P(v))``: ``r P`` is the Jacobian of ``xhat = x r`` in ``x``.

    ``P(v) = v - xhat mean(xhat v) = v - x r^2 mean(x v)`` removes the component along
    ``x``. ``P`` is symmetric, so the same map gives the tangent (``v = dx``) and the
    backward (``v = g * (offset + scale)``).
    """
    rstd = res["rstd"][..., None]
    xhat = upcast(res["x"]) * rstd
    return xhat, rstd * (v - xhat * _mean(xhat * v))


def _rms_norm_tangent(res, dx, dscale, *, eps, offset):
    xhat, dxhat = _rms_norm_jacobian(res, upcast(dx))
    scale = _applied_scale(res["scale"], offset, dx.ndim)
    return (dxhat * scale + xhat * upcast(_expand(dscale, dx.ndim))).astype(dx.dtype)


def _rms_norm_backward(res, g, *, eps, offset):
    """The jacobian's ``r P(v)`` (``v = g s``, ``s = offset + scale``) with ``xhat = x r``:

      dx = r v - xhat (r^2 mean(g x s)),  dscale = sum_rows(r g x)

    (the offset is a constant: ``dscale`` as without it), the sums matrix-vector
    products as in ``layer_norm``'s backward."""
    gf = upcast(g)
    r = res["rstd"][..., None]
    x = upcast(res["x"])
    s = _applied_scale(res["scale"], offset, 1)
    gx = gf * x
    c = _dot("...d,d->...", gx, s)[..., None] / g.shape[-1]
    dx = r * gf * jnp.broadcast_to(s, g.shape) - (x * r) * (r * r * c)
    return dx.astype(g.dtype), _dot("...,...d->d", res["rstd"], gx)


_rms_norm = defop(
    "rms_norm",
    forward=_rms_norm_forward,
    tangent=_rms_norm_tangent,
    backward=_rms_norm_backward,
    residuals={
        "x": "the input x, [..., D]",
        "rstd": "per-row 1/sqrt(mean(x^2) + eps), [...] (float32 for half inputs)",
        "scale": "the scale, [D]",
    },
    level=Level.DERIVED,
)


def _rms_norm_reference(x, scale, eps=1e-6, offset=0.0):
    r = jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x / r * (offset + _expand(scale, x.ndim))


@registered(
    _rms_norm,
    reference=_rms_norm_reference,
    sample=lambda key: _sample(key, bias=False),
    edges=_norm_edges(bias=False),
    configs=({}, {"offset": 1.0}),
)
def rms_norm(
    x: ArrayLike, scale: ArrayLike, eps: float = 1e-6, *, offset: float = 0.0
) -> jax.Array:
    """Root-mean-square normalization over the last axis.

    ``r = 1 / sqrt(mean(x^2) + eps)``, ``xhat = x r``, ``y = xhat * (offset + scale)``;
    ``offset=1.0`` gives Gemma's ``(1 + scale)`` (its scale initialized at 0).

    The Jacobian of ``xhat`` is ``r P`` with ``P(v) = v - xhat mean(xhat v)``, a
    symmetric map, so with ``gs = g * (offset + scale)``::

      dx = r * P(gs) = r * (gs - xhat * mean(gs * xhat)),   dscale = sum_rows(g * xhat)

    Tangent: ``dy = r P(dx) (offset + scale) + xhat dscale``. Keeps ``x``, the per-row
    ``rstd`` (``r``) and ``scale``. Edge conventions: a zero row has ``r = eps^-1/2``
    (finite): value 0, gradient ``dx = r gs`` (finite). Half-precision inputs are
    normalized in float32 (``offset + scale`` too) and cast back.

    Args:
      x: ``[..., D]``.
      scale: ``[D]``.
      eps: positive constant added to the mean square.
      offset: a constant added to ``scale`` (a Python float, static): 0.0 (the
        default) applies ``scale`` itself, 1.0 Gemma's ``1 + scale``.

    Returns:
      ``[..., D]``, in the promoted dtype of the arguments.

    Raises:
      TypeError: if an argument is not a floating-point array, or ``offset`` not a
        Python number.
      ValueError: if ``x`` is a scalar, ``scale`` is not ``[D]``, ``eps <= 0`` or
        ``offset`` is not finite.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> y = cannjax.ops.rms_norm(jnp.array([[3.0, 4.0]]), jnp.ones(2), eps=3.5)
      >>> [round(float(v), 3) for v in y[0]]
      [0.75, 1.0]
      >>> y = cannjax.ops.rms_norm(jnp.array([[3.0, 4.0]]), jnp.zeros(2), 3.5, offset=1.0)
      >>> [round(float(v), 3) for v in y[0]]
      [0.75, 1.0]

    References:
      Zhang and Sennrich, "Root Mean Square Layer Normalization", 2019.
      https://arxiv.org/abs/1910.07467
      Gemma Team, "Gemma: Open Models Based on Gemini Research and Technology", 2024
      (RMSNorm applies ``1 + scale``). https://arxiv.org/abs/2403.08295
      Huawei CANN operator RmsNorm
      Huawei CANN operator RmsNormGrad
    """
    fn = "cannjax.ops.rms_norm"
    offset = _check_offset(fn, offset)
    x, (scale,), eps = _check_args(fn, x, {"scale": scale}, eps)
    return _rms_norm(x, scale, eps=eps, offset=offset)
