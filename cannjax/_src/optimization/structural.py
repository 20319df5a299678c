"""Dense layers, attention and the head before a cross-entropy, matched by structure.

These idioms appear in many layouts: ``x @ w`` or, under ``jax.vmap`` of an equinox
``Linear``, ``transpose(w @ x)``; attention with heads before or after the sequence axis,
with a unit group axis (jax's grouped-query path), scaled before or after the ``q k``
product, masked by ``jnp.where`` with a large negative fill. Rather than enumerate them as
templates, the finders here read the dimension numbers of the ``dot_general`` equations
and follow each axis through transposes and unit reshapes, so a match still proves equal
math: every axis of the inputs and the output has a known role.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.optimization.match import Graph

# A fill at or below this excludes a logit from softmax exactly, in every float dtype
# (exp(fill - max) underflows to 0 for any finite logits of ordinary size).
_MASK_FILL = -1e30


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x @ w`` found at a var.

    ``x``'s last ``k`` axes contract with ``w``'s first ``k`` (flax's ``LinearGeneral``
    has ``k = 2`` for the output projection of attention); ``transposed``: ``w`` is
    ``[P, K]`` (equinox's ``Linear`` under ``vmap``).
    """

    x: Any
    w: Any
    transposed: bool
    covered: frozenset
    k: int = 1

    @property
    def features(self) -> tuple:
        """The trailing output axes ``w`` contributes."""
        shape = tuple(self.w.aval.shape)
        return shape[:1] if self.transposed else shape[self.k :]


def _dims(eqn):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _plain_precision(eqn) -> bool:
    pref = eqn.params.get("preferred_element_type")
    out = eqn.outvars[0].aval.dtype
    ins = {v.aval.dtype for v in eqn.invars}
    return (pref is None or pref == out) and ins == {out}


def linear_at(g: Graph, v: Any) -> Linear | None:
    """``v = x @ w`` (``x``'s trailing axes against ``w``'s leading ones), or None."""
    e = g.eqn_of(v)
    if e is None:
        return None
    i = g.producer[v][0]
    if e.primitive.name == "dot_general" and _plain_precision(e):
        lc, rc, lb, rb = _dims(e)
        x, w = e.invars
        k, r = len(lc), x.aval.ndim
        if lb or rb or not 1 <= k < w.aval.ndim or lc != tuple(range(r - k, r)):
            return None
        if rc == tuple(range(k)):
            return Linear(x, w, False, frozenset({i}), k)
        if w.aval.ndim == 2 and rc == (1,):
            return Linear(x, w, True, frozenset({i}))
        return None
    if e.primitive.name == "transpose":
        (u,) = e.invars
        d = g.eqn_of(u)
        if d is None or d.primitive.name != "dot_general" or not _plain_precision(d):
            return None
        lc, rc, lb, rb = _dims(d)
        w, x = d.invars
        r = x.aval.ndim
        perm = tuple(e.params["permutation"])
        if lb or rb or w.aval.ndim != 2 or rc != (r - 1,) or perm != (*range(1, r), 0):
            return None
        return Linear(x, w, lc == (1,), frozenset({i, g.producer[u][0]}))
    return None


def _bias_source(g: Graph, v: Any, features: tuple) -> tuple[Any, frozenset] | None:
    """The ``features``-shaped array ``v`` broadcasts along its trailing axes, and the chain."""
    chain, nf = set(), len(features)
    while True:
        shape = tuple(getattr(getattr(v, "aval", None), "shape", ()))
        if len(shape) < nf or shape[len(shape) - nf :] != features:
            return None
        if any(s != 1 for s in shape[: len(shape) - nf]):
            return None
        if len(shape) == nf:
            return (v, frozenset(chain)) if isinstance(v, jcore.Var) else None
        e = g.eqn_of(v)
        if e is None or e.primitive.name not in ("reshape", "broadcast_in_dim"):
            return None
        src = e.invars[0]
        if e.primitive.name == "broadcast_in_dim":
            dims = tuple(e.params["broadcast_dimensions"])
            if dims != tuple(range(len(shape) - src.aval.ndim, len(shape))):
                return None
        chain.add(g.producer[v][0])
        v = src


def _linear_call(lin: Linear, has_bias: bool):
    transposed, k = lin.transposed, lin.k

    def call(x, w, *b):
        if transposed:
            w = w.T
        lead, feats = x.shape[: x.ndim - k], w.shape[k:]
        x2 = x.reshape(*lead, -1)
        w2 = w.reshape(x2.shape[-1], -1)
        b2 = tuple(bi.reshape(-1) for bi in b) if has_bias else ()
        return ops.linear(x2, w2, *b2).reshape(*lead, *feats)

    return call


def find_dense(g: Graph, i: int):
    """A dense layer ending at equation ``i``: ``add(x @ w, bias)`` or ``x @ w``."""
    from cannjax._src.optimization.rewrite import Replacement

    eqn = g.jaxpr.eqns[i]
    out = eqn.outvars[0]
    if eqn.primitive.name == "add" and J.is_float(out.aval.dtype):
        for a, b in (eqn.invars, eqn.invars[::-1]):
            lin = linear_at(g, a)
            if lin is None or a.aval.shape != out.aval.shape:
                continue
            bias = _bias_source(g, b, lin.features)
            if bias is None:
                continue
            return Replacement(
                "dense",
                "linear",
                "x @ w + b",
                (lin.x, lin.w, bias[0]),
                lin.covered | bias[1] | {i},
                out,
                _linear_call(lin, True),
            )
        return None
    if eqn.primitive.name in ("dot_general", "transpose"):
        lin = linear_at(g, out)
        if lin is None or max(lin.covered) != i:
            return None
        # A product followed by a bias add is found at the add.
        users = g.users.get(out, ())
        if len(users) == 1 and find_dense(g, users[0]) is not None:
            return None
        return Replacement(
            "dense", "linear", "x @ w", (lin.x, lin.w), lin.covered, out, _linear_call(lin, False)
        )
    return None


# ---------------------------------------------------------------------- attention
def arrange(x: Any, axes: Sequence[int | None], xp: Any = jnp) -> Any:
    """``x`` with axes ``axes`` in that order (None: a new unit axis); others are squeezed."""
    present = [a for a in axes if a is not None]
    rest = [a for a in range(x.ndim) if a not in present]
    y = xp.transpose(x, (*present, *rest)).reshape([x.shape[a] for a in present])
    return y.reshape([1 if a is None else x.shape[a] for a in axes])


def _unit_reshape(roles: list, in_shape, out_shape) -> list | None:
    """Roles after a reshape that only adds or drops unit axes (None if it does more)."""
    src = [(r, s) for r, s in zip(roles, in_shape) if s != 1]
    if [s for _, s in src] != [s for s in out_shape if s != 1]:
        return None
    it = iter(src)
    return [("u",) if s == 1 else next(it)[0] for s in out_shape]


def _scalar(g: Graph, v) -> float | None:
    """A 0-d constant: a literal, a constant input, or computed from those (``sqrt(d)``)."""
    c = g.scalar(v)
    if c is None and getattr(getattr(v, "aval", None), "shape", None) == ():
        c = _constant_value(g, v)
    return None if c is None or np.ndim(c) else float(c)


def _fill(g: Graph, v) -> bool:
    """Whether ``v`` is a broadcast constant at or below :data:`_MASK_FILL`."""
    while True:
        c = _scalar(g, v)
        if c is not None:
            return c <= _MASK_FILL
        e = g.eqn_of(v)
        if e is None or e.primitive.name not in ("broadcast_in_dim", "convert_element_type"):
            return False
        v = e.invars[0]


def _constant_value(g: Graph, v) -> np.ndarray | None:
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
    eqns = eqns[::-1]
    key = _slice_key(eqns, v)
    if key not in _CONSTANTS:
        try:
            # One small program, compiled and run at plan time (concrete even when
            # optimize is called under an outer jit).
            run = jax.jit(lambda: J.eval_eqns(eqns, [], [v], [])[0]).lower().compile()
            _CONSTANTS[key] = np.asarray(run())
        except Exception:  # noqa: BLE001 -- not evaluable here: treat as data-dependent
            _CONSTANTS[key] = None
    return _CONSTANTS[key]


_CONSTANTS: dict = {}  # the same mask code (one per layer) is evaluated once


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


def find_attention(g: Graph, i: int, softmax_at):
    """``softmax(scale * q k^T [masked]) v`` ending at the ``dot_general`` equation ``i``.

    ``softmax_at(g, var)`` returns ``(axis, input var, covered)`` when ``var`` is the
    output of a softmax over one axis.
    """
    from cannjax._src.optimization.rewrite import Replacement

    pv = g.jaxpr.eqns[i]
    if pv.primitive.name != "dot_general" or not _plain_precision(pv):
        return None
    lc, rc, lb, rb = _dims(pv)
    if len(lc) != 1:
        return None
    for p_side in (0, 1):
        p_var, v_var = pv.invars[p_side], pv.invars[1 - p_side]
        pc, vc = (lc, rc)[p_side][0], (lc, rc)[1 - p_side][0]
        pb, vb = (lb, rb)[p_side], (lb, rb)[1 - p_side]
        if not isinstance(p_var, jcore.Var):
            continue
        sm = softmax_at(g, p_var)
        if sm is None or sm[0] != pc:
            continue
        found = _attention_core(g, sm, pc, pb, vc, vb, p_side, v_var, pv)
        if found is None:
            continue
        inputs, covered, call = found
        return Replacement(
            "attention", "attention", "softmax(q k^T) v", inputs, covered | {i}, pv.outvars[0], call
        )
    return None


def _attention_core(g, sm, pc, pb, vc, vb, p_side, v_var, pv):
    axis, s, sm_covered = sm
    chain, covered, cur = [], set(sm_covered), s
    while True:  # walk back from the softmax input to the q k^T product
        e = g.eqn_of(cur)
        if e is None:
            return None
        idx = g.producer[cur][0]
        name = e.primitive.name
        if name == "dot_general":
            qk = e
            covered.add(idx)
            break
        if name in ("mul", "div") and len(e.invars) == 2:
            c = _scalar(g, e.invars[1])
            other = e.invars[0]
            if c is None and name == "mul":
                c, other = _scalar(g, e.invars[0]), e.invars[1]
            if c is None or c == 0.0:
                return None
            chain.append(("scale", c if name == "mul" else 1.0 / c))
            cur = other
        elif name == "transpose":
            chain.append(("perm", tuple(e.params["permutation"])))
            cur = e.invars[0]
        elif name == "reshape":
            chain.append(("reshape", tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)))
            cur = e.invars[0]
        elif name == "select_n" and len(e.invars) == 3 and _fill(g, e.invars[1]):
            chain.append(("mask", e.invars[0]))
            cur = e.invars[2]
        else:
            return None
        covered.add(idx)
    if not _plain_precision(qk):
        return None
    qlc, qrc, qlb, qrb = _dims(qk)
    if len(qlc) != 1 or len(qlb) > 2:
        return None
    a_var, b_var = qk.invars
    nb = len(qlb)
    roles = [("b", k) for k in range(nb)]
    roles += [("A", d) for d in range(a_var.aval.ndim) if d not in (*qlc, *qlb)]
    roles += [("B", d) for d in range(b_var.aval.ndim) if d not in (*qrc, *qrb)]
    scale, masks = 1.0, []
    for step in reversed(chain):
        if step[0] == "scale":
            scale *= step[1]
        elif step[0] == "perm":
            roles = [roles[p] for p in step[1]]
        elif step[0] == "reshape":
            roles = _unit_reshape(roles, step[1], step[2])
            if roles is None:
                return None
        else:
            masks.append((step[1], list(roles)))
    if not scale > 0:  # a negative scale after a mask would turn its fill into +large
        return None
    shape = s.aval.shape
    key_role = roles[axis]
    if key_role[0] not in ("A", "B"):
        return None
    q_side = "A" if key_role[0] == "B" else "B"
    q_var, k_var = (a_var, b_var) if q_side == "A" else (b_var, a_var)
    q_con, k_con = (qlc[0], qrc[0]) if q_side == "A" else (qrc[0], qlc[0])
    q_bat, k_bat = (qlb, qrb) if q_side == "A" else (qrb, qlb)
    free = [(r, n) for r, n in zip(roles, shape) if r[0] in ("A", "B") and r != key_role]
    t_roles = [r for r, n in free if r[0] == q_side and n != 1]
    if len(t_roles) > 1 or any(n != 1 for r, n in free if r not in t_roles):
        return None  # every free axis but T and S must be a unit axis
    # The probabilities feed the second product unchanged: same axes as s.
    p_roles = roles
    if sorted(p_roles[a] for a in pb) != [("b", k) for k in range(nb)]:
        return None
    for a, r in enumerate(p_roles):
        if a != pc and a not in pb and r[0] in ("A", "B") and r not in t_roles and shape[a] != 1:
            return None
    t_axis = t_roles[0][1] if t_roles else None  # axis of q
    batch_of = {("b", k): (q_bat[k], k_bat[k]) for k in range(nb)}
    v_batch = {p_roles[a]: vb[j] for j, a in enumerate(pb)}
    v_free = [d for d in range(v_var.aval.ndim) if d != vc and d not in vb]
    v_h = [d for d in v_free if v_var.aval.shape[d] != 1]
    if len(v_h) > 1:
        return None
    bb = [("b", k) for k in range(nb)] + [None] * (2 - nb)
    q_axes = [
        batch_of[bb[0]][0] if bb[0] else None,
        t_axis,
        batch_of[bb[1]][0] if bb[1] else None,
        q_con,
    ]
    k_axes = [
        batch_of[bb[0]][1] if bb[0] else None,
        key_role[1],
        batch_of[bb[1]][1] if bb[1] else None,
        k_con,
    ]
    v_axes = [
        v_batch[bb[0]] if bb[0] else None,
        vc,
        v_batch[bb[1]] if bb[1] else None,
        v_h[0] if v_h else None,
    ]
    # Masks: each arranged to [B, N, T, S]; a mask built from shapes alone that is the
    # causal triangle becomes causal=True (blocks above the diagonal are skipped).
    mask_specs, causal = [], False
    for pred, mroles in masks:
        pos = {r: a for a, r in enumerate(mroles)}
        axes4 = [pos.get(bb[0]) if bb[0] else None, pos.get(bb[1]) if bb[1] else None,
                 pos.get(t_roles[0]) if t_roles else None, pos.get(key_role)]  # fmt: skip
        if axes4[3] is None:
            return None
        const = _constant_value(g, pred)
        if const is not None:
            m4 = arrange(const, axes4, np)
            tq, sk = m4.shape[2], m4.shape[3]
            if np.array_equal(m4, np.broadcast_to(np.tril(np.ones((tq, sk), bool)), m4.shape)):
                causal = True
                continue
        mask_specs.append((pred, axes4))
    if not g.private(covered | {g.producer[pv.outvars[0]][0]}, [pv.outvars[0]]):
        return None
    # Output axes of the second product: its batch axes, then P's free axes, then v's.
    o_roles = [p_roles[a] for a in pb]
    p_free = [("P", a) for a in range(len(shape)) if a != pc and a not in pb]
    v_free_r = [("V", d) for d in v_free]
    o_roles += (p_free + v_free_r) if p_side == 0 else (v_free_r + p_free)
    o_src = []  # for each output axis: the axis of [B, T, N, H] it holds, None for a unit
    for r in o_roles:
        if r[0] == "b":
            o_src.append(0 if r == bb[0] else 2)
        elif r[0] == "P":
            o_src.append(1 if p_roles[r[1]] in t_roles else None)
        else:
            o_src.append(3 if r[1] in v_h else None)

    def call(q, k, v, *preds):
        q4, k4, v4 = arrange(q, q_axes), arrange(k, k_axes), arrange(v, v_axes)
        mask = None
        for p, (_, axes4) in zip(preds, mask_specs):
            m = arrange(p, axes4)
            mask = m if mask is None else jnp.logical_and(mask, m)
        o4 = ops.attention(q4, k4, v4, causal=causal, mask=mask, scale=scale)
        return arrange(o4, o_src)

    inputs = (q_var, k_var, v_var, *[p for p, _ in mask_specs])
    return inputs, covered, call
