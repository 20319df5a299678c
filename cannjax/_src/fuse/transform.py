"""``cannjax.fuse``: elementwise fusion as a function transform.

``fuse(fun)`` traces ``fun`` to a jaxpr (once per input signature), finds each maximal
cluster of elementwise work (unary and binary math, broadcasts, casts, selects,
``integer_pow``...) and replaces it by *one* cannjax operator (:func:`cannjax.core.defop`):

* its forward runs the cluster and keeps only what the cluster's backward needs, at least
  cost: the inputs the derivative actually reads (``level="recompute"``), or the
  composite derivative ``f'(x)`` itself when the cluster is a pointwise map of one input
  to one output and that is no larger (``level="derivative"``);
* its backward computes the cotangent of the whole cluster in one pass (from the composite
  derivative: ``g * f'(x)``; or by re-running the cluster from its saved inputs under
  ``jax.vjp``), and its tangent rule does the same for forward mode.

Plain JAX keeps one residual per nonlinear step of a chain (``sin(exp(x))`` keeps
``exp(x)`` and ``cos(exp(x))``); a fused cluster keeps one array. Matmuls, reductions,
cannjax operators, ``cond``/``while`` and custom_vjp rules are left as they are; the
bodies of ``lax.scan`` and ``jax.checkpoint`` are fused in place (under ``scan`` every
residual of the body is stacked across iterations: that is where the memory is won).

Example:
  >>> import jax, jax.numpy as jnp, cannjax
  >>> f = lambda x: jnp.sin(jnp.exp(x)).sum()
  >>> x = jnp.linspace(-1.0, 1.0, 8)
  >>> cannjax.inspect.residuals(f, x).count
  2
  >>> cannjax.inspect.residuals(cannjax.fuse(f), x).count
  1
  >>> bool(jnp.allclose(jax.grad(cannjax.fuse(f))(x), jax.grad(f)(x)))
  True
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore
from jax._src.interpreters import partial_eval as pe

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R
from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.core.operator import defop
from cannjax._src.core.signatures import (
    NeedsConcreteValues,
    PerSignature,
    is_dynamic,
    trace_signature,
)
from cannjax._src.core.symbolic import less
from cannjax._src.fuse.clusters import Cluster, find_clusters, schedule

LEVELS = ("derivative", "recompute")
"""The values of ``fuse``'s ``level`` option.

* ``"derivative"`` (default): a cluster that maps one input pointwise to one output
  (``y = f(x)``, same shape) keeps the composite derivative ``f'(x)``, computed in the
  forward pass alongside ``y``; the backward is one multiply ``g * f'(x)``. Memory equals
  keeping ``x``; the backward does not re-run the cluster (fastest backward). Other
  clusters, and clusters whose derivative would be larger than their input (a cast up to
  a wider dtype inside), keep their inputs as under ``"recompute"``.
* ``"recompute"``: every cluster keeps only the inputs its derivative reads (none for an
  affine cluster like ``2 * x + 1``); the backward re-runs the cluster from them under
  ``jax.vjp``. Least forward work; the backward repeats the cluster's forward math.
"""

_MAX_NAME = 48


# ---------------------------------------------------------------------- the fused operator
@dataclasses.dataclass
class FusedCluster:
    """One fused cluster: its equations, interface and what its operator keeps.

    Attributes:
      primitives: names of the equations, in program order.
      lines: the distinct user source lines of the equations.
      inputs: avals of the operator's inputs.
      outputs: avals of the operator's (floating) outputs.
      style: ``"derivative"`` or ``"recompute"``, see :data:`LEVELS`.
      saved: avals of the residuals the operator keeps.
      op_name: the operator's name (residuals are ``cannjax.<op_name>.<key>``).
    """

    primitives: tuple[str, ...]
    lines: tuple[str, ...]
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    style: str
    saved: tuple[Any, ...]
    op_name: str

    @property
    def saved_bytes(self) -> int:
        """Bytes the operator keeps for the backward, per call."""
        return sum(_nbytes(a) for a in self.saved)


def _nbytes(aval) -> Any:
    # math.prod keeps symbolic dimensions (jax.export) symbolic; np.prod needs constants.
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize


def _op_name(prims: Sequence[str]) -> str:
    short = []
    for p in prims:
        if p in ("convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "copy"):
            continue
        if not short or short[-1] != p:
            short.append(p)
    name = "fused_" + "_".join(short)
    if len(name) > _MAX_NAME:
        name = name[: _MAX_NAME - 4].rstrip("_") + "_etc"
    return name if name.isidentifier() else "fused"


def _is_pointwise_map(jaxpr, c: Cluster) -> bool:
    """Whether the cluster's output element i depends only on its input element i."""
    (x,) = c.inputs
    (y,) = c.outputs
    shape = x.aval.shape
    if y.aval.shape != shape:
        return False
    dependent = {x}
    for i in c.eqns:
        eqn = jaxpr.eqns[i]
        dep_in = [v for v in eqn.invars if isinstance(v, jcore.Var) and v in dependent]
        if not dep_in:
            continue  # work on constants only (broadcast scalars, iota)
        kind, _ = J.kind_of(eqn)
        same = all(v.aval.shape == shape for v in (*dep_in, *eqn.outvars))
        if kind not in ("pointwise", "shape") or not same:
            return False
        dependent.update(eqn.outvars)
    return True


def _needed_inputs(fun, avals, diff) -> list[bool]:
    """Which inputs the linear map of ``fun`` (its derivative) reads."""

    def linear_map(*xs):
        def f(*dx):
            it = iter(dx)
            return fun(*[next(it) if d else x for x, d in zip(xs, diff)])

        return jax.linearize(f, *[x for x, d in zip(xs, diff) if d])[1]

    closed = jax.make_jaxpr(lambda *xs: jax.tree_util.tree_leaves(linear_map(*xs)))(
        *map(J.sds, avals)
    )
    if closed.jaxpr.effects:
        return [True] * len(avals)
    _, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return list(used)


def _build_op(jaxpr, c: Cluster, level: str):
    """The operator for cluster ``c`` and its description."""
    eqns = [jaxpr.eqns[i] for i in c.eqns]
    fouts = [v for v in c.outputs if J.is_float(v.aval.dtype)]
    in_avals = [v.aval for v in c.inputs]
    diff = tuple(J.is_float(a.dtype) for a in in_avals)
    nondiff = tuple(i for i, d in enumerate(diff) if not d)

    def run(*xs):
        return J.eval_eqns(eqns, c.inputs, fouts, xs)

    needed = _needed_inputs(run, in_avals, diff)
    input_bytes = sum(_nbytes(a) for a, n in zip(in_avals, needed) if n)
    deriv_ok = (
        level == "derivative"
        and len(c.inputs) == 1
        and len(fouts) == 1
        and len(c.outputs) == 1
        and diff[0]
        and _is_pointwise_map(jaxpr, c)
        # Undecidable under symbolic shapes: keep the inputs (recompute style).
        and not less(input_bytes, _nbytes(fouts[0].aval), undecided=True)
    )
    style = "derivative" if deriv_ok else "recompute"
    single = len(fouts) == 1
    prims = tuple(e.primitive.name for e in eqns)
    name = _op_name(prims)

    def dummy(i):
        a = in_avals[i]
        return jnp.zeros(a.shape, a.dtype)

    def inputs_from(res):
        return [res[f"x{i}"] if needed[i] else dummy(i) for i in range(len(in_avals))]

    def diff_fun(xs):
        def f(*dx):
            it = iter(dx)
            return run(*[next(it) if d else x for x, d in zip(xs, diff)])

        return f, [x for x, d in zip(xs, diff) if d]

    if style == "derivative":

        def forward(x):
            y, d = jax.jvp(lambda x: run(x)[0], (x,), (jnp.ones_like(x),))
            return y, {"d": d}

        def tangent(res, t):
            return (res["d"] * t).astype(fouts[0].aval.dtype)

        def backward(res, g):
            return ((res["d"] * g).astype(in_avals[0].dtype),)

        saved = (fouts[0].aval,)
    else:

        def forward(*xs):
            outs = run(*xs)
            res = {f"x{i}": x for i, x in enumerate(xs) if needed[i]}
            return (outs[0] if single else tuple(outs)), res

        def tangent(res, *ts):
            f, dxs = diff_fun(inputs_from(res))
            outs = jax.jvp(f, dxs, list(ts))[1]
            return outs[0] if single else tuple(outs)

        def backward(res, g):
            f, dxs = diff_fun(inputs_from(res))
            _, vjp = jax.vjp(f, *dxs)
            return tuple(vjp([g] if single else list(g)))

        saved = tuple(a for a, n in zip(in_avals, needed) if n)

    op = defop(
        name,
        forward=forward,
        tangent=tangent,
        backward=backward,
        nondiff_argnums=nondiff,
        num_outputs=len(fouts),
    )
    info = FusedCluster(
        primitives=prims,
        lines=tuple(dict.fromkeys(J.source_line(e) for e in eqns)),
        inputs=tuple(in_avals),
        outputs=tuple(v.aval for v in fouts),
        style=style,
        saved=saved,
        op_name=name,
    )
    # Non-floating outputs (masks, indices) used outside are recomputed plainly: they
    # carry no gradient, and XLA merges the duplicate work.
    steps = [R.Call(op, tuple(c.inputs), tuple(fouts), context=eqns[-1])]
    plain_outs = [v for v in c.outputs if not J.is_float(v.aval.dtype)]
    if plain_outs:
        steps.append(_plain_step(_slice(eqns, plain_outs), c.inputs, plain_outs))
    return steps, info


def _plain_step(eqns, inputs, outs) -> R.Call:
    """Computes ``outs`` from ``inputs`` by ``eqns``, outside any gradient."""

    def fn(*xs):
        vals = J.eval_eqns(eqns, inputs, outs, [jax.lax.stop_gradient(x) for x in xs])
        return vals[0] if len(vals) == 1 else vals

    return R.Call(fn, tuple(inputs), tuple(outs))


def _slice(eqns, outvars) -> list:
    """The equations of ``eqns`` that ``outvars`` depend on."""
    need = {v for v in outvars if isinstance(v, jcore.Var)}
    keep = []
    for eqn in reversed(eqns):
        if any(v in need for v in eqn.outvars):
            keep.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    return keep[::-1]


# ---------------------------------------------------------------------- the plan
@dataclasses.dataclass
class Kept:
    """An equation left as it is, with the reason (for :func:`cannjax.inspect.fusion`)."""

    primitive: str
    line: str
    reason: str
    body: Plan | None = None  # the fused plan of a scan or checkpoint body


@dataclasses.dataclass
class Plan:
    """How one jaxpr runs fused: nodes in a valid order (kept equations and fused ops)."""

    jaxpr: jcore.Jaxpr
    steps: list  # core.rewrite steps: Bind (kept equations), Call (fused operators)
    fused: list[FusedCluster]
    kept: list[Kept]
    items: list  # FusedCluster and Kept entries in the order they run


_FUSABLE_BODIES = ("scan", "remat2", "checkpoint")


def plan_jaxpr(jaxpr: jcore.Jaxpr, level: str, min_ops: int) -> Plan:
    """Plans the fused evaluation of ``jaxpr`` (constvars are its leading inputs)."""
    clusters = find_clusters(jaxpr)
    fused_of: dict[int, Cluster] = {}
    small: set[int] = set()
    for c in clusters:
        math = sum(
            jaxpr.eqns[i].primitive.name not in J.SHAPE_ONLY
            and jaxpr.eqns[i].primitive.name != "convert_element_type"
            for i in c.eqns
        )
        float_out = any(J.is_float(v.aval.dtype) for v in c.outputs)
        float_in = any(J.is_float(v.aval.dtype) for v in c.inputs)
        if math >= min_ops and float_out and float_in:
            fused_of[c.eqns[0]] = c
        else:
            small.update(c.eqns)
    nodes: list[list[int]] = []
    in_fused = {i for c in fused_of.values() for i in c.eqns}
    for i in range(len(jaxpr.eqns)):
        if i in fused_of:
            nodes.append(list(fused_of[i].eqns))
        elif i not in in_fused:
            nodes.append([i])
    steps, fused, kept, items = [], [], [], []
    for k in schedule(jaxpr, nodes):
        first = nodes[k][0]
        if first in fused_of:
            op_steps, info = _build_op(jaxpr, fused_of[first], level)
            steps.extend(op_steps)
            fused.append(info)
            items.append(info)
            continue
        eqn = jaxpr.eqns[first]
        _, reason = J.kind_of(eqn)
        if first in small:
            reason = f"elementwise, in a cluster of fewer than {min_ops} math operations"
        step, body = R.Bind(eqn), None
        if eqn.primitive.name in _FUSABLE_BODIES:
            try:
                step, body = _fuse_body(eqn, level, min_ops)
            except Exception as e:  # noqa: BLE001 -- correctness first: leave it intact
                reason = f"{eqn.primitive.name} body left unfused ({type(e).__name__}: {e})"
                step, body = R.Bind(eqn), None
        steps.append(step)
        kept.append(Kept(eqn.primitive.name, J.source_line(eqn), reason, body))
        items.append(kept[-1])
    return Plan(jaxpr, steps, fused, kept, items)


def run_plan(plan: Plan, args: Sequence[Any]) -> list:
    """Evaluates ``plan`` at ``args`` (constants first, as in ``plan.jaxpr``'s inputs)."""
    return R.run(plan.jaxpr, plan.steps, args)


def _fuse_body(eqn, level, min_ops) -> tuple[R.Bind, Plan]:
    """The step for a scan or checkpoint equation with its body fused, and the body's plan
    (the equation as written when nothing in the body fuses)."""
    (body,) = R.bodies(eqn)
    jaxpr, consts = R.normalize(body)
    plan = plan_jaxpr(jaxpr, level, min_ops)
    if not plan.fused and not any(k.body and k.body.fused for k in plan.kept):
        return R.Bind(eqn), plan
    new_jaxpr, new_consts = R.retrace(jaxpr, plan.steps)
    return R.with_bodies(eqn, [(new_jaxpr, (*new_consts, *consts))]), plan


# ---------------------------------------------------------------------- the transform
@dataclasses.dataclass
class _Entry:
    plan: Plan | None
    consts: tuple
    out_tree: Any
    reason: str = ""


@keyword_decorator
def fuse(
    fun: Callable[..., Any], *, level: str = "derivative", min_ops: int = 2
) -> Callable[..., Any]:
    """Fuses each maximal cluster of elementwise work in ``fun`` into one operator.

    ``fuse(fun)`` has ``fun``'s signature and values. Under differentiation each cluster
    of elementwise equations (``+ - * /``, ``exp``, ``tanh``, ``where``, casts,
    broadcasts...) is one cannjax operator that keeps one residual per cluster instead of
    one per nonlinear step. For ``y = f(x)`` with ``f`` a pointwise chain::

        forward:   y = f(x),  d = f'(x)          (level="derivative"; keeps d)
        backward:  dx = g * d
        tangent:   dy = d * dx

    With ``level="recompute"`` the operator keeps the inputs its derivative reads and the
    backward re-runs the cluster under ``jax.vjp``. See :data:`LEVELS`.

    ``fun`` is traced once per input signature (tree structure, shapes, dtypes and
    non-array leaves: Python numbers are static, as in ``optimize``). Matmuls,
    reductions, cannjax operators, ``cond``/``while`` and custom_vjp rules are kept as
    they are; ``lax.scan`` and ``jax.checkpoint`` bodies are fused in place; nested
    ``jax.jit`` calls (without shardings) are inlined. A function whose tracing needs
    concrete values (Python control flow on array values) runs unfused.
    ``cannjax.inspect.fusion`` shows what was and was not fused.

    Also a decorator: ``@cannjax.fuse`` or ``@cannjax.fuse(level="recompute")``.

    Args:
      fun: the function to fuse; pytrees of arrays in and out.
      level: ``"derivative"`` or ``"recompute"``: what each fused operator keeps.
      min_ops: the least number of arithmetic equations (casts and broadcasts do not
        count) a cluster needs to be fused, ``>= 1``.

    Returns:
      A function with the signature and values of ``fun``.

    Raises:
      TypeError: if ``fun`` is not callable or ``min_ops`` is not an int.
      ValueError: if ``level`` is not one of :data:`LEVELS` or ``min_ops < 1``.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> act = cannjax.fuse(lambda h: jnp.tanh(h) * jax.nn.sigmoid(h) + 0.1 * h)
      >>> h = jnp.linspace(-2.0, 2.0, 5)
      >>> [r.op for r in cannjax.inspect.residuals(lambda h: act(h).sum(), h).rows]
      ['fused_tanh_logistic_mul_add']
    """
    if not callable(fun):
        raise TypeError(f"cannjax.fuse: fun must be callable, got {type(fun).__name__} {fun!r}")
    if level not in LEVELS:
        raise ValueError(f"cannjax.fuse: level must be one of {LEVELS}, got {level!r}")
    if not isinstance(min_ops, int) or isinstance(min_ops, bool):
        raise TypeError(f"cannjax.fuse: min_ops must be an int >= 1, got {min_ops!r}")
    if min_ops < 1:
        raise ValueError(f"cannjax.fuse: min_ops must be >= 1, got {min_ops}")

    entry = PerSignature(is_dynamic, lambda *sig: _make_entry(fun, *sig, level, min_ops))

    @functools.wraps(fun)
    def fused(*args, **kwargs):
        e, dyn_leaves = entry(args, kwargs)
        if e.plan is None:
            return fun(*args, **kwargs)
        outs = run_plan(e.plan, [*e.consts, *dyn_leaves])
        return jax.tree_util.tree_unflatten(e.out_tree, outs)

    def plan_for(*args, **kwargs) -> tuple[Plan | None, str]:
        e, _ = entry(args, kwargs)
        return e.plan, e.reason

    fused.fusion_plan = plan_for
    fused.fuse_options = {"level": level, "min_ops": min_ops}
    return fused


def _make_entry(fun, in_tree, dyn, statics, avals, level, min_ops) -> _Entry:
    try:
        t = trace_signature(fun, in_tree, dyn, statics, avals)
    except NeedsConcreteValues as err:
        return _Entry(None, (), None, f"not fused: tracing needs concrete values ({err})")
    return _Entry(plan_jaxpr(t.jaxpr, level, min_ops), t.consts, t.out_tree)
