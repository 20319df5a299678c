"""Questions asked of one jaxpr, in one place: who made a value, who reads it, what a
value is a view of, whether it is a square, what is upstream, and which values are
constants (and what they hold).

optimize's finders and its template matcher read programs only through this module, and
``fuse`` builds its clusters from :func:`producers`. A :class:`Graph` is the jaxpr with
its indices; the functions below take one and answer a question about a value.

A *view* of ``x`` is ``x`` read through equations that move or replicate elements without
arithmetic: broadcasts, unit reshapes (``squeeze``, ``expand_dims``) and, when asked,
transposes and copies. Its *axis map* gives, per axis of the view, the axis of ``x`` it
reads (None for a broadcast or unit axis).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J


def producers(jaxpr: jcore.Jaxpr) -> dict:
    """``var -> (equation index, output position)`` for every value an equation makes."""
    return {v: (i, k) for i, eqn in enumerate(jaxpr.eqns) for k, v in enumerate(eqn.outvars)}


@dataclasses.dataclass
class Graph:
    """A jaxpr with its producer and user indices."""

    jaxpr: jcore.Jaxpr
    producer: dict  # var -> (eqn index, output position)
    users: dict  # var -> list of eqn indices
    outvars: frozenset
    scalars: dict = dataclasses.field(default_factory=dict)  # input var -> known 0-d value
    # Equations computing from literals only (``8.0 - 0.0`` in equinox's variance): shared
    # between idioms once repeats are merged, so never part of one's match.
    constant: frozenset = frozenset()
    values: dict = dataclasses.field(default_factory=dict)  # input var -> concrete constant

    @classmethod
    def of(cls, jaxpr: jcore.Jaxpr, consts: Sequence[Any] = ()) -> Graph:
        """The graph of ``jaxpr`` whose leading inputs hold ``consts`` (tracers: unknown)."""
        users: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    users.setdefault(v, []).append(i)
        outs = frozenset(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
        # Equations whose outputs nobody reads (jax's sign of a sum in logsumexp) do not
        # count as readers.
        live = set(outs)
        for i in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[i]
            if eqn.effects or any(v in live for v in eqn.outvars):
                live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
            else:
                for v in eqn.invars:
                    if isinstance(v, jcore.Var) and i in users.get(v, ()):
                        users[v] = [u for u in users[v] if u != i]
        scalars, values = {}, {}
        for v, c in zip(jaxpr.invars, consts):
            if isinstance(c, jcore.Tracer):
                continue
            values[v] = c
            if np.ndim(c) == 0:
                scalars[v] = np.asarray(c)  # a constant such as jnp.sqrt(d)
        constant, made = set(), set()
        for i, eqn in enumerate(jaxpr.eqns):
            if not eqn.effects and all(
                isinstance(v, jcore.Literal) or v in made for v in eqn.invars
            ):
                constant.add(i)
                made.update(eqn.outvars)
        return cls(jaxpr, producers(jaxpr), users, outs, scalars, frozenset(constant), values)

    @functools.cached_property
    def differentiable(self) -> frozenset:
        """Vars that depend on a floating input that is not a known constant: the values a
        gradient can flow through."""
        out = {
            v
            for v in self.jaxpr.invars
            if jnp.issubdtype(v.aval.dtype, jnp.floating) and v not in self.values
        }
        for e in self.jaxpr.eqns:
            if any(isinstance(v, jcore.Var) and v in out for v in e.invars):
                out.update(e.outvars)
        return frozenset(out)

    def scalar(self, v) -> Any:
        """The value of ``v`` if it is a literal or a known 0-d constant, else None."""
        if isinstance(v, jcore.Literal):
            return np.asarray(v.val)
        return self.scalars.get(v)

    def eqn_of(self, v) -> jcore.JaxprEqn | None:
        """The equation that made ``v`` (None for an input or a literal)."""
        if not isinstance(v, jcore.Var) or v not in self.producer:
            return None
        return self.jaxpr.eqns[self.producer[v][0]]

    def consumers(self, v) -> list[int]:
        """Indices of the live equations that read ``v``."""
        return list(self.users.get(v, ()))

    def private(self, covered: set[int], outputs: Sequence[Any]) -> bool:
        """Whether values made by ``covered`` are read only inside it (``outputs`` aside)."""
        outs = set(outputs)
        for i in covered:
            for v in self.jaxpr.eqns[i].outvars:
                if v in outs or isinstance(v, jcore.DropVar):
                    continue
                if v in self.outvars or any(u not in covered for u in self.users.get(v, ())):
                    return False
        return True


def producer(g: Graph, v) -> tuple[int, Any] | tuple[None, None]:
    """``(index, equation)`` that made ``v``, or ``(None, None)`` for an input or literal."""
    e = g.eqn_of(v)
    return (g.producer[v][0], e) if e is not None else (None, None)


def upstream(g: Graph, i: int, names: frozenset, depth: int) -> bool:
    """Whether an equation named in ``names`` is at most ``depth`` steps upstream of ``i``
    (``i`` itself is step 0)."""
    frontier, seen = {i}, set()
    for _ in range(depth + 1):
        if any(g.jaxpr.eqns[j].primitive.name in names for j in frontier):
            return True
        seen |= frontier
        frontier = {
            g.producer[v][0]
            for j in frontier
            for v in g.jaxpr.eqns[j].invars
            if isinstance(v, jcore.Var) and v in g.producer
        } - seen
    return False


# ---------------------------------------------------------------------- pass-throughs
def is_identity(e) -> bool:
    """Whether ``e`` passes its operand through unchanged (a copy, a same-dtype convert)."""
    if e.primitive.name in ("copy", "copy_p"):
        return True
    return (
        e.primitive.name == "convert_element_type"
        and e.invars[0].aval.dtype == e.outvars[0].aval.dtype
    )


def is_upcast(e) -> bool:
    """A float-to-float convert that loses nothing (bfloat16 logits to float32)."""
    if e.primitive.name != "convert_element_type":
        return False
    a, b = e.invars[0].aval.dtype, e.outvars[0].aval.dtype
    if not (jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)):
        return False
    return jnp.finfo(b).bits >= jnp.finfo(a).bits and jnp.promote_types(a, b) == b


def skip_identities(g: Graph, v, covered: set | None = None, *, unit_products: bool = False):
    """The value ``v`` copies, through copies and same-dtype converts (and ``x * 1.0``
    when ``unit_products``: haliax multiplies weights by one); their indices go to
    ``covered``."""
    while True:
        i, e = producer(g, v)
        if e is None:
            return v
        if is_identity(e):
            v = e.invars[0]
        elif unit_products and e.primitive.name == "mul" and scalar(g, e.invars[1]) == 1.0:
            v = e.invars[0]
        elif unit_products and e.primitive.name == "mul" and scalar(g, e.invars[0]) == 1.0:
            v = e.invars[1]
        else:
            return v
        if covered is not None:
            covered.add(i)


# ---------------------------------------------------------------------- views
VIEWS = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})


def view_step(e) -> list | None:
    """For a broadcast or unit reshape (squeeze, expand_dims) equation ``e``: the input
    axis each output axis reads (None for a new or unit axis); None for any other."""
    src, out = e.invars[0], e.outvars[0]
    ins = tuple(np.shape(src.aval) if hasattr(src, "aval") else ())
    outs = tuple(out.aval.shape)
    if e.primitive.name == "broadcast_in_dim":
        inv = {d: k for k, d in enumerate(e.params["broadcast_dimensions"])}
        return [inv[a] if a in inv and ins[inv[a]] == outs[a] else None for a in range(len(outs))]
    if e.primitive.name not in VIEWS:
        return None
    if e.primitive.name == "reshape" and e.params.get("dimensions") is not None:
        return None  # a reshape that transposes first (squeeze's `dimensions` is fine)
    src_axes = [k for k, n in enumerate(ins) if n != 1]
    out_axes = [a for a, n in enumerate(outs) if n != 1]
    if [ins[k] for k in src_axes] != [outs[a] for a in out_axes]:
        return None
    step = [None] * len(outs)
    for a, k in zip(out_axes, src_axes):
        step[a] = k
    return step


def _moved_step(e) -> list | None:
    """:func:`view_step`, and also a transpose's permutation and an identity's axes."""
    if is_identity(e):
        return list(range(e.outvars[0].aval.ndim))
    if e.primitive.name == "transpose":
        return list(e.params["permutation"])
    return view_step(e)


def view(g: Graph, v: Any, *, moves: bool = False) -> tuple[Any, tuple, list]:
    """``(source, axis map, chain)``: ``v`` read from ``source`` through broadcasts and
    unit reshapes (and transposes and copies when ``moves``); ``chain`` holds the indices
    of the view's equations."""
    shape = tuple(getattr(getattr(v, "aval", None), "shape", ()))
    step_of = _moved_step if moves else view_step
    amap, chain = list(range(len(shape))), []
    while True:
        i, e = producer(g, v)
        if e is None or len(e.invars) != 1:
            break
        step = step_of(e)
        if step is None:
            break
        amap = [None if a is None else step[a] for a in amap]
        chain.append(i)
        v = e.invars[0]
    return v, tuple(None if shape[a] == 1 else m for a, m in enumerate(amap)), chain


# ---------------------------------------------------------------------- squares
SQUARES = frozenset({"square", "integer_pow", "pow", "mul"})


def squared(g: Graph, v: Any) -> Any:
    """``u`` when ``v = u^2`` in any spelling (``square``, ``integer_pow``, ``pow(u, 2)``,
    ``u * u``) and ``u`` is a var, else None."""
    e = g.eqn_of(v)
    if e is None or e.primitive.name not in SQUARES:
        return None
    name, u = e.primitive.name, e.invars[0]
    if (
        name == "square"
        or (name == "integer_pow" and e.params["y"] == 2)
        or (name == "pow" and scalar(g, e.invars[1]) == 2.0)
        or (name == "mul" and e.invars[0] is e.invars[1])
    ):
        return u if isinstance(u, jcore.Var) else None
    return None


# ---------------------------------------------------------------------- constants
def scalar(g: Graph, v) -> float | None:
    """A 0-d constant: a literal, a constant input, or computed from those (``sqrt(d)``)."""
    c = g.scalar(v)
    if c is None and getattr(getattr(v, "aval", None), "shape", None) == ():
        c = constant_value(g, v)
    return None if c is None or np.ndim(c) else float(c)


def uniform(g: Graph, v) -> float | None:
    """The value of ``v`` when it is a constant equal in every element (a 0-d constant
    broadcast, a filled array, a known input), else None."""
    w = v
    while True:  # a broadcast 0-d constant, read without evaluating anything
        c = scalar(g, w)
        if c is not None:
            return c
        e = g.eqn_of(w)
        if e is None or e.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            break
        if e.primitive.name == "convert_element_type" and not jnp.issubdtype(
            e.outvars[0].aval.dtype, jnp.floating
        ):
            break
        w = e.invars[0]
    value = None
    if isinstance(v, jcore.Var):
        if v in g.values:
            value = np.asarray(g.values[v])
        elif g.producer.get(v, (-1,))[0] in g.constant:
            value = constant_value(g, v)
    if value is None:
        return None
    value = np.asarray(value)
    # jnp's issubdtype: numpy's does not count bfloat16 (ml_dtypes) as a number.
    if value.size == 0 or not jnp.issubdtype(value.dtype, jnp.number):
        return None
    first = value.reshape(-1)[0]
    if value.size > 1 and not np.all(value == first):
        return None
    return float(first)


def constant_value(g: Graph, v) -> np.ndarray | None:
    """The value of ``v`` if it depends on no input of the program (a built mask)."""
    cache = g.__dict__.setdefault("_constants", {})
    if v not in cache:
        cache[v] = _evaluate_constant(g, v)
    return cache[v]


def _evaluate_constant(g: Graph, v) -> np.ndarray | None:
    need, eqns = {v}, []
    for e in reversed(g.jaxpr.eqns):
        if any(o in need for o in e.outvars):
            if e.effects or J.call_body(e) is not None:
                return None
            eqns.append(e)
            need.update(x for x in e.invars if isinstance(x, jcore.Var))
    if any(x in need for x in (*g.jaxpr.invars, *g.jaxpr.constvars)):
        return None
    if any(_symbolic(e) for e in eqns):
        return None  # symbolic sizes (jax.export): known only when the program runs
    eqns = eqns[::-1]
    key = _slice_key(eqns, v)
    if key not in _CONSTANTS:
        try:
            # One small program, compiled and run at plan time (concrete even when
            # optimize is called under an outer jit).
            run = jax.jit(lambda: J.eval_eqns(eqns, [], [v], [])[0]).lower().compile()
            _CONSTANTS[key] = np.asarray(run())
        except (TypeError, ValueError, jax.errors.JaxRuntimeError):  # not evaluable here
            _CONSTANTS[key] = None  # so treated as data-dependent
    return _CONSTANTS[key]


_CONSTANTS: dict = {}  # the same mask code (one per layer) is evaluated once


def _symbolic(e) -> bool:
    """Whether the equation ``e`` has a symbolic size (``jax.export``'s shape
    polymorphism) in an operand's or result's shape or in its parameters."""
    avals = [x.aval for x in (*e.invars, *e.outvars) if hasattr(x, "aval")]
    if not all(jcore.is_constant_shape(getattr(a, "shape", ())) for a in avals):
        return True
    todo = list(e.params.values())
    while todo:
        p = todo.pop()
        if isinstance(p, (tuple, list)):
            todo.extend(p)
        elif jcore.is_symbolic_dim(p):
            return True
    return False


def _slice_key(eqns, out) -> str:
    """The equations as text with their own variable numbering (equal code, equal key)."""
    names: dict = {}

    def name(x):
        if isinstance(x, jcore.Literal):
            return repr(x.val)
        return names.setdefault(x, f"v{len(names)}:{x.aval}")

    lines = [
        f"{[name(o) for o in e.outvars]}={e.primitive.name}{sorted(e.params.items())!r}"
        f"{[name(x) for x in e.invars]}"
        for e in eqns
    ]
    return "\n".join(lines) + f"->{name(out)}"
