"""A ``lax.scan`` whose reverse pass keeps a bounded number of carries.

Four schedules trade memory for recomputation (``n`` steps, ``c`` checkpoints, ``S``
bytes of one carry, ``R`` bytes of one step's residuals):

=========  ==================================  =================================
schedule   backward memory                     forward steps in all (grad)
=========  ==================================  =================================
none       ``n (S + R)``                       ``n``
every      ``n S + R``                         ``2 n``
sqrt       ``(c + 1) S + (n / c) R``           ``2 n``
binomial   ``(c + 1) S + R``                   ``n + 1 + t(n, c)`` (Revolve optimum)
=========  ==================================  =================================

``"binomial"`` runs the optimal schedule of :mod:`cannjax.remat.revolve` from a fixed
``[c + 1, ...]`` buffer (``c`` checkpoints and the working state) driven by while loops,
so its memory stays bounded after compilation: XLA cannot undo it the way it removes
``jax.checkpoint`` barriers around unrolled code. It is one cannjax operator (see
``cannjax.core.defop``): its backward is the Revolve reversal, its tangent rule is the
JVP of the plain scan, so ``jax.jvp``/``jacfwd`` work (at the cost of one extra
forward), as do grad, vmap, jit and nesting inside other scans.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cannjax._src.core.operator import defop
from cannjax._src.remat import revolve

SCHEDULES = ("none", "every", "sqrt", "binomial")

_FN = "cannjax.remat.checkpointed_scan"


def checkpointed_scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    *,
    length: int | None = None,
    checkpoints: int | None = None,
    schedule: str = "binomial",
) -> tuple[Any, Any]:
    """``jax.lax.scan`` with a reverse pass that keeps at most ``checkpoints`` carries.

    Same semantics as ``jax.lax.scan(f, init, xs, length)``: ``f(carry, x) -> (carry, y)``
    over the leading axis of the pytree ``xs``; returns the final carry and the stacked
    ``ys``. Only the memory and recomputation of reverse-mode differentiation differ:

    * ``"none"``: plain ``lax.scan``: keeps every step's residuals.
    * ``"every"``: ``jax.checkpoint`` on the body: keeps all ``n`` carries and recomputes
      each step once in the backward.
    * ``"sqrt"`` (Chen et al. 2016): ``checkpoints`` segments (default ``ceil(sqrt n)``);
      keeps the segment-start carries and one segment's residuals at a time.
    * ``"binomial"`` (Griewank's Revolve): keeps ``checkpoints`` carries plus the working
      one and recomputes the least number of steps possible with them,
      ``t(n, c) = r n - C(c + r, c + 1)`` advances in all (see
      :func:`cannjax.remat.revolve.advances`). The default ``checkpoints`` is the
      least ``c`` with ``(c + 1)(c + 2) / 2 >= n``: ``O(sqrt n)`` carries, each step
      recomputed at most twice.

    Gradients agree across schedules to float rounding.

    Args:
      f: the body, ``f(carry, x) -> (new_carry, y)``; ``new_carry`` must match ``carry``.
      init: the initial carry (a pytree of arrays).
      xs: pytree of arrays scanned over their leading axis, or None (then give ``length``).
      length: the number of steps; must agree with the leading axis of ``xs``.
      checkpoints: carries the backward may keep, an int >= 1 (``"sqrt"``: segments;
        ``"binomial"``: checkpoint slots); ``"none"`` and ``"every"`` ignore it.
      schedule: one of ``"none"``, ``"every"``, ``"sqrt"``, ``"binomial"``.

    Returns:
      ``(final_carry, ys)`` as ``jax.lax.scan`` returns them.

    Raises:
      ValueError: unknown schedule, ``checkpoints < 1``, or leading axes of ``xs`` that
        disagree with each other or with ``length``.
      TypeError: ``f`` not callable, ``checkpoints`` not an int, or (``"binomial"``) a
        carry or output leaf that is not floating point.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> def body(h, w):
      ...     h = jnp.tanh(h @ w)
      ...     return h, h.sum()
      >>> ws = jnp.full((16, 4, 4), 0.1)
      >>> loss = lambda ws, s: cannjax.remat.checkpointed_scan(
      ...     body, jnp.ones(4), ws, checkpoints=3, schedule=s)[1].sum()
      >>> g_plain = jax.grad(loss)(ws, "none")
      >>> g_binom = jax.grad(loss)(ws, "binomial")
      >>> bool(jnp.allclose(g_plain, g_binom, rtol=1e-6))
      True

    References:
      Chen, Xu, Zhang and Guestrin, "Training Deep Nets with Sublinear Memory Cost",
      2016. https://arxiv.org/abs/1604.06174

      Griewank and Walther, "Algorithm 799: Revolve: An Implementation of Checkpointing
      for the Reverse or Adjoint Mode of Computational Differentiation", ACM TOMS 26(1),
      2000. https://doi.org/10.1145/347837.347846
    """
    if not callable(f):
        raise TypeError(f"{_FN}: f must be callable, got {type(f).__name__}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{_FN}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if checkpoints is not None:
        if isinstance(checkpoints, bool) or not isinstance(checkpoints, (int, np.integer)):
            raise TypeError(
                f"{_FN}: checkpoints must be an int >= 1 or None, got "
                f"{type(checkpoints).__name__} {checkpoints!r}"
            )
        if checkpoints < 1:
            raise ValueError(
                f"{_FN}: checkpoints must be >= 1 (the number of carries the backward keeps), "
                f"got {checkpoints}"
            )
        checkpoints = int(checkpoints)
    n = _scan_length(xs, length)
    with _body_errors():
        if schedule == "none" or n <= 1:
            return lax.scan(f, init, xs, length=n)
        if schedule == "every":
            return lax.scan(jax.checkpoint(f, prevent_cse=False), init, xs, length=n)
        if schedule == "sqrt":
            return _sqrt_scan(f, init, xs, n, checkpoints or math.isqrt(n - 1) + 1)
        return _binomial_scan(f, init, xs, n, checkpoints or revolve.default_checkpoints(n))


@contextlib.contextmanager
def _body_errors():
    """Names this function in ``lax.scan``'s errors about what ``f`` returned."""
    try:
        yield
    except TypeError as e:
        if not str(e).startswith("scan body"):  # not lax.scan's check of f's output
            raise
        raise TypeError(
            f"{_FN}: f(carry, x) must return a pair (new_carry, y), new_carry with the "
            f"structure, shapes and dtypes of init; {e}"
        ) from e


def _scan_length(xs: Any, length: int | None, fn: str = _FN) -> int:
    """The number of steps: the common leading axis of ``xs``'s leaves, or ``length``.

    Errors name ``fn``, the public function that was called.
    """
    leaves, _ = jax.tree_util.tree_flatten_with_path(xs)
    dims = []
    for path, leaf in leaves:
        shape = np.shape(leaf)
        if not shape:
            raise ValueError(
                f"{fn}: every leaf of xs needs a leading axis to scan over; "
                f"xs{jax.tree_util.keystr(path)} is a scalar"
            )
        dims.append((jax.tree_util.keystr(path), shape[0]))
    if length is not None:
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise ValueError(f"{fn}: length must be an int >= 0, got {length!r}")
        length = int(length)
    sizes = {d for _, d in dims}
    if len(sizes) > 1 or (length is not None and sizes and sizes != {length}):
        got = ", ".join(f"xs{p}: {d}" for p, d in dims)
        want = f"length={length}" if length is not None else "one common size"
        raise ValueError(f"{fn}: the leading axes of xs must all equal {want}; got {got}")
    if length is None:
        if not sizes:
            raise ValueError(f"{fn}: give length when xs is None or has no leaves")
        length = sizes.pop()
    return length


# ---------------------------------------------------------------- sqrt (Chen et al.)
def _sqrt_scan(f, init, xs, n, segments):
    seg = -(-n // min(segments, n))  # ceil(n / segments)
    # A divisor of n avoids slicing xs (and copying its cotangent) for a remainder.
    div = next(d for d in range(seg, n + 1) if n % d == 0)
    seg = div if div <= 2 * seg else seg
    q, rem = divmod(n, seg)

    def run(length):
        return jax.checkpoint(
            lambda c, x: lax.scan(f, c, x, length=length), prevent_cse=False, policy=None
        )

    head = jax.tree_util.tree_map(lambda a: a[: q * seg].reshape(q, seg, *a.shape[1:]), xs)
    carry, ys = lax.scan(run(seg), init, head, length=q)
    ys = jax.tree_util.tree_map(lambda a: a.reshape(q * seg, *a.shape[2:]), ys)
    if rem:
        tail = jax.tree_util.tree_map(lambda a: a[q * seg :], xs)
        carry, ys_tail = run(rem)(carry, tail)
        ys = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_tail)
    return carry, ys


# ---------------------------------------------------------------- binomial (Revolve)
def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _binomial_scan(f, init, xs, n, c):
    c = min(c, max(n - 1, 1))
    # lax.scan checks the body's types for us and gives the output structure.
    out_shape = jax.eval_shape(lambda i, x: lax.scan(f, i, x, length=n), init, xs)
    init_leaves, init_tree = jax.tree_util.tree_flatten(init)
    init_leaves = [jnp.asarray(v) for v in init_leaves]
    xs_leaves, xs_tree = jax.tree_util.tree_flatten(xs)
    xs_leaves = [jnp.asarray(v) for v in xs_leaves]
    y_tree = jax.tree_util.tree_structure(out_shape[1])
    for path, leaf in jax.tree_util.tree_flatten_with_path(out_shape)[0]:
        if not jnp.issubdtype(leaf.dtype, jnp.inexact):
            raise TypeError(
                f"{_FN}: schedule='binomial' needs floating-point carry and ys leaves; "
                f"output{jax.tree_util.keystr(path)} is {leaf.dtype.name}{list(leaf.shape)}. "
                "Use schedule='sqrt' or 'every' for integer state."
            )
    if not init_leaves and not jax.tree_util.tree_leaves(out_shape[1]):
        return lax.scan(f, init, xs, length=n)

    def flat_body(carry, x):
        new, y = f(
            jax.tree_util.tree_unflatten(init_tree, carry),
            jax.tree_util.tree_unflatten(xs_tree, x),
        )
        return jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(y)

    x_avals = [jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for v in xs_leaves]
    closed = jax.make_jaxpr(flat_body)(init_leaves, x_avals)
    consts = [jnp.asarray(k) for k in closed.consts]
    nc, nx = len(init_leaves), len(xs_leaves)
    args = [*init_leaves, *xs_leaves, *consts]
    nondiff = tuple(i for i, a in enumerate(args) if not _inexact(a))
    op = _revolve_operator(closed.jaxpr, nc, nx, n, c, nondiff)
    outs = op(*args)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    carry = jax.tree_util.tree_unflatten(init_tree, outs[:nc])
    return carry, jax.tree_util.tree_unflatten(y_tree, outs[nc:])


def _revolve_operator(jaxpr, nc, nx, n, c, nondiff):
    """One cannjax operator: forward sweep with checkpoints, Revolve backward."""
    sched = revolve.schedule(n, c)
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    ny = len(jaxpr.outvars) - nc
    nargs = nc + nx + len(jaxpr.constvars)
    diff = [i not in nondiff for i in range(nargs)]

    def split(args):
        return list(args[:nc]), list(args[nc : nc + nx]), list(args[nc + nx :])

    def step(carry, x, k):
        outs = jax.core.eval_jaxpr(jaxpr, k, *carry, *x)
        return list(outs[:nc]), list(outs[nc:])

    def x_at(xs, i):
        return [lax.dynamic_index_in_dim(a, i, keepdims=False) for a in xs]

    def advance(a, b, carry, xs, k):
        return lax.fori_loop(a, b, lambda j, s: step(s, x_at(xs, j), k)[0], carry)

    def store(buf, carry, slot):
        return [lax.dynamic_update_index_in_dim(b, v, slot, 0) for b, v in zip(buf, carry)]

    def forward(*args):
        carry, xs, k = split(args)
        # Slots 0..c-1 are checkpoints; slot c holds the working state s_{n-1}.
        buf = [jnp.zeros((c + 1, *v.shape), v.dtype).at[0].set(v) for v in carry]
        stores = sched.forward_stores[1:] + ((n - 1, c),)
        starts = [0] + [s for s, _ in stores[:-1]]
        f_start = i32(starts)
        f_stop = i32([s for s, _ in stores])
        f_slot = i32([slot for _, slot in stores])
        y_avals = [v.aval for v in jaxpr.outvars[nc:]]
        ys = [jnp.zeros((n, *a.shape), a.dtype) for a in y_avals]

        def fwd_step(j, s):
            carry, ys = s
            carry, y = step(carry, x_at(xs, j), k)
            return carry, [lax.dynamic_update_index_in_dim(a, v, j, 0) for a, v in zip(ys, y)]

        def run(r, s):
            carry, buf, ys = s
            carry, ys = lax.fori_loop(f_start[r], f_stop[r], fwd_step, (carry, ys))
            return carry, store(buf, carry, f_slot[r]), ys

        carry, buf, ys = lax.fori_loop(0, len(stores), run, (carry, buf, ys))
        carry, ys = fwd_step(n - 1, (carry, ys))
        res = {"checkpoints": buf, "xs": xs, "consts": k}
        return [*carry, *ys], res

    def backward(res, cts):
        buf, xs, k = res["checkpoints"], res["xs"], res["consts"]
        cts = list(cts) if isinstance(cts, (tuple, list)) else [cts]
        g_carry, g_ys = list(cts[:nc]), list(cts[nc:])
        dxi = [i for i in range(nx) if diff[nc + i]]
        dki = [i for i in range(len(k)) if diff[nc + nx + i]]
        g_xs = [jnp.zeros_like(xs[i]) for i in dxi]
        g_k = [jnp.zeros_like(k[i]) for i in dki]
        src = i32(np.r_[sched.src[:-1], c])
        final_start = i32(np.r_[sched.final_start[:-1], n - 1])
        run_ptr = i32(sched.run_ptr)
        # One padding entry keeps the tables non-empty (c == 1 has no runs).
        run_start, run_stop, run_slot = (i32(np.r_[a, 0]) for a in sched.runs())

        def taped(i, state, g_carry, g_xs, g_k):
            x = x_at(xs, i)

            def fn(state, xd, kd):
                xx, kk = list(x), list(k)
                for j, v in zip(dxi, xd):
                    xx[j] = v
                for j, v in zip(dki, kd):
                    kk[j] = v
                return step(state, xx, kk)

            _, vjp = jax.vjp(fn, state, [x[j] for j in dxi], [k[j] for j in dki])
            dc, dx, dk = vjp((g_carry, [lax.dynamic_index_in_dim(g, i, 0, False) for g in g_ys]))
            g_xs = [lax.dynamic_update_index_in_dim(g, d, i, 0) for g, d in zip(g_xs, dx)]
            return dc, g_xs, [a + b for a, b in zip(g_k, dk)]

        def reverse_step(j, s):
            i = n - 1 - j
            buf, g_carry, g_xs, g_k = s
            state = [lax.dynamic_index_in_dim(b, src[i], 0, False) for b in buf]

            def run(r, s):
                state, buf = s
                state = advance(run_start[r], run_stop[r], state, xs, k)
                return state, store(buf, state, run_slot[r])

            state, buf = lax.fori_loop(run_ptr[i], run_ptr[i + 1], run, (state, buf))
            state = advance(final_start[i], i, state, xs, k)
            return (buf, *taped(i, state, g_carry, g_xs, g_k))

        _, g_carry, g_xs, g_k = lax.fori_loop(0, n, reverse_step, (buf, g_carry, g_xs, g_k))
        return (*g_carry, *g_xs, *g_k)

    def tangent(res, *ts):
        buf, xs, k = res["checkpoints"], res["xs"], res["consts"]
        primals = [b[0] for b in buf] + list(xs) + list(k)
        dpos = [i for i in range(nargs) if diff[i]]

        def scan_of(*dargs):
            args = list(primals)
            for i, v in zip(dpos, dargs):
                args[i] = v
            carry, xs_, k_ = split(args)
            carry, ys = lax.scan(lambda c_, x_: step(c_, x_, k_), carry, xs_, length=n)
            return [*carry, *ys]

        _, out = jax.jvp(scan_of, [primals[i] for i in dpos], list(ts))
        return out if len(out) > 1 else out[0]

    return defop(
        "checkpointed_scan",
        forward=lambda *a: _single(forward(*a)),
        tangent=tangent,
        backward=backward,
        nondiff_argnums=nondiff,
        num_outputs=nc + ny,
    )


def _single(out_res):
    outs, res = out_res
    return (outs if len(outs) > 1 else outs[0]), res
