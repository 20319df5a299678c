"""Elementwise operators, each keeping a single residual for its backward.

Every operator here is ``y = f(x)`` with ``dy = f'(x) dx``; the comment under each
names what the forward keeps and why (see :mod:`cannjax._src.ops.unary`). Where plain
autodiff of the jax.nn formula gives NaN (gelu and silu at huge or infinite inputs), the
rule is evaluated on ``x`` clipped to a range where ``f'`` is already exactly saturated.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.special import erf as _jerf
from jax.scipy.special import erfc as _jerfc
from jax.typing import ArrayLike

from cannjax._src.core.operator import registered
from cannjax._src.core.validate import as_inexact
from cannjax._src.ops.unary import edge, edges, normal, positive, unary

INF = math.inf
# |x| beyond which gelu' and silu' equal 0 or 1 exactly in float64 (and x**2 is finite
# even in float32): the backward clips there so inf * 0 never makes a NaN.
_SATURATED = 1e4


def _in(name: str, x: ArrayLike) -> jax.Array:
    # Integer and boolean inputs are promoted as jnp.exp and jax.nn.gelu promote them
    # (int32 -> float32, int64 -> float64); a Python scalar stays weakly typed.
    return as_inexact(f"cannjax.ops.{name}", "x", x)


def _integer(name: str, x: ArrayLike) -> jax.Array | None:
    """``x`` as an array if it is integer or boolean (else None): ``relu`` and ``square``
    keep integer dtypes, as ``jax.nn.relu`` and ``jnp.square`` do."""
    if isinstance(x, (list, tuple)):
        as_inexact(f"cannjax.ops.{name}", "x", x)  # raises, naming the op
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_ else None


# ------------------------------------------------------------------------------ exp
_exp = unary("exp", jnp.exp, lambda y: y, saves="out")


@registered(
    _exp,
    reference=jnp.exp,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, -1e-30, 20, -20, 80),
        edge(-1e4, -INF, fd=False, expected=[0, 0]),
    ),
)
def exp(x: ArrayLike) -> jax.Array:
    """Exponential, ``y = exp(x)``.

    Backward: ``dy = y dx``; keeps the output, so the input may be overwritten.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.exp)(0.0))
      1.0
    """
    return _exp(_in("exp", x))


# ------------------------------------------------------------------------------ log
_log = unary("log", jnp.log, lambda x: 1 / x, saves="x")


@registered(
    _log,
    reference=jnp.log,
    sample=positive,
    edges=edges(
        edge(1e-30, 1e30, 1.0, 0.5),
        edge(0, INF, fd=False, expected=[INF, 0]),
    ),
)
def log(x: ArrayLike) -> jax.Array:
    """Natural logarithm, ``y = log(x)``.

    Backward: ``dy = dx / x``; keeps ``x`` (``1/x`` from ``y`` would cost an ``exp``).
    At ``x = 0`` the derivative is ``+inf``, reported as such.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.log)(2.0))
      0.5
    """
    return _log(_in("log", x))


# ------------------------------------------------------------------------------ sin, cos
_sin = unary("sin", jnp.sin, jnp.cos, saves="x")


@registered(_sin, reference=jnp.sin, sample=normal, edges=edges(edge(0, 1e-30, -1e-30, 1e4, -1e4)))
def sin(x: ArrayLike) -> jax.Array:
    """Sine, ``y = sin(x)``; backward ``dy = cos(x) dx`` (keeps ``x``).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.sin)(0.0))
      1.0
    """
    return _sin(_in("sin", x))


_cos = unary("cos", jnp.cos, lambda x: -jnp.sin(x), saves="x")


@registered(_cos, reference=jnp.cos, sample=normal, edges=edges(edge(0, 1e-30, -1e-30, 1e4, -1e4)))
def cos(x: ArrayLike) -> jax.Array:
    """Cosine, ``y = cos(x)``; backward ``dy = -sin(x) dx`` (keeps ``x``).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.cos)(0.0))
      -0.0
    """
    return _cos(_in("cos", x))


# ------------------------------------------------------------------------------ tanh
_tanh = unary("tanh", jnp.tanh, lambda y: 1 - y * y, saves="out")


@registered(
    _tanh,
    reference=jnp.tanh,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 20, -20),
        edge(INF, -INF, fd=False, expected=[0, 0]),
    ),
)
def tanh(x: ArrayLike) -> jax.Array:
    """Hyperbolic tangent, ``y = tanh(x)``.

    Backward: ``dy = (1 - y^2) dx``; keeps the output.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.tanh)(0.0))
      1.0
    """
    return _tanh(_in("tanh", x))


# ------------------------------------------------------------------------------ sigmoid
_sigmoid = unary("sigmoid", jax.nn.sigmoid, lambda y: y * (1 - y), saves="out")


@registered(
    _sigmoid,
    reference=jax.nn.sigmoid,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 30, -30),
        edge(INF, -INF, fd=False, expected=[0, 0]),
    ),
)
def sigmoid(x: ArrayLike) -> jax.Array:
    """Logistic sigmoid, ``y = 1 / (1 + exp(-x))``, stable at any ``x``.

    Backward: ``dy = y (1 - y) dx``; keeps the output.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.sigmoid)(0.0))
      0.25
    """
    return _sigmoid(_in("sigmoid", x))


# ------------------------------------------------------------------------------ softplus
_softplus = unary("softplus", jax.nn.softplus, jax.nn.sigmoid, saves="x")


@registered(
    _softplus,
    reference=jax.nn.softplus,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 30, -30),
        edge(INF, -INF, fd=False, expected=[1, 0]),
    ),
)
def softplus(x: ArrayLike) -> jax.Array:
    """Softplus, ``y = log(1 + exp(x))``, stable at any ``x``.

    Backward: ``dy = sigmoid(x) dx``. Keeps the input: ``sigmoid(x)`` is also
    ``-expm1(-y)``, a function of the output, but ``expm1`` is slow on XLA:CPU (the
    backward became slower than plain autodiff's; ``docs/performance.md``), and
    ``1 - exp(-y)`` loses all precision where ``y`` is tiny (``x -> -inf``).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.softplus)(0.0))
      0.5
    """
    return _softplus(_in("softplus", x))


# ------------------------------------------------------------------------------ log_sigmoid
_log_sigmoid = unary("log_sigmoid", jax.nn.log_sigmoid, lambda x: jax.nn.sigmoid(-x), saves="x")


@registered(
    _log_sigmoid,
    reference=jax.nn.log_sigmoid,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 30, -30),
        edge(INF, -INF, fd=False, expected=[0, 1]),
    ),
)
def log_sigmoid(x: ArrayLike) -> jax.Array:
    """Log-sigmoid, ``y = log(sigmoid(x)) = -softplus(-x)``, stable at any ``x``.

    Backward: ``dy = sigmoid(-x) dx``; keeps the input (as :func:`softplus`, whose
    output-based ``-expm1(y)`` is slower on XLA:CPU).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.log_sigmoid)(0.0))
      0.5
    """
    return _log_sigmoid(_in("log_sigmoid", x))


# ------------------------------------------------------------------------------ relu
_relu = unary(
    "relu",
    # A weak 0 keeps x's dtype and weak type (relu(2.0) is weakly typed, as in jax.nn).
    lambda x: jnp.maximum(x, 0),
    # The mask itself, not mask.astype(float32): the rule selects t where it is True, so
    # a tangent of any dtype is passed through exactly, with no promotion.
    lambda mask: mask,
    saves="mask",
    save=lambda x, y: x > 0,
)


@registered(
    _relu,
    reference=jax.nn.relu,
    sample=normal,
    edges=edges(
        edge(1e-30, -1e-30, 1e4, -1e4),
        edge(0.0, -0.0, INF, -INF, fd=False, expected=[0, 0, 1, 0]),
    ),
)
def relu(x: ArrayLike) -> jax.Array:
    """Rectified linear unit, ``y = max(x, 0)``.

    Backward: ``dy = [x > 0] dx``; keeps a boolean mask (1 byte per element). At the kink,
    ``relu'(0) = 0``, as in ``jax.nn.relu`` (a subgradient, and the choice that keeps
    sparse activations sparse in the backward).

    Integer and boolean inputs give ``jnp.maximum(x, 0)`` in the integer dtype, as
    ``jax.nn.relu`` (no gradient to write for them).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.relu)(0.0))
      0.0
    """
    xi = _integer("relu", x)
    if xi is not None:
        return jnp.maximum(xi, 0)
    return _relu(_in("relu", x))


# ------------------------------------------------------------------------------ gelu
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
_SQRT_HALF = math.sqrt(0.5)


def _normal_cdf(x):
    # Phi(x) = erfc(-x / sqrt 2) / 2: accurate in the left tail, where 1 + erf(x / sqrt 2)
    # cancels (from x ~ -2.6 on in float32: gelu(-6) came out as -0.0).
    return 0.5 * _jerfc(-x / math.sqrt(2))


def _gelu_derivative(x, *, approximate):
    x = jnp.clip(x, -_SATURATED, _SATURATED)
    if approximate:
        # With s = sigmoid(2u) = (1 + t) / 2 and 1 - t^2 = 4 s sigmoid(-2u), the
        # derivative is s (1 + 2 x u' sigmoid(-2u)): no 1 + t or 1 - t^2 to cancel in
        # the left tail, where t = tanh(u) rounds to -1.
        u2 = 2 * _SQRT_2_OVER_PI * (x + 0.044715 * x**3)
        du2 = 2 * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
        return jax.nn.sigmoid(u2) * (1 + x * du2 * jax.nn.sigmoid(-u2))
    return _normal_cdf(x) + x * jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _gelu_value(x, *, approximate):
    # x * Phi(x) is -inf * 0 at x = -inf; the limit is 0. Clamping the factor x to the
    # most negative finite value gives that 0 (Phi(-inf) is exactly 0) and is the
    # identity elsewhere; a select against a zero constant instead made XLA materialize
    # a broadcast zero array per call site (hoisted out of scan loops).
    xf = jnp.maximum(x, jnp.finfo(x.dtype).min)
    if approximate:
        cdf = 0.5 * (1 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3)))
        return xf * cdf
    # (x / 2) erfc(-x / sqrt 2), in this order: Phi(x) = erfc / 2 alone falls below the
    # smallest normal number (and XLA:CPU flushes it to 0) from x ~ -13 in float32 while
    # x Phi(x) is still normal. The argument is -x * sqrt(1/2), as jax.nn.gelu forms it:
    # erfc magnifies its rounding by 2 z^2 in the tail (docs/ops_accuracy.md).
    return (0.5 * xf) * _jerfc(-x * _SQRT_HALF)


_gelu = unary(
    "gelu",
    _gelu_value,
    _gelu_derivative,
    saves="x",
)


@registered(
    _gelu,
    reference=jax.nn.gelu,
    sample=normal,
    configs=({"approximate": True}, {"approximate": False}),
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 5, -5),
        edge(1e20, -1e20, fd=False, ref=False, expected=[1, 0]),
        edge(INF, -INF, fd=False, ref=False, expected=[1, 0], value=[INF, 0]),
    ),
)
def gelu(x: ArrayLike, approximate: bool = True) -> jax.Array:
    """Gaussian error linear unit, as ``jax.nn.gelu`` (same default).

    Exact: ``y = x Phi(x)``, ``dy = (Phi(x) + x phi(x)) dx``, with ``Phi``/``phi`` the
    standard normal CDF/density. Tanh approximation: ``y = x (1 + tanh(u)) / 2`` with
    ``u = sqrt(2/pi) (x + 0.044715 x^3)``, ``dy = [(1 + t) / 2 + x (1 - t^2) u' / 2] dx``,
    ``t = tanh(u)``, ``u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)``. Keeps ``x`` (the
    derivative needs it; one array instead of the five plain autodiff keeps for the tanh
    form). Finite at huge and infinite ``x``, where plain autodiff gives NaN.

    Args:
      x: input array.
      approximate: use the tanh approximation (True) or the exact erf form (False),
        computed as ``Phi(x) = erfc(-x / sqrt 2) / 2`` so the left tail keeps its
        relative accuracy.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.gelu)(0.0))
      0.5

    References:
      Hendrycks and Gimpel, "Gaussian Error Linear Units (GELUs)", 2016.
      https://arxiv.org/abs/1606.08415

      Huawei CANN operators Gelu and GeluGrad.
    """
    if not isinstance(approximate, bool):
        raise ValueError(
            f"cannjax.ops.gelu: approximate must be True (tanh form) or False (exact erf "
            f"form), got {approximate!r}"
        )
    return _gelu(_in("gelu", x), approximate=approximate)


# ------------------------------------------------------------------------------ silu
def _silu_derivative(x):
    x = jnp.clip(x, -_SATURATED, _SATURATED)
    s = jax.nn.sigmoid(x)
    return s * (1 + x * (1 - s))


def _silu_value(x):
    # x * sigmoid(x) is -inf * 0 at x = -inf; the limit is 0.
    # (A weak 0.0 keeps x's dtype and weak type.)
    return jnp.where(jnp.isneginf(x), 0.0, jax.nn.silu(x))


_silu = unary("silu", _silu_value, _silu_derivative, saves="x")


@registered(
    _silu,
    reference=jax.nn.silu,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 20, -20),
        edge(1e20, -1e20, fd=False, ref=False, expected=[1, 0]),
        edge(INF, -INF, fd=False, ref=False, expected=[1, 0], value=[INF, 0]),
    ),
)
def silu(x: ArrayLike) -> jax.Array:
    """SiLU (swish), ``y = x sigmoid(x)``.

    Backward: ``dy = s (1 + x (1 - s)) dx`` with ``s = sigmoid(x)``; keeps ``x``. Finite at
    infinite ``x``, where plain autodiff gives NaN.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.silu)(0.0))
      0.5

    References:
      Elfwing, Uchibe and Doya, "Sigmoid-Weighted Linear Units for Neural Network
      Function Approximation in Reinforcement Learning", 2017.
      https://arxiv.org/abs/1702.03118
    """
    return _silu(_in("silu", x))


# ------------------------------------------------------------------------------ sqrt, rsqrt
_sqrt = unary("sqrt", jnp.sqrt, lambda y: 0.5 / y, saves="out")


_rsqrt = unary("rsqrt", jax.lax.rsqrt, lambda y: -0.5 * y * y * y, saves="out")


@registered(
    _sqrt,
    reference=jnp.sqrt,
    sample=positive,
    edges=edges(
        edge(1e-30, 1e30, 1.0),
        edge(0, INF, fd=False, expected=[INF, 0]),
    ),
)
def sqrt(x: ArrayLike) -> jax.Array:
    """Square root, ``y = sqrt(x)``.

    Backward: ``dy = dx / (2 y)``; keeps the output. At ``x = 0`` the derivative is
    ``+inf``, reported as such.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.sqrt)(4.0))
      0.25
    """
    return _sqrt(_in("sqrt", x))


@registered(
    _rsqrt,
    reference=jax.lax.rsqrt,
    sample=positive,
    edges=edges(
        edge(1e-20, 1e20, 1.0),
        edge(0, INF, fd=False, expected=[-INF, 0]),
    ),
)
def rsqrt(x: ArrayLike) -> jax.Array:
    """Reciprocal square root, ``y = 1 / sqrt(x)``.

    Backward: ``dy = -x^{-3/2} dx / 2 = -y^3 dx / 2``; keeps the output.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.rsqrt)(4.0))
      -0.0625
    """
    return _rsqrt(_in("rsqrt", x))


# ------------------------------------------------------------------------------ log1p, expm1
_log1p = unary("log1p", jnp.log1p, lambda x: 1 / (1 + x), saves="x")


_expm1 = unary("expm1", jnp.expm1, lambda y: y + 1, saves="out")


@registered(
    _log1p,
    reference=jnp.log1p,
    sample=positive,
    edges=edges(
        edge(0, 1e-30, -1e-30, 1e30, -0.5),
        edge(-1, INF, fd=False, expected=[INF, 0]),
    ),
)
def log1p(x: ArrayLike) -> jax.Array:
    """``y = log(1 + x)``, accurate for tiny ``x``.

    Backward: ``dy = dx / (1 + x)``; keeps ``x`` (recovering ``1 + x`` as ``exp(y)`` would
    lose accuracy for large ``x``).

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.log1p)(1.0))
      0.5
    """
    return _log1p(_in("log1p", x))


@registered(
    _expm1,
    reference=jnp.expm1,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, -1e-30, 20, -20, -1e4),
        edge(-INF, fd=False, expected=[0]),
    ),
)
def expm1(x: ArrayLike) -> jax.Array:
    """``y = exp(x) - 1``, accurate for tiny ``x``.

    Backward: ``dy = exp(x) dx = (y + 1) dx``; keeps the output.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.expm1)(0.0))
      1.0
    """
    return _expm1(_in("expm1", x))


# ------------------------------------------------------------------------------ erf, square
# exp(-x^2) is 0 beyond |x| = 28 in float32 and float64: clipping there changes no value
# and gives the higher derivatives their limit 0 at +-inf (not 0 * inf).
_erf = unary(
    "erf",
    _jerf,
    lambda x: (2 / math.sqrt(math.pi)) * jnp.exp(-jnp.square(jnp.clip(x, -28.0, 28.0))),
    saves="x",
)


_square = unary("square", jnp.square, lambda x: 2 * x, saves="x")


@registered(
    _erf,
    reference=_jerf,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 3),
        edge(INF, -INF, fd=False, expected=[0, 0]),
    ),
)
def erf(x: ArrayLike) -> jax.Array:
    """Error function; backward ``dy = 2/sqrt(pi) exp(-x^2) dx`` (keeps ``x``).

    Example:
      >>> import jax, cannjax
      >>> round(float(jax.grad(cannjax.ops.erf)(0.0)), 6)
      1.128379
    """
    return _erf(_in("erf", x))


@registered(
    _square,
    reference=jnp.square,
    sample=normal,
    edges=edges(
        edge(0, 1e-30, 1e4, -1e4, 1e18),
        edge(INF, -INF, fd=False, expected=[INF, -INF]),
    ),
)
def square(x: ArrayLike) -> jax.Array:
    """``y = x^2``; backward ``dy = 2 x dx`` (keeps ``x``).

    Integer and boolean inputs are squared in their integer dtype, as ``jnp.square``.

    Example:
      >>> import jax, cannjax
      >>> float(jax.grad(cannjax.ops.square)(3.0))
      6.0
    """
    xi = _integer("square", x)
    if xi is not None:
        return jnp.square(xi)
    return _square(_in("square", x))
