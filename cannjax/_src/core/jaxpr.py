"""The jaxpr walker everyone shares: classify equations, evaluate them, step into calls.

``fuse`` classifies equations (:func:`kind_of`), evaluates clusters (:func:`eval_eqns`)
and inlines ``jit`` (:func:`inline_jit`); ``health.find_nonfinite`` interprets a whole
program one equation at a time (:func:`walk`). These read and re-bind jaxprs through the
public-ish surface of ``jax._src.core`` (equations, vars, literals); jax is pinned to
0.10.x for this reason.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore
from jax._src import sharding_impls, source_info_util

# Equations whose output element i depends only on element i of each operand (operands of
# the output's shape, or scalars). Their composition is what fuse turns into one operator.
POINTWISE = frozenset(
    """
    neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan
    asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs erf erfc erf_inv lgamma
    digamma integer_pow square add add_any sub mul div rem pow max min atan2 nextafter
    select_n clamp convert_element_type eq ne lt le gt ge and or not xor copy copy_p
    reduce_precision stop_gradient
    """.split()
)
# Elementwise-compatible equations that move or replicate elements without arithmetic:
# broadcasts (of scalars, constants or rows), reshapes, iota.
SHAPE_ONLY = frozenset("broadcast_in_dim reshape squeeze expand_dims iota".split())
_REDUCTIONS = frozenset(
    """
    reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor argmax argmin
    cumsum cumprod cummax cummin cumlogsumexp reduce_precision_sum
    """.split()
)
_JIT = frozenset(("jit", "pjit"))


def is_float(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating dtype (the differentiable ones fuse handles)."""
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def _plain_dtype(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not isinstance(aval, jcore.ShapedArray):
        return False
    return jax.numpy.issubdtype(dtype, jax.numpy.number) or dtype == np.bool_


def _pointwise_jaxpr(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _JIT:
            if not _pointwise_jaxpr(eqn.params["jaxpr"].jaxpr):
                return False
        elif name not in POINTWISE or eqn.effects:
            return False
    return True


def kind_of(eqn: jcore.JaxprEqn) -> tuple[str, str]:
    """Classifies an equation for fusion: ``(kind, reason)``.

    ``kind`` is ``"pointwise"`` or ``"shape"`` (may join a fused cluster) or ``"kept"``
    (left as it is); ``reason`` says why, for :func:`cannjax.inspect.fusion`.
    """
    name = eqn.primitive.name
    if eqn.effects:
        return "kept", "has side effects"
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    plain = all(_plain_dtype(a) for a in avals)
    complex_ = any(jax.numpy.issubdtype(a.dtype, jax.numpy.complexfloating) for a in avals)
    if name == "cannjax_op" or name == "cannjax_lin":
        return "kept", "cannjax operator: has its own backward rule"
    if name in POINTWISE or name in SHAPE_ONLY:
        if not plain or complex_:
            return "kept", "elementwise, but on complex or non-numeric dtypes"
        return ("pointwise" if name in POINTWISE else "shape"), "elementwise"
    if name == "custom_jvp_call":
        if plain and not complex_ and _pointwise_jaxpr(eqn.params["call_jaxpr"].jaxpr):
            # Re-bound inside the fused operator, so its custom rule still applies there.
            return "pointwise", "elementwise (custom_jvp rule kept inside the fused operator)"
        return "kept", "custom_jvp rule around non-elementwise work: left intact"
    if name == "custom_vjp_call":
        return "kept", "custom_vjp rule: left intact"
    if name in ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"):
        return "kept", "matmul/convolution: left as is"
    if name in _REDUCTIONS or name.startswith("reduce_"):
        return "kept", "reduction: left as is"
    if name in ("cond", "while"):
        return "kept", f"control flow ({name}): left intact"
    if name == "scan":
        return "kept", "control flow (scan): body fused separately"
    if name in ("remat2", "checkpoint"):
        return "kept", "jax.checkpoint: body fused separately"
    if name in _JIT:
        return "kept", "jit with shardings or donation: left intact"
    return "kept", f"{name}: not elementwise"


def sds(aval: Any) -> jax.ShapeDtypeStruct:
    """A ``ShapeDtypeStruct`` with the shape, dtype and weak type of ``aval``."""
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def source_line(eqn: jcore.JaxprEqn) -> str:
    """The user source line that made ``eqn`` (``"?"`` when unknown)."""
    return source_info_util.summarize(eqn.source_info) or "?"


def user_line(eqn: jcore.JaxprEqn) -> str:
    """The innermost line of ``eqn``'s traceback outside installed packages (flax, optax...).

    For an equation made inside ``flax.nnx.LayerNorm`` this is the user's call of the
    layer, not flax's line; falls back to :func:`source_line`.
    """
    for frame in source_info_util.user_frames(eqn.source_info.traceback):
        name = frame.file_name.replace("\\", "/")
        if "/site-packages/" not in name and "/dist-packages/" not in name:
            return f"{name}:{frame.start_line} ({frame.function_name})"
    return source_line(eqn)


def eqn_context(eqn: jcore.JaxprEqn) -> contextlib.AbstractContextManager:
    """Context that makes equations bound inside it carry ``eqn``'s source info."""
    stack = contextlib.ExitStack()
    tb = eqn.source_info.traceback
    # An equation made inside jax itself (the body of jax.nn.silu) has no user frame:
    # keep the enclosing context, which points at the user's call.
    if tb is not None and source_info_util.summarize(eqn.source_info):
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        stack.enter_context(source_info_util.user_context(tb, name_stack=name_stack))
    stack.enter_context(eqn.ctx.manager)
    return stack


def bind_eqn(eqn: jcore.JaxprEqn, invals: Sequence[Any], params: dict | None = None) -> list:
    """Binds ``eqn``'s primitive to ``invals`` (with ``params`` if given); a list of outputs."""
    bind_params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    with eqn_context(eqn):
        ans = eqn.primitive.bind(*invals, **bind_params)
    return list(ans) if eqn.primitive.multiple_results else [ans]


def _bind(eqn: jcore.JaxprEqn, invals: Sequence[Any], where: str) -> list:
    del where  # a plain evaluation does not care which calls surround the equation
    return bind_eqn(eqn, invals)


def read_atom(env: dict, v: Any) -> Any:
    """The value of a jaxpr atom: a literal's value or the environment's entry."""
    return v.val if isinstance(v, jcore.Literal) else env[v]


def eval_eqns(
    eqns: Sequence[jcore.JaxprEqn],
    invars: Sequence[jcore.Var],
    outvars: Sequence[Any],
    args: Sequence[Any],
) -> list:
    """Evaluates a straight-line list of equations from ``invars`` to ``outvars``."""
    env = dict(zip(invars, args))
    for eqn in eqns:
        outs = bind_eqn(eqn, [read_atom(env, v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs))
    return [read_atom(env, v) for v in outvars]


def _inlinable(eqn: jcore.JaxprEqn) -> bool:
    p = eqn.params
    unspecified = lambda s: isinstance(s, sharding_impls.UnspecifiedValue)  # noqa: E731
    return (
        eqn.primitive.name in _JIT
        and all(map(unspecified, p.get("in_shardings", ())))
        and all(map(unspecified, p.get("out_shardings", ())))
        and not any(p.get("donated_invars", ()))
        and not p.get("compiler_options_kvs", ())
        and not eqn.effects
    )


_CALL_BODIES = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}  # fmt: skip


def call_body(eqn: jcore.JaxprEqn) -> tuple[jcore.Jaxpr, Sequence[Any]] | None:
    """The body ``(jaxpr, consts)`` of a call equation, or None for any other equation.

    Calls are ``jit`` (``pjit``), ``closed_call``, ``core_call`` and ``jax.checkpoint``
    (``remat2``); control flow (``scan``, ``cond``, ``while``) and custom-rule calls are
    not: their bodies do not run once, in place, as written.
    """
    key = _CALL_BODIES.get(eqn.primitive.name)
    if key is None or key not in eqn.params:
        return None
    body = eqn.params[key]
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def is_call(eqn: jcore.JaxprEqn) -> bool:
    """Whether ``eqn`` calls a body that :func:`walk` can step into."""
    return call_body(eqn) is not None


def name_prefix(eqn: jcore.JaxprEqn) -> str:
    """JAX's name stack of ``eqn`` followed by ``/`` (``"jit(f)/"``), or ``""``."""
    stack = str(eqn.source_info.name_stack)
    return f"{stack}/" if stack else ""


def _same(x: Any) -> Any:
    return x


def walk(
    jaxpr: jcore.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    visit: Callable[[jcore.JaxprEqn, list, str], Sequence[Any]],
    *,
    inline: Callable[[jcore.JaxprEqn], bool],
    literal: Callable[[Any], Any] = _same,
    lift: Callable[[Any], Any] = _same,
    where: str = "",
) -> list:
    """Evaluates ``jaxpr`` equation by equation, stepping into the calls ``inline`` picks.

    The environment maps each variable to an *entry*: a value, or whatever stands for one
    (an index into a tape, say). A call equation for which ``inline(eqn)`` holds has its
    body walked in place, in the call's context, with ``where`` extended by
    ``"<name stack>/<primitive>(<name>)/"``; every other equation goes to ``visit``.

    Args:
      jaxpr: the jaxpr to walk.
      consts: values of its constvars.
      args: entries of its invars.
      visit: ``visit(eqn, operands, where) -> output entries`` evaluates one equation;
        ``operands`` are the entries of its inputs, ``where`` the path of the calls
        around it (``""`` at the top).
      inline: which call equations to step into (see :func:`call_body`).
      literal: the entry of a literal operand handed to ``visit``, from its value.
      lift: the entry of any other value the walk meets: a constant, or a literal passed
        into a body or returned.
      where: the path of the calls around ``jaxpr``.

    Returns:
      The entries of ``jaxpr``'s outputs.
    """
    env = {v: lift(c) for v, c in zip(jaxpr.constvars, consts)}
    env.update(zip(jaxpr.invars, args))

    def read(v: Any, as_literal: Callable[[Any], Any]) -> Any:
        return as_literal(v.val) if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        body = call_body(eqn) if inline(eqn) else None
        if body is None:
            outs = visit(eqn, [read(v, literal) for v in eqn.invars], where)
        else:
            inner_where = (
                f"{where}{name_prefix(eqn)}{eqn.primitive.name}({eqn.params.get('name', '')})/"
            )
            with eqn_context(eqn):
                outs = walk(
                    *body,
                    [read(v, lift) for v in eqn.invars],
                    visit,
                    inline=inline,
                    literal=literal,
                    lift=lift,
                    where=inner_where,
                )
        env.update(zip(eqn.outvars, outs))
    return [read(v, lift) for v in jaxpr.outvars]


def has_inlinable_jit(jaxpr: jcore.Jaxpr) -> bool:
    """Whether ``jaxpr`` holds a ``jit`` call that :func:`inline_jit` would inline."""
    return any(_inlinable(e) for e in jaxpr.eqns)


def inline_jit(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """``closed`` with nested ``jit`` calls (without shardings or donation) inlined.

    The constants of ``closed`` become leading inputs of the result, whose own constants
    are only those tracing introduces (none in practice).
    """
    jaxpr = closed.jaxpr
    n = len(jaxpr.constvars)

    def run(*args):
        return walk(jaxpr, args[:n], args[n:], _bind, inline=_inlinable)

    avals = [v.aval for v in (*jaxpr.constvars, *jaxpr.invars)]
    return jax.make_jaxpr(run)(*map(sds, avals))


def trace(fun: Callable[..., Any], avals: Sequence[Any]) -> jcore.ClosedJaxpr:
    """``jax.make_jaxpr(fun)`` at abstract values ``avals``."""
    return jax.make_jaxpr(fun)(*map(sds, avals))
