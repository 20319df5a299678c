"""Spelling fuzzer for cannjax.optimize's norm, activation, cross-entropy, attention, RoPE
and gated-MLP finders: equal spellings found, mutants not.

Run: ``PYTHONPATH=. python benchmarks/optimize_spellings.py [--count N] [--seed S]``.

For each kind (layer norm; RMS norm with and without ``1 + scale``), a seeded generator
composes spellings of the same math at random from ``jnp``, ``lax`` and ``jax.nn``
pieces: the mean (``jnp.mean``, a sum over ``d`` or times ``1 / d``, ``lax.reduce_sum``),
the variance or mean square (``jnp.var``, ``E[(x - m)^2]`` with ``square``, ``** 2``,
``x * x`` or ``lax.integer_pow``, ``E[x^2] - E[x]^2``), the inverse root (``rsqrt``,
``1 / sqrt``, ``pow(., -0.5)``, ``sqrt(.) ** -1``, a division by ``sqrt``), where the
scale and bias go (after the normalization, before it, folded into the inverse root with
the mean subtracted after the multiply), ``eps`` as a literal or a closed-over array, and
an ``astype``. Beside them, **near-miss mutants**: the same composition with one change
that computes something else (``eps`` outside the root, the unbiased variance, the
statistics over another axis, an uncentred variance, the scale inside the root, the
mean left in the numerator, a wrong ``1 / d``).

The activations the same way: GELU's tanh form (``sqrt(2 / pi)`` written four ways, the
cube five, the inner polynomial three, the outer product seven, among them
``x sigmoid(2 z)``), GELU's erf form (``sqrt 2`` four ways, the normal CDF through
``erf`` or ``erfc`` five, the product two) and SiLU (the sigmoid nine ways, the product
five); mutants: another constant, ``x^2`` for ``x^3``, no ``1/2``, not times ``x``,
``sigmoid(z)`` for ``sigmoid(2 z)``, ``erf(x)`` without ``1 / sqrt 2``, ``erfc(x)`` for
``erfc(-x)``, ``sigmoid(2 x)``, ``x + sigmoid(x)``, ``exp(x)`` for ``exp(-x)``.

Cross-entropy of a head's logits ``z = x @ W`` against integer labels (an argument of the
loss): the log-softmax five ways (``jax.nn.log_softmax``, ``z - logsumexp``, by hand with
and without the max), the logsumexp four, the readout twelve (``take_along_axis`` of
the log-probabilities as they are or flattened to ``[N, V]``, a one-hot as
``jax.nn.one_hot`` or ``labels == arange``, ``einsum``, smoothed targets, optax's
integer, one-hot and ``smooth_labels`` losses, ``logsumexp - label logit``, numpy-style
indexing ``log_softmax(z)[arange, labels]``), the negation four, a z-loss or none;
mutants: ``softmax`` for ``log_softmax``, the log-softmax or logsumexp over another axis,
the max not added back, another row's label logit, twice the label logit.

Attention ``softmax(q k^T * scale + bias) v`` with grouped-query heads (``repeat_kv``,
``jnp.repeat``, a grouped einsum with 5-D scores, a heads-first matmul), the scale five
ways on ``q`` or on the scores, a soft cap or none, an ALiBi bias or none, ten masks
(none, causal by ``where`` with ``finfo.min``, ``-inf`` or ``-1e9``, causal as an additive
``0 / finfo.min``, key padding, causal and padding, a sliding window, segments of packed
sequences with and without causality) and the softmax
three ways (``jax.nn.softmax``, ``exp(s - max) / sum``, ``exp(s - logsumexp)``); mutants:
the softmax over the queries, the max subtracted in the numerator only, a bias after the
softmax, a scale on the probabilities, a mask after the softmax without renormalizing, a
weak ``-10`` fill.

RoPE of ``x [B, T, N, H]`` at integer positions (an argument): the inverse frequencies
three ways, the angles four, six forms (half-split with concatenated or tiled tables,
the halves split and concatenated, heads first, interleaved with ``jnp.repeat`` tables,
interleaved pairs stacked), the sum of the two terms four ways; mutants: ``rotate_half``
without its negation, tables whose halves differ, one half not rotated, ``x sin`` for
``rotate_half(x) sin``. Gated MLPs ``(act(x @ wg) * (x @ wu)) @ wd``: six activations
(SiLU four ways, GELU's two forms), five projection spellings, three products; mutants: a
sigmoid gate (GLU), the activation on both projections, a sum for the product, the up
projection twice. A mutant counts as substituted when it gets an operator of its kind's
family (a norm for a norm, an activation for an activation, ...): a gated MLP's mutant
whose activation alone becomes ``silu`` is rightly substituted, and checked for soundness.

Each case is the loss ``sum(f(...) * w)``; printed per kind: spellings
recognized (``cannjax.inspect.optimize`` lists the kind's operator), mutants
substituted (it lists one: must be 0), and unsound cases: value, gradient or JVP of
``cannjax.optimize(loss)`` differing from ``loss``'s in float64 beyond 1e-6 relative
(must be 0). ``tests/test_optimize_spellings.py`` runs a sample in ``make test`` and every
case in ``make test-extended``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import markdown_table, write_results  # noqa: E402

import cannjax  # noqa: E402

EPS = 1e-5
EPS_ARRAY = np.float32(EPS)  # a closed-over constant, not a literal
SHAPE = (2, 3, 16)  # x: [B, T, d]


# ------------------------------------------------------------------ the pieces
def _keep(s):  # a row statistic [..., 1]
    return s[..., None]


MEANS: dict[str, Callable] = {
    "jnp.mean": lambda x: jnp.mean(x, -1, keepdims=True),
    "sum / d": lambda x: jnp.sum(x, -1, keepdims=True) / x.shape[-1],
    "sum * (1 / d)": lambda x: jnp.sum(x, axis=-1, keepdims=True) * (1.0 / x.shape[-1]),
    "lax.reduce_sum": lambda x: _keep(lax.reduce_sum(x, (x.ndim - 1,))) / x.shape[-1],
    "x.mean": lambda x: x.mean(-1, keepdims=True),
}
SQUARES: dict[str, Callable] = {
    "jnp.square": jnp.square,
    "** 2": lambda u: u**2,
    "u * u": lambda u: u * u,
    "lax.integer_pow": lambda u: lax.integer_pow(u, 2),
    "jnp.power(u, 2)": lambda u: jnp.power(u, 2),
}
# Variances from a mean spelling and a square spelling.
VARIANCES: dict[str, Callable] = {
    "jnp.var": lambda x, m, mean, sq: jnp.var(x, -1, keepdims=True),
    "E[(x - m)^2]": lambda x, m, mean, sq: mean(sq(x - m)),
    "E[x^2] - m^2": lambda x, m, mean, sq: mean(sq(x)) - sq(m),
}
# ``inv(s)`` multiplies by s ** -1/2; ``None`` marks the division form.
ROOTS: dict[str, Callable | None] = {
    "lax.rsqrt": lax.rsqrt,
    "1 / jnp.sqrt": lambda s: 1.0 / jnp.sqrt(s),
    "jnp.power(., -0.5)": lambda s: jnp.power(s, -0.5),
    "sqrt(.) ** -1": lambda s: jnp.sqrt(s) ** -1,
    "divide by sqrt": None,
}
EPSILONS = {"literal": EPS, "closed-over array": EPS_ARRAY}


def _normalized(x, m, s, root, eps):
    """``(x - m) * (s + eps) ** -1/2`` as the root spelling writes it."""
    return (x - m) / jnp.sqrt(s + eps) if root is None else (x - m) * root(s + eps)


def _affine_after(x, m, s, root, eps, g, b):
    return _normalized(x, m, s, root, eps) * g + b


def _scale_first(x, m, s, root, eps, g, b):
    return b + g * _normalized(x, m, s, root, eps)


def _folded(x, m, s, root, eps, g, b):
    r = (1.0 / jnp.sqrt(s + eps) if root is None else root(s + eps)) * g
    return x * r + (b - m * r)


PLACEMENTS = {"after": _affine_after, "scale first": _scale_first, "folded": _folded}
CASTS = {"none": lambda x: x, "astype(float32)": lambda x: x.astype(jnp.float32)}


@dataclasses.dataclass(frozen=True)
class Spelling:
    """One composed spelling: its choices (the name) and the norm as ``f(x, g, b)``."""

    kind: str
    name: str
    fn: Callable
    mutant: str | None = None  # what the mutation changed; None for an equal spelling


def _layer_norm(choice: dict, mutation: str | None = None) -> Callable:
    mean, sq = MEANS[choice["mean"]], SQUARES[choice["square"]]
    var, root = VARIANCES[choice["variance"]], ROOTS[choice["root"]]
    place, eps, cast = (
        PLACEMENTS[choice["placement"]],
        EPSILONS[choice["eps"]],
        CASTS[choice["cast"]],
    )

    def f(x, g, b):
        x = cast(x)
        m = mean(x)
        s = var(x, m, mean, sq)
        centre = m
        if mutation == "unbiased variance":
            s = s * x.shape[-1] / (x.shape[-1] - 1)
        elif mutation == "uncentred variance":
            s = mean(sq(x))
        elif mutation == "statistics over another axis":
            m = jnp.mean(x, -2, keepdims=True)
            s = jnp.var(x, -2, keepdims=True)
            centre = m
        elif mutation == "mean left in the numerator":
            centre = 0.0 * m
        elif mutation == "wrong 1 / d":
            s = jnp.sum(sq(x - m), -1, keepdims=True) / (x.shape[-1] + 1)
        if mutation == "eps outside the root":
            y = (x - centre) / (jnp.sqrt(s) + eps) * g + b
        elif mutation == "scale inside the root":
            y = (x - centre) / jnp.sqrt(s * g + eps) + b
        else:
            y = place(x, centre, s, root, eps, g, b)
        return y

    return f


def _rms_norm(choice: dict, mutation: str | None = None) -> Callable:
    mean, sq = MEANS[choice["mean"]], SQUARES[choice["square"]]
    root, eps, cast = ROOTS[choice["root"]], EPSILONS[choice["eps"]], CASTS[choice["cast"]]
    one_plus = choice["scale"] == "1 + g"

    def f(x, g, b):
        x = cast(x)
        s = mean(sq(x))
        w = 1 + g if one_plus else g
        if mutation == "unbiased mean square":
            s = s * x.shape[-1] / (x.shape[-1] - 1)
        elif mutation == "statistic over another axis":
            s = jnp.mean(sq(x), -2, keepdims=True)
        elif mutation == "centred (a layer norm's statistic)":
            s = mean(sq(x - mean(x)))
        if mutation == "eps outside the root":
            y = x / (jnp.sqrt(s) + eps)
        elif mutation == "root, not its inverse":
            y = x * jnp.sqrt(s + eps)
        else:
            y = x / jnp.sqrt(s + eps) if root is None else x * root(s + eps)
        y = w * y if choice["side"] == "scale left" else y * w
        return y + 0.0 * b  # b unused: the loss takes the same arguments for every kind

    return f


# ------------------------------------------------------------------ activations
SQRT_2_OVER_PI: dict[str, Callable] = {
    "np.sqrt(2 / np.pi)": lambda: np.sqrt(2 / np.pi),
    "0.7978845608": lambda: 0.7978845608,
    "math.sqrt(2 / math.pi)": lambda: math.sqrt(2 / math.pi),
    "jnp.sqrt(2 / jnp.pi)": lambda: jnp.sqrt(2 / jnp.pi),
}
CUBES: dict[str, Callable] = {
    "x ** 3": lambda x: x**3,
    "x * x * x": lambda x: x * x * x,
    "lax.integer_pow": lambda x: lax.integer_pow(x, 3),
    "jnp.power(x, 3)": lambda x: jnp.power(x, 3),
    "x * jnp.square(x)": lambda x: x * jnp.square(x),
}
# c (x + 0.044715 x^3), from c and a cube spelling
GELU_INNER: dict[str, Callable] = {
    "c * (x + k x^3)": lambda x, c, cube: c * (x + 0.044715 * cube(x)),
    "c * x * (1 + k x^2)": lambda x, c, cube: c * x * (1 + 0.044715 * x * x),
    "c * (k x^3 + x)": lambda x, c, cube: c * (0.044715 * cube(x) + x),
}
# x Phi(x) from z = c (x + 0.044715 x^3): 0.5 (1 + tanh(z)) = sigmoid(2 z)
GELU_OUTER: dict[str, Callable] = {
    "0.5 * x * (1 + tanh)": lambda x, z: 0.5 * x * (1 + jnp.tanh(z)),
    "x * 0.5 * (1 + tanh)": lambda x, z: x * 0.5 * (1.0 + jnp.tanh(z)),
    "0.5 x + 0.5 x tanh": lambda x, z: 0.5 * x + 0.5 * x * jnp.tanh(z),
    "x * (0.5 + 0.5 tanh)": lambda x, z: x * (0.5 + 0.5 * jnp.tanh(z)),
    "x * (1 + tanh) / 2": lambda x, z: x * (1 + jnp.tanh(z)) / 2,
    "x * sigmoid(2 z)": lambda x, z: x * jax.nn.sigmoid(2 * z),
    "x / (1 + exp(-2 z))": lambda x, z: x / (1 + jnp.exp(-2 * z)),
}
SQRT_2: dict[str, Callable] = {
    "np.sqrt(2)": lambda: np.sqrt(2),
    "1.4142135623730951": lambda: 1.4142135623730951,
    "math.sqrt(2.0)": lambda: math.sqrt(2.0),
    "jnp.sqrt(2.0)": lambda: jnp.sqrt(2.0),
}
# Phi(x), the normal CDF, from sqrt(2)
NORMAL_CDF: dict[str, Callable] = {
    "0.5 (1 + erf(x / r))": lambda x, r: 0.5 * (1 + lax.erf(x / r)),
    "0.5 (1 + erf(x * (1 / r)))": lambda x, r: 0.5 * (1 + jax.scipy.special.erf(x * (1 / r))),
    "0.5 erfc(-x / r)": lambda x, r: 0.5 * jax.scipy.special.erfc(-x / r),
    "(1 + erf(x / r)) / 2": lambda x, r: (1 + lax.erf(x / r)) / 2,
    "1 - 0.5 erfc(x / r)": lambda x, r: 1 - 0.5 * lax.erfc(x / r),
}
SIDES = {"x * f": lambda x, f: x * f, "f * x": lambda x, f: f * x}
SIGMOIDS: dict[str, Callable] = {
    "jax.nn.sigmoid": jax.nn.sigmoid,
    "1 / (1 + exp(-x))": lambda x: 1 / (1 + jnp.exp(-x)),
    "0.5 (1 + tanh(x / 2))": lambda x: 0.5 * (1 + jnp.tanh(x / 2)),
    "lax.logistic": lax.logistic,
    "0.5 tanh(0.5 x) + 0.5": lambda x: 0.5 * jnp.tanh(0.5 * x) + 0.5,
    "jnp.reciprocal(1 + exp(-x))": lambda x: jnp.reciprocal(1 + jnp.exp(-x)),
    "exp(-log1p(exp(-x)))": lambda x: jnp.exp(-jnp.log1p(jnp.exp(-x))),
    "1 - 1 / (1 + exp(x))": lambda x: 1 - 1 / (1 + jnp.exp(x)),
    "exp(-logaddexp(0, -x))": lambda x: jnp.exp(-jnp.logaddexp(0.0, -x)),
}
SILU_PRODUCTS: dict[str, Callable] = {
    "x * s": lambda x, s: x * s,
    "s * x": lambda x, s: s * x,
    "x / (1 / s)": lambda x, s: x / (1 / s),
    "jnp.multiply(x, s)": jnp.multiply,
    "lax.mul(x, s)": lax.mul,
}


def _gelu_tanh(choice: dict, mutation: str | None = None) -> Callable:
    c_of, cube = SQRT_2_OVER_PI[choice["sqrt(2/pi)"]], CUBES[choice["cube"]]
    inner, outer = GELU_INNER[choice["inner"]], GELU_OUTER[choice["outer"]]

    def f(x, g, b):
        c = c_of()
        if mutation == "sqrt(pi / 2) for sqrt(2 / pi)":
            c = np.sqrt(np.pi / 2)
        if mutation == "0.04 for 0.044715":
            z = c * (x + 0.04 * cube(x))
        elif mutation == "x^2 for x^3":
            z = c * (x + 0.044715 * x * x)
        else:
            z = inner(x, c, cube)
        if mutation == "no 1/2":
            y = x * (1 + jnp.tanh(z))
        elif mutation == "not times x":
            y = 0.5 * (1 + jnp.tanh(z))
        elif mutation == "sigmoid(z) for sigmoid(2 z)":
            y = x * jax.nn.sigmoid(z)
        else:
            y = outer(x, z)
        return y + 0.0 * (g + b)  # g, b unused: the loss takes the same arguments

    return f


def _gelu_erf(choice: dict, mutation: str | None = None) -> Callable:
    r_of, cdf = SQRT_2[choice["sqrt(2)"]], NORMAL_CDF[choice["cdf"]]
    side = SIDES[choice["side"]]

    def f(x, g, b):
        r = r_of()
        if mutation == "erf(x), not erf(x / sqrt 2)":
            p = 0.5 * (1 + lax.erf(x))
        elif mutation == "erfc(x) for erfc(-x)":
            p = 0.5 * lax.erfc(x / r)
        elif mutation == "x * sqrt 2 for x / sqrt 2":
            p = 0.5 * (1 + lax.erf(x * r))
        elif mutation == "no 1/2":
            p = 1 + lax.erf(x / r)
        else:
            p = cdf(x, r)
        return side(x, p) + 0.0 * (g + b)

    return f


def _silu(choice: dict, mutation: str | None = None) -> Callable:
    sigmoid, product = SIGMOIDS[choice["sigmoid"]], SILU_PRODUCTS[choice["product"]]

    def f(x, g, b):
        if mutation == "sigmoid(2 x)":
            y = x * jax.nn.sigmoid(2 * x)
        elif mutation == "x + sigmoid(x)":
            y = x + sigmoid(x)
        elif mutation == "tanh(x) for tanh(x / 2)":
            y = x * 0.5 * (1 + jnp.tanh(x))
        elif mutation == "exp(x) for exp(-x)":
            y = x / (1 + jnp.exp(x))
        elif mutation == "not times x":
            y = sigmoid(x)
        else:
            y = product(x, sigmoid(x))
        return y + 0.0 * (g + b)

    return f


# ------------------------------------------------------------------ cross-entropy
# The per-row loss ``-log softmax(z)[label]`` of logits ``z = x @ W`` (a head, so that
# optimize may fuse it) against integer labels the loss takes as an argument.
CLASSES = 16


def _one_hot(labels):
    return jax.nn.one_hot(labels, CLASSES)


LOGITS: dict[str, Callable] = {
    "x @ W": lambda x, w: x @ w,
    "jnp.einsum(x, W)": lambda x, w: jnp.einsum("btd,dv->btv", x, w),
    "x @ W + 0.5 (not a bare head)": lambda x, w: x @ w + 0.5,
}
LOG_SOFTMAXES: dict[str, Callable] = {
    "jax.nn.log_softmax": lambda z: jax.nn.log_softmax(z, axis=-1),
    "z - logsumexp(keepdims)": lambda z: z - jax.nn.logsumexp(z, -1, keepdims=True),
    "s - log(sum(exp(s))), s = z - max": lambda z: (
        lambda s: s - jnp.log(jnp.sum(jnp.exp(s), -1, keepdims=True))
    )(z - lax.stop_gradient(jnp.max(z, -1, keepdims=True))),
    "z - log(sum(exp(z)))": lambda z: z - jnp.log(jnp.sum(jnp.exp(z), -1, keepdims=True)),
    "jax.nn.log_softmax(axis=2)": lambda z: jax.nn.log_softmax(z, axis=2),
}
LOGSUMEXPS: dict[str, Callable] = {
    "jax.nn.logsumexp": lambda z: jax.nn.logsumexp(z, -1),
    "jax.scipy.special.logsumexp": lambda z: jax.scipy.special.logsumexp(z, axis=-1),
    "log(sum(exp(z - m))) + m": lambda z: (
        lambda m: jnp.log(jnp.sum(jnp.exp(z - m[..., None]), -1)) + m
    )(lax.stop_gradient(jnp.max(z, -1))),
    "log(sum(exp(z)))": lambda z: jnp.log(jnp.sum(jnp.exp(z), -1)),
}
NEGATIONS: dict[str, Callable] = {
    "-r": lambda r: -r,
    "0.0 - r": lambda r: 0.0 - r,
    "-1.0 * r": lambda r: -1.0 * r,
    "jnp.negative(r)": jnp.negative,
}


def _take(a, labels):
    return jnp.take_along_axis(a, labels[..., None], axis=-1)[..., 0]


# A readout: the loss from the logits z, the labels and the spellings drawn for the
# log-softmax (``lsm``), the logsumexp (``lse``) and the negation (``neg``).
READOUTS: dict[str, Callable] = {
    "take_along_axis(log_softmax)": lambda z, y, lsm, lse, neg: neg(_take(lsm(z), y)),
    "sum(one_hot * log_softmax)": lambda z, y, lsm, lse, neg: neg(
        jnp.sum(_one_hot(y) * lsm(z), -1)
    ),
    "einsum(one_hot, log_softmax)": lambda z, y, lsm, lse, neg: neg(
        jnp.einsum("btv,btv->bt", _one_hot(y), lsm(z))
    ),
    "sum((y == arange) * log_softmax)": lambda z, y, lsm, lse, neg: neg(
        jnp.sum((y[..., None] == jnp.arange(CLASSES)).astype(z.dtype) * lsm(z), axis=-1)
    ),
    "sum(smoothed one_hot * log_softmax)": lambda z, y, lsm, lse, neg: neg(
        jnp.sum((0.9 * _one_hot(y) + 0.1 / CLASSES) * lsm(z), -1)
    ),
    "take_along_axis(log_softmax.reshape(-1, V))": lambda z, y, lsm, lse, neg: neg(
        jnp.take_along_axis(lsm(z).reshape(-1, CLASSES), y.reshape(-1, 1), -1).reshape(y.shape)
    ),
    "log_softmax[arange, labels]": lambda z, y, lsm, lse, neg: neg(
        lsm(z)[jnp.arange(z.shape[0])[:, None], jnp.arange(z.shape[1])[None, :], y]
    ),
    "optax integer labels": lambda z, y, lsm, lse, neg: (
        optax.softmax_cross_entropy_with_integer_labels(z, y)
    ),
    "optax one-hot": lambda z, y, lsm, lse, neg: optax.softmax_cross_entropy(z, _one_hot(y)),
    "optax smooth_labels": lambda z, y, lsm, lse, neg: optax.softmax_cross_entropy(
        z, optax.smooth_labels(_one_hot(y), 0.1)
    ),
    "logsumexp - take_along_axis(z)": lambda z, y, lsm, lse, neg: lse(z) - _take(z, y),
    "logsumexp - sum(one_hot * z)": lambda z, y, lsm, lse, neg: (
        lse(z) - jnp.sum(_one_hot(y) * z, -1)
    ),
}
Z_LOSSES: dict[str, Callable] = {
    "none": lambda z, lse: 0.0,
    "+ 1e-4 logsumexp^2": lambda z, lse: 1e-4 * jax.nn.logsumexp(z, -1) ** 2,
    "+ 1e-4 square(logsumexp)": lambda z, lse: 1e-4 * jnp.square(lse(z)),
}


def _cross_entropy(choice: dict, mutation: str | None = None) -> Callable:
    logits, lsm = LOGITS[choice["logits"]], LOG_SOFTMAXES[choice["log_softmax"]]
    lse, neg = LOGSUMEXPS[choice["logsumexp"]], NEGATIONS[choice["negation"]]
    readout, z_loss = READOUTS[choice["readout"]], Z_LOSSES[choice["z-loss"]]

    def f(x, w, labels):
        z = logits(x, w)
        if mutation == "softmax, not log_softmax":
            loss = -jnp.sum(_one_hot(labels) * jax.nn.softmax(z), -1)
        elif mutation == "log_softmax over another axis":
            loss = -_take(jax.nn.log_softmax(z, axis=-2), labels)
        elif mutation == "logsumexp over another axis":
            loss = _take(jax.nn.logsumexp(z, -2, keepdims=True) - z, labels)
        elif mutation == "max not added back":
            m = lax.stop_gradient(jnp.max(z, -1, keepdims=True))
            loss = jnp.log(jnp.sum(jnp.exp(z - m), -1)) - _take(z, labels)
        elif mutation == "another row's label logit":
            loss = lse(z) - _take(jnp.roll(z, 1, axis=-2), labels)
        elif mutation == "twice the label logit":
            loss = lse(z) - jnp.sum(2.0 * _one_hot(labels) * z, -1)
        else:
            loss = readout(z, labels, lsm, lse, neg)
        return loss + z_loss(z, lse)

    return f


# ------------------------------------------------------------------ attention
# softmax(q k^T * scale + bias) v with q [B, T, N, H] and k, v [B, T, KV, H]: N query
# heads in KV groups (grouped-query attention), outputs [B, T, N, H].
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
GROUP = HEADS // KV_HEADS
TOKENS = SHAPE[1] * 2
CAUSAL = np.tril(np.ones((TOKENS, TOKENS), bool))
MIN = float(np.finfo(np.float32).min)
PAD = np.ones((SHAPE[0], TOKENS), bool)
PAD[1, TOKENS - 2 :] = False  # right padding: every row still sees a key
_POS = np.arange(TOKENS)
WINDOW = (_POS[:, None] >= _POS[None, :]) & (_POS[:, None] - _POS[None, :] < 3)
SLOPES = np.asarray([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)], np.float32)
DISTANCE = (_POS[None, :] - _POS[:, None]).astype(np.float32)  # key - query


def _repeat_kv(x):  # transformers: a new axis broadcast, then merged
    b, t, k, h = x.shape
    return jnp.broadcast_to(x[:, :, :, None, :], (b, t, k, GROUP, h)).reshape(b, t, k * GROUP, h)


# GQA: how the KV heads meet the query heads. Each returns scores [B, N, Tq, Tk] from
# (q, k) and the output [B, Tq, N, H] from (p, v).
def _scores_repeat(q, k):
    return jnp.einsum("bqnh,bknh->bnqk", q, _repeat_kv(k))


def _out_repeat(p, v):
    return jnp.einsum("bnqk,bknh->bqnh", p, _repeat_kv(v))


def _scores_jnp_repeat(q, k):
    return jnp.einsum("bqnh,bknh->bnqk", q, jnp.repeat(k, GROUP, axis=2))


def _out_jnp_repeat(p, v):
    return jnp.einsum("bnqk,bknh->bqnh", p, jnp.repeat(v, GROUP, axis=2))


def _scores_grouped(q, k):  # flax.nnx / haliax: q's heads split into (KV, G), scores 5-D
    b, t, n, h = q.shape
    return jnp.einsum("btkgh,bskh->bkgts", q.reshape(b, t, KV_HEADS, GROUP, h), k)


def _out_grouped(p, v):
    o = jnp.einsum("bkgts,bskh->btkgh", p, v)
    return o.reshape(*o.shape[:2], HEADS, v.shape[-1])


def _per_head(a, s):
    """A per-head ``[N, ...]`` array laid out for scores ``s`` (grouped: ``[KV, G, ...]``)."""
    return a.reshape(KV_HEADS, GROUP, *a.shape[1:]) if s.ndim == 5 else a


SEGMENTS = np.repeat(np.array([[0, 1], [0, 0]]), TOKENS // 2, axis=1)  # packed rows


def _same_segment(s):
    """Queries see only keys of their own segment, laid out for scores ``s``."""
    same = SEGMENTS[:, :, None] == SEGMENTS[:, None, :]  # [B, Tq, Tk]
    return same.reshape(same.shape[0], *(1,) * (s.ndim - 3), *same.shape[1:])


def _padding(s):
    """The key padding ``[B, 1, .., 1, Tk]`` for scores ``s``."""
    return PAD.reshape(PAD.shape[0], *(1,) * (s.ndim - 2), PAD.shape[1])


def _scores_matmul(q, k):  # heads first, then q @ k^T
    qh, kh = jnp.transpose(q, (0, 2, 1, 3)), jnp.transpose(_repeat_kv(k), (0, 2, 1, 3))
    return qh @ jnp.swapaxes(kh, -1, -2)


def _out_matmul(p, v):
    return jnp.transpose(p @ jnp.transpose(_repeat_kv(v), (0, 2, 1, 3)), (0, 2, 1, 3))


HEAD_GROUPS: dict[str, tuple[Callable, Callable]] = {
    "repeat_kv (broadcast + reshape)": (_scores_repeat, _out_repeat),
    "jnp.repeat": (_scores_jnp_repeat, _out_jnp_repeat),
    "grouped einsum": (_scores_grouped, _out_grouped),
    "heads-first matmul": (_scores_matmul, _out_matmul),
}
# (scale q first, scale the scores): one of the two does the 1/sqrt(H)
SCALES: dict[str, tuple[Callable, Callable]] = {
    "q * H ** -0.5": (lambda q: q * HEAD_DIM**-0.5, lambda s: s),
    "q / sqrt(H)": (lambda q: q / jnp.sqrt(jnp.float32(HEAD_DIM)), lambda s: s),
    "s / sqrt(H)": (lambda q: q, lambda s: s / math.sqrt(HEAD_DIM)),
    "s * (1 / sqrt(H))": (lambda q: q, lambda s: s * (1.0 / np.sqrt(HEAD_DIM))),
    "lax.rsqrt(H) * s": (lambda q: q, lambda s: lax.rsqrt(jnp.float32(HEAD_DIM)) * s),
}
CAPS: dict[str, Callable] = {
    "none": lambda s: s,
    "30 tanh(s / 30)": lambda s: 30.0 * jnp.tanh(s / 30.0),
}
POSITION_BIASES: dict[str, Callable] = {
    "none": lambda s: s,
    "ALiBi slope * (key - query)": lambda s: s + _per_head(SLOPES[:, None, None], s) * DISTANCE,
}
# The mask, as a function of the scores [B, N, Tq, Tk].
MASKS: dict[str, Callable] = {
    "none": lambda s: s,
    "causal where(tril, s, finfo.min)": lambda s: jnp.where(CAUSAL, s, MIN),
    "causal where(tril, s, -inf)": lambda s: jnp.where(CAUSAL, s, -jnp.inf),
    "causal additive 0 / finfo.min": lambda s: s + jnp.where(CAUSAL, 0.0, MIN),
    "causal where(q >= k, s, -1e9)": lambda s: jnp.where(
        jnp.arange(TOKENS)[:, None] >= jnp.arange(TOKENS)[None, :], s, -1e9
    ),
    "padding where(pad[:, None, None, :])": lambda s: jnp.where(_padding(s), s, MIN),
    "causal and padding": lambda s: jnp.where(jnp.logical_and(CAUSAL, _padding(s)), s, MIN),
    "sliding window of 3": lambda s: jnp.where(WINDOW, s, MIN),
    "segments (packed sequences)": lambda s: jnp.where(_same_segment(s), s, MIN),
    "segments and causal": lambda s: jnp.where(_same_segment(s) & CAUSAL, s, MIN),
}
SOFTMAXES: dict[str, Callable] = {
    "jax.nn.softmax": lambda s: jax.nn.softmax(s, axis=-1),
    "exp(s - max) / sum": lambda s: (lambda e: e / jnp.sum(e, -1, keepdims=True))(
        jnp.exp(s - lax.stop_gradient(jnp.max(s, -1, keepdims=True)))
    ),
    "exp(s - logsumexp)": lambda s: jnp.exp(s - jax.nn.logsumexp(s, -1, keepdims=True)),
}


def _attention(choice: dict, mutation: str | None = None) -> Callable:
    scores, out = HEAD_GROUPS[choice["heads"]]
    scale_q, scale_s = SCALES[choice["scale"]]
    cap, bias = CAPS[choice["cap"]], POSITION_BIASES[choice["position bias"]]
    mask, softmax = MASKS[choice["mask"]], SOFTMAXES[choice["softmax"]]

    def f(q, k, v):
        s = scale_s(scores(scale_q(q), k))
        s = mask(bias(cap(s)))
        if mutation == "softmax over the queries":
            p = jax.nn.softmax(s, axis=-2)
        elif mutation == "max subtracted in the numerator only":
            p = jnp.exp(s - jnp.max(s, -1, keepdims=True)) / jnp.sum(jnp.exp(s), -1, keepdims=True)
        elif mutation == "bias after the softmax":
            p = softmax(s) + 0.01 * _per_head(SLOPES[:, None, None], s) * DISTANCE
        elif mutation == "scale on the probabilities":
            p = softmax(s) * HEAD_DIM**-0.5
        elif mutation == "mask after the softmax, not renormalized":
            p = jnp.where(CAUSAL, softmax(s), 0.0)
        elif mutation == "weak fill (-10 keeps the masked keys)":
            p = softmax(jnp.where(CAUSAL, s, -10.0))
        else:
            p = softmax(s)
        return out(p, v)

    return f


# ------------------------------------------------------------------ RoPE
# Rotary embeddings of x [B, T, N, H] at integer positions [T] (an argument): the tables
# carry no gradient. Half-split: y = x cos + rotate_half(x) sin; interleaved: pairs
# (2i, 2i + 1) rotated.
THETA = 10000.0
HALF = HEAD_DIM // 2
INV_FREQS: dict[str, Callable] = {
    "1 / theta ** (arange(0, H, 2) / H)": lambda: (
        1.0 / (THETA ** (jnp.arange(0, HEAD_DIM, 2) / HEAD_DIM))
    ),
    "theta ** (-2 arange(h) / H)": lambda: THETA ** (-2.0 * jnp.arange(HALF) / HEAD_DIM),
    "exp(-log(theta) arange(0, H, 2) / H)": lambda: jnp.exp(
        -math.log(THETA) * jnp.arange(0, HEAD_DIM, 2, dtype=jnp.float32) / HEAD_DIM
    ),
}
ANGLES: dict[str, Callable] = {
    "pos[:, None] * inv[None]": lambda pos, inv: pos.astype(jnp.float32)[:, None] * inv[None],
    "jnp.outer(pos, inv)": lambda pos, inv: jnp.outer(pos.astype(jnp.float32), inv),
    "einsum('i,j->ij')": lambda pos, inv: jnp.einsum("i,j->ij", pos.astype(jnp.float32), inv),
    "pos / (1 / inv)": lambda pos, inv: pos.astype(jnp.float32)[:, None] / (1.0 / inv)[None],
}


def _rotate_half(x):
    return jnp.concatenate([-x[..., HALF:], x[..., :HALF]], axis=-1)


def _rotate_half_split(x):
    x0, x1 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate((-x1, x0), axis=-1)


def _rotate_every_two(x):
    r = jnp.stack((-x[..., 1::2], x[..., ::2]), axis=-1)
    return r.reshape(r.shape[:-2] + (-1,))


def _tables(a):  # [T, h] -> cos, sin laid out for x [B, T, N, .]
    return jnp.cos(a)[None, :, None], jnp.sin(a)[None, :, None]


# Each form: (x, angles [T, h], order) -> y; ``order`` puts the two terms' sum together.
def _concat_tables(x, a, order):
    c, s = _tables(jnp.concatenate([a, a], axis=-1))
    return order(x * c, _rotate_half(x) * s)


def _tiled_tables(x, a, order):
    c, s = _tables(a)
    return order(x * jnp.tile(c, (1, 1, 1, 2)), _rotate_half_split(x) * jnp.tile(s, (1, 1, 1, 2)))


def _split_halves(x, a, order):  # penzai: the halves' products, concatenated
    c, s = _tables(a)
    x0, x1 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([order(x0 * c, -(x1 * s)), order(x1 * c, x0 * s)], axis=-1)


def _heads_first(x, a, order):  # equinox: heads before positions, tables [T, H]
    c = jnp.tile(jnp.cos(a), (1, 2))
    s = jnp.tile(jnp.sin(a), (1, 2))
    xt = jnp.swapaxes(x, 1, 2)
    return jnp.swapaxes(order(xt * c, _rotate_half(xt) * s), 1, 2)


def _repeated_tables(x, a, order):  # GPT-J: interleaved, jnp.repeat tables
    c, s = _tables(a)
    return order(x * jnp.repeat(c, 2, axis=-1), _rotate_every_two(x) * jnp.repeat(s, 2, -1))


def _pairs(x, a, order):  # interleaved pairs as a reshape, stacked back
    c, s = _tables(a)
    p = x.reshape(*x.shape[:-1], HALF, 2)
    u, w = p[..., 0], p[..., 1]
    return jnp.stack([order(u * c, -(w * s)), order(w * c, u * s)], -1).reshape(x.shape)


ROPE_FORMS: dict[str, Callable] = {
    "x cos + rotate_half(x) sin, concatenated angles": _concat_tables,
    "tiled tables, rotate_half by split": _tiled_tables,
    "split halves, concatenated": _split_halves,
    "heads first, tiled tables": _heads_first,
    "interleaved, jnp.repeat tables": _repeated_tables,
    "interleaved pairs, stacked": _pairs,
}
ORDERS: dict[str, Callable] = {
    "a + b": lambda a, b: a + b,
    "b + a": lambda a, b: b + a,
    "jnp.add(a, b)": jnp.add,
    "a - (-b)": lambda a, b: a - (-b),
}


def _rope(choice: dict, mutation: str | None = None) -> Callable:
    inv_of, angles = INV_FREQS[choice["inverse frequencies"]], ANGLES[choice["angles"]]
    form, order = ROPE_FORMS[choice["form"]], ORDERS[choice["sum"]]

    def f(x, pos):
        a = angles(pos, inv_of())
        if mutation == "rotate_half without the negation":
            c, s = _tables(jnp.concatenate([a, a], axis=-1))
            rot = jnp.concatenate([x[..., HALF:], x[..., :HALF]], axis=-1)
            return x * c + rot * s
        if mutation == "the halves' tables differ":
            c, s = _tables(jnp.concatenate([a, 2.0 * a], axis=-1))
            return x * c + _rotate_half(x) * s
        if mutation == "one half not rotated":
            c, s = _tables(a)
            x0, x1 = jnp.split(x, 2, axis=-1)
            return jnp.concatenate([x0 * c - x1 * s, x1 * c + x1 * s], axis=-1)
        if mutation == "x times sin, not rotate_half(x)":
            c, s = _tables(jnp.concatenate([a, a], axis=-1))
            return x * c + x * s
        return form(x, a, order)

    return f


# ------------------------------------------------------------------ gated MLPs
# (act(x @ wg) * (x @ wu)) @ wd with x [B, T, D], wg and wu [D, F], wd [F, D].
FFN = 24
GATE_ACTIVATIONS: dict[str, tuple[str, Callable]] = {
    "jax.nn.silu": ("swiglu", jax.nn.silu),
    "jax.nn.swish": ("swiglu", jax.nn.swish),
    "a * sigmoid(a)": ("swiglu", lambda a: a * jax.nn.sigmoid(a)),
    "a / (1 + exp(-a))": ("swiglu", lambda a: a / (1 + jnp.exp(-a))),
    "jax.nn.gelu (tanh)": ("geglu", lambda a: jax.nn.gelu(a, approximate=True)),
    "jax.nn.gelu (erf)": ("geglu", lambda a: jax.nn.gelu(a, approximate=False)),
}
PROJECTIONS: dict[str, Callable] = {
    "x @ w": lambda x, w: x @ w,
    "jnp.einsum('btd,df')": lambda x, w: jnp.einsum("btd,df->btf", x, w),
    "jnp.dot": jnp.dot,
    "[out, in] weights: einsum('btd,fd')": lambda x, w: jnp.einsum("btd,fd->btf", x, w.T),
    "lax.dot_general": lambda x, w: lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ()))),
}
GATE_PRODUCTS: dict[str, Callable] = {
    "act(g) * u": lambda g, u: g * u,
    "u * act(g)": lambda g, u: u * g,
    "jnp.multiply": jnp.multiply,
}


def _gated_mlp(choice: dict, mutation: str | None = None) -> Callable:
    _, act = GATE_ACTIVATIONS[choice["activation"]]
    project, product = PROJECTIONS[choice["projection"]], GATE_PRODUCTS[choice["product"]]

    def f(x, wg, wu, wd):
        g, u = project(x, wg), project(x, wu)
        if mutation == "sigmoid gate (GLU), not silu":
            h = jax.nn.sigmoid(g) * u
        elif mutation == "the activation on both projections":
            h = act(g) * act(u)
        elif mutation == "gate plus up, not times":
            h = act(g) + u
        elif mutation == "times the up projection twice":
            h = act(g) * u * u
        else:
            h = product(act(g), u)
        return project(h, wd)

    return f


KINDS = {
    "layer_norm": (
        _layer_norm,
        {
            "mean": MEANS,
            "square": SQUARES,
            "variance": VARIANCES,
            "root": ROOTS,
            "placement": PLACEMENTS,
            "eps": EPSILONS,
            "cast": CASTS,
        },
        (
            "eps outside the root",
            "unbiased variance",
            "uncentred variance",
            "statistics over another axis",
            "mean left in the numerator",
            "wrong 1 / d",
            "scale inside the root",
        ),
    ),
    "rms_norm": (
        _rms_norm,
        {
            "mean": MEANS,
            "square": SQUARES,
            "root": ROOTS,
            "scale": {"g": None, "1 + g": None},
            "side": {"scale left": None, "scale right": None},
            "eps": EPSILONS,
            "cast": CASTS,
        },
        (
            "eps outside the root",
            "unbiased mean square",
            "statistic over another axis",
            "centred (a layer norm's statistic)",
            "root, not its inverse",
        ),
    ),
    "gelu_tanh": (
        _gelu_tanh,
        {
            "sqrt(2/pi)": SQRT_2_OVER_PI,
            "cube": CUBES,
            "inner": GELU_INNER,
            "outer": GELU_OUTER,
        },
        (
            "sqrt(pi / 2) for sqrt(2 / pi)",
            "0.04 for 0.044715",
            "x^2 for x^3",
            "no 1/2",
            "not times x",
            "sigmoid(z) for sigmoid(2 z)",
        ),
    ),
    "gelu_erf": (
        _gelu_erf,
        {"sqrt(2)": SQRT_2, "cdf": NORMAL_CDF, "side": SIDES},
        (
            "erf(x), not erf(x / sqrt 2)",
            "erfc(x) for erfc(-x)",
            "x * sqrt 2 for x / sqrt 2",
            "no 1/2",
        ),
    ),
    "silu": (
        _silu,
        {"sigmoid": SIGMOIDS, "product": SILU_PRODUCTS},
        (
            "sigmoid(2 x)",
            "x + sigmoid(x)",
            "tanh(x) for tanh(x / 2)",
            "exp(x) for exp(-x)",
            "not times x",
        ),
    ),
    "cross_entropy": (
        _cross_entropy,
        {
            "logits": LOGITS,
            "log_softmax": LOG_SOFTMAXES,
            "logsumexp": LOGSUMEXPS,
            "negation": NEGATIONS,
            "readout": READOUTS,
            "z-loss": Z_LOSSES,
        },
        (
            "softmax, not log_softmax",
            "log_softmax over another axis",
            "logsumexp over another axis",
            "max not added back",
            "another row's label logit",
            "twice the label logit",
        ),
    ),
    "attention": (
        _attention,
        {
            "heads": HEAD_GROUPS,
            "scale": SCALES,
            "cap": CAPS,
            "position bias": POSITION_BIASES,
            "mask": MASKS,
            "softmax": SOFTMAXES,
        },
        (
            "softmax over the queries",
            "max subtracted in the numerator only",
            "bias after the softmax",
            "scale on the probabilities",
            "mask after the softmax, not renormalized",
            "weak fill (-10 keeps the masked keys)",
        ),
    ),
    "rope": (
        _rope,
        {
            "inverse frequencies": INV_FREQS,
            "angles": ANGLES,
            "form": ROPE_FORMS,
            "sum": ORDERS,
        },
        (
            "rotate_half without the negation",
            "the halves' tables differ",
            "one half not rotated",
            "x times sin, not rotate_half(x)",
        ),
    ),
    "gated_mlp": (
        _gated_mlp,
        {"activation": GATE_ACTIVATIONS, "projection": PROJECTIONS, "product": GATE_PRODUCTS},
        (
            "sigmoid gate (GLU), not silu",
            "the activation on both projections",
            "gate plus up, not times",
            "times the up projection twice",
        ),
    ),
}
# The operators each kind is substituted by (the report's op).
OPS = {
    "layer_norm": ("layer_norm",),
    "rms_norm": ("rms_norm",),
    "gelu_tanh": ("gelu",),
    "gelu_erf": ("gelu",),
    "silu": ("silu",),
    "cross_entropy": ("softmax_cross_entropy", "linear_cross_entropy"),
    "attention": ("attention",),
    "rope": ("apply_rope",),
    "gated_mlp": ("swiglu", "geglu"),
}
# A mutant counts as substituted when it gets an operator of its kind's family: a
# layer-norm mutant made an RMS norm is wrong, while a gated MLP's mutant whose
# activation alone becomes silu is right (and checked for soundness like every case).
FAMILIES = (
    frozenset({"layer_norm", "rms_norm"}),
    frozenset({"gelu", "silu"}),
    frozenset(OPS["cross_entropy"]),
    frozenset(OPS["attention"]),
    frozenset(OPS["rope"]),
    frozenset(OPS["gated_mlp"]),
)


def family(kind: str) -> frozenset:
    """The operators a mutant of ``kind`` must not be substituted by."""
    return frozenset().union(*(f for f in FAMILIES if f & set(OPS[kind])))


def spellings(kind: str, count: int, seed: int = 0) -> list[Spelling]:
    """``count`` distinct equal spellings of ``kind``, drawn with ``seed``."""
    make, space, _ = KINDS[kind]
    rng = np.random.default_rng(seed)
    seen, out = set(), []
    total = int(np.prod([len(v) for v in space.values()]))
    while len(out) < min(count, total):
        choice = {k: list(v)[rng.integers(len(v))] for k, v in space.items()}
        name = ", ".join(f"{k}={v}" for k, v in choice.items())
        if name not in seen:
            seen.add(name)
            out.append(Spelling(kind, name, make(choice)))
    return out


def mutants(kind: str, per_mutation: int, seed: int = 0) -> list[Spelling]:
    """Each mutation of ``kind`` applied to ``per_mutation`` random spellings."""
    make, space, mutations = KINDS[kind]
    rng = np.random.default_rng(seed + 1)
    out = []
    for mutation in mutations:
        for _ in range(per_mutation):
            choice = {k: list(v)[rng.integers(len(v))] for k, v in space.items()}
            name = ", ".join(f"{k}={v}" for k, v in choice.items())
            out.append(Spelling(kind, name, make(choice, mutation), mutation))
    return out


# ------------------------------------------------------------------ the checks
def inputs(seed: int = 0):
    """``(x, g, b, w)``: rows of random mean and spread, a scale near 1, a bias, weights."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=SHAPE) * rng.uniform(0.5, 2.0, (*SHAPE[:-1], 1)) + rng.uniform(
        -1, 1, (*SHAPE[:-1], 1)
    )
    g = 1.0 + 0.1 * rng.normal(size=SHAPE[-1])
    b = 0.1 * rng.normal(size=SHAPE[-1])
    w = rng.normal(size=SHAPE)
    return tuple(np.asarray(a, np.float32) for a in (x, g, b, w))


def arguments(kind: str, seed: int = 0):
    """``(floats, labels, w)``: the loss's differentiated arguments, its integer
    arguments, and the weights its per-element output is summed with."""
    if kind == "attention":
        rng = np.random.default_rng(seed)
        b, t = SHAPE[0], TOKENS
        q = rng.normal(size=(b, t, HEADS, HEAD_DIM))
        k, v = (rng.normal(size=(b, t, KV_HEADS, HEAD_DIM)) for _ in range(2))
        w = rng.normal(size=(b, t, HEADS, HEAD_DIM))
        return tuple(np.asarray(a, np.float32) for a in (q, k, v)), (), np.float32(w)
    if kind == "rope":
        rng = np.random.default_rng(seed)
        b, t = SHAPE[0], TOKENS
        x = rng.normal(size=(b, t, HEADS, HEAD_DIM)).astype(np.float32)
        w = rng.normal(size=(b, t, HEADS, HEAD_DIM)).astype(np.float32)
        return (x,), (np.arange(t, dtype=np.int32) + 3,), w
    if kind == "gated_mlp":
        rng = np.random.default_rng(seed)
        d = SHAPE[-1]
        x = rng.normal(size=SHAPE)
        wg, wu = (0.3 * rng.normal(size=(d, FFN)) for _ in range(2))
        wd = 0.3 * rng.normal(size=(FFN, d))
        w = rng.normal(size=SHAPE)
        return tuple(np.float32(a) for a in (x, wg, wu, wd)), (), np.float32(w)
    if kind != "cross_entropy":
        x, g, b, w = inputs(seed)
        return (x, g, b), (), w
    rng = np.random.default_rng(seed)
    x = rng.normal(size=SHAPE).astype(np.float32)
    head = (rng.normal(size=(SHAPE[-1], CLASSES)) * 0.7).astype(np.float32)
    labels = rng.integers(0, CLASSES, SHAPE[:-1]).astype(np.int32)
    w = rng.normal(size=SHAPE[:-1]).astype(np.float32)
    return (x, head), (labels,), w


@dataclasses.dataclass(frozen=True)
class Outcome:
    spelling: Spelling
    substituted: tuple[str, ...]  # the operators optimize put in
    error: float  # largest relative difference of value, gradient and JVP, float64


def check(spelling: Spelling, seed: int = 0) -> Outcome:
    """What optimize does with ``spelling``'s loss, and how far it moves its derivatives."""
    floats, ints, w = arguments(spelling.kind, seed)
    n = len(floats)

    def loss(*args):
        return jnp.sum(spelling.fn(*args) * w)

    with jax.numpy_rank_promotion("allow"):
        report = cannjax.inspect.optimize(loss, *floats, *ints)
        opt = cannjax.optimize(loss)
        with jax.enable_x64(True):
            a64 = tuple(jnp.asarray(a, jnp.float64) for a in floats)
            t = tuple(
                jnp.asarray(np.random.default_rng(seed + 7).normal(size=a.shape)) for a in a64
            )

            def derivatives(f, *args):
                a, labels = args[:n], args[n:]

                def of_floats(*a):
                    return f(*a, *labels)

                return jax.value_and_grad(of_floats, tuple(range(n)))(*a), jax.jvp(of_floats, a, t)[
                    1
                ]

            results = [
                jax.jit(lambda *a, f=f: derivatives(f, *a))(*a64, *ints) for f in (opt, loss)
            ]
    error = 0.0
    for u, v in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        scale = max(1e-30, float(np.max(np.abs(v))))
        error = max(error, float(np.max(np.abs(u - v))) / scale)
    ops = tuple(sorted(r.op for r in report.replaced))
    return Outcome(spelling, ops, error)


SOUND_RTOL = 1e-6


def summarize(outcomes: list[Outcome]) -> dict:
    """Per kind: spellings recognized, mutants substituted, unsound cases."""
    out: dict = {}
    for o in outcomes:
        k = out.setdefault(
            o.spelling.kind,
            {
                "spellings": 0,
                "recognized": 0,
                "mutants": 0,
                "mutants_substituted": 0,
                "unsound": 0,
                "missed": [],
                "substituted": [],
            },  # fmt: skip
        )
        found = bool(set(OPS[o.spelling.kind]) & set(o.substituted))
        if o.spelling.mutant is not None:  # any operator of the kind's family counts
            found = bool(set(o.substituted) & family(o.spelling.kind))
        if o.spelling.mutant is None:
            k["spellings"] += 1
            k["recognized"] += found
            if not found:
                k["missed"].append(o.spelling.name)
        else:
            k["mutants"] += 1
            k["mutants_substituted"] += found
            if found:
                k["substituted"].append(f"{o.spelling.mutant}: {o.spelling.name}")
        k["unsound"] += o.error > SOUND_RTOL
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=40, help="spellings per kind (default 40)")
    p.add_argument("--mutants", type=int, default=3, help="spellings per mutation (default 3)")
    p.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    a = p.parse_args(argv)
    outcomes = []
    for kind in KINDS:
        for s in spellings(kind, a.count, a.seed) + mutants(kind, a.mutants, a.seed):
            outcomes.append(check(s))
    summary = summarize(outcomes)
    rows = [
        [
            k,
            f"{v['recognized']}/{v['spellings']}",
            f"{v['mutants_substituted']}/{v['mutants']}",
            v["unsound"],
        ]  # fmt: skip
        for k, v in summary.items()
    ]
    table = markdown_table(["kind", "spellings recognized", "mutants substituted", "unsound"], rows)
    print(table)
    for k, v in summary.items():
        for name in v["missed"]:
            print(f"missed {k}: {name}")
        for name in v["substituted"]:
            print(f"MUTANT SUBSTITUTED {k}: {name}")
    command = "PYTHONPATH=. python benchmarks/optimize_spellings.py" + "".join(
        f" {x}" for x in (argv if argv is not None else sys.argv[1:])
    )
    write_results(
        "optimize_spellings", {"command": command, "seed": a.seed, "kinds": summary}, table
    )


if __name__ == "__main__":
    main()
