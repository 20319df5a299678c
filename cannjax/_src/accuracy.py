"""How accurate each registered operator is: its largest relative error over its domain.

Every operator gets a sweep: a fixed set of inputs covering its whole domain, tails
included, a 50-digit truth computed with mpmath at the inputs as rounded to the dtype
under test, and the error of cannjax's result and of its counterpart's (jax.nn,
jax.scipy.special, jnp or optax) at each point.

The error at one output is ``|got - true| / max(|true|, floor)``, and it is also given in
ulps, ``error / eps`` with ``eps = 2**-23`` (float32) or ``2**-52`` (float64): a correctly
rounded result is within 0.5 ulp. The floor is what keeps the measure meaningful near a
zero of the function and nowhere else:

- elementwise ops, softmax, rms_norm, norm, normalize, entropy: the smallest normal
  number of the dtype (``tiny``), so the error is purely relative wherever the true value
  is a normal number, and outputs that underflow are compared in units of ``tiny``;
- ops whose output is a sum of signed terms: the magnitude of the terms that cancel
  (``sum |a_k b_k|`` for matmul, linear and cosine_similarity, ``sum p_j |v_j|`` for
  attention, ``(|x - mean| + |mean|) |scale| / sd + |bias|`` for layer_norm,
  ``|a cos| + |c sin|`` for rope's rotated pair ``a cos - c sin``). Where no
  cancellation happens this equals ``|true|``: the floor acts only where the output is
  smaller than the terms it comes from, that is, near a zero;
- log-domain outputs (logsumexp, log_softmax and the cross-entropy losses): the
  magnitude of the terms ``x_i - max`` (or ``max`` itself) plus 1, since ``log(s)`` for a
  sum ``s >= 1`` rounded to relative ``eps`` carries an absolute error of ``eps``;
  likewise for the distillation losses (kl_divergence, jensen_shannon), sums of
  log-probabilities weighed by probabilities: ``1 + sum_c (p_c + q_c)(|log p_c| +
  |log q_c|)``, plus twice the largest ``sum_k |x_k w_kc|`` of a logit for
  linear_jensen_shannon (the logits' own rounding, as linear_cross_entropy's floor).

A true value below ``tiny`` may come out as its subnormal or flushed to zero (XLA:CPU
flushes subnormals), both counted as exact; a true value beyond the dtype's range must
come out as the infinity of its sign. A NaN where the truth is a number is an infinite
error.

For elementwise ops the first derivative is measured the same way (``jax.grad`` of the
cannjax op, plain autodiff of the counterpart, mpmath's closed form as the truth).
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import mpmath
import numpy as np

from cannjax._src.core.registry import lookup

mp = mpmath.mp
_DPS = 50
# multipliers of the number of points in a sweep: (elementwise, row-wise)
_SIZES = {"test": (1, 2), "benchmark": (8, 16)}


# ------------------------------------------------------------------ error measure
def _truth(values: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """50-digit values as float64 pairs ``hi + lo`` (``hi`` the rounded value)."""
    hi = np.empty(len(values))
    lo = np.zeros(len(values))
    for i, t in enumerate(values):
        h = float(t)
        hi[i] = h
        if math.isfinite(h):
            lo[i] = float(t - h)
    return hi, lo


def _at(f: Callable[..., Any], *v: Any) -> Any:
    """``f(*v)``, or its one-sided limit from the right where ``f`` divides by zero (the
    derivative of log or sqrt at 0; the limit's sign is what the dtype rounds to)."""
    try:
        return f(*v)
    except ZeroDivisionError:
        with mp.workdps(2 * _DPS + 1000):
            return f(*(u + mpmath.mpf(10) ** -1000 for u in v))


def _relative_error(got, hi, lo, floor, dtype) -> np.ndarray:
    """``|got - true| / max(|true|, floor)`` per point (module docstring for the rules)."""
    got = np.asarray(got, np.float64).ravel()
    tiny = float(np.finfo(dtype).tiny)
    with np.errstate(over="ignore", invalid="ignore"):
        target = hi.astype(dtype).astype(np.float64)
        d = np.abs((got - hi) - lo)
        d = np.where(np.abs(hi) < tiny, np.minimum(d, np.abs(got)), d)
        err = d / np.maximum(np.abs(hi), np.maximum(floor, tiny))
    err = np.where(np.isinf(target), np.where(got == target, 0.0, np.inf), err)
    return np.where(np.isnan(got), np.inf, err)


def _summary(err, inputs, got, hi, dtype) -> dict[str, Any]:
    i = int(np.argmax(err))
    e = float(err[i])
    return {
        "max_rel": e,
        "ulps": e / float(np.finfo(dtype).eps),
        "worst_input": inputs[i],
        "worst_got": float(np.asarray(got, np.float64).ravel()[i]),
        "worst_true": float(hi[i]),
    }


# ------------------------------------------------------------------ elementwise sweeps
def _sigma(x):
    return 1 / (1 + mp.exp(-x))


def _gelu_tanh_u(x):
    return mp.sqrt(2 / mp.pi) * (x + mpmath.mpf("0.044715") * x**3)


def _gelu_tanh(x):  # x (1 + tanh(u)) / 2 = x sigmoid(2u), without cancellation
    return x * _sigma(2 * _gelu_tanh_u(x))


def _gelu_tanh_d(x):
    u2 = 2 * _gelu_tanh_u(x)
    du2 = 2 * mp.sqrt(2 / mp.pi) * (1 + 3 * mpmath.mpf("0.044715") * x**2)
    return _sigma(u2) + x * du2 * _sigma(u2) * _sigma(-u2)


def _ncdf(x):
    return mp.erfc(-x / mp.sqrt(2)) / 2


def _npdf(x):
    return mp.exp(-x * x / 2) / mp.sqrt(2 * mp.pi)


@dataclass(frozen=True)
class _Unary:
    op: str
    value: Callable[[Any], Any]
    derivative: Callable[[Any], Any]
    counterpart: str
    region: tuple[float, float]  # a linear grid over the interesting part of the domain
    kwargs: dict = field(default_factory=dict)
    positive: bool = False  # domain x >= 0 (x > lower bound for log1p)
    lower: float | None = None


def _jnp(name):
    return getattr(jnp, name)


_UNARY = [
    _Unary("exp", mp.exp, mp.exp, "jnp.exp", (-750, 710)),
    _Unary("log", mp.log, lambda x: 1 / x, "jnp.log", (0, 3), positive=True),
    _Unary("sin", mp.sin, mp.cos, "jnp.sin", (-10, 10)),
    _Unary("cos", mp.cos, lambda x: -mp.sin(x), "jnp.cos", (-10, 10)),
    _Unary("tanh", mp.tanh, lambda x: mp.sech(x) ** 2, "jnp.tanh", (-20, 20)),
    _Unary("sigmoid", _sigma, lambda x: _sigma(x) * _sigma(-x), "jax.nn.sigmoid", (-750, 40)),
    _Unary("softplus", lambda x: mp.log1p(mp.exp(x)), _sigma, "jax.nn.softplus", (-750, 40)),
    _Unary(
        "log_sigmoid",
        lambda x: -mp.log1p(mp.exp(-x)),
        lambda x: _sigma(-x),
        "jax.nn.log_sigmoid",
        (-40, 750),
    ),
    _Unary(
        "relu",
        lambda x: max(x, 0),
        lambda x: mpmath.mpf(1 if x > 0 else 0),
        "jax.nn.relu",
        (-1, 1),
    ),
    _Unary(
        "gelu",
        _gelu_tanh,
        _gelu_tanh_d,
        "jax.nn.gelu",
        (-40, 10),
        kwargs={"approximate": True},
    ),
    _Unary(
        "gelu",
        lambda x: x * _ncdf(x),
        lambda x: _ncdf(x) + x * _npdf(x),
        "jax.nn.gelu",
        (-40, 10),
        kwargs={"approximate": False},
    ),
    _Unary(
        "silu",
        lambda x: x * _sigma(x),
        lambda x: _sigma(x) * (1 + x * _sigma(-x)),
        "jax.nn.silu",
        (-750, 40),
    ),
    _Unary("sqrt", mp.sqrt, lambda x: 1 / (2 * mp.sqrt(x)), "jnp.sqrt", (0, 4), positive=True),
    _Unary(
        "rsqrt",
        lambda x: 1 / mp.sqrt(x),
        lambda x: -1 / (2 * x * mp.sqrt(x)),
        "jax.lax.rsqrt",
        (0, 4),
        positive=True,
    ),
    _Unary("log1p", mp.log1p, lambda x: 1 / (1 + x), "jnp.log1p", (-1, 2), lower=-1.0),
    _Unary("expm1", mp.expm1, mp.exp, "jnp.expm1", (-40, 710)),
    _Unary(
        "erf",
        mp.erf,
        lambda x: 2 / mp.sqrt(mp.pi) * mp.exp(-x * x),
        "jax.scipy.special.erf",
        (-6, 6),
    ),
    _Unary("square", lambda x: x * x, lambda x: 2 * x, "jnp.square", (-10, 10)),
]

_COUNTERPARTS: dict[str, Callable[..., Any]] = {
    "jnp.exp": jnp.exp,
    "jnp.log": jnp.log,
    "jnp.sin": jnp.sin,
    "jnp.cos": jnp.cos,
    "jnp.tanh": jnp.tanh,
    "jax.nn.sigmoid": jax.nn.sigmoid,
    "jax.nn.softplus": jax.nn.softplus,
    "jax.nn.log_sigmoid": jax.nn.log_sigmoid,
    "jax.nn.relu": jax.nn.relu,
    "jax.nn.gelu": jax.nn.gelu,
    "jax.nn.silu": jax.nn.silu,
    "jnp.sqrt": jnp.sqrt,
    "jax.lax.rsqrt": jax.lax.rsqrt,
    "jnp.log1p": jnp.log1p,
    "jnp.expm1": jnp.expm1,
    "jax.scipy.special.erf": jax.scipy.special.erf,
    "jnp.square": jnp.square,
    "jax.scipy.special.xlogy": jax.scipy.special.xlogy,
    "jnp.arctan2": jnp.arctan2,
}


def _magnitudes(n: int) -> np.ndarray:
    return np.logspace(-30, 30, n)


def _unary_points(s: _Unary, mult: int) -> np.ndarray:
    mags = _magnitudes(50 * mult)
    lo, hi = s.region
    pts = [mags, np.linspace(lo, hi, 150 * mult + 1)]
    if not s.positive:
        pts.append(-mags)
    x = np.concatenate(pts + [np.zeros(1)])
    if s.positive:
        x = x[x >= 0]
    if s.lower is not None:
        x = x[x >= s.lower]
    return x


def _label(op: str, kwargs: dict) -> str:
    inner = ", ".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{op}({inner})" if inner else op


def _x64(dtype):
    return jax.enable_x64(np.dtype(dtype) == np.float64)


def _grad_elementwise(f, x, argnum=0):
    return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=argnum)(*x)


def _measure_unary(s: _Unary, dtype: str, mult: int) -> dict[str, Any]:
    x = np.unique(_unary_points(s, mult).astype(dtype)).astype(np.float64)
    x = x[np.isfinite(x)]
    with mp.workdps(_DPS):
        xs = [mpmath.mpf(float(v)) for v in x]
        vhi, vlo = _truth([_at(s.value, v) for v in xs])
        dhi, dlo = _truth([_at(s.derivative, v) for v in xs])
    ours = lookup(s.op).fn
    theirs = _COUNTERPARTS[s.counterpart]
    out: dict[str, Any] = {"op": _label(s.op, s.kwargs), "dtype": dtype, "points": len(x)}
    out["counterpart_name"] = s.counterpart
    with _x64(dtype):
        xj = jnp.asarray(x, dtype)
        for who, f in (("cannjax", ours), ("counterpart", theirs)):

            def g(v, f=f):
                return f(v, **s.kwargs)

            got = np.asarray(g(xj))
            err = _relative_error(got, vhi, vlo, 0.0, dtype)
            out[who] = _summary(err, x.tolist(), got, vhi, dtype)
            dgot = np.asarray(_grad_elementwise(g, (xj,)))
            derr = _relative_error(dgot, dhi, dlo, 0.0, dtype)
            out[f"{who}_derivative"] = _summary(derr, x.tolist(), dgot, dhi, dtype)
    return out


# ------------------------------------------------------------------ binary elementwise
@dataclass(frozen=True)
class _Binary:
    op: str
    value: Callable[[Any, Any], Any]
    partials: tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]
    counterpart: str
    first: Callable[[int], np.ndarray]
    second: Callable[[int], np.ndarray]


def _signed(n):
    m = _magnitudes(n)
    return np.concatenate([-m, m, np.linspace(-3, 3, n // 2 + 1), [0.0]])


def _positive(n):
    return np.concatenate([_magnitudes(n), np.linspace(0, 3, n + 1), np.linspace(0.9, 1.1, n)])


_BINARY = [
    _Binary(
        "xlogy",
        lambda x, y: mpmath.mpf(0) if x == 0 else x * mp.log(y),
        # x log y is 0 wherever x = 0, so is its y-derivative (y = 0 included)
        (lambda x, y: mp.log(y), lambda x, y: mpmath.mpf(0) if x == 0 else x / y),
        "jax.scipy.special.xlogy",
        _signed,
        _positive,
    ),
    _Binary(
        "arctan2",
        mp.atan2,
        (
            lambda y, x: x / (x * x + y * y),
            lambda y, x: -y / (x * x + y * y),
        ),
        "jnp.arctan2",
        _signed,
        _signed,
    ),
]


def _measure_binary(s: _Binary, dtype: str, mult: int) -> dict[str, Any]:
    n = 8 + 2 * mult
    a = np.unique(s.first(n).astype(dtype)).astype(np.float64)
    b = np.unique(s.second(n).astype(dtype)).astype(np.float64)
    a, b = (v.ravel() for v in np.meshgrid(a, b))
    if s.op == "arctan2":  # the derivative is undefined at the origin
        keep = (a != 0) | (b != 0)
        a, b = a[keep], b[keep]
    inputs = list(zip(a.tolist(), b.tolist(), strict=True))
    with mp.workdps(_DPS):
        ps = [(mpmath.mpf(u), mpmath.mpf(v)) for u, v in inputs]
        vhi, vlo = _truth([_at(s.value, u, v) for u, v in ps])
        parts = [_truth([_at(p, u, v) for u, v in ps]) for p in s.partials]
    out: dict[str, Any] = {"op": s.op, "dtype": dtype, "points": len(inputs)}
    out["counterpart_name"] = s.counterpart
    with _x64(dtype):
        aj, bj = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
        for who, f in (("cannjax", lookup(s.op).fn), ("counterpart", _COUNTERPARTS[s.counterpart])):
            got = np.asarray(f(aj, bj))
            out[who] = _summary(_relative_error(got, vhi, vlo, 0.0, dtype), inputs, got, vhi, dtype)
            worst = None
            for k, (phi, plo) in enumerate(parts):
                dgot = np.asarray(_grad_elementwise(f, (aj, bj), k))
                r = _summary(_relative_error(dgot, phi, plo, 0.0, dtype), inputs, dgot, phi, dtype)
                r["argument"] = k
                if worst is None or r["max_rel"] > worst["max_rel"]:
                    worst = r
            out[f"{who}_derivative"] = worst
    return out


# ------------------------------------------------------------------ row-wise and matrix ops
_W = 8  # row width
_SCALES = (1e-15, 1e-3, 1.0, 30.0, 1e3, 1e15)
_OFFSETS = (0.0, 1e4, -1e4)


def _rows(rng, mult, scales=_SCALES, offsets=_OFFSETS, width=_W):
    """Rows of ``width`` normal entries times each scale plus each offset, and rows
    where one entry dominates the rest by a wide margin."""
    out = []
    for sc in scales:
        for off in offsets:
            out.append(rng.standard_normal((mult, width)) * sc + off)
    dom = rng.standard_normal((mult, width)) - 120.0
    dom[:, 0] = 0.0
    out.append(dom)
    return np.concatenate(out)


def _mask(rng, shape):
    m = rng.random(shape) < 0.7
    m[:, 0] = True
    return m


def _mpf_rows(x):
    return [[mpmath.mpf(float(v)) for v in row] for row in x]


def _lse_parts(row):
    m = max(row)
    return m, mp.fsum(mp.exp(v - m) for v in row)


def _truth_logsumexp(x, mask):
    vals, floors = [], []
    for row, mk in zip(_mpf_rows(x), mask, strict=True):
        m, s = _lse_parts([v for v, k in zip(row, mk, strict=True) if k])
        vals.append(m + mp.log(s))
        floors.append(abs(float(m)) + 1.0)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_softmax(x, mask):
    vals = []
    for row, mk in zip(_mpf_rows(x), mask, strict=True):
        m, s = _lse_parts([v for v, k in zip(row, mk, strict=True) if k])
        vals += [mp.exp(v - m) / s if k else mpmath.mpf(0) for v, k in zip(row, mk, strict=True)]
    return vals, np.zeros(len(vals)), np.ones(len(vals), bool)


def _truth_log_softmax(x, mask):
    vals, floors = [], []
    for row, mk in zip(_mpf_rows(x), mask, strict=True):
        m, s = _lse_parts([v for v, k in zip(row, mk, strict=True) if k])
        ls = mp.log(s)
        for v in row:
            vals.append(v - m - ls)
            floors.append(abs(float(v - m)) + 1.0)
    return vals, np.asarray(floors), np.asarray(mask).ravel()


def _truth_cross_entropy(logits, labels):
    vals, floors = [], []
    for row, lab in zip(_mpf_rows(logits), labels, strict=True):
        m, s = _lse_parts(row)
        vals.append(m + mp.log(s) - row[int(lab)])
        floors.append(abs(float(row[int(lab)] - m)) + 1.0)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


# softmax_cross_entropy's options, fixed for their sweeps: (label_smoothing, z_loss, cap).
_XENT_SMOOTHED = (0.1, 1e-4, None)
_XENT_CAPPED = (0.0, 0.0, 30.0)


def _xent_kwargs(options):
    eps, zl, cap = options
    return {"label_smoothing": eps, "z_loss": zl, "logit_cap": cap}


def _truth_xent_options(logits, labels, options):
    # lse - (1 - eps) z[y] - eps mean(z) + z_loss lse^2 of z = cap tanh(x / cap): the sum
    # of (1 - eps)(lse - z[y]), eps (lse - mean z) and z_loss lse^2, all >= 0; the floor
    # is the magnitude of the z - max they cancel in, plus 1.
    eps, zl, cap = (None if v is None else mpmath.mpf(v) for v in options)
    vals, floors = [], []
    for row, lab in zip(_mpf_rows(logits), labels, strict=True):
        z = row if cap is None else [cap * mp.tanh(v / cap) for v in row]
        m, s = _lse_parts(z)
        lse = m + mp.log(s)
        mean = mp.fsum(z) / len(z)
        vals.append((1 - eps) * (lse - z[int(lab)]) + eps * (lse - mean) + zl * lse**2)
        spread = mp.fsum(abs(v - m) for v in z) / len(z)
        floors.append(float((1 - eps) * abs(z[int(lab)] - m) + eps * spread) + 1.0)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _optax_xent_options(logits, labels, options):
    optax = _optax()
    eps, zl, cap = options
    z = logits if cap is None else cap * jnp.tanh(logits / cap)
    target = optax.smooth_labels(jax.nn.one_hot(labels, z.shape[-1], dtype=z.dtype), eps)
    return optax.softmax_cross_entropy(z, target) + zl * jax.nn.logsumexp(z, axis=-1) ** 2


def _dot_parts(a, b):
    return mp.fsum(u * v for u, v in zip(a, b, strict=True)), float(
        mp.fsum(abs(u * v) for u, v in zip(a, b, strict=True))
    )


def _truth_matmul(a, b, bias=None):
    A, B = _mpf_rows(a), _mpf_rows(np.asarray(b).T)
    c = None if bias is None else [mpmath.mpf(float(v)) for v in bias]
    vals, floors = [], []
    for ra in A:
        for j, cb in enumerate(B):
            d, f = _dot_parts(ra, cb)
            if c is not None:
                d, f = d + c[j], f + abs(float(c[j]))
            vals.append(d)
            floors.append(f)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


_LORA_SCALE = 0.5


def _lora_args(rng, mult):
    # x: rows of every scale, offsets 0 and 1e4; w [8, 8]; rank 2: a [8, 2], b [2, 8]; bias.
    x, w = _matrices(rng, mult)
    a, b = rng.standard_normal((_W, 2)), rng.standard_normal((2, _W))
    return x, w, a, b, rng.standard_normal(_W) * 10


def _truth_lora(x, w, a, b, bias, scale=_LORA_SCALE):
    # y = x w + s (x a) b + bias. Floor: the terms that cancel, sum |x_k w_ke| + |bias_e|,
    # and those of the low-rank part, where the rank-r value s (x a)_f is rounded before
    # its product with b: sum_f |s| (|x| @ |a|)_f |b_fe| (which bounds |s (x a)_f b_fe|).
    s = mpmath.mpf(scale)
    W, A, Bt = _mpf_rows(np.asarray(w).T), _mpf_rows(np.asarray(a).T), _mpf_rows(np.asarray(b).T)
    c = [mpmath.mpf(float(v)) for v in bias]
    vals, floors = [], []
    for row in _mpf_rows(x):
        xa, ma = zip(*(_dot_parts(row, col) for col in A), strict=True)
        for e, (wc, bc) in enumerate(zip(W, Bt, strict=True)):
            d, f = _dot_parts(row, wc)
            low = mp.fsum(s * u * v for u, v in zip(xa, bc, strict=True))
            vals.append(d + low + c[e])
            low_floor = sum(float(abs(s)) * m * abs(float(v)) for m, v in zip(ma, bc))
            floors.append(f + abs(float(c[e])) + low_floor)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_linear_cross_entropy(x, w, labels):
    X, Wt = _mpf_rows(x), _mpf_rows(np.asarray(w).T)
    vals, floors = [], []
    for rx, lab in zip(X, labels, strict=True):
        parts = [_dot_parts(rx, cw) for cw in Wt]
        logits = [p[0] for p in parts]
        m, s = _lse_parts(logits)
        vals.append(m + mp.log(s) - logits[int(lab)])
        floors.append(max(p[1] for p in parts) + 1.0)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_layer_norm(x, scale, bias, eps):
    g = [mpmath.mpf(float(v)) for v in scale]
    b = [mpmath.mpf(float(v)) for v in bias]
    eps = mpmath.mpf(eps)
    vals, floors = [], []
    for row in _mpf_rows(x):
        mu = mp.fsum(row) / len(row)
        var = mp.fsum((v - mu) ** 2 for v in row) / len(row)
        sd = mp.sqrt(var + eps)
        for v, gi, bi in zip(row, g, b, strict=True):
            vals.append((v - mu) / sd * gi + bi)
            floors.append(float((abs(v - mu) + abs(mu)) / sd * abs(gi) + abs(bi)))
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_rms_norm(x, scale, eps, offset=0.0):
    g = [mpmath.mpf(float(v)) + mpmath.mpf(offset) for v in scale]
    eps = mpmath.mpf(eps)
    vals = []
    for row in _mpf_rows(x):
        r = mp.sqrt(mp.fsum(v * v for v in row) / len(row) + eps)
        vals += [v / r * gi for v, gi in zip(row, g, strict=True)]
    return vals, np.zeros(len(vals)), np.ones(len(vals), bool)


def _norm_mp(row):
    return mp.sqrt(mp.fsum(v * v for v in row))


def _truth_norm(x):
    vals = [_norm_mp(row) for row in _mpf_rows(x)]
    return vals, np.zeros(len(vals)), np.ones(len(vals), bool)


def _truth_normalize(x, eps):
    vals = []
    for row in _mpf_rows(x):
        n = max(_norm_mp(row), mpmath.mpf(eps))
        vals += [v / n for v in row]
    return vals, np.zeros(len(vals)), np.ones(len(vals), bool)


def _truth_cosine(a, b, eps):
    vals, floors = [], []
    for ra, rb in zip(_mpf_rows(a), _mpf_rows(b), strict=True):
        den = max(_norm_mp(ra), mpmath.mpf(eps)) * max(_norm_mp(rb), mpmath.mpf(eps))
        d, f = _dot_parts(ra, rb)
        vals.append(d / den)
        floors.append(f / float(den))
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_entropy(p):
    vals = [-mp.fsum(v * mp.log(v) for v in row if v > 0) for row in _mpf_rows(p)]
    return vals, np.zeros(len(vals)), np.ones(len(vals), bool)


def _truth_attention(q, k, v, causal):
    B, T, N, H = q.shape
    S = k.shape[1]
    scale = 1 / mp.sqrt(H)
    vals, floors = [], []
    for bi in range(B):
        for t in range(T):
            for n in range(N):
                qv = [mpmath.mpf(float(u)) for u in q[bi, t, n]]
                keys = range(t + 1) if causal else range(S)
                s = [
                    scale * _dot_parts(qv, [mpmath.mpf(float(u)) for u in k[bi, j, n]])[0]
                    for j in keys
                ]
                m = max(s)
                e = [mp.exp(u - m) for u in s]
                tot = mp.fsum(e)
                p = [u / tot for u in e]
                for h in range(H):
                    vh = [mpmath.mpf(float(v[bi, j, n, h])) for j in keys]
                    vals.append(mp.fsum(pj * u for pj, u in zip(p, vh, strict=True)))
                    floors.append(float(mp.fsum(pj * abs(u) for pj, u in zip(p, vh, strict=True))))
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_rope(x, positions, dtype, interleaved=False, scaling=None):
    # The truth rotates x, to 50 digits, by the angle p * inv_freq as the dtype rounds it
    # (frequencies and products rounded, as in every implementation: the op's defined
    # angle; the absolute error of that rounding, growing with p, is stated in rope's
    # docstring and measured in tests/test_rope.py).
    from cannjax._src.ops.positional import rope_frequencies

    H = x.shape[-1]
    with jax.enable_x64(True):
        f = np.asarray(rope_frequencies(H, scaling=scaling, dtype=jnp.float64)).astype(dtype)
    angles = np.asarray(positions).astype(dtype)[:, None] * f[None, :]  # rounded to dtype
    mpf = [[mpmath.mpf(float(a)) for a in row] for row in angles]
    return _truth_rotation(x, [[(mp.cos(a), mp.sin(a)) for a in row] for row in mpf], interleaved)


def _truth_apply_rope(x, cos, sin, interleaved=False):
    # The given tables are exact inputs (rounded to the dtype): the truth rotates x by
    # them to 50 digits.
    T, half = cos.shape[0], cos.shape[-1]
    trig = [
        [(mpmath.mpf(float(cos[t, 0, i])), mpmath.mpf(float(sin[t, 0, i]))) for i in range(half)]
        for t in range(T)
    ]
    return _truth_rotation(x, trig, interleaved)


def _truth_rotation(x, trig, interleaved):
    """Each pair ``(a, c)`` of token ``t`` rotated by ``trig[t][i] = (cos, sin)``, to 50
    digits; the floor of each output is the size of its two terms."""
    B, T, N, H = x.shape
    half = len(trig[0])
    vals = np.empty(x.shape, object)
    floors = np.empty(x.shape)
    for b, t, n in np.ndindex(B, T, N):
        for i in range(half):
            j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            a, c = mpmath.mpf(float(x[b, t, n, j])), mpmath.mpf(float(x[b, t, n, k]))
            co, si = trig[t][i]
            vals[b, t, n, j], vals[b, t, n, k] = a * co - c * si, c * co + a * si
            floors[b, t, n, j] = float(abs(a * co) + abs(c * si))
            floors[b, t, n, k] = float(abs(c * co) + abs(a * si))
    return list(vals.ravel()), floors.ravel(), np.ones(vals.size, bool)


def _mp_log_softmax(row):
    m, s = _lse_parts(row)
    ls = mp.log(s)
    return [v - m - ls for v in row]


def _mp_divergence(lp, lq, beta):
    """The generalized JSD of ``exp(lp)`` (student) and ``exp(lq)`` (teacher): ``KL(q || p)``
    at ``beta = 0``, ``KL(p || q)`` at 1; and its floor (module docstring)."""
    p, q = [mp.exp(v) for v in lp], [mp.exp(v) for v in lq]
    if beta == 0:
        val = mp.fsum(b * (u - v) for b, u, v in zip(q, lq, lp, strict=True))
    elif beta == 1:
        val = mp.fsum(a * (v - u) for a, u, v in zip(p, lq, lp, strict=True))
    else:
        bt = mpmath.mpf(beta)
        lm = [mp.log(bt * b + (1 - bt) * a) for a, b in zip(p, q, strict=True)]
        val = bt * mp.fsum(b * (u - m) for b, u, m in zip(q, lq, lm, strict=True)) + (
            1 - bt
        ) * mp.fsum(a * (v - m) for a, v, m in zip(p, lp, lm, strict=True))
    terms = zip(p, q, lp, lq, strict=True)
    return val, 1.0 + float(mp.fsum((a + b) * (abs(u) + abs(v)) for a, b, u, v in terms))


def _truth_divergence(x, y, beta=0.0):
    vals, floors = [], []
    for rx, ry in zip(_mpf_rows(x), _mpf_rows(y), strict=True):
        v, f = _mp_divergence(_mp_log_softmax(rx), _mp_log_softmax(ry), beta)
        vals.append(v)
        floors.append(f)
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_linear_jensen_shannon(x, w, tx, tw, beta=0.5):
    W, TW = _mpf_rows(np.asarray(w).T), _mpf_rows(np.asarray(tw).T)
    vals, floors = [], []
    for rx, rt in zip(_mpf_rows(x), _mpf_rows(tx), strict=True):
        ps, pt = [_dot_parts(rx, c) for c in W], [_dot_parts(rt, c) for c in TW]
        lp = _mp_log_softmax([d for d, _ in ps])
        v, f = _mp_divergence(lp, _mp_log_softmax([d for d, _ in pt]), beta)
        vals.append(v)
        floors.append(f + 2 * max(a + b for (_, a), (_, b) in zip(ps, pt, strict=True)))
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _truth_preference(xc, xr, w, yc, yr, rc, rr, beta=0.1):
    """Per pair: DPO's loss, the chosen and the rejected log-likelihoods. Floors: a
    log-likelihood's, the sum over its tokens of linear_cross_entropy's; the loss's, 1
    plus beta times the log-likelihoods' floors and the references' magnitudes (the terms
    of the margin that cancel)."""
    W = _mpf_rows(np.asarray(w).T)

    def sequence(x, y):
        total, floor = mpmath.mpf(0), 0.0
        for rx, lab in zip(_mpf_rows(x), y, strict=True):
            if lab < 0:
                continue
            parts = [_dot_parts(rx, c) for c in W]
            logits = [p[0] for p in parts]
            m, s = _lse_parts(logits)
            total += logits[int(lab)] - m - mp.log(s)
            floor += max(p[1] for p in parts) + 1.0
        return total, floor

    vals, floors = [], []
    for x1, x2, y1, y2, a, b in zip(xc, xr, yc, yr, rc, rr, strict=True):
        (sc, fc), (sr, fr) = sequence(x1, y1), sequence(x2, y2)
        h = beta * ((sc - mpmath.mpf(float(a))) - (sr - mpmath.mpf(float(b))))
        vals += [mp.log1p(mp.exp(-h)), sc, sr]
        floors += [1.0 + beta * (fc + fr + abs(float(a)) + abs(float(b))), fc, fr]
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _preference_args(rng, mult):
    """Pairs at scales 1e-3, 1 and 30 of the hidden states; the first token a prompt."""
    B, T, V = 3 * mult, 4, 2 * _W
    scale = np.repeat([1e-3, 1.0, 30.0], mult)[:, None, None]
    xc = rng.standard_normal((B, T, _W)) * scale
    xr = rng.standard_normal((B, T, _W)) * scale
    y = rng.integers(0, V, (2, B, T))
    y[:, :, 0] = -100
    ref = rng.standard_normal((2, B)) * 3 - 10
    return (xc, xr, rng.standard_normal((_W, V)), y[0], y[1], ref[0], ref[1]), {}


def _ours_preference(xc, xr, w, yc, yr, rc, rr):
    """Per pair (the op on one pair at a time, under vmap): loss, log-likelihoods."""

    def pair(xc, xr, yc, yr, rc, rr):
        one = lambda v: v[None]  # noqa: E731
        loss, m = lookup("linear_preference_loss").fn(
            *map(one, (xc, xr)), w, *map(one, (yc, yr, rc, rr)), kind="dpo"
        )
        return jnp.stack([loss, m.chosen_logps[0], m.rejected_logps[0]])

    return jax.vmap(pair)(xc, xr, yc, yr, rc, rr).reshape(-1)


@dataclass(frozen=True)
class _Rowwise:
    op: str  # registry name
    label: str
    make: Callable[[np.random.Generator, int], tuple[tuple, dict]]  # float64 args, kwargs
    truth: Callable[..., tuple]  # (args as the dtype, kwargs) -> (values, floors, include)
    ours: Callable[..., Any]
    counterpart_name: str | None = None
    counterpart: Callable[..., Any] | None = None
    floats: tuple[int, ...] = (0,)  # which args are float arrays to round to the dtype
    truth_dtype: bool = False  # the truth also takes dtype= (it rounds as the op does)


def _x_and_mask(rng, mult):
    x = _rows(rng, mult)
    return (x,), {"where": _mask(rng, x.shape)}


def _eps_of(dtype, eps):
    return float(np.asarray(eps, dtype))


def _entropy_rows(rng, mult):
    z = _rows(rng, mult, scales=(1e-3, 1.0, 30.0), offsets=(0.0,))
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    near_one = np.full((mult, _W), 1e-9)
    near_one[:, 0] = 1 - 7e-9
    zeros = p[:mult].copy()
    zeros[:, 1::2] = 0.0
    return np.concatenate([p, near_one, zeros])


def _matrices(rng, mult):
    a = _rows(rng, mult, offsets=(0.0, 1e4))
    b = rng.standard_normal((_W, _W))
    b[:, 0] += 5.0
    return a, b


def _attention_args(rng, mult, causal):
    qs, ks, vs = [], [], []
    for sc in (1e-3, 1.0, 4.0, 30.0):
        for _ in range(mult):
            qs.append(rng.standard_normal((6, 2, 4)) * sc)
            ks.append(rng.standard_normal((6, 2, 4)) * sc)
            vs.append(rng.standard_normal((6, 2, 4)) + (1e3 if len(vs) % 2 else 0.0))
    return (np.stack(qs), np.stack(ks), np.stack(vs)), {"causal": causal}


# Llama 3.1's scaling with the original length 1024: H = 8 has frequencies in all three
# bands (kept, interpolated, divided).
_LLAMA3_SMALL = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _rope_args(rng, mult, **kwargs):
    # Magnitudes 1e-3 to 1e3; positions from 0 to 2^17 - 1 (angles up to 1.3e5 rad).
    x = np.stack(
        [rng.standard_normal((6, 2, 8)) * sc for sc in (1e-3, 1.0, 1e3) for _ in range(mult)]
    )
    return (x, np.array([0, 1, 7, 100, 4097, 131071])), kwargs


def _apply_rope_args(rng, mult, **kwargs):
    # rope's inputs, with the tables of its angles (and scaled by 1.1, as YaRN scales them).
    (x, p), _ = _rope_args(rng, mult)
    angle = p.astype(np.float64)[:, None, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    return (x, 1.1 * np.cos(angle), 1.1 * np.sin(angle)), kwargs


def _cosine_rows(rng, mult):
    a = _rows(rng, mult, scales=(1e-3, 1.0, 1e3, 1e15), offsets=(0.0, 1e4))
    b = a + rng.standard_normal(a.shape) * np.abs(a).max(-1, keepdims=True) * 1e-3
    b[::3] = rng.standard_normal(b[::3].shape) * np.abs(a[::3]).max(-1, keepdims=True)
    return a, b


def _lce_args(rng, mult):
    x = _rows(rng, mult, scales=(1e-3, 1.0, 30.0), offsets=(0.0, 10.0))
    return x, rng.standard_normal((_W, 2 * _W)), rng.integers(0, 2 * _W, len(x))


def _pair_rows(rng, mult):
    # Student and teacher rows of the same scale and offset: independent, or (every
    # other row) the student's perturbed by 1e-3 of its range (divergences near 0).
    x, y = _rows(rng, mult), _rows(rng, mult)
    near = x + rng.standard_normal(x.shape) * np.abs(x).max(-1, keepdims=True) * 1e-3
    y[::2] = near[::2]
    return x, y


def _ljsd_args(rng, mult):
    x = _rows(rng, mult, scales=(1e-3, 1.0, 30.0), offsets=(0.0, 10.0))
    tx = x[:, ::-1] + rng.standard_normal(x.shape)
    return x, rng.standard_normal((_W, 2 * _W)), tx, rng.standard_normal((_W, 2 * _W))


def _optax():
    import optax

    return optax


# Gated MLPs: y[e] = sum_f act(a_f) b_f w_down[f, e], a = x @ w_gate, b = x @ w_up.
_GATED_ACTS = {  # (act, act')
    "silu": (lambda a: a * _sigma(a), lambda a: _sigma(a) * (1 + a * _sigma(-a))),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_d),
    "gelu_erf": (lambda a: a * _ncdf(a), lambda a: _ncdf(a) + a * _npdf(a)),
}


def _truth_gated(x, wg, wu, wd, act):
    # Floor: each a_f and b_f is a sum of signed terms (|x| @ |w|), and an error in a_f
    # reaches the output through act'(a_f) b_f: sum_f |w_down[f, e]| (|act'(a_f)|
    # |x| @ |w_gate| |b_f| + |act(a_f)| |x| @ |w_up|), which is |y[e]| where nothing cancels.
    f, df = _GATED_ACTS[act]
    G, U, Dn = (_mpf_rows(np.asarray(w).T) for w in (wg, wu, wd))
    vals, floors = [], []
    for row in _mpf_rows(x):
        a, ma = zip(*(_dot_parts(row, c) for c in G), strict=True)
        b, mb = zip(*(_dot_parts(row, c) for c in U), strict=True)
        h = [f(u) * v for u, v in zip(a, b, strict=True)]
        terms = [
            float(abs(df(u)) * ra * abs(v) + abs(f(u)) * rb)
            for u, v, ra, rb in zip(a, b, ma, mb, strict=True)
        ]
        for col in Dn:
            vals.append(mp.fsum(hf * w for hf, w in zip(h, col, strict=True)))
            floors.append(sum(t * abs(float(w)) for t, w in zip(terms, col, strict=True)))
    return vals, np.asarray(floors), np.ones(len(vals), bool)


def _gated_args(rng, mult):
    # x: rows of every scale and offset; w_gate, w_up [8, 8]; w_down [8, 4].
    x = _rows(rng, mult)
    w = [rng.standard_normal((_W, n)) for n in (_W, _W, _W // 2)]
    return (x, *w)


def _gated_sweep(op, kwargs, act, counterpart_name, counterpart_act):
    def ours(*a):
        return lookup(op).fn(*a, **kwargs)

    def plain(x, wg, wu, wd):
        return (counterpart_act(x @ wg) * (x @ wu)) @ wd

    return _Rowwise(
        op,
        _label(op, kwargs),
        lambda r, m: (_gated_args(r, m), {}),
        functools.partial(_truth_gated, act=act),
        ours,
        f"{counterpart_name}(x @ w_gate) * (x @ w_up) @ w_down",
        plain,
        floats=(0, 1, 2, 3),
    )


_ROWWISE = [
    _Rowwise(
        "logsumexp",
        "logsumexp",
        lambda r, m: ((_rows(r, m),), {}),
        lambda x: _truth_logsumexp(x, np.ones(x.shape, bool)),
        lambda x: lookup("logsumexp").fn(x, axis=-1),
        "jax.nn.logsumexp",
        lambda x: jax.nn.logsumexp(x, axis=-1),
    ),
    _Rowwise(
        "logsumexp",
        "logsumexp(where=mask)",
        _x_and_mask,
        lambda x, where: _truth_logsumexp(x, where),
        lambda x, where: lookup("logsumexp").fn(x, axis=-1, where=where),
        "jax.nn.logsumexp",
        lambda x, where: jax.nn.logsumexp(x, axis=-1, where=where),
    ),
    _Rowwise(
        "softmax",
        "softmax",
        lambda r, m: ((_rows(r, m),), {}),
        lambda x: _truth_softmax(x, np.ones(x.shape, bool)),
        lambda x: lookup("softmax").fn(x, axis=-1),
        "jax.nn.softmax",
        lambda x: jax.nn.softmax(x, axis=-1),
    ),
    _Rowwise(
        "softmax",
        "softmax(where=mask)",
        _x_and_mask,
        lambda x, where: _truth_softmax(x, where),
        lambda x, where: lookup("softmax").fn(x, axis=-1, where=where),
        "jax.nn.softmax",
        lambda x, where: jax.nn.softmax(x, axis=-1, where=where),
    ),
    _Rowwise(
        "log_softmax",
        "log_softmax",
        lambda r, m: ((_rows(r, m),), {}),
        lambda x: _truth_log_softmax(x, np.ones(x.shape, bool)),
        lambda x: lookup("log_softmax").fn(x, axis=-1),
        "jax.nn.log_softmax",
        lambda x: jax.nn.log_softmax(x, axis=-1),
    ),
    _Rowwise(
        "log_softmax",
        "log_softmax(where=mask)",
        _x_and_mask,
        lambda x, where: _truth_log_softmax(x, where),
        lambda x, where: lookup("log_softmax").fn(x, axis=-1, where=where),
        "jax.nn.log_softmax",
        lambda x, where: jax.nn.log_softmax(x, axis=-1, where=where),
    ),
    _Rowwise(
        "softmax_cross_entropy",
        "softmax_cross_entropy",
        lambda r, m: (lambda x: ((x, r.integers(0, _W, len(x))), {}))(_rows(r, m)),
        _truth_cross_entropy,
        lambda x, lab: lookup("softmax_cross_entropy").fn(x, lab),
        "optax.softmax_cross_entropy_with_integer_labels",
        lambda x, lab: _optax().softmax_cross_entropy_with_integer_labels(x, lab),
    ),
    *(
        _Rowwise(
            "softmax_cross_entropy",
            f"softmax_cross_entropy({', '.join(f'{k}={v}' for k, v in kw.items() if v)})",
            lambda r, m: (lambda x: ((x, r.integers(0, _W, len(x))), {}))(_rows(r, m)),
            functools.partial(_truth_xent_options, options=options),
            lambda x, lab, kw=kw: lookup("softmax_cross_entropy").fn(x, lab, **kw),
            "optax.smooth_labels + softmax_cross_entropy (+ z-loss)",
            functools.partial(_optax_xent_options, options=options),
        )
        for options in (_XENT_SMOOTHED, _XENT_CAPPED)
        for kw in (_xent_kwargs(options),)
    ),
    _Rowwise(
        "linear_cross_entropy",
        "linear_cross_entropy",
        lambda r, m: (_lce_args(r, m), {}),
        _truth_linear_cross_entropy,
        lambda x, w, lab: lookup("linear_cross_entropy").fn(x, w, lab),
        floats=(0, 1),
    ),
    _Rowwise(
        "layer_norm",
        "layer_norm",
        lambda r, m: ((_rows(r, m), 1 + r.standard_normal(_W) * 0.3, r.standard_normal(_W)), {}),
        lambda x, g, b, eps: _truth_layer_norm(x, g, b, eps),
        lambda x, g, b, eps: lookup("layer_norm").fn(x, g, b, eps=eps),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "rms_norm",
        "rms_norm",
        lambda r, m: ((_rows(r, m), 1 + r.standard_normal(_W) * 0.3), {}),
        lambda x, g, eps: _truth_rms_norm(x, g, eps),
        lambda x, g, eps: lookup("rms_norm").fn(x, g, eps=eps),
        floats=(0, 1),
    ),
    _Rowwise(
        "rms_norm",
        "rms_norm(offset=1.0)",
        # Gemma's (1 + scale), its scale near 0.
        lambda r, m: ((_rows(r, m), r.standard_normal(_W) * 0.3), {"offset": 1.0}),
        lambda x, g, eps, offset: _truth_rms_norm(x, g, eps, offset),
        lambda x, g, eps, offset: lookup("rms_norm").fn(x, g, eps=eps, offset=offset),
        floats=(0, 1),
    ),
    _Rowwise(
        "layer_norm",
        "layer_norm(bias=None)",
        lambda r, m: ((_rows(r, m), 1 + r.standard_normal(_W) * 0.3), {}),
        lambda x, g, eps: _truth_layer_norm(x, g, np.zeros(_W), eps),
        lambda x, g, eps: lookup("layer_norm").fn(x, g, eps=eps),
        floats=(0, 1),
    ),
    _gated_sweep("swiglu", {}, "silu", "jax.nn.silu", jax.nn.silu),
    _gated_sweep("geglu", {"approximate": True}, "gelu_tanh", "jax.nn.gelu", jax.nn.gelu),
    _gated_sweep(
        "geglu",
        {"approximate": False},
        "gelu_erf",
        "jax.nn.gelu(approximate=False)",
        functools.partial(jax.nn.gelu, approximate=False),
    ),
    _Rowwise(
        "norm",
        "norm",
        lambda r, m: ((_rows(r, m),), {}),
        _truth_norm,
        lambda x: lookup("norm").fn(x, axis=-1),
        "jnp.linalg.norm",
        lambda x: jnp.linalg.norm(x, axis=-1),
    ),
    _Rowwise(
        "normalize",
        "normalize",
        lambda r, m: ((_rows(r, m),), {}),
        lambda x, eps: _truth_normalize(x, eps),
        lambda x, eps: lookup("normalize").fn(x, axis=-1, eps=eps),
    ),
    _Rowwise(
        "cosine_similarity",
        "cosine_similarity",
        lambda r, m: (_cosine_rows(r, m), {}),
        lambda a, b, eps: _truth_cosine(a, b, eps),
        lambda a, b, eps: lookup("cosine_similarity").fn(a, b, axis=-1, eps=eps),
        "optax.cosine_similarity",
        lambda a, b, eps: _optax().cosine_similarity(a, b, epsilon=eps * eps),
        floats=(0, 1),
    ),
    _Rowwise(
        "entropy",
        "entropy",
        lambda r, m: ((_entropy_rows(r, m),), {}),
        _truth_entropy,
        lambda p: lookup("entropy").fn(p, axis=-1),
        "jax.scipy.special.entr(p).sum(-1)",
        lambda p: jnp.sum(jax.scipy.special.entr(p), axis=-1),
    ),
    _Rowwise(
        "matmul",
        "matmul",
        lambda r, m: (_matrices(r, m), {}),
        _truth_matmul,
        lambda a, b: lookup("matmul").fn(a, b),
        "jnp.matmul",
        jnp.matmul,
        floats=(0, 1),
    ),
    _Rowwise(
        "linear",
        "linear",
        lambda r, m: ((*_matrices(r, m), r.standard_normal(_W) * 10), {}),
        _truth_matmul,
        lambda x, w, b: lookup("linear").fn(x, w, b),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "lora_linear",
        "lora_linear",
        lambda r, m: (_lora_args(r, m), {}),
        _truth_lora,
        lambda x, w, a, b, c: lookup("lora_linear").fn(x, w, a, b, c, scale=_LORA_SCALE),
        "x @ w + s * (x @ a) @ b + bias",
        lambda x, w, a, b, c: x @ w + _LORA_SCALE * ((x @ a) @ b) + c[None, :],
        floats=(0, 1, 2, 3, 4),
    ),
    _Rowwise(
        "attention",
        "attention",
        lambda r, m: _attention_args(r, m, False),
        _truth_attention,
        lambda q, k, v, causal: lookup("attention").fn(q, k, v, causal=causal),
        "jax.nn.dot_product_attention",
        lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "attention",
        "attention(causal=True)",
        lambda r, m: _attention_args(r, m, True),
        _truth_attention,
        lambda q, k, v, causal: lookup("attention").fn(q, k, v, causal=causal),
        "jax.nn.dot_product_attention",
        lambda q, k, v, causal: jax.nn.dot_product_attention(q, k, v, is_causal=causal),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "rope",
        "rope",
        _rope_args,
        _truth_rope,
        lambda x, p: lookup("rope").fn(x, p),
        truth_dtype=True,
    ),
    _Rowwise(
        "rope",
        "rope(interleaved=True, scaling=llama3)",
        lambda r, m: _rope_args(r, m, interleaved=True, scaling=_LLAMA3_SMALL),
        _truth_rope,
        lambda x, p, **kw: lookup("rope").fn(x, p, **kw),
        truth_dtype=True,
    ),
    _Rowwise(
        "apply_rope",
        "apply_rope",
        _apply_rope_args,
        _truth_apply_rope,
        lambda x, c, s: lookup("apply_rope").fn(x, c, s),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "apply_rope",
        "apply_rope(interleaved=True)",
        lambda r, m: _apply_rope_args(r, m, interleaved=True),
        _truth_apply_rope,
        lambda x, c, s, **kw: lookup("apply_rope").fn(x, c, s, **kw),
        floats=(0, 1, 2),
    ),
    _Rowwise(
        "kl_divergence",
        "kl_divergence",
        lambda r, m: (_pair_rows(r, m), {}),
        _truth_divergence,
        lambda x, y: lookup("kl_divergence").fn(x, y),
        "optax.kl_divergence(log_softmax(x), softmax(y))",
        lambda x, y: _optax().kl_divergence(jax.nn.log_softmax(x), jax.nn.softmax(y)),
        floats=(0, 1),
    ),
    _Rowwise(
        "jensen_shannon",
        "jensen_shannon",
        lambda r, m: (_pair_rows(r, m), {"beta": 0.5}),
        _truth_divergence,
        lambda x, y, beta: lookup("jensen_shannon").fn(x, y, beta=beta),
        floats=(0, 1),
    ),
    _Rowwise(
        "jensen_shannon",
        "jensen_shannon(beta=0.9)",
        lambda r, m: (_pair_rows(r, m), {"beta": 0.9}),
        _truth_divergence,
        lambda x, y, beta: lookup("jensen_shannon").fn(x, y, beta=beta),
        floats=(0, 1),
    ),
    _Rowwise(
        "linear_preference_loss",
        "linear_preference_loss(kind='dpo'), per pair: loss, log-likelihoods",
        _preference_args,
        _truth_preference,
        _ours_preference,
        floats=(0, 1, 2, 5, 6),
    ),
    _Rowwise(
        "linear_jensen_shannon",
        "linear_jensen_shannon",
        lambda r, m: (_ljsd_args(r, m), {}),
        _truth_linear_jensen_shannon,
        lambda x, w, tx, tw: lookup("linear_jensen_shannon").fn(x, w, tx, tw, reduction="none"),
        floats=(0, 1, 2, 3),
    ),
]

_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6, "normalize": 1e-12, "cosine_similarity": 1e-8}


def _measure_rowwise(s: _Rowwise, dtype: str, mult: int) -> dict[str, Any]:
    rng = np.random.default_rng(_seed(s.label))
    args, kwargs = s.make(rng, mult)
    args = tuple(
        np.asarray(a, dtype).astype(np.float64) if i in s.floats else np.asarray(a)
        for i, a in enumerate(args)
    )
    if s.op in _EPS:
        kwargs = {**kwargs, "eps": _eps_of(dtype, _EPS[s.op])}
    with mp.workdps(_DPS):
        extra = {"dtype": dtype} if s.truth_dtype else {}
        vals, floors, include = s.truth(*args, **kwargs, **extra)
        hi, lo = _truth(vals)
    out: dict[str, Any] = {"op": s.label, "dtype": dtype, "points": int(include.sum())}
    out["counterpart_name"] = s.counterpart_name
    with _x64(dtype):
        jargs = tuple(
            jnp.asarray(a, dtype) if i in s.floats else jnp.asarray(a) for i, a in enumerate(args)
        )
        jkw = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        fns = [("cannjax", s.ours)]
        if s.counterpart is not None:
            fns.append(("counterpart", s.counterpart))
        for who, f in fns:
            got = np.asarray(f(*jargs, **jkw), np.float64).ravel()
            err = _relative_error(got, hi, lo, floors, dtype)
            err = np.where(include, err, 0.0)
            out[who] = _summary(err, _row_inputs(args[0], len(err)), got, hi, dtype)
    return out


def _row_inputs(x, n_out):
    """For each output, the row (or batch item) of the first argument it comes from."""
    x = np.asarray(x)
    per = n_out // x.shape[0]
    rows = [
        np.array2string(r.ravel()[:16], precision=3, separator=", ", max_line_width=10**6)
        for r in x
    ]
    return [f"row {i // per}: {rows[i // per]}" for i in range(n_out)]


def _seed(label: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(label)) % 2**31


# ------------------------------------------------------------------ public entry
def _sweeps_of(name: str):
    return [s for s in _UNARY + _BINARY + _ROWWISE if s.op == name]


def _measure(s, dtype: str, mult: int) -> dict[str, Any]:
    if isinstance(s, _Unary):
        return _measure_unary(s, dtype, mult[0])
    if isinstance(s, _Binary):
        return _measure_binary(s, dtype, mult[0])
    return _measure_rowwise(s, dtype, mult[1])


@functools.cache
def _cached(name: str, dtype: str, points: str) -> tuple[dict[str, Any], ...]:
    return tuple(_measure(s, dtype, _SIZES[points]) for s in _sweeps_of(name))


def measure_accuracy(
    op: str | Callable[..., Any], dtype: Any = "float32", *, points: str = "test"
) -> list[dict[str, Any]]:
    """Measures the largest relative error of a registered operator over its domain.

    For each configuration of the operator (gelu's two forms, softmax with and without
    ``where``, ...) the sweep's inputs are rounded to ``dtype``, a 50-digit truth is
    computed with mpmath at those inputs, and the error at each output is
    ``|got - true| / max(|true|, floor)``: the floor is the dtype's smallest normal
    number, or for outputs that are sums of signed terms the magnitude of those terms,
    so it only matters near a zero of the function (``docs/ops_accuracy.md`` lists the
    rule for each operator). The same is measured for the operator's counterpart in
    jax.nn, jax.scipy.special, jnp or optax, and, for elementwise operators, for the
    first derivative (``jax.grad`` of each). The sweep is deterministic.

    Args:
      op: a registered operator: its name (``"gelu"``) or its public function.
      dtype: ``float32`` or ``float64`` (float64 runs under ``jax.enable_x64``).
      points: ``"test"`` (a few hundred points per op) or ``"benchmark"`` (a few
        thousand).

    Returns:
      One dict per configuration with keys ``op`` (a label such as
      ``"gelu(approximate=False)"``), ``dtype``, ``points``, ``counterpart_name`` (None
      without a counterpart), and ``cannjax``, ``counterpart`` and, for elementwise ops,
      ``cannjax_derivative`` and ``counterpart_derivative``: dicts with ``max_rel``,
      ``ulps`` (``max_rel / eps``), ``worst_input``, ``worst_got`` and ``worst_true``.

    Raises:
      KeyError: ``op`` is not a registered operator.
      ValueError: ``dtype`` or ``points`` is not one of the values above.

    Example:
      >>> import cannjax
      >>> (r,) = cannjax.testing.measure_accuracy("exp", "float32")
      >>> r["cannjax"]["ulps"] < 4
      True
    """
    name = lookup(op).name
    dt = np.dtype(dtype).name
    if dt not in ("float32", "float64"):
        raise ValueError(
            f"cannjax.testing.measure_accuracy: dtype must be float32 or float64, got {dtype!r}"
        )
    if points not in _SIZES:
        raise ValueError(
            f"cannjax.testing.measure_accuracy: points must be one of {sorted(_SIZES)}, "
            f"got {points!r}"
        )
    if not _sweeps_of(name):
        raise KeyError(f"cannjax.testing.measure_accuracy: no accuracy sweep for op {name!r}")
    return copy.deepcopy(list(_cached(name, dt, points)))
