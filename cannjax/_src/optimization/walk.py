"""Reading a jaxpr backward, for the finders that match by meaning (attention, losses,
gated MLPs): the equation that made a value, equations that pass a value through, 0-d
constants behind broadcasts, a row maximum, a soft cap ``c * tanh(x / c)``."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from cannjax._src.optimization.match import Graph
from cannjax._src.optimization.structural import _scalar


def producer(g: Graph, v) -> tuple[int, Any] | tuple[None, None]:
    """``(index, equation)`` that made ``v``, or ``(None, None)`` for an input or literal."""
    e = g.eqn_of(v)
    return (g.producer[v][0], e) if e is not None else (None, None)


def is_identity(e) -> bool:
    """Whether ``e`` passes its operand through unchanged (a copy, a same-dtype convert)."""
    if e.primitive.name in ("copy", "copy_p"):
        return True
    return (
        e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == e.outvars[0].aval.dtype
    )


def skip_identities(g: Graph, v, covered: set | None = None):
    """The value ``v`` copies (through ``copy`` and same-dtype converts)."""
    while True:
        i, e = producer(g, v)
        if e is None or not is_identity(e):
            return v
        if covered is not None:
            covered.add(i)
        v = e.invars[0]


def constant_fill(g: Graph, v) -> float | None:
    """The value of a broadcast 0-d constant ``v`` (through broadcasts and converts)."""
    while True:
        c = _scalar(g, v)
        if c is not None:
            return c
        e = g.eqn_of(v)
        if e is None or e.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            return None
        if e.primitive.name == "convert_element_type" and not np.issubdtype(
            e.outvars[0].aval.dtype, np.floating
        ):
            return None
        v = e.invars[0]


def is_upcast(e) -> bool:
    """A float-to-float convert that loses nothing (bfloat16 logits to float32)."""
    if e.primitive.name != "convert_element_type":
        return False
    a, b = e.invars[0].aval.dtype, e.outvars[0].aval.dtype
    if not (jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)):
        return False
    return jnp.finfo(b).bits >= jnp.finfo(a).bits and jnp.promote_types(a, b) == b


def is_row_max(g: Graph, c, x, axis: int, covered: set) -> bool:
    """Whether ``c`` is ``max_axis x`` (broadcast back, maybe guarded or stopped)."""
    chain = set()
    while True:
        i, e = producer(g, c)
        if e is None:
            return False
        name = e.primitive.name
        if name == "reduce_max":
            if e.invars[0] is not x or tuple(e.params["axes"]) != (axis,):
                return False
            covered.update(chain | {i})
            return True
        chain.add(i)
        if name in ("broadcast_in_dim", "stop_gradient", "reshape") or is_identity(e):
            c = e.invars[0]
        elif name == "max" and len(e.invars) == 2:  # max(-inf, m) = m
            a, b = e.invars
            if _scalar(g, a) == -np.inf:
                c = b
            elif _scalar(g, b) == -np.inf:
                c = a
            else:
                return False
        elif name == "select_n" and len(e.invars) == 3:  # where(isfinite(m), m, 0)
            pred, zero, m = e.invars
            j, fin = producer(g, pred)
            if fin is None or fin.primitive.name != "is_finite" or fin.invars[0] is not m:
                return False
            if constant_fill(g, zero) is None:
                return False
            chain.add(j)
            c = m
        else:
            return False


def soft_cap(g: Graph, e, covered: set):
    """``(c, x)`` when ``e`` is ``c * tanh(x / c)`` (or ``tanh(x * (1 / c)) * c``)."""
    for t, cv in (e.invars, e.invars[::-1]):
        c = _scalar(g, cv)
        if c is None or not c > 0:
            continue
        chain = set()
        t = skip_identities(g, t, chain)
        i, th = producer(g, t)
        if th is None or th.primitive.name != "tanh":
            continue
        u = skip_identities(g, th.invars[0], chain)
        j, d = producer(g, u)
        if d is None or d.primitive.name not in ("div", "mul"):
            continue
        x, inner = d.invars
        k = _scalar(g, inner)
        if k is None and d.primitive.name == "mul":
            x, k = d.invars[1], _scalar(g, d.invars[0])
        if k is None or k == 0:
            continue
        cap_in = k if d.primitive.name == "div" else 1.0 / k
        if not math.isclose(cap_in, c, rel_tol=1e-6):
            continue
        covered.update(chain | {i, j})
        return c, x
    return None
