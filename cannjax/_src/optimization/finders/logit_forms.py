"""Two shapes the softmax finders (attention, losses) read backward from a value: a row
maximum (maybe guarded against ``-inf`` rows) and a soft cap ``c * tanh(x / c)``. The
general questions (producers, pass-throughs, constants) are :mod:`core.graph`'s."""

from __future__ import annotations

import math

import numpy as np

from cannjax._src.core.graph import Graph, is_identity, producer, scalar, skip_identities, uniform


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
            if scalar(g, a) == -np.inf:
                c = b
            elif scalar(g, b) == -np.inf:
                c = a
            else:
                return False
        elif name == "select_n" and len(e.invars) == 3:  # where(isfinite(m), m, 0)
            pred, zero, m = e.invars
            j, fin = producer(g, pred)
            if fin is None or fin.primitive.name != "is_finite" or fin.invars[0] is not m:
                return False
            if uniform(g, zero) is None:
                return False
            chain.add(j)
            c = m
        else:
            return False


def soft_cap(g: Graph, e, covered: set):
    """``(c, x)`` when ``e`` is ``c * tanh(x / c)`` (or ``tanh(x * (1 / c)) * c``)."""
    for t, cv in (e.invars, e.invars[::-1]):
        c = scalar(g, cv)
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
        k = scalar(g, inner)
        if k is None and d.primitive.name == "mul":
            x, k = d.invars[1], scalar(g, d.invars[0])
        if k is None or k == 0:
            continue
        cap_in = k if d.primitive.name == "div" else 1.0 / k
        if not math.isclose(cap_in, c, rel_tol=1e-6):
            continue
        covered.update(chain | {i, j})
        return c, x
    return None
