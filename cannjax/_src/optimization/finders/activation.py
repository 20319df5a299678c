"""Activations recognized by what they compute, verified by evaluation.

GELU has many equal spellings: ``0.5 x (1 + tanh(c (x + 0.044715 x^3)))`` with ``c``
written as ``sqrt(2 / pi)`` or its digits, the cube as ``x**3`` or ``x * x * x``, the
product in any order; ``x sigmoid(2c (x + 0.044715 x^3))``; the exact form through
``erf(x / sqrt 2)`` or ``erfc(-x / sqrt 2)``. SiLU is ``x sigmoid(x)``, ``x / (1 + exp(-x))``
or ``x (1 + tanh(x / 2)) / 2``. The templates of :mod:`idioms` meet some; this finder
meets the others.

:func:`find_activation` takes the region of smooth elementwise algebra that ends at an
equation (sums, products, quotients, powers, roots, ``exp``, ``log``, ``tanh``,
``logistic``, ``erf``, ``erfc``, float casts, jax's ``logaddexp`` and so ``softplus``; no
comparison, select or reduction) and
reads one array ``x`` of the output's shape besides scalar constants. The region is then
a function of one real variable, analytic where it is defined; evaluated in float64
NumPy at random points, it is compared with each activation's formula. Two analytic
functions that agree at a random point are equal with probability one, so equal values
at many points mean an equal function, and equal derivatives of every order. A region
that computes something else (another constant, a missing ``1/2``) is left alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph, uniform
from cannjax._src.optimization.replacement import Kind, Replacement


def _erf(a: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(a)


def _logistic(a: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * a))


# Primitives a region may hold, as float64 NumPy functions of their operands.
_PRIMITIVES: dict[str, Callable[..., np.ndarray]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.divide,
    "neg": np.negative,
    "exp": np.exp,
    "expm1": np.expm1,
    "log": np.log,
    "log1p": np.log1p,
    "tanh": np.tanh,
    "logistic": _logistic,
    "erf": _erf,
    "erfc": lambda a: 1.0 - _erf(a),
    "sqrt": np.sqrt,
    "rsqrt": lambda a: 1.0 / np.sqrt(a),
    "square": np.square,
    "pow": np.power,
    "convert_element_type": lambda a: a,  # float casts; evaluated in float64 throughout
    "copy": lambda a: a,
}
# jax's own smooth functions that are custom_jvp calls (a rule for their derivative, a
# max and a select for their edges in the body), read as the function they compute.
# softplus(x) is logaddexp(x, 0).
_JAX_FUNCTIONS: dict[str, Callable[..., np.ndarray]] = {"logaddexp": np.logaddexp}
# A region without one of these is a polynomial or a ratio of them: no activation.
_TRANSCENDENTAL = frozenset({"exp", "expm1", "tanh", "logistic", "erf", "erfc", "logaddexp"})


def _name(e: jcore.JaxprEqn) -> str:
    """The primitive's name; for a ``custom_jvp_call`` of one of jax's own functions in
    :data:`_JAX_FUNCTIONS`, that function's name."""
    if e.primitive.name != "custom_jvp_call":
        return e.primitive.name
    info = getattr(e.params["call_jaxpr"].jaxpr, "debug_info", None)
    where = getattr(info, "func_src_info", None) or ""
    func, _, path = where.partition(" at ")
    in_jax = "/jax/_src/" in path.replace("\\", "/")
    return func if in_jax and func in _JAX_FUNCTIONS else e.primitive.name


_MAX_REGION = 24  # equations; a spelled-out GELU takes about 10
_MAX_INPUTS = 16  # candidates for x tried per anchor
# Constants written in float32 (sqrt(2 / pi) as 0.7978845608, 0.044715) move GELU by
# about 1e-9; a constant changed in its fifth digit (0.79788) moves it by 2e-7.
_RTOL = 1e-8


def _gelu_tanh64(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _gelu_erf64(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _silu64(x):
    return x * _logistic(x)


@dataclasses.dataclass(frozen=True)
class _Activation:
    op: str  # the cannjax operator
    approximate: bool | None  # gelu's form (None: silu)
    what: str  # for the report
    reference: Callable[[np.ndarray], np.ndarray]
    call: Callable[[Any], Any]


ACTIVATIONS = (
    _Activation(
        "gelu", True, "gelu, tanh form", _gelu_tanh64, lambda x: ops.gelu(x, approximate=True)
    ),
    _Activation(
        "gelu", False, "gelu, erf form", _gelu_erf64, lambda x: ops.gelu(x, approximate=False)
    ),
    _Activation("silu", None, "silu", _silu64, ops.silu),
)


@dataclasses.dataclass(frozen=True)
class _Region:
    """The equations between ``x`` and the anchor's output, and the constants they read."""

    eqns: tuple[int, ...]
    constants: dict  # var -> float, the scalar constants read


def _allowed(e: jcore.JaxprEqn, shape: tuple) -> bool:
    name = _name(e)
    if name not in _PRIMITIVES and name not in _JAX_FUNCTIONS and name != "integer_pow":
        return False
    if len(e.outvars) != 1 or tuple(e.outvars[0].aval.shape) != shape:
        return False
    if name == "convert_element_type":
        return J.is_float(e.invars[0].aval.dtype) and J.is_float(e.outvars[0].aval.dtype)
    return True


def _region(g: Graph, out: Any, x: Any) -> _Region | None:
    """The equations from ``x`` to ``out``, or None when another array than ``x`` (not a
    constant equal in every element) feeds them, or one is outside the smooth set."""
    shape = tuple(out.aval.shape)
    eqns, constants, seen, stack = set(), {}, set(), [out]
    reads_x = False
    while stack:
        v = stack.pop()
        if isinstance(v, jcore.Literal):
            continue
        if v in seen:
            continue
        seen.add(v)
        if v is x:
            reads_x = True
            continue
        c = uniform(g, v)
        if c is not None:
            constants[v] = c
            continue
        e = g.eqn_of(v)
        if e is None or not _allowed(e, shape) or len(eqns) >= _MAX_REGION:
            return None
        eqns.add(g.producer[v][0])
        stack.extend(e.invars)
    if not reads_x:
        return None
    return _Region(tuple(sorted(eqns)), constants)


def _inputs(g: Graph, out: Any) -> list:
    """Values of ``out``'s shape in the smooth elementwise region above ``out``, nearest
    first: the candidates for ``x`` (an intermediate one too: ``x`` may be ``h + b``)."""
    shape, found, seen, queue = tuple(out.aval.shape), [], {out}, [out]
    while queue and len(found) < _MAX_INPUTS:
        v = queue.pop(0)
        if v is not out and uniform(g, v) is None and J.is_float(v.aval.dtype):
            found.append(v)
        e = g.eqn_of(v)
        if e is None or not _allowed(e, shape):
            continue
        for a in e.invars:
            if isinstance(a, jcore.Var) and a not in seen and tuple(a.aval.shape) == shape:
                seen.add(a)
                queue.append(a)
    return found


def _evaluate(g: Graph, region: _Region, out: Any, x: Any, points: np.ndarray) -> np.ndarray:
    vals: dict = {x: points}
    vals.update(region.constants)

    def read(a):
        return np.float64(a.val) if isinstance(a, jcore.Literal) else vals[a]

    for i in region.eqns:
        e = g.jaxpr.eqns[i]
        args = [read(a) for a in e.invars]
        with np.errstate(all="ignore"):
            name = _name(e)
            if name == "integer_pow":
                r = np.power(args[0], float(e.params["y"]))
            elif name in _JAX_FUNCTIONS:
                r = _JAX_FUNCTIONS[name](*args)
            else:
                r = _PRIMITIVES[name](*args)
        vals[e.outvars[0]] = np.broadcast_to(np.asarray(r, np.float64), points.shape)
    return vals[out]


def _points(seed: int) -> np.ndarray:
    """Where regions are compared: random points of both signs and a few magnitudes."""
    rng = np.random.default_rng(seed)
    return np.concatenate([rng.normal(size=24) * 2.0, rng.uniform(-6.0, 6.0, size=8)])


def find_activation(g: Graph, i: int):
    """An activation ending at equation ``i``, verified by evaluation (None otherwise)."""

    found = verified_activation(g, i)
    if found is None:
        return None
    act, x, region = found
    return _replacement(Replacement, act, x, out=g.jaxpr.eqns[i].outvars[0], region=region)


def verified_activation(g: Graph, i: int):
    """``(activation, x, region)`` when equation ``i`` ends a region of smooth algebra of
    one ``x`` that equals one of :data:`ACTIVATIONS` at the sample points."""
    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in ("mul", "div", "add", "sub", "convert_element_type"):
        return None
    out = eqn.outvars[0]
    shape = tuple(out.aval.shape)
    if not J.is_float(out.aval.dtype) or not _allowed(eqn, shape):
        return None
    points = _points(i)
    for x in _inputs(g, out):
        region = _region(g, out, x)
        if region is None:
            continue
        names = {_name(g.jaxpr.eqns[k]) for k in region.eqns}
        if not names & _TRANSCENDENTAL:
            continue
        got = _evaluate(g, region, out, x, points)
        if not np.all(np.isfinite(got)):
            continue
        for act in ACTIVATIONS:
            want = act.reference(points)
            if np.allclose(got, want, rtol=_RTOL, atol=_RTOL * max(1.0, np.max(np.abs(want)))):
                return act, x, region
    return None


def _replacement(Replacement, act: _Activation, x: Any, out: Any, region: _Region):
    dtype = out.aval.dtype

    def call(x):
        return act.call(x.astype(dtype)).astype(dtype)

    source = f"{act.what} (verified by evaluation)"
    return Replacement(Kind.ACTIVATION, act.op, source, (x,), frozenset(region.eqns), out, call)
