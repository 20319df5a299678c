"""Spelling fuzzer for cannjax.optimize's norm and activation finders: equal spellings found,
mutants not.

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

Each case is the loss ``sum(norm(x, g, b) * w)``; printed per kind: spellings
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
}
# The operator each kind is substituted by (the report's op).
OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
    "gelu_tanh": "gelu",
    "gelu_erf": "gelu",
    "silu": "silu",
}


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


@dataclasses.dataclass(frozen=True)
class Outcome:
    spelling: Spelling
    substituted: tuple[str, ...]  # the operators optimize put in
    error: float  # largest relative difference of value, gradient and JVP, float64


def check(spelling: Spelling, seed: int = 0) -> Outcome:
    """What optimize does with ``spelling``'s loss, and how far it moves its derivatives."""
    x, g, b, w = inputs(seed)

    def loss(x, g, b):
        return jnp.sum(spelling.fn(x, g, b) * w)

    with jax.numpy_rank_promotion("allow"):
        report = cannjax.inspect.optimize(loss, x, g, b)
        opt = cannjax.optimize(loss)
        with jax.enable_x64(True):
            a64 = tuple(jnp.asarray(a, jnp.float64) for a in (x, g, b))
            t = tuple(
                jnp.asarray(np.random.default_rng(seed + 7).normal(size=a.shape)) for a in a64
            )
            results = [
                jax.jit(
                    lambda *a, f=f: (jax.value_and_grad(f, (0, 1, 2))(*a), jax.jvp(f, a, t)[1])
                )(*a64)
                for f in (opt, loss)
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
        found = OPS[o.spelling.kind] in o.substituted
        if o.spelling.mutant is not None:  # any norm or activation put in counts
            found = bool(set(o.substituted) & set(OPS.values()))
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
