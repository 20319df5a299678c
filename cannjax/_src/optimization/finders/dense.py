"""Dense layers and the head before a cross-entropy, matched by structure.

Dense layers appear in many layouts: ``x @ w`` or, under ``jax.vmap`` of an equinox
``Linear``, ``transpose(w @ x)``; flax's ``LinearGeneral`` contracts two axes. Rather than
enumerate them as templates, the finder reads the dimension numbers of the
``dot_general`` equations and follows each axis through transposes, so a match still
proves equal math: every axis of the inputs and the output has a known role. The axis
helpers here (:func:`arrange`, constants evaluated at plan time) also serve the attention
finder (:mod:`cannjax._src.optimization.finders.attention`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph
from cannjax._src.optimization.replacement import Kind, Replacement


@dataclasses.dataclass(frozen=True)
class Linear:
    """``y = x @ w`` found at a var.

    ``x``'s last ``k`` axes contract with ``w``'s first ``k`` (flax's ``LinearGeneral``
    has ``k = 2`` for the output projection of attention); ``transposed``: ``w`` is
    ``[P, K]`` (equinox's ``Linear`` under ``vmap``). ``dtype``: None when ``x`` and ``w``
    have the product's dtype; else the product's (wider) dtype, to which the narrower
    operand is promoted (:func:`_promoted_precision`).
    """

    x: Any
    w: Any
    transposed: bool
    covered: frozenset
    k: int = 1
    dtype: Any = None

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


def _promoted_precision(eqn) -> bool:
    """One operand of the output's dtype and the other a narrower float, accumulated in
    the output's dtype: a float32 activation times a bfloat16 weight, as ``jnp.einsum``
    and ``jnp.matmul`` write it (a model whose parameters are cast to bfloat16 while its
    norms return float32: penzai, dm-haiku). The product converts the narrower operand
    exactly, so it equals the product of both operands promoted to the output's dtype."""
    out = eqn.outvars[0].aval.dtype
    ins = [v.aval.dtype for v in eqn.invars]
    return (
        eqn.params.get("preferred_element_type") == out
        and out in ins
        and len(set(ins)) == 2
        and all(J.is_float(d) and jnp.promote_types(d, out) == out for d in ins)
    )


def _promotion(eqn) -> Any:
    """The product's dtype when its operands are promoted to it, else None."""
    return eqn.outvars[0].aval.dtype if _promoted_precision(eqn) else None


def promoted(dtype: Any, *arrays: Any) -> tuple:
    """``arrays`` converted to ``dtype`` (None: as they are)."""
    return arrays if dtype is None else tuple(a.astype(dtype) for a in arrays)


def _half_accumulated(eqn) -> bool:
    """Half-precision operands of one dtype, accumulated in and returned as float32:
    what a bfloat16 model's attention logits are (flax's ``dot_product_attention``), and
    what ``cannjax.ops.attention`` computes for half inputs."""
    out = eqn.outvars[0].aval.dtype
    ins = {v.aval.dtype for v in eqn.invars}
    return (
        len(ins) == 1
        and jnp.dtype(next(iter(ins))).itemsize == 2
        and eqn.params.get("preferred_element_type") == out == jnp.float32
    )


def linear_at(g: Graph, v: Any) -> Linear | None:
    """``v = x @ w`` (``x``'s trailing axes against ``w``'s leading ones), or None."""
    e = g.eqn_of(v)
    if e is None:
        return None
    i = g.producer[v][0]
    if e.primitive.name == "dot_general" and (_plain_precision(e) or _promoted_precision(e)):
        lc, rc, lb, rb = _dims(e)
        x, w = e.invars
        k, r = len(lc), x.aval.ndim
        if lb or rb or not 1 <= k < w.aval.ndim or lc != tuple(range(r - k, r)):
            return None
        if rc == tuple(range(k)):
            return Linear(x, w, False, frozenset({i}), k, _promotion(e))
        if w.aval.ndim == 2 and rc == (1,):
            return Linear(x, w, True, frozenset({i}), dtype=_promotion(e))
        return None
    if e.primitive.name == "transpose":
        (u,) = e.invars
        d = g.eqn_of(u)
        if d is None or d.primitive.name != "dot_general":
            return None
        if not (_plain_precision(d) or _promoted_precision(d)):
            return None
        lc, rc, lb, rb = _dims(d)
        w, x = d.invars
        r = x.aval.ndim
        perm = tuple(e.params["permutation"])
        if lb or rb or w.aval.ndim != 2 or rc != (r - 1,) or perm != (*range(1, r), 0):
            return None
        return Linear(x, w, lc == (1,), frozenset({i, g.producer[u][0]}), dtype=_promotion(d))
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
    transposed, k, dtype = lin.transposed, lin.k, lin.dtype

    def call(x, w, *b):
        x, w = promoted(dtype, x, w)
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
                Kind.DENSE,
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
        if lin is None and eqn.primitive.name == "dot_general":
            return _reordered_product(eqn, i)
        if lin is None or max(lin.covered) != i:
            return None
        # A product followed by a bias add is found at the add.
        users = g.consumers(out)
        if len(users) == 1 and find_dense(g, users[0]) is not None:
            return None
        return Replacement(
            Kind.DENSE,
            "linear",
            "x @ w",
            (lin.x, lin.w),
            lin.covered,
            out,
            _linear_call(lin, False),
        )
    return None


def _reordered_product(eqn, i: int):
    """``dot_general`` without batch axes in any other layout, as ``x @ w``.

    haliax contracts a weight's trailing axes (``[out..., in...]``); equinox's ``Linear``
    under ``jax.vmap`` puts the weight first (``w @ x`` with the features leading). The
    operand with more free axes is ``x``; both are transposed so the contracted axes meet
    (pair by pair, as the equation pairs them), and the result is laid out as the
    equation's output (``lhs`` free axes, then ``rhs``'s).
    """

    lc, rc, lb, rb = _dims(eqn)
    a, b = eqn.invars
    if lb or rb or not lc or not J.is_float(a.aval.dtype):
        return None
    if not (_plain_precision(eqn) or _promoted_precision(eqn)):
        return None
    if not all(isinstance(v, jcore.Var) for v in (a, b)):
        return None
    a_free = [d for d in range(a.aval.ndim) if d not in lc]
    b_free = [d for d in range(b.aval.ndim) if d not in rc]
    if not b_free:  # a contraction to a vector of rows: no weight to speak of
        return None
    x_is_a = len(a_free) >= len(b_free)
    (x, xc, xf), (w, wc, wf) = ((a, lc, a_free), (b, rc, b_free))[:: 1 if x_is_a else -1]
    lead = [x.aval.shape[d] for d in xf]
    feats = [w.aval.shape[d] for d in wf]
    dtype = _promotion(eqn)

    def call(xv, wv):
        xv, wv = promoted(dtype, xv, wv)
        x2 = jnp.transpose(xv, (*xf, *xc)).reshape(*lead, -1)
        w2 = jnp.transpose(wv, (*wc, *wf)).reshape(x2.shape[-1], -1)
        y = ops.linear(x2, w2).reshape(*lead, *feats)
        if x_is_a:
            return y
        nl, nf = len(lead), len(feats)
        return jnp.transpose(y, (*range(nl, nl + nf), *range(nl)))

    source = "x @ w (axes reordered)" if x_is_a else "w @ x (axes reordered)"
    return Replacement(Kind.DENSE, "linear", source, (x, w), frozenset({i}), eqn.outvars[0], call)


# ------------------------------------------------------ axes (shared with attention.py)
def arrange(x: Any, axes: Sequence[int | None], xp: Any = jnp) -> Any:
    """``x`` with axes ``axes`` in that order (None: a new unit axis); others are squeezed."""
    present = [a for a in axes if a is not None]
    rest = [a for a in range(x.ndim) if a not in present]
    y = xp.transpose(x, (*present, *rest)).reshape([x.shape[a] for a in present])
    return y.reshape([1 if a is None else x.shape[a] for a in axes])


def _unit_reshape(roles: list, in_shape, out_shape, unit: Any) -> list | None:
    """Roles after a reshape that only adds or drops unit axes, ``unit`` the role of each
    unit axis after it (None if the reshape does more)."""
    src = [(r, s) for r, s in zip(roles, in_shape) if s != 1]
    if [s for _, s in src] != [s for s in out_shape if s != 1]:
        return None
    it = iter(src)
    return [unit if s == 1 else next(it)[0] for s in out_shape]
