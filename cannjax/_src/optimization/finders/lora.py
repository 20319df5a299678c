"""LoRA layers found by meaning: ``x @ w + s * ((x @ a) @ b) (+ bias)``.

flax.nnx's ``LoRALinear`` computes ``(x @ kernel + bias) + (x @ lora_a) @ lora_b`` (no
scale); hand-written LoRA adds ``(x @ a) @ b * s`` or ``s * (x @ a) @ b`` (the scale on
the rank-``r`` projection) to a dense layer, the bias anywhere in the sum. The finder
reads the sum at its last ``add``: its terms (through adds that nothing else reads) must
be exactly one base product ``x @ w``, one low-rank product ``(x @ a) @ b`` of the same
``x`` (``a [D, r]``, ``b [r, E]``), maybe scaled by a constant, and at most one bias
broadcast along the features. Each product is read as the dense finder reads ``x @ w``
(:func:`cannjax._src.optimization.finders.dense.linear_at`: ``x``'s last axis against the
weight's first, any leading axes). The whole sum becomes one LoRA operator, whose
backward keeps ``x`` and the rank-``r`` ``s (x a)`` and never forms a ``[D, E]`` product
for the frozen ``w``.

Which operator depends on what can be proven about ``w``. ``optimize`` rewrites the
program before it is differentiated, so it cannot see whether the caller's gradient
reaches ``w`` (flax.nnx's ``nnx.DiffState(0, nnx.LoRAParam)`` leaves it out, a plain
``jax.grad`` over all parameters does not):

* ``w`` provably constant: a value closed over (a concrete constant), computed from
  constants only, or passed through ``jax.lax.stop_gradient``. Then nothing can
  differentiate it, and the substitute is :func:`cannjax.ops.lora_linear`, whose ``w``
  gets no cotangent at all.
* otherwise (``w`` is an input of the function, the usual case): the substitute is the
  same rules with ``w`` differentiable (``lora_linear_with_w_grad``), whose backward
  also returns ``dw = x^T g``: the exact gradient when ``w`` is differentiated, and dead
  code, which jax and XLA remove under ``jit``, when it is not.
"""

from __future__ import annotations

import functools
from typing import Any

from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core import jaxpr as J
from cannjax._src.core.graph import Graph, producer, skip_identities, uniform
from cannjax._src.ops.lora import lora_linear_with_w_grad
from cannjax._src.optimization.finders.dense import _bias_source, linear_at
from cannjax._src.optimization.replacement import Kind, Miss, Replacement

_ADDS = ("add", "add_any")


def _terms(g: Graph, i: int) -> tuple[list, set]:
    """The terms of the sum ending at equation ``i`` (through adds of the same shape
    and dtype that only this sum reads), and the add equations."""
    out = g.jaxpr.eqns[i].outvars[0]
    terms, adds, todo = [], {i}, list(g.jaxpr.eqns[i].invars)
    while todo:
        v = todo.pop(0)
        j, e = producer(g, v)
        inner = (
            e is not None
            and e.primitive.name in _ADDS
            and v.aval.shape == out.aval.shape
            and v.aval.dtype == out.aval.dtype
            and v not in g.outvars
            and len(g.consumers(v)) == 1
        )
        if inner:
            adds.add(j)
            todo.extend(e.invars)
        else:
            terms.append(v)
    return terms, adds


def _product(g: Graph, v):
    """``v = x @ w`` over ``x``'s last axis with a ``[K, P]`` ``w``, or None."""
    lin = linear_at(g, v)
    if lin is None or lin.k != 1 or lin.transposed or lin.w.aval.ndim != 2:
        return None
    if lin.dtype is not None:  # a promoted product: the dense finder takes it
        return None
    return lin


_NOT_CONSTANT = Miss(
    "looks like LoRA (x @ w + s * (x @ a) @ b) but the scale s is not a constant; "
    "compute it from Python numbers (s = alpha / rank) to have it substituted"
)


def _scaled(g: Graph, v, covered: set) -> tuple[Any, float | None]:
    """``(u, s)`` with ``v = s * u`` for a 0-d constant ``s`` (``(v, 1.0)`` when ``v``
    is no product with a scalar, ``(u, None)`` when ``s`` is not a constant); the
    multiply joins ``covered``."""
    j, e = producer(g, v)
    if e is None or e.primitive.name != "mul":
        return v, 1.0
    for u, c in (e.invars, e.invars[::-1]):
        if getattr(getattr(u, "aval", None), "shape", None) != v.aval.shape:
            continue
        if _product(g, u) is None:
            continue
        covered.add(j)
        return u, uniform(g, c)
    return v, 1.0


def _low_rank(g: Graph, v):
    """``(x, a, b, s, covered)`` when ``v = s * ((x @ a) @ b)``, the scale on either
    product's output (``(s * (x @ a)) @ b`` too); a reason when only the scale is
    missing; else None."""
    covered: set = set()
    u, s_out = _scaled(g, v, covered)
    up = _product(g, u)
    if up is None:
        return None
    h, s_in = _scaled(g, up.x, covered)
    down = _product(g, h)
    if down is None or down.w.aval.shape[1] != up.w.aval.shape[0]:
        return None
    if s_out is None or s_in is None:
        return _NOT_CONSTANT
    return down.x, down.w, up.w, s_out * s_in, covered | up.covered | down.covered


def _constant(g: Graph, w) -> bool:
    """Whether no gradient can reach ``w``: it depends on no differentiable input, or
    it is the output of ``stop_gradient``."""
    if isinstance(w, jcore.Literal) or w not in g.differentiable:
        return True
    _, e = producer(g, w)
    return e is not None and e.primitive.name == "stop_gradient"


def _call(frozen: bool, scale: float):
    op = ops.lora_linear if frozen else lora_linear_with_w_grad
    return functools.partial(op, scale=scale)


def find_lora(g: Graph, i: int):
    """A LoRA layer whose sum ends at equation ``i``."""

    eqn = g.jaxpr.eqns[i]
    if eqn.primitive.name not in _ADDS or not J.is_float(eqn.outvars[0].aval.dtype):
        return None
    out = eqn.outvars[0]
    terms, adds = _terms(g, i)
    if not 2 <= len(terms) <= 3:
        return None
    chained = False  # a base product of the low-rank term's x, of chaining shapes
    for k, t in enumerate(terms):
        low = _low_rank(g, t) if t.aval.shape == out.aval.shape else None
        if low is None:
            continue
        if isinstance(low, Miss):
            if any(_product(g, v) is not None for v in terms[:k] + terms[k + 1 :]):
                return low
            continue
        x, a, b, scale, low_covered = low
        rest = terms[:k] + terms[k + 1 :]
        for m, base_v in enumerate(rest):
            base = _product(g, base_v) if base_v.aval.shape == out.aval.shape else None
            if base is None or skip_identities(g, base.x) is not skip_identities(g, x):
                continue
            w = base.w
            if w.aval.shape != (a.aval.shape[0], b.aval.shape[1]):
                continue
            chained = True
            if len({v.aval.dtype for v in (out, x, base.x, w, a, b)}) != 1:
                return Miss("looks like LoRA (x @ w + (x @ a) @ b) but mixes dtypes")
            covered = adds | low_covered | base.covered
            inputs = [base.x, w, a, b]
            extra = rest[:m] + rest[m + 1 :]
            if extra:
                bias = _bias_source(g, extra[0], (w.aval.shape[1],))
                if bias is None:
                    continue  # a third term that is not a bias: another sum
                if bias[0].aval.dtype != out.aval.dtype:
                    return Miss("looks like LoRA (x @ w + (x @ a) @ b + bias) but mixes dtypes")
                inputs.append(bias[0])
                covered |= bias[1]
            frozen = _constant(g, w)
            source = "x @ w + (x @ a) @ b" + (" * s" if scale != 1.0 else "")
            source += " + bias" if extra else ""
            source += ", w constant" if frozen else ", w's gradient kept"
            call = _call(frozen, scale)
            return Replacement(Kind.LORA, "lora_linear", source, tuple(inputs), frozenset(covered),
                               out, call)  # fmt: skip
        if not chained and any(_product(g, v) is not None for v in rest):
            return Miss(
                "looks like LoRA (x @ w + (x @ a) @ b) but the base product and the low-rank "
                "one read different inputs, or their shapes do not chain"
            )
    return None
