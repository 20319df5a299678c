"""Gated MLPs found by meaning: ``(act(x @ w_gate) * (x @ w_up)) @ w_down``.

Llama-family models (transformers, penzai, haliax, equinox) write the SwiGLU block as three
projections of one ``x``, an activation of the first, a product, and the down projection;
Gemma uses the tanh gelu (GeGLU). Found at the down projection, with each projection read
as ``x @ w`` in any of the dense finder's layouts (``[in, out]`` weights or ``[out, in]``)
and the activation matched by its templates (``jax.nn.silu``, ``x * sigmoid(x)``,
``jax.nn.gelu`` in both forms), the block becomes one :func:`cannjax.ops.swiglu` or
:func:`cannjax.ops.geglu`, whose backward keeps ``x @ w_gate`` and ``x @ w_up`` and
recomputes the rest.

Under ``jax.vmap`` of a per-token equinox block (``down(silu(gate(t)) * up(t))``) the
hidden features come first: the projections are ``w @ x`` of shape ``[F, ...]``, the
down projection contracts that leading axis and ``vmap`` moves its output's features
last with a transpose. That layout is read too (each axis's role checked from the
dimension numbers), and the operator's ``[..., D]`` result stands for the transpose.
"""

from __future__ import annotations

import functools

from cannjax import ops
from cannjax._src.core.graph import Graph, producer, skip_identities
from cannjax._src.optimization import idioms
from cannjax._src.optimization.finders import activation
from cannjax._src.optimization.finders.dense import Linear, linear_at, promoted
from cannjax._src.optimization.replacement import Kind, Replacement
from cannjax._src.optimization.templates import IdiomMatch, match_idiom

_ACTIVATION = {a.op: a for a in idioms.ACTIVATIONS if a.op in ("silu", "gelu")}


def _projection(g: Graph, v, covered: set):
    """The :class:`Linear` ``v = x @ w`` over ``x``'s last axis (through copies, which
    penzai inserts; their equations join ``covered``)."""
    lin = linear_at(g, skip_identities(g, v, covered))
    if lin is None or lin.k != 1 or lin.w.aval.ndim != 2:
        return None
    return lin


def _dot(g: Graph, v):
    """``(index, w, x, w's contracted axis, x's contracted axis)`` when ``v`` is a
    ``dot_general`` of a 2-d ``w`` (first operand) with ``x``, one axis each, no batch
    axes, at the operands' precision; else None."""
    i, e = producer(g, v)
    if e is None or e.primitive.name != "dot_general":
        return None
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    w, x = e.invars
    pref = e.params.get("preferred_element_type")
    same = {w.aval.dtype, x.aval.dtype} == {v.aval.dtype} and pref in (None, v.aval.dtype)
    if lb or rb or len(lc) != 1 or w.aval.ndim != 2 or not same:
        return None
    return i, w, x, lc[0], rc[0]


def _leading_projection(g: Graph, v, covered: set):
    """``v = moveaxis(x @ w, -1, 0)``, written ``w @ x``: ``[F, ...]`` from ``x [..., D]``
    (equinox's ``Linear`` under ``vmap``, ``w [F, D]``; or ``w [D, F]``), as a Linear."""
    found = _dot(g, skip_identities(g, v, covered))
    if found is None:
        return None
    i, w, x, wc, xc = found
    if xc != x.aval.ndim - 1:
        return None
    return Linear(x, w, wc == 1, frozenset({i}))


def _leading_down(g: Graph, i: int):
    """``(hidden, Linear)`` when equation ``i`` is ``transpose(w @ hidden)`` that puts the
    leading output axis last, ``hidden`` being ``[F, ...]`` and ``w`` contracting ``F``:
    the down projection of a features-leading block."""
    e = g.jaxpr.eqns[i]
    if e.primitive.name != "transpose":
        return None
    found = _dot(g, e.invars[0])
    if found is None:
        return None
    j, w, h, wc, hc = found
    r = h.aval.ndim
    if hc != 0 or tuple(e.params["permutation"]) != (*range(1, r), 0):
        return None
    return h, Linear(h, w, wc == 1, frozenset({i, j}))


def _activation(g: Graph, u):
    """``(a, op)`` when ``u`` is silu(a) or gelu(a): the gated operator it makes and ``a``."""

    i, e = producer(g, u)
    if e is None:
        return None
    for name, idiom in _ACTIVATION.items():
        found = match_idiom(g, i, idiom)
        if not isinstance(found, IdiomMatch):
            continue
        cand, m = found.candidate, found.match
        if len(m.inputs) != 1:
            continue
        if name == "silu":
            return m.inputs[0], ops.swiglu, "silu", m.covered
        approximate = cand.replace.keywords.get("approximate", True)
        op = functools.partial(ops.geglu, approximate=approximate)
        return m.inputs[0], op, "gelu" if approximate else "gelu (erf)", m.covered
    verified = activation.verified_activation(g, i)  # spelled out: x / (1 + exp(-x)), ...
    if verified is None:
        return None
    act, a, region = verified
    if act.op == "silu":
        return a, ops.swiglu, "silu", frozenset(region.eqns)
    op = functools.partial(ops.geglu, approximate=act.approximate)
    return a, op, "gelu" if act.approximate else "gelu (erf)", frozenset(region.eqns)


def find_gated_mlp(g: Graph, i: int):
    """A gated MLP whose down projection is equation ``i`` (or ends there)."""
    copies: set = set()
    out = g.jaxpr.eqns[i].outvars[0]
    down = _projection(g, out, copies)
    if down is not None and max(down.covered) == i:
        return _block(g, i, down, skip_identities(g, down.x, copies), _projection, copies)
    leading = _leading_down(g, i)
    if leading is not None:
        hidden, down = leading
        hidden = skip_identities(g, hidden, copies)
        return _block(g, i, down, hidden, _leading_projection, copies)
    return None


def _block(g: Graph, i: int, down: Linear, hidden, projection, copies: set):
    """The replacement of the block whose down projection ``down`` (ending at equation
    ``i``) reads ``hidden``, with the gate and up projections read by ``projection``."""

    j, mul = producer(g, hidden)
    if mul is None or mul.primitive.name != "mul":
        return None
    for u, b in (mul.invars, mul.invars[::-1]):
        act = _activation(g, u)  # a template may end in a copy (jax's erf gelu) or not
        if act is None:
            act = _activation(g, skip_identities(g, u, copies))
        if act is None:
            continue
        a, op, act_name, act_covered = act
        gate, up = projection(g, a, copies), projection(g, b, copies)
        if gate is None or up is None:
            continue
        if skip_identities(g, gate.x) is not skip_identities(g, up.x):
            continue
        if tuple(a.aval.shape) != tuple(b.aval.shape):
            continue
        # Products of a float32 activation and bfloat16 weights (a policy's cast
        # parameters): the block runs on the operands promoted to that one dtype.
        promotions = {lin.dtype for lin in (gate, up, down)} - {None}
        if len(promotions) > 1:
            continue
        dtype = next(iter(promotions), None)
        trans = (gate.transposed, up.transposed, down.transposed)
        out = g.jaxpr.eqns[i].outvars[0]

        def call(x, wg, wu, wd, op=op, trans=trans, dtype=dtype, out_dtype=out.aval.dtype):
            x, wg, wu, wd = promoted(dtype, x, wg, wu, wd)
            wg, wu, wd = (w.T if t else w for w, t in zip((wg, wu, wd), trans))
            return op(x, wg, wu, wd).astype(out_dtype)

        covered = down.covered | gate.covered | up.covered | act_covered | copies | {j}
        source = f"{act_name}(x @ w_gate) * (x @ w_up) @ w_down"
        op_name = "swiglu" if act_name == "silu" else "geglu"
        inputs = (gate.x, gate.w, up.w, down.w)  # up.x is gate.x or a copy of it
        return Replacement(Kind.GATED, op_name, source, inputs, frozenset(covered), out, call)
    return None
