"""Attention found by meaning: ``softmax(f(q k^T)) v`` in any layout, grouping and mask form.

Model libraries write the same attention many ways: heads before or after the sequence
axis, named axes in any order, grouped-query heads as a group axis of ``q`` (flax.nnx,
haliax, penzai) or as keys and values repeated per group (transformers), the scale on
``q`` or on the logits, a soft cap ``c * tanh(s / c)`` (Gemma 2), masks as ``jnp.where``
with a large negative fill or as an additive ``0 / finfo.min`` bias, causal and
sliding-window masks built from positions. This finder reads the two ``dot_general``
equations and everything between them by role, so whatever matches is exactly

    out = softmax_S(mask(cap(scale * q k^T) + bias)) v

with every axis of ``q``, ``k``, ``v`` and the output assigned to one of: batch (``B``),
query rows (``T``), key/value heads (``K``), query heads per key head (``G``), keys (``S``),
head features (``H``). Axes of one role are merged, so the call is one
:func:`cannjax.ops.attention` with ``q [B, T, K*G, H]`` and ``k, v [B, S, K, H]``.

A mask fill counts as hiding a logit when it is at most :data:`MASK_FILL`: ``exp(fill -
m)`` is then exactly 0 in float32 and bfloat16 for any row whose largest visible logit
``m`` exceeds ``fill + 104``. A row with no visible key (padding) gives the mean of ``v``
there, as the written code does; the operator alone would give 0, so the replacement
restores those rows (only when a mask comes from data; a causal or windowed band always
shows the diagonal).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from cannjax import ops
from cannjax._src.core.graph import (
    Graph,
    constant_value,
    is_identity,
    is_upcast,
    producer,
    scalar,
    skip_identities,
    uniform,
)
from cannjax._src.optimization.finders import cross_entropy
from cannjax._src.optimization.finders.dense import (
    _dims,
    _half_accumulated,
    _plain_precision,
    _promoted_precision,
    _unit_reshape,
    arrange,
    promoted,
)
from cannjax._src.optimization.finders.logit_forms import is_row_max, soft_cap
from cannjax._src.optimization.replacement import Kind, Miss, Replacement

MASK_FILL = -1e9
"""A ``where`` fill or additive bias at or below this hides its logit (see the module doc)."""


# ---------------------------------------------------------------------- small readers
def fill_limit(dtype) -> float:
    """The largest fill that hides a logit of ``dtype``: :data:`MASK_FILL`, or for float16
    (whose range ends at 65504) nine tenths of its lowest value."""
    lowest = float(jnp.finfo(dtype).min)
    return MASK_FILL if lowest < MASK_FILL else 0.9 * lowest


def _hides(g: Graph, v) -> bool:
    c = uniform(g, v)
    dtype = getattr(getattr(v, "aval", None), "dtype", np.float32)
    return c is not None and c <= fill_limit(dtype)


# ---------------------------------------------------------------------- softmax
@dataclasses.dataclass(frozen=True)
class Softmax:
    """``p = softmax(x)`` over one axis, found at ``p``.

    ``p``'s axis ``a`` is ``x``'s axis ``x_axes[a]`` (penzai moves the axis last after
    taking the maximum); ``axis`` is the normalized axis of ``p``.
    """

    x: Any
    axis: int
    x_axes: tuple
    covered: frozenset


def softmax_at(g: Graph, p) -> Softmax | None:
    """``p = exp(y - c) / sum_a exp(y - c)`` with ``y`` = ``x`` or a transpose of it and
    ``c`` a row maximum of ``x`` (any shift constant along the axis cancels; the forms
    accepted are the maximum, guarded against ``-inf`` by ``max`` or ``is_finite``, with or
    without ``stop_gradient``)."""
    covered: set = set()
    p = skip_identities(g, p, covered)
    i, cast = producer(g, p)
    if cast is not None and cast.primitive.name == "convert_element_type":
        if jnp.issubdtype(cast.outvars[0].aval.dtype, jnp.floating):  # f32 p to bfloat16
            covered.add(i)
            p = skip_identities(g, cast.invars[0], covered)
    i, div = producer(g, p)
    if div is not None and div.primitive.name == "exp":
        return _exp_minus_logsumexp(g, div, covered | {i})
    if div is None or div.primitive.name != "div":
        return None
    covered.add(i)
    num, den = div.invars
    if not isinstance(num, jcore.Var):
        return None
    shape = tuple(num.aval.shape)
    axis = _row_sum_axis(g, den, num, covered)
    if axis is None:
        return None
    i, exp = producer(g, num)
    if exp is None or exp.primitive.name != "exp":
        return None
    covered.add(i)
    i, sub = producer(g, exp.invars[0])
    if sub is None or sub.primitive.name != "sub":
        return None
    covered.add(i)
    y, shift = sub.invars
    perm = tuple(range(len(shape)))
    j, t = producer(g, y)
    if t is not None and t.primitive.name == "transpose":
        covered.add(j)
        perm, y = tuple(t.params["permutation"]), t.invars[0]
    if not isinstance(y, jcore.Var) or not is_row_max(g, shift, y, perm[axis], covered):
        return None
    if tuple(y.aval.shape[a] for a in perm) != shape:
        return None
    return Softmax(y, axis, perm, frozenset(covered))


def _exp_minus_logsumexp(g: Graph, e, covered: set) -> Softmax | None:
    """``p = exp(y - logsumexp_a(y))``, the logsumexp kept as a unit axis ``a``."""
    i, sub = producer(g, e.invars[0])
    if sub is None or sub.primitive.name != "sub" or not isinstance(sub.invars[0], jcore.Var):
        return None
    y, rank = sub.invars[0], sub.invars[0].aval.ndim
    for axis in range(rank):
        trial = {i}
        shift = cross_entropy.row_shift(g, sub.invars[1], axis, rank)
        if shift is not None and cross_entropy.logsumexp_at(g, shift[0], y, axis, trial):
            covered.update(trial | set(shift[1]))
            return Softmax(y, axis, tuple(range(rank)), frozenset(covered))
    return None


def _row_sum_axis(g: Graph, den, num, covered: set) -> int | None:
    """The axis ``a`` when ``den`` is ``sum_a num`` kept as a unit axis (or broadcast)."""
    i, b = producer(g, den)
    if b is None or b.primitive.name != "broadcast_in_dim":
        return None
    j, r = producer(g, b.invars[0])
    if r is None or r.primitive.name != "reduce_sum" or r.invars[0] is not num:
        return None
    (axis,) = r.params["axes"] if len(r.params["axes"]) == 1 else (None,)
    if axis is None:
        return None
    rank = num.aval.ndim
    if tuple(b.params["broadcast_dimensions"]) != tuple(a for a in range(rank) if a != axis):
        return None
    covered.update((i, j))
    return int(axis)


def _template_softmax(g: Graph, p, fallback) -> Softmax | None:
    found = fallback(g, p) if fallback is not None else None
    if found is None:
        return None
    axis, x, covered = found
    return Softmax(x, axis, tuple(range(x.aval.ndim)), frozenset(covered))


# ---------------------------------------------------------------------- logits
@dataclasses.dataclass(frozen=True)
class Axis:
    """The role of one axis of the logits, read off the ``q k`` product.

    ``side``: ``"batch"`` (the product's ``index``-th batch dimension), ``"lhs"`` or
    ``"rhs"`` (a free axis of that operand, ``index`` its axis there) or ``"unit"`` (a
    unit axis a reshape added).
    """

    side: str
    index: int = 0


_UNIT = Axis("unit")


@dataclasses.dataclass(frozen=True)
class Masking:
    """A boolean mask (True = attend) or a float bias, with the roles of its axes."""

    value: Any
    roles: tuple
    negate: bool = False  # the mask is ``~value``
    is_bias: bool = False


# The steps between the ``q k`` product and the softmax, as the walk back records them.
@dataclasses.dataclass(frozen=True)
class Moved:
    """A transpose of the logits."""

    permutation: tuple


@dataclasses.dataclass(frozen=True)
class Reshaped:
    """A reshape of the logits (only unit axes may come or go)."""

    before: tuple
    after: tuple


@dataclasses.dataclass(frozen=True)
class Scaled:
    """The logits times a constant."""

    factor: float


@dataclasses.dataclass(frozen=True)
class Capped:
    """``cap * tanh(s / cap)``."""

    cap: float


@dataclasses.dataclass(frozen=True)
class Masked:
    """A boolean mask (``where`` with a fill, or an added ``where(mask, 0, fill)``) or an
    added float bias, its axes' roles not known yet."""

    value: Any
    negate: bool = False
    is_bias: bool = False


@dataclasses.dataclass
class Logits:
    """``s = mask(cap(scale * q k^T) + bias)`` between the ``q k`` product and a softmax."""

    qk: Any  # the dot_general equation
    roles: list  # the roles of the softmax input's axes
    scale: float
    cap: float | None
    masks: list
    covered: set


def logits_at(g: Graph, x) -> Logits | Miss:
    """The logits computation ending at ``x``, walked back to its ``q k`` product, or why
    it is not attention's."""
    steps, covered = [], set()
    qk = _walk_logits(g, x, steps, covered)
    if isinstance(qk, Miss):
        return qk
    if not (_plain_precision(qk) or _half_accumulated(qk) or _promoted_precision(qk)):
        return Miss(
            "q k^T has a preferred or mixed precision (other than half operands "
            "accumulated in float32, or one operand promoted to the other's dtype)"
        )
    lc, _, lb, _ = _dims(qk)
    a, b = qk.invars
    roles = [Axis("batch", k) for k in range(len(lb))]
    roles += [Axis("lhs", d) for d in range(a.aval.ndim) if d not in (*lc, *lb)]
    roles += [Axis("rhs", d) for d in range(b.aval.ndim) if d not in (*_dims(qk)[1], *_dims(qk)[3])]
    scale, cap, phase, masks = 1.0, None, 0, []
    for step in reversed(steps):  # in program order
        if isinstance(step, Moved):
            roles = [roles[p] for p in step.permutation]
        elif isinstance(step, Reshaped):
            roles = _unit_reshape(roles, step.before, step.after, _UNIT)
            if roles is None:
                return Miss("a reshape of the logits that merges or splits axes")
        elif isinstance(step, Scaled):
            if phase > 0:
                return Miss("the logits are scaled after the soft cap, bias or mask")
            scale *= step.factor
        elif isinstance(step, Capped):
            if phase > 0:
                return Miss(
                    "the soft cap comes after a mask or bias (it would turn the fill into -cap)"
                )
            cap, phase = step.cap, 1
        else:  # Masked: a mask or bias, added or applied after the cap
            if step.value.aval.ndim != len(roles):
                return Miss("a mask or bias of another rank than the logits")
            masks.append(Masking(step.value, tuple(roles), step.negate, step.is_bias))
            phase = 2
    if not scale > 0:
        return Miss(f"a scale of {scale:g} (attention's is positive)")
    return Logits(qk, roles, scale, cap, masks, covered)


def _walk_logits(g: Graph, cur, steps: list, covered: set):
    """Walks back from ``cur`` to the ``q k`` product, recording the steps (last first);
    the product's equation, or why the walk stopped."""
    while True:
        i, e = producer(g, cur)
        if e is None:
            return Miss("the logits do not come from a product q k^T")
        name = e.primitive.name
        if name == "dot_general":
            covered.add(i)
            return e
        if is_identity(e) or is_upcast(e):  # half logits upcast for the softmax
            nxt = e.invars[0]
        elif name == "transpose":
            steps.append(Moved(tuple(e.params["permutation"])))
            nxt = e.invars[0]
        elif name == "reshape":
            steps.append(Reshaped(tuple(e.invars[0].aval.shape), tuple(e.outvars[0].aval.shape)))
            nxt = e.invars[0]
        elif name in ("mul", "div") and len(e.invars) == 2:
            cap = soft_cap(g, e, covered) if name == "mul" else None
            if cap is not None:
                steps.append(Capped(cap[0]))
                covered.add(i)
                cur = cap[1]
                continue
            c, nxt = scalar(g, e.invars[1]), e.invars[0]
            if c is None and name == "mul":
                c, nxt = scalar(g, e.invars[0]), e.invars[1]
            if c is None or c == 0.0:
                how = "multiplied" if name == "mul" else "divided"
                return Miss(f"the logits are {how} by a value that is not a nonzero constant")
            steps.append(Scaled(c if name == "mul" else 1.0 / c))
        elif name == "select_n" and len(e.invars) == 3:
            pred, a, b = e.invars
            if _hides(g, a):
                steps.append(Masked(pred))
                nxt = b
            elif _hides(g, b):
                steps.append(Masked(pred, negate=True))
                nxt = a
            else:
                limit = fill_limit(e.outvars[0].aval.dtype)
                return Miss(
                    f"a jnp.where fill that is not a constant <= {limit:g} (keys stay visible)"
                )
        elif name == "add":
            found = _walk_add(g, e, steps, covered)
            if not isinstance(found, Miss):
                covered.add(i)
            return found
        else:
            return Miss(
                f"`{name}` between q k^T and the softmax (not a scale, soft cap, mask or bias)"
            )
        covered.add(i)
        cur = nxt


def _walk_add(g: Graph, e, steps: list, covered: set):
    """``s + m`` with ``m`` a ``0 / fill`` mask bias, or ``s + bias``: the side that leads
    back to the product is the logits."""
    why, depth = Miss("an addition to the logits that is neither a mask nor a float bias"), -1
    for s, other in (e.invars, e.invars[::-1]):
        if not isinstance(s, jcore.Var):
            continue
        mask = _mask_bias(g, other)
        trial_steps, trial_cov = [*steps, mask or Masked(other, is_bias=True)], set(covered)
        if mask is None and (
            not isinstance(other, jcore.Var) or not jnp.issubdtype(other.aval.dtype, jnp.floating)
        ):
            continue
        qk = _walk_logits(g, s, trial_steps, trial_cov)
        if not isinstance(qk, Miss):
            steps[:] = trial_steps
            covered.update(trial_cov)
            return qk
        if len(trial_steps) > depth:  # the reason of the side walked furthest
            why, depth = qk, len(trial_steps)
    return why


def _mask_bias(g: Graph, v):
    """A :class:`Masked` ``pred`` when ``v = where(pred, 0, fill)`` (either order)."""
    e = g.eqn_of(v)
    if e is None or e.primitive.name != "select_n" or len(e.invars) != 3:
        return None
    pred, a, b = e.invars
    if _hides(g, a) and uniform(g, b) == 0.0:
        return Masked(pred)
    if _hides(g, b) and uniform(g, a) == 0.0:
        return Masked(pred, negate=True)
    return None


# ---------------------------------------------------------------------- repeats
def _repeat(g: Graph, v) -> tuple[Any, int, int] | None:
    """``(src, a, r)`` when ``v`` is ``src`` with axis ``a`` repeated ``r`` times per entry
    (``jnp.repeat(src, r, axis=a)``, written as a broadcast to a new axis ``a + 1`` and a
    reshape merging the two: transformers' ``repeat_kv``; the new axis may first be
    added as a unit, ``x[:, :, :, None]``)."""
    e = g.eqn_of(v)
    if e is None or e.primitive.name != "reshape" or e.params.get("dimensions") is not None:
        return None
    b = g.eqn_of(e.invars[0])
    if b is None or b.primitive.name != "broadcast_in_dim":
        return None
    wide, src = tuple(b.outvars[0].aval.shape), b.invars[0]
    dims = tuple(b.params["broadcast_dimensions"])
    if src.aval.ndim == len(wide):  # [.., K, 1, ..] broadcast to [.., K, r, ..]
        units = [d for d in range(len(wide)) if src.aval.shape[d] == 1 != wide[d]]
        u = g.eqn_of(src)
        if len(units) != 1 or dims != tuple(range(len(wide))) or u is None:
            return None
        if u.primitive.name not in ("reshape", "broadcast_in_dim"):
            return None
        src, dims = u.invars[0], tuple(d for d in range(len(wide)) if d != units[0])
        if u.primitive.name == "reshape" and u.params.get("dimensions") is not None:
            return None
        if (
            u.primitive.name == "broadcast_in_dim"
            and tuple(u.params["broadcast_dimensions"]) != dims
        ):
            return None
    n = src.aval.ndim
    if len(wide) != n + 1 or tuple(src.aval.shape) != tuple(wide[d] for d in dims):
        return None
    (a,) = [d for d in range(n + 1) if d not in dims] or (None,)
    if a is None or a == 0 or dims != (*range(a), *range(a + 1, n + 1)):
        return None
    a -= 1  # the repeated axis of src; the new axis follows it
    if tuple(v.aval.shape) != (*wide[:a], wide[a] * wide[a + 1], *wide[a + 2 :]):
        return None
    return src, a, wide[a + 1]


# ---------------------------------------------------------------------- the finder
def _grouped(x, groups, xp=jnp, full=None):
    """``x`` with its axes merged into ``len(groups)`` axes, in order.

    ``groups[i]`` lists the axes of ``x`` merged into axis ``i`` (None: a unit axis);
    axes in no group must be units. With ``full`` (a size per listed entry), a group in
    which ``x`` is not all units is broadcast to its full sizes before it is merged.
    """
    flat = [a for grp in groups for a in grp]
    present = [a for a in flat if a is not None]
    rest = [a for a in range(x.ndim) if a not in present]
    y = xp.transpose(x, (*present, *rest)).reshape([x.shape[a] for a in present])
    sizes = [1 if a is None else x.shape[a] for a in flat]
    y = y.reshape(sizes)
    if full is not None:
        want, k = [], 0
        for grp in groups:
            part = sizes[k : k + len(grp)]
            want += part if all(s == 1 for s in part) else full[k : k + len(grp)]
            k += len(grp)
        y = xp.broadcast_to(y, want)
        sizes = want
    out, k = [], 0
    for grp in groups:
        out.append(math.prod(sizes[k : k + len(grp)]))
        k += len(grp)
    return y.reshape(out)


def _band(m: np.ndarray) -> tuple[bool, tuple | None] | None:
    """``(causal, window)`` when the ``[T, T]`` mask ``m`` is a band around the diagonal
    (``t - left <= s <= t + right``), or None."""
    t, s = np.indices(m.shape)
    if m.shape[0] != m.shape[1] or not m.any():
        return None
    left, right = int((t - s)[m].max()), int((s - t)[m].max())
    if left < 0 or right < 0 or not np.array_equal(m, (t - s <= left) & (s - t <= right)):
        return None
    n = m.shape[0] - 1
    if right == 0:
        return True, (None if left >= n else (left, 0))
    return False, (None if left >= n and right >= n else (left, right))


def find_attention(g: Graph, i: int, template_softmax=None) -> Replacement | Miss | None:
    """Attention ending at the ``dot_general`` equation ``i`` (``p v``)."""

    pv = g.jaxpr.eqns[i]
    if pv.primitive.name != "dot_general":
        return None
    if not (_plain_precision(pv) or _promoted_precision(pv)):
        return None
    lc, rc, lb, rb = _dims(pv)
    if len(lc) != 1:
        return None
    why = None  # a softmax feeds this product: then say what else failed
    for p_side in (0, 1):
        p_var = pv.invars[p_side]
        if not isinstance(p_var, jcore.Var):
            continue
        sm = softmax_at(g, p_var) or _template_softmax(g, p_var, template_softmax)
        if sm is None or sm.axis != (lc, rc)[p_side][0]:
            continue
        found = _assemble(g, i, p_side, sm)
        if isinstance(found, Miss):
            why = Miss(f"attention (softmax(q k^T) v) but {found}")
            continue
        return found
    return why


def _prescaled(g: Graph, v) -> tuple[Any, float]:
    """``(x, c)`` when ``v = c * x`` (``x / c``, through copies) for a constant ``c > 0``."""
    factor = 1.0
    while True:
        v = skip_identities(g, v)
        e = g.eqn_of(v)
        if e is None or e.primitive.name not in ("mul", "div") or len(g.consumers(v)) > 1:
            return v, factor
        a, b = e.invars
        c = scalar(g, b)
        if c is None and e.primitive.name == "mul":
            a, c = b, scalar(g, a)
        if c is None or not c > 0 or not isinstance(a, jcore.Var):
            return v, factor
        factor *= c if e.primitive.name == "mul" else 1.0 / c
        v = a


def _upcast_source(g: Graph, v):
    """The narrower value ``v`` is an exact upcast of (bfloat16 keys widened to float32
    for the logits), else ``v``."""
    e = g.eqn_of(skip_identities(g, v))
    if e is not None and is_upcast(e) and isinstance(e.invars[0], jcore.Var):
        return e.invars[0]
    return v


def _logits_operands(g: Graph, q, k, v) -> tuple[Any, Any]:
    """``q`` and ``k`` as the call reads them: where each is in ``v``'s dtype or an exact
    upcast of a value in it (flax's ``dot_product_attention_weights(dtype=float32)`` on bfloat16
    heads, as transformers' Flax models call it), those values. Their float32 product is
    then the operator's own: half operands, the logits accumulated in float32."""
    q0, k0 = (x if x.aval.dtype == v.aval.dtype else _upcast_source(g, x) for x in (q, k))
    if not q0.aval.dtype == k0.aval.dtype == v.aval.dtype:
        return q, k
    return q0, k0


def _query_rows(rows: list, size: dict, masks: list) -> Axis | None:
    """The query-row axis among ``q``'s free axes: the longest, preferring one a mask
    varies along (the others are query heads per key head)."""
    if not rows:
        return None
    masked = [r for r in rows if any(_varies(m, r) for m in masks)]
    return max(masked or rows, key=lambda r: size[r])


def _varies(m: Masking, role: Axis) -> bool:
    return role in m.roles and m.value.aval.shape[m.roles.index(role)] != 1


def _mask_axes(m: Masking, groups: list) -> list | None:
    """``m``'s axes for each role group (None where it has none), or None when ``m`` varies
    along an axis that no group holds."""
    axes = [[m.roles.index(r) if r in m.roles else None for r in grp] for grp in groups]
    held = {a for grp in axes for a in grp if a is not None}
    if any(n != 1 and a not in held for a, n in enumerate(m.value.aval.shape)):
        return None
    return axes


def _restore_empty_rows(o, v, mask, causal: bool, window):
    """``o`` with the mean of ``v`` in every query row that attends no key (as softmax over
    all-equal fills gives), ``o [B, T, N, H]``, ``v [B, S, K, H]``, ``mask [B|1, N|1, T|1, S]``."""
    T, S = o.shape[1], v.shape[1]
    seen = mask
    if causal or window is not None:
        t, s = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
        left, right = window if window is not None else (T + S, T + S)
        band = (t - s <= left) & (s - t <= (0 if causal else right))
        seen = jnp.logical_and(seen, band)
    seen = jnp.broadcast_to(seen, (*seen.shape[:2], T, S)).any(axis=-1)  # [B|1, N|1, T]
    groups = o.shape[2] // v.shape[2]
    mean = jnp.repeat(jnp.mean(v, axis=1), groups, axis=1)  # [B, N, H]
    return jnp.where(jnp.transpose(seen, (0, 2, 1))[..., None], o, mean[:, None])


# ---------------------------------------------------------------------- the call
@dataclasses.dataclass
class Roles:
    """The axes of ``q``, ``k``, ``v`` and of the probabilities ``p``, by role.

    Axes are named by :class:`Axis` (the logits' roles); ``*_bat``, ``*_con`` are the
    batch and contracted axes of ``q k^T`` and ``p v`` on each operand.
    """

    q: Any
    k: Any
    v: Any
    k_src: Any  # k before it was repeated per query group (k itself if it was not)
    v_src: Any
    key: Axis  # the softmax's axis
    q_con: int
    k_con: int
    q_bat: tuple
    k_bat: tuple
    rows: list  # q's free axes longer than one (query rows, query heads per key head)
    batch: list  # the batch axes of q k^T
    size: dict  # role -> its size in the logits
    p_roles: list  # the role of each axis of p
    p_bat: tuple  # p's batch axes in p v
    p_free: list  # p's free axes in p v
    v_con: int
    v_axis: dict  # batch role -> its axis of v
    v_free: list
    v_head: int  # v's feature axis
    repeated: Axis | None  # the batch role k and v were repeated along
    p_first: bool  # p is p v's left operand


def _roles(g: Graph, pv, p_side: int, sm: Softmax, lg: Logits) -> Roles | Miss:
    """The roles of every axis of ``q k^T`` and ``p v``, or why they are not attention's."""
    qlc, qrc, qlb, qrb = _dims(lg.qk)
    if len(qlc) != 1:
        return Miss("q k^T contracts more than one axis")
    key = lg.roles[sm.x_axes[sm.axis]]
    if key.side not in ("lhs", "rhs"):
        return Miss("the softmax runs over an axis that is not a key axis of q k^T")
    kp = 0 if key.side == "lhs" else 1  # the operand of q k^T that holds the keys
    q_var, k_var = lg.qk.invars[1 - kp], lg.qk.invars[kp]
    q_side = ("lhs", "rhs")[1 - kp]
    q_con, k_con = (qlc, qrc)[1 - kp][0], (qlc, qrc)[kp][0]
    q_bat, k_bat = (qlb, qrb)[1 - kp], (qlb, qrb)[kp]
    size = dict(zip(lg.roles, sm.x.aval.shape))
    k_free = [d for d in range(k_var.aval.ndim) if d not in (k_con, *k_bat, key.index)]
    if any(k_var.aval.shape[d] != 1 for d in k_free):
        return Miss("k has a free axis besides the keys")
    q_free = [Axis(q_side, d) for d in range(q_var.aval.ndim) if d not in (q_con, *q_bat)]
    rows = [r for r in q_free if q_var.aval.shape[r.index] != 1]
    batch = [Axis("batch", j) for j in range(len(q_bat))]

    # p v: p's axes hold the logits' roles in the softmax's layout.
    p_roles = [lg.roles[a] for a in sm.x_axes]
    plc, prc, plb, prb = _dims(pv)
    pb, vb = (plb, prb) if p_side == 0 else (prb, plb)
    pc, vc = (plc, prc)[p_side][0], (plc, prc)[1 - p_side][0]
    v_var = pv.invars[1 - p_side]
    if sorted((p_roles[a] for a in pb), key=repr) != sorted(batch, key=repr):
        return Miss("p v is not batched over the axes q k^T is batched over")
    p_free = [a for a in range(len(p_roles)) if a != pc and a not in pb]
    if any(p_roles[a] not in rows and size[p_roles[a]] != 1 for a in p_free):
        return Miss("p v keeps an axis of the probabilities that is not a query axis")
    v_free = [d for d in range(v_var.aval.ndim) if d != vc and d not in vb]
    v_head = [d for d in v_free if v_var.aval.shape[d] != 1]
    if len(v_head) != 1 or v_var.aval.shape[v_head[0]] != q_var.aval.shape[q_con]:
        return Miss("v does not have one feature axis as long as q's")

    # Keys and values repeated per query group: the call reads the unrepeated arrays.
    k_axis = dict(zip(batch, k_bat))
    v_axis = {p_roles[a]: d for a, d in zip(pb, vb)}
    k_src, v_src, repeated = k_var, v_var, None
    kr, vr = _repeat(g, k_var) or _repeat(g, _upcast_source(g, k_var)), _repeat(g, v_var)
    if kr and vr and kr[2] == vr[2]:
        role_k = next((r for r, a in k_axis.items() if a == kr[1]), None)
        role_v = next((r for r, a in v_axis.items() if a == vr[1]), None)
        if role_k is not None and role_k == role_v:
            k_src, v_src, repeated = kr[0], vr[0], role_k
    return Roles(
        q_var, k_var, v_var, k_src, v_src, key, q_con, k_con, tuple(q_bat), tuple(k_bat),
        rows, batch, size, p_roles, tuple(pb), p_free, vc, v_axis, v_free, v_head[0], repeated,
        p_side == 0,
    )  # fmt: skip


@dataclasses.dataclass
class Groups:
    """Roles grouped as ops.attention's ``q [B, T, K*G, H]``: batch axes some mask varies
    along are ``B``, the other batch axes (a repeated one last) ``K``, ``q``'s free axes
    other than the query rows ``T`` are ``G`` (held in ``n`` after ``K``)."""

    b: list
    k: list
    n: list  # K then G: the query heads
    t: list  # the query-row role, or none

    @property
    def masks(self) -> list:
        """The role groups of a ``[B, N, T, S]`` mask (``key``: the ``S`` role)."""
        return [self.b, self.n, self.t]


def _groups(r: Roles, masks: list) -> Groups:
    t_role = _query_rows(r.rows, r.size, masks)
    b = [x for x in r.batch if x != r.repeated and any(_varies(m, x) for m in masks)]
    k = [x for x in r.batch if x != r.repeated and x not in b]
    k += [r.repeated] if r.repeated is not None else []
    n = [*k, *(x for x in r.rows if x != t_role)]
    return Groups(b, k, n, [t_role] if t_role is not None else [])


@dataclasses.dataclass
class Masks:
    """The logits' masks as ops.attention reads them: a band (``causal``, ``window``)
    found in constant masks, and the masks and biases passed as arrays with their axes
    per ``[B, N, T, S]`` group (masks first, then the biases, which are summed)."""

    causal: bool
    window: tuple | None
    passed: list  # (Masking, axes)


def _masks(g: Graph, r: Roles, lg: Logits, grp: Groups) -> Masks | Miss:
    """Constant masks that are a band become causal / window; the others are passed.
    May move the last ``B`` role to the heads (``grp`` is updated)."""
    groups = [*grp.masks, [r.key]]
    causal, window, passed = False, None, []
    for m in lg.masks:
        axes = _mask_axes(m, groups)
        if axes is None:
            return Miss("a mask or bias varies along an axis the logits do not have")
        const = None if m.is_bias else constant_value(g, m.value)
        if const is not None:
            m4 = _grouped(~const if m.negate else const, axes, np)
            if m4.all():
                continue
            if (m4 == m4[:1, :1]).all() and not causal and window is None:
                band = _band(m4[0, 0])
                if band is not None and grp.t:
                    causal, window = band
                    continue
        passed.append((m, axes))
    if not grp.n and len(grp.b) > 1 and not any(_varies(m, grp.b[-1]) for m, _ in passed):
        # The band mask that put every batch axis in B is now `causal`: give the last one
        # (jax.nn's heads) to ops.attention's head axis. Merging it into B would hide a
        # head-sharded axis (tensor parallelism) from the partitioner, which then gathers it.
        grp.n = grp.k = [grp.b.pop()]
        groups = [*grp.masks, [r.key]]
        passed = [(m, _mask_axes(m, groups)) for m, _ in passed]
    passed.sort(key=lambda ma: ma[0].is_bias)  # masks, then the biases (summed)
    return Masks(causal, window, passed)


def _call(
    r: Roles, grp: Groups, mk: Masks, scale: float, cap: float | None, dtype: Any, out_dtype: Any
):
    """``call(q, k, v, *masks, *biases)``: ops.attention on the arrays grouped to
    ``[B, T, N, H]``, its output put back in ``p v``'s axis order; or why it cannot be.
    ``dtype``: where a product promotes one operand (:func:`_promoted_precision`), q, k
    and v are promoted to it and the output is returned in ``p v``'s dtype."""
    q_groups = [
        [r.q_bat[x.index] for x in grp.b],
        [x.index for x in grp.t],
        [r.q_bat[x.index] if x.side == "batch" else x.index for x in grp.n],
        [r.q_con],
    ]
    k_groups = [
        [r.k_bat[x.index] for x in grp.b],
        [r.key.index],
        [r.k_bat[x.index] for x in grp.k],
        [r.k_con],
    ]
    v_groups = [
        [r.v_axis[x] for x in grp.b], [r.v_con], [r.v_axis[x] for x in grp.k], [r.v_head]
    ]  # fmt: skip
    full = [r.size[x] for x in (*grp.b, *grp.n, *grp.t, r.key)]

    # The output [B.., T, K.., G.., H] back in p v's axis order.
    def q_size(x):
        return r.q.aval.shape[r.q_bat[x.index] if x.side == "batch" else x.index]

    canon = [*grp.b, *grp.t, *grp.n, "H"]
    out_sizes = [*(q_size(x) for x in canon[:-1]), r.v.aval.shape[r.v_head]]
    p_out = [r.p_roles[a] for a in r.p_free]
    v_out = ["H" if d == r.v_head else None for d in r.v_free]
    out_roles = [r.p_roles[a] for a in r.p_bat] + (
        (p_out + v_out) if r.p_first else (v_out + p_out)
    )
    o_src = [canon.index(x) if x in canon else None for x in out_roles]
    if sorted(a for a in o_src if a is not None) != list(range(len(canon))):
        return Miss("the output of p v does not hold every axis of q")

    masks = [(axes, m.negate) for m, axes in mk.passed if not m.is_bias]
    bias_axes = [axes for m, axes in mk.passed if m.is_bias]
    causal, window = mk.causal, mk.window

    def call(q, k, v, *given):
        q, k, v = promoted(dtype, q, k, v)
        q4, k4, v4 = _grouped(q, q_groups), _grouped(k, k_groups), _grouped(v, v_groups)
        mask = bias = None
        for x, (axes, negate) in zip(given, masks):
            m = _grouped(x, axes, full=full)
            m = jnp.logical_not(m) if negate else m
            mask = m if mask is None else jnp.logical_and(mask, m)
        for x, axes in zip(given[len(masks) :], bias_axes):  # ALiBi + a 0 / -inf mask, say
            b = _grouped(x, axes, full=full)
            bias = b if bias is None else bias + b
        o = ops.attention(
            q4, k4, v4, causal=causal, window=window, mask=mask, bias=bias, scale=scale,
            logit_cap=cap,
        )  # fmt: skip
        if mask is not None:  # a data mask may hide a whole row (a band never does)
            o = _restore_empty_rows(o, v4, mask, causal, window)
        o = o if dtype is None else o.astype(out_dtype)
        return arrange(o.reshape(out_sizes), o_src)

    return call


def _assemble(g: Graph, i: int, p_side: int, sm: Softmax) -> Replacement | Miss:
    """The replacement of the ``p v`` at equation ``i`` whose ``p`` is ``sm``, or why it
    is not attention: the roles of the axes, the masks, then the call."""
    pv = g.jaxpr.eqns[i]
    lg = logits_at(g, sm.x)
    if isinstance(lg, Miss):
        return lg
    r = _roles(g, pv, p_side, sm, lg)
    if isinstance(r, Miss):
        return r
    grp = _groups(r, lg.masks)
    mk = _masks(g, r, lg, grp)
    if isinstance(mk, Miss):
        return mk
    q_src, q_scale = _prescaled(g, r.q)
    k_src, k_scale = _prescaled(g, r.k_src) if r.k_src is r.k else (r.k_src, 1.0)
    q_src, k_src = _logits_operands(g, q_src, k_src, r.v_src)
    promoting = [e.outvars[0].aval.dtype for e in (lg.qk, pv) if _promoted_precision(e)]
    dtype = jnp.result_type(*promoting) if promoting else None
    scale = lg.scale * q_scale * k_scale
    call = _call(r, grp, mk, scale, lg.cap, dtype, pv.outvars[0].aval.dtype)
    if isinstance(call, Miss):
        return call
    covered = set(lg.covered) | set(sm.covered) | {i}
    if not g.private(covered, [pv.outvars[0]]):
        return Miss("the logits or probabilities are also read elsewhere")
    inputs = (q_src, k_src, r.v_src, *(m.value for m, _ in mk.passed))
    source = "softmax(q k^T) v"
    if r.repeated is not None:
        source += ", k and v repeated per query group"
    if lg.cap is not None:
        source += ", logits soft-capped"
    return Replacement(Kind.ATTENTION, "attention", source, inputs, covered, pv.outvars[0], call)
