"""Distillation losses on logits: KL divergence, generalized Jensen-Shannon, and a fused
linear + Jensen-Shannon that never holds the ``[N, V]`` logits.

Notation, per row of ``C`` (or ``V``) classes: ``T`` the temperature, ``a = logits / T``
(the student), ``b = target_logits / T`` (the teacher), ``p = softmax(a)``,
``q = softmax(b)``, ``lp = log p`` and ``lq = log q`` (``-inf`` where a class is masked
with a ``-inf`` logit).

* ``kl_divergence``: ``KL(q || p) = sum_c q_c (lq_c - lp_c)``, the forward KL that
  Hinton et al.'s distillation minimizes, with
  ``d/da = p - q`` and ``d/db = q (lq - lp - KL)``.
* ``jensen_shannon``: the generalized JSD of Agarwal et al. (GKD) with Liger-Kernel's
  and TRL's argument order, ``m = beta q + (1 - beta) p``,
  ``JSD = beta KL(q || m) + (1 - beta) KL(p || m)``, with
  ``d/da = (1 - beta) p (lp - lm - KL(p || m))`` and
  ``d/db = beta q (lq - lm - KL(q || m))``; at ``beta = 0`` and ``beta = 1`` it is the
  forward and the reverse KL.
* ``linear_jensen_shannon``: the same loss of ``x @ w`` against ``teacher_x @ teacher_w``,
  ``chunk_size`` rows at a time in a ``lax.scan`` (Liger-Kernel's FusedLinearJSD).

The local gradients above are written from log-probabilities and ``log1p``/``expm1``
forms, never from a ``log`` of a sum of probabilities, so logits of magnitude 1e4 and
``-inf`` masks stay exact and finite; both rules (tangent and backward) follow from them,
as :func:`cannjax._src.ops.rowwise.reduction` does for one input. Half-precision inputs
are computed in float32 and the results cast back.

Shape letters: ``C`` classes (last axis), ``...`` any leading axes (rows); for the fused
loss ``N`` rows, ``D`` the student width, ``D_t`` the teacher width and ``V`` the
vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.export import is_symbolic_dim
from jax.typing import ArrayLike

from cannjax._src.core import dots
from cannjax._src.core.dtypes import compute_dtype, upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.partitioned import Layout, Shards, bound, needs_devices, row_local
from cannjax._src.core.registry import EdgeCase, Level, written_for
from cannjax._src.core.validate import as_float
from cannjax._src.core.vma import varying_like
from cannjax._src.ops.linalg import weight_grad
from cannjax._src.ops.linear_cross_entropy import (
    _chunk,
    _chunks,
    _local_chunk,
    _logits,
    _padded,
    _partial_rows,
    _rows,
    _scan_chunks,
)
from cannjax._src.ops.rowwise import inv_sum, minus_max, shifted_exp

INF = float("inf")
_KL = "cannjax.ops.kl_divergence"
_JSD = "cannjax.ops.jensen_shannon"
_LJSD = "cannjax.ops.linear_jensen_shannon"
_REDUCTIONS = ("none", "sum", "mean")
_WHOLE = Shards()  # one device's view: nothing split


# ------------------------------------------------------------------------------ the math
def _log_probs(x: jax.Array, temperature: float, shards: Shards = _WHOLE):
    """``(log p, p, nonempty)`` of ``p = softmax(x / T)`` over the last axis.

    ``log p = (x - max) / T - log(sum(exp((x - max) / T)))``: the max is subtracted
    before the division, so the differences are exact for logits of 1e4 whatever ``T``;
    ``-inf`` at ``-inf`` logits. A row with no finite logit is empty: ``p = 0``,
    ``log p = -inf`` and ``nonempty`` False (axis kept). Every derivative is finite (the
    ``log`` and ``1 / s`` of an empty row are taken at 1). ``x`` is upcast here. With
    ``shards.vocab``, ``x`` holds this device's classes and the row's max and sum are
    reduced over the devices."""
    if shards.vocab:
        x = upcast(x)
        top = jax.lax.stop_gradient(
            shards.vocab_max(jnp.max(x, -1, keepdims=True, initial=-jnp.inf))
        )
        z = minus_max(x, top)
        e = jnp.exp(z)
        s = shards.vocab_sum(jnp.sum(e, -1, keepdims=True))
    else:
        z, _, e, s = shifted_exp(upcast(x), None, -1)
    if temperature != 1:
        z = z / temperature
        e = jnp.exp(z)
        s = shards.vocab_sum(jnp.sum(e, -1, keepdims=True))
    empty = s == 0
    log_s = jnp.where(empty, jnp.zeros((), s.dtype), jnp.log(jnp.where(empty, 1, s)))
    return z - log_s, e * inv_sum(s), ~empty


def _difference(keep: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``a - b`` where ``keep``, else 0; the operands are masked, not the result, so no
    ``-inf - (-inf)`` NaN is made where the result has none (``jax.debug_nans``)."""
    zero = jnp.zeros((), a.dtype)
    return jnp.where(keep, a, zero) - jnp.where(keep, b, zero)


def _kl_terms(x: jax.Array, y: jax.Array, temperature: float, shards: Shards = _WHOLE):
    """``(KL(q || p), d/da, d/db)`` per row of the student ``x`` and teacher ``y`` logits,
    differentiated w.r.t. ``a = x / T`` and ``b = y / T`` (``KL`` with the axis kept).

    ``KL = sum_c q_c (lq_c - lp_c)``; ``d/da = p sum(q) - q`` (``sum(q)`` is 1, or 0 for
    an empty teacher row), ``d/db = q (lq - lp - KL)`` (``dq_c = q_c (db_c - <q, db>)``
    and ``sum(dq) = 0``). A class the teacher masks (``q_c = 0``) contributes 0 whatever
    the student does (``0 log 0 = 0``). A row where the teacher has mass on a class the
    student masks (``lp_c = -inf < lq_c``) has ``KL = +inf`` on a whole neighbourhood:
    its gradients are 0, the derivative of that constant, at every order.
    """
    lp, p, _ = _log_probs(x, temperature, shards)
    lq, q, has_q = _log_probs(y, temperature, shards)
    sp, sq = lp != -INF, lq != -INF  # in the support (NaN counts: it propagates)
    zero = jnp.zeros((), lp.dtype)
    # lq - lp where both are finite, 0 elsewhere (q = 0 there, or the row is +inf).
    d = _difference(sp & sq, lq, lp)
    kl = shards.vocab_sum(jnp.sum(q * d, -1, keepdims=True))
    infinite = jnp.any(sq & ~sp, -1, keepdims=True)
    if shards.vocab:
        infinite = shards.vocab_max(infinite.astype(jnp.int32)) > 0
    da = jnp.where(infinite, zero, p * has_q.astype(p.dtype) - q)
    db = jnp.where(infinite, zero, q * (d - kl))
    return jnp.where(infinite, INF, kl), da, db


def _jsd_terms(x: jax.Array, y: jax.Array, beta: float, temperature: float,
               shards: Shards = _WHOLE):  # fmt: skip
    """``(JSD, d/da, d/db)`` per row for ``0 < beta < 1`` (as :func:`_kl_terms`).

    With ``lm = log(beta q + (1 - beta) p)`` the ratios ``rp = lp - lm`` and
    ``rq = lq - lm`` come from ``delta = lq - lp`` alone, never from ``lm``: on the side
    of the smaller probability, ``rp = -log1p(beta expm1(delta))`` where ``delta <= 0``
    (``q <= p``) and ``rq = -log1p((1 - beta) expm1(-delta))`` where ``delta > 0``; the
    other from ``rq = rp + delta``. One ``expm1`` and one ``log1p`` per entry, bounded
    (``rp <= -log(1 - beta)``, ``rq <= -log(beta)``), exactly 0 where ``p = q``, and the
    finite limits at the ``+-inf`` deltas of a class one side masks. That side then
    contributes 0; a class both sides mask contributes nothing.
    """
    lp, p, _ = _log_probs(x, temperature, shards)
    lq, q, _ = _log_probs(y, temperature, shards)
    sp, sq = lp != -INF, lq != -INF  # in the support (NaN counts: it propagates)
    zero = jnp.zeros((), lp.dtype)
    delta = _difference(sp | sq, lq, lp)  # +inf: only q; -inf: only p
    low = delta <= 0
    # -|delta|, written with where so that its derivative at delta = 0 is the low side's.
    t = -jnp.log1p(jnp.where(low, beta, 1 - beta) * jnp.expm1(jnp.where(low, delta, -delta)))
    rp = jnp.where(sp, jnp.where(low, t, t - delta), zero)
    rq = jnp.where(sq, jnp.where(low, t + delta, t), zero)
    kl_p = shards.vocab_sum(jnp.sum(p * rp, -1, keepdims=True))  # KL(p || m)
    kl_q = shards.vocab_sum(jnp.sum(q * rq, -1, keepdims=True))  # KL(q || m)
    loss = beta * kl_q + (1 - beta) * kl_p
    return loss, (1 - beta) * p * (rp - kl_p), beta * q * (rq - kl_q)


def _divergence(x: jax.Array, y: jax.Array, beta: float, temperature: float,
                shards: Shards = _WHOLE):  # fmt: skip
    """``(loss, d/da, d/db)`` per row (axis kept) of the generalized JSD at ``beta`` of the
    logits ``x`` (student) and ``y`` (teacher), the derivatives w.r.t. ``x / T`` and
    ``y / T``; ``beta = 0`` is ``KL(q || p)`` and ``beta = 1`` is ``KL(p || q)``. With
    ``shards.vocab`` the classes are split over devices (:func:`_log_probs`)."""
    if beta == 0:
        return _kl_terms(x, y, temperature, shards)
    if beta == 1:
        # KL(p || q): the student plays the teacher's part.
        loss, db, da = _kl_terms(y, x, temperature, shards)
        return loss, da, db
    return _jsd_terms(x, y, beta, temperature, shards)


# ------------------------------------------------------------------------------ row operators
def _pair_operator(name: str, *, kl: bool):
    """The operator of a divergence of two ``[..., C]`` logit arrays, both differentiated.

    It keeps only its two inputs: the rules recompute both softmaxes (one ``exp`` per
    entry each) and the local gradients ``J_a``, ``J_b`` of :func:`_divergence`, then
    ``tangent = sum(J_a da + J_b db) / T`` and ``backward = (g J_a / T, g J_b / T)``.
    """

    def terms(res, beta, temperature):
        return _divergence(res["logits"], res["target_logits"], 0.0 if kl else beta, temperature)

    def forward(logits, target_logits, *, temperature, beta=0.0):
        res = {"logits": logits, "target_logits": target_logits}
        loss = terms(res, beta, temperature)[0][..., 0]
        return loss.astype(logits.dtype), res

    def tangent(res, t_logits, t_target, *, temperature, beta=0.0):
        _, da, db = terms(res, beta, temperature)
        dy = jnp.sum(da * upcast(t_logits) + db * upcast(t_target), -1) / temperature
        return dy.astype(t_logits.dtype)

    def backward(res, g, *, temperature, beta=0.0):
        _, da, db = terms(res, beta, temperature)
        g = upcast(g)[..., None] / temperature
        logits, target = res["logits"], res["target_logits"]
        return (g * da).astype(logits.dtype), (g * db).astype(target.dtype)

    return defop(
        name,
        forward=forward,
        tangent=tangent,
        backward=backward,
        residuals={
            "logits": "the student logits [..., C] (an input)",
            "target_logits": "the teacher logits [..., C] (an input)",
        },
        level=Level.RECOMPUTE,
        reuse=(),
    )


_kl = _pair_operator("kl_divergence", kl=True)
_jsd = _pair_operator("jensen_shannon", kl=False)


# ------------------------------------------------------------------------------ validation
def _number(fn: str, arg: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{fn}: {arg} must be a Python number (a static argument), got {value!r}")
    return float(value)


def _temperature(fn: str, temperature: Any) -> float:
    t = _number(fn, "temperature", temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{fn}: temperature must be a finite number > 0, got {temperature!r}")
    return t


def _beta(fn: str, beta: Any) -> float:
    b = _number(fn, "beta", beta)
    if not 0 <= b <= 1:
        raise ValueError(
            f"{fn}: beta must be in [0, 1] (0: forward KL(q || p), 1: reverse KL(p || q)), "
            f"got {beta!r}"
        )
    return b


def _logit_pair(fn: str, logits: Any, target_logits: Any) -> tuple[jax.Array, jax.Array]:
    logits = as_float(fn, "logits", logits)
    target_logits = as_float(fn, "target_logits", target_logits)
    if logits.ndim < 1:
        raise ValueError(
            f"{fn}: logits must have at least one dimension (classes on the last axis), "
            "got a scalar"
        )
    if target_logits.shape != logits.shape:
        raise ValueError(
            f"{fn}: target_logits must have the shape of logits {tuple(logits.shape)} (one "
            f"teacher distribution per student row), got {tuple(target_logits.shape)}"
        )
    dtype = jnp.promote_types(logits.dtype, target_logits.dtype)
    return logits.astype(dtype), target_logits.astype(dtype)


# ------------------------------------------------------------------------------ references
def _plain_log_probs(x, temperature):
    return jax.nn.log_softmax(x / temperature, axis=-1)


def _plain_kl(lp, lq):
    # sum q (lq - lp), 0 where q = 0: the double where keeps plain autodiff finite there.
    q = jnp.exp(lq)
    return jnp.sum(q * jnp.where(q > 0, lq - lp, 0.0), -1)


def _kl_reference(logits, target_logits, *, temperature=1.0):
    """``KL(q || p)`` in plain jnp: jax.nn.log_softmax and ``sum q (log q - log p)``."""
    lp = _plain_log_probs(logits, temperature)
    return _plain_kl(lp, _plain_log_probs(target_logits, temperature))


def _jsd_reference(logits, target_logits, *, beta=0.5, temperature=1.0):
    """The generalized JSD in plain jnp, with the mixture ``m`` formed from probabilities."""
    lp = _plain_log_probs(logits, temperature)
    lq = _plain_log_probs(target_logits, temperature)
    if beta == 0:
        return _plain_kl(lp, lq)
    if beta == 1:
        return _plain_kl(lq, lp)
    p, q = jnp.exp(lp), jnp.exp(lq)
    m = beta * q + (1 - beta) * p
    lm = jnp.log(jnp.where(m > 0, m, 1.0))
    kl_q = jnp.sum(q * jnp.where(q > 0, lq - lm, 0.0), -1)
    kl_p = jnp.sum(p * jnp.where(p > 0, lp - lm, 0.0), -1)
    return beta * kl_q + (1 - beta) * kl_p


# ------------------------------------------------------------------------------ samples, edges
def _pair_sample(key):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.normal(k1, (3, 5), jnp.float32) * 2,
        jax.random.normal(k2, (3, 5), jnp.float32) * 2,
    )


def _f32(v):
    return jnp.asarray(v, jnp.float32)


# Rows with -inf logits. _MASKED: the teacher masks classes the student keeps (they
# contribute 0 to KL(q || p)) and both mask some; the student masks none the teacher
# keeps. _SAME: the student masks exactly the teacher's masked classes.
_MASKED_S = [[0.5, -1.0, -INF, 2.0], [1.0, 0.0, 3.0, -2.0], [-INF, 0.3, 0.1, -INF]]
_MASKED_T = [[-INF, 1.5, -INF, 0.0], [-INF, -INF, 2.0, -1.0], [-INF, -1.0, 0.7, -INF]]
_SAME_S = [[-INF, -1.0, -INF, 2.0], [-INF, -INF, 3.0, -2.0], [-INF, 0.3, 0.1, -INF]]
# Logits of magnitude 1e4: plain exp overflows; the differences are exact.
_BIG_S = [[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 3.0, -1e4 + 1.0, -1e4]]
_BIG_T = [[1e4 - 2.0, 1e4, -1e4, 0.0], [-1e4 + 2.0, -1e4, -1e4 + 1.0, -1e4 + 0.5]]


def _np_log_probs(x, temperature=1.0):
    x = np.asarray(x, np.float64) / temperature
    m = x.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        z = x - np.where(np.isfinite(m), m, 0.0)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _kl_grads_np(logits, target, temperature=1.0):
    """``(KL, d/dlogits, d/dtarget)`` of ``sum(KL)`` in float64 numpy, rows with finite
    values only (the edge points' expected values)."""
    lp, lq = _np_log_probs(logits, temperature), _np_log_probs(target, temperature)
    p, q = np.exp(lp), np.exp(lq)
    with np.errstate(invalid="ignore"):
        d = np.where(q > 0, lq - lp, 0.0)
    kl = (q * d).sum(-1, keepdims=True)
    return kl[..., 0], (p - q) / temperature, q * (d - kl) / temperature


def _kl_edges():
    s, t = _f32(_MASKED_S), _f32(_MASKED_T)
    # Row 0: the teacher puts mass on class 2, which the student masks: KL = +inf with
    # gradients 0 (row 1 is an ordinary row).
    inf_s = _f32([[0.5, -1.0, -INF, 2.0], [0.3, 0.1, -0.2, 1.0]])
    inf_t = _f32([[0.0, 1.0, 0.5, -INF], [1.0, -1.0, 0.0, 0.5]])
    kl1, gs1, gt1 = _kl_grads_np(inf_s[1:], inf_t[1:])
    zeros = np.zeros((1, 4))
    return [
        EdgeCase((s, t)),
        EdgeCase((inf_s, inf_t), kwargs={"temperature": 1.0}, reference_grad=False,
                 expected_value=np.concatenate([[INF], kl1]),
                 expected_grad=(np.concatenate([zeros, gs1]), np.concatenate([zeros, gt1]))),
        EdgeCase((_f32(_BIG_S), _f32(_BIG_T))),
        # Identical distributions: 0 and gradient 0, exactly.
        EdgeCase((s, s), expected_value=np.zeros(3),
                 expected_grad=(np.zeros((3, 4)), np.zeros((3, 4)))),
    ]  # fmt: skip


def _jsd_edges():
    s, t, same = _f32(_MASKED_S), _f32(_MASKED_T), _f32(_SAME_S)
    return [
        # Both sides mask the same classes: finite for every beta.
        EdgeCase((same, t)),
        # One side masks classes the other keeps: finite for 0 < beta < 1 (an endpoint
        # is a KL, +inf for one of the two orders).
        EdgeCase((s, t), kwargs={"beta": 0.5}),
        EdgeCase((t, s), kwargs={"beta": 0.9}),
        EdgeCase((_f32(_BIG_S), _f32(_BIG_T))),
        EdgeCase((same, same), expected_value=np.zeros(3),
                 expected_grad=(np.zeros((3, 4)), np.zeros((3, 4)))),
    ]  # fmt: skip


# ------------------------------------------------------------------------------ kl_divergence
@registered(
    _kl,
    reference=_kl_reference,
    sample=_pair_sample,
    edges=_kl_edges,
    configs=({}, {"temperature": 2.0}),
    doc="KL(q || p) of the teacher's softmax q against the student's p, per row of logits.",
)
def kl_divergence(
    logits: ArrayLike, target_logits: ArrayLike, *, temperature: float = 1.0
) -> jax.Array:
    """Kullback-Leibler divergence ``KL(q || p)`` of softmax distributions, per row.

    With ``p = softmax(logits / T)`` (the student) and ``q = softmax(target_logits / T)``
    (the teacher, or the target), over the last axis::

      KL(q || p) = sum_c q_c (log q_c - log p_c)

    the forward KL of distillation (Hinton et al.). The same value as
    ``optax.kl_divergence(jax.nn.log_softmax(logits / T), jax.nn.softmax(target_logits / T))``
    and ``optax.losses.kl_divergence_with_log_targets`` on the two log-softmaxes (optax
    takes log-probabilities and probabilities; this function takes logits). Hinton et
    al. multiply the loss by ``T**2`` to keep gradient magnitudes independent of ``T``;
    that factor is left to the caller.

    Both inputs are differentiated (hand-written)::

      d KL / d logits        = (p - q) / T
      d KL / d target_logits = q (log q - log p - KL) / T

    Saved for the backward: the two inputs only. The tangent and the backward recompute
    both softmaxes from them (one ``exp`` per entry each); plain autodiff of the formula
    keeps several ``[..., C]`` arrays (both log-softmaxes, ``q``, the differences).

    Edge conventions (``-inf`` logits are masked classes):

    * A class the teacher masks (``q_c = 0``) contributes 0 whatever the student's logit
      (``0 log 0 = 0``), also where the student masks it too, and gets no gradient.
    * Where the teacher has mass on a class the student masks (``q_c > 0``,
      ``logits_c = -inf``) the row's loss is ``+inf``. It is ``+inf`` on a whole
      neighbourhood of that point, so its gradients (and second derivatives) are 0, the
      derivative of a constant, rather than NaN.
    * A teacher row with no finite logit is an empty distribution: loss 0, gradient 0.
    * Logits of magnitude 1e4 are exact (the row maxima are subtracted before dividing
      by ``T`` and before ``exp``); identical distributions give 0 and gradient 0,
      exactly at ``T = 1``. A NaN logit makes its row NaN.

    Args:
      logits: the student's logits ``[..., C]``, floating point.
      target_logits: the teacher's logits, the same shape (promoted with ``logits`` to a
        common dtype).
      temperature: ``T > 0`` (a Python number), dividing both logit arrays.

    Returns:
      ``KL(q || p)`` per row, shape ``[...]``, in the common dtype of the inputs
      (half-precision inputs are computed in float32).

    Raises:
      TypeError: a non-floating input, or a temperature that is not a number.
      ValueError: a scalar ``logits``, ``target_logits`` of another shape, or
        ``temperature <= 0``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import kl_divergence
      >>> student = jnp.array([[0.0, 0.0], [0.0, -jnp.inf]])
      >>> teacher = jnp.array([[0.0, jnp.log(3.0)], [0.0, -jnp.inf]])
      >>> kl_divergence(student, teacher).round(6)  # KL([1/4, 3/4] || [1/2, 1/2]), 0
      Array([0.130812, 0.      ], dtype=float32)
      >>> g = jax.grad(lambda s: kl_divergence(s, teacher).sum())(student)  # p - q
      >>> g.round(6)
      Array([[ 0.25, -0.25],
             [ 0.  ,  0.  ]], dtype=float32)

    References:
      Hinton, Vinyals and Dean, "Distilling the Knowledge in a Neural Network", 2015.
      https://arxiv.org/abs/1503.02531
      Kullback and Leibler, "On Information and Sufficiency", 1951.
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024 (its
      KLDivergence kernel). https://arxiv.org/abs/2410.10989
    """
    logits, target_logits = _logit_pair(_KL, logits, target_logits)
    return _kl(logits, target_logits, temperature=_temperature(_KL, temperature))


# ------------------------------------------------------------------------------ jensen_shannon
@registered(
    _jsd,
    reference=_jsd_reference,
    sample=_pair_sample,
    edges=_jsd_edges,
    configs=({}, {"beta": 0.0}, {"beta": 1.0, "temperature": 2.0}),
    doc="Generalized Jensen-Shannon divergence of two softmax distributions, per row.",
)
def jensen_shannon(
    logits: ArrayLike,
    target_logits: ArrayLike,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> jax.Array:
    """Generalized Jensen-Shannon divergence of softmax distributions, per row.

    With ``p = softmax(logits / T)`` (the student), ``q = softmax(target_logits / T)``
    (the teacher) over the last axis and the mixture ``m = beta q + (1 - beta) p``::

      JSD_beta = beta KL(q || m) + (1 - beta) KL(p || m)        for 0 < beta < 1
      JSD_0    = KL(q || p)      (forward KL, = kl_divergence(logits, target_logits))
      JSD_1    = KL(p || q)      (reverse KL, = kl_divergence(target_logits, logits))

    This is the generalized JSD of Agarwal et al. (GKD) in the convention of
    Liger-Kernel's ``LigerJSD`` and TRL's ``generalized_jsd_loss``: the first argument is
    the student, ``beta`` weighs the teacher's term, and ``beta = 1/2`` is the symmetric
    JSD of Lin (1991), at most ``log 2``. The endpoints follow them too: the formula
    itself tends to 0 as ``beta -> 0`` or ``beta -> 1`` (the mixture becomes one of the
    two distributions), while ``JSD_beta / beta -> KL(q || p)`` and
    ``JSD_beta / (1 - beta) -> KL(p || q)``; ``beta`` in ``{0, 1}`` therefore selects
    those KLs, the divergences whose gradients JSD's approach near the ends. The
    function is defined on the closed interval ``[0, 1]`` but not continuous at its
    ends.

    Both inputs are differentiated (hand-written), for ``0 < beta < 1``::

      d JSD / d logits        = (1 - beta) p (log p - log m - KL(p || m)) / T
      d JSD / d target_logits = beta q (log q - log m - KL(q || m)) / T

    and as :func:`kl_divergence` at the endpoints. The ratios ``log p - log m`` and
    ``log q - log m`` are computed from ``delta = log q - log p`` alone
    (``-log1p(beta expm1(delta))`` and its mirror), never as the log of a sum of
    probabilities: finite and exact for logits of magnitude 1e4, exactly 0 where
    ``p = q``. Saved for the backward: the two inputs only (as :func:`kl_divergence`).

    Edge conventions: for ``0 < beta < 1`` the loss is finite for every pair of
    distributions (``KL(q || m) <= -log(beta)``); a class one side masks (``-inf``)
    contributes only from the other side, a class both mask contributes nothing,
    identical distributions give 0 with gradient 0 (exactly at ``T = 1``), and a NaN
    logit makes its row NaN. At ``beta = 0`` or 1 the
    conventions of :func:`kl_divergence` hold (``+inf`` where the KL is infinite, with
    gradient 0).

    Args:
      logits: the student's logits ``[..., C]``, floating point.
      target_logits: the teacher's logits, the same shape (promoted with ``logits``).
      beta: the teacher's weight in the mixture, in ``[0, 1]`` (a Python number).
      temperature: ``T > 0`` (a Python number), dividing both logit arrays.

    Returns:
      ``JSD_beta`` per row, shape ``[...]``, in the common dtype of the inputs
      (half-precision inputs are computed in float32).

    Raises:
      TypeError: a non-floating input, or ``beta`` or ``temperature`` not a number.
      ValueError: a scalar ``logits``, ``target_logits`` of another shape,
        ``beta`` outside ``[0, 1]`` or ``temperature <= 0``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.ops import jensen_shannon
      >>> student = jnp.array([[0.0, -jnp.inf], [1.0, 1.0]])
      >>> teacher = jnp.array([[-jnp.inf, 0.0], [1.0, 1.0]])
      >>> jensen_shannon(student, teacher)  # disjoint supports: log 2; equal: 0
      Array([0.6931472, 0.       ], dtype=float32)

    References:
      Lin, "Divergence Measures Based on the Shannon Entropy", IEEE Trans. Inf. Theory,
      1991.
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), ICLR 2024. https://arxiv.org/abs/2306.13649
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024 (its
      JSD kernel). https://arxiv.org/abs/2410.10989
    """
    logits, target_logits = _logit_pair(_JSD, logits, target_logits)
    return _jsd(
        logits,
        target_logits,
        beta=_beta(_JSD, beta),
        temperature=_temperature(_JSD, temperature),
    )


# ------------------------------------------------------------------------------ fused, per row
# Arguments of both operators: x [N, D], w [D, V], teacher_x [N, D_t], teacher_w [D_t, V]
# and valid [N] (bool: the row counts); the last three are not differentiated.
def _chunk_terms(xc, txc, w, tw, *, beta, temperature, acc, shards=_WHOLE):
    """``(loss [c], d/da [c, V])`` of one chunk; ``a`` the scaled student logits."""
    a, b = _logits(xc, w, acc), _logits(txc, tw, acc)
    loss, da, _ = _divergence(a, b, beta, temperature, shards)
    return loss[:, 0], da


def _acc(x, tx):
    return compute_dtype(jnp.promote_types(x.dtype, tx.dtype))


def _fused_chunks(x, tx, valid, chunk, strided):
    xs, vs, N = _chunks(x, valid, chunk, False, strided)  # padded rows are not valid
    return xs, _chunks(tx, valid, chunk, False, strided)[0], vs, N


def _fused_forward(x, w, tx, tw, valid, *, chunk, beta, temperature):
    local = bound(_forward_rows, chunk=chunk, beta=beta, temperature=temperature)
    (loss,) = row_local(local, _FORWARD_LAYOUT, x, w, tx, tw, valid)
    return loss, {"x": x, "w": w, "tx": tx, "tw": tw, "valid": valid}


def _forward_rows(x, w, tx, tw, valid, *, chunk, beta, temperature, shards):
    """:func:`_fused_forward` on one device's rows (and classes): ``[loss]``."""
    acc = _acc(x, tx)
    xs, txs, vs, N = _fused_chunks(x, tx, valid, _local_chunk(chunk, x.shape[0]), True)
    kw = dict(beta=beta, temperature=temperature, acc=acc, shards=shards)

    def step(_, c):
        xc, txc, vc = c
        loss, _ = _chunk_terms(xc, txc, w, tw, **kw)
        return None, jnp.where(vc, loss, 0.0)

    _, loss = _scan_chunks(step, None, (xs, txs, vs), True)
    return [_rows(loss, N, True).astype(x.dtype)]


def _fused_backward(res, g, *, chunk, beta, temperature):
    # G = g J_a / T on valid rows; dx = G w^T per chunk, dw = sum over chunks of x^T G.
    x, w, tx, tw = res["x"], res["w"], res["tx"], res["tw"]
    local = bound(_backward_rows, chunk=chunk, beta=beta, temperature=temperature)
    dx, dw = row_local(local, _BACKWARD_LAYOUT, x, w, tx, tw, res["valid"], g)
    return dx, dw.astype(w.dtype)


def _backward_rows(x, w, tx, tw, valid, g, *, chunk, beta, temperature, shards):
    """:func:`_fused_backward` on one device's rows (and classes): ``[dx, dw]``."""
    acc, (D, V) = _acc(x, tx), w.shape
    xs, txs, vs, N = _fused_chunks(x, tx, valid, _local_chunk(chunk, x.shape[0]), False)
    gs = _padded(upcast(g), vs, False)
    kw = dict(beta=beta, temperature=temperature, acc=acc, shards=shards)

    def step(dw, c):
        xc, txc, vc, gc = c
        _, da = _chunk_terms(xc, txc, w, tw, **kw)
        G = (da * (jnp.where(vc, gc, 0.0) / temperature)[:, None]).astype(x.dtype)
        dxc = dots.matmul_t(G, w, out_dtype=acc)
        return dw + weight_grad(xc, G, acc), _partial_rows(dxc, x.dtype, shards)

    dw0 = varying_like(jnp.zeros((D, V), acc), x, w, tx, tw, valid, g)  # under shard_map
    dw, dx = _scan_chunks(step, dw0, (xs, txs, vs, gs), False)
    dx = shards.vocab_sum(_rows(dx, N, False)).astype(x.dtype)
    return [dx, shards.rows_sum(dw)]


# Rows (n) stay where the program put them, and the classes (v) of both heads where the
# student's are split over axes the rows do not use (core/partitioned.py).
_FORWARD_LAYOUT = Layout(ins=("nd", "dv", "nt", "tv", "n"), outs=("n",), vocab_of=1)
_BACKWARD_LAYOUT = Layout(ins=("nd", "dv", "nt", "tv", "n", "n"), outs=("nd", "dv"), vocab_of=1)


def _fused_tangent(res, t_x, t_w, *, chunk, beta, temperature):
    # d loss[n] = <J_a[n], (dx w + x dw)[n]> / T, chunk by chunk.
    x, w, tx, tw = res["x"], res["w"], res["tx"], res["tw"]
    acc = _acc(x, tx)
    xs, txs, vs, N = _fused_chunks(x, tx, res["valid"], chunk, True)
    t_xs = _chunks(t_x, res["valid"], chunk, False, True)[0]

    def step(_, c):
        xc, txc, vc, t_xc = c
        _, da = _chunk_terms(xc, txc, w, tw, beta=beta, temperature=temperature, acc=acc)
        dlogits = _logits(t_xc, w, acc) + _logits(xc, t_w, acc)
        return None, jnp.where(vc, (da * dlogits).sum(-1) / temperature, 0.0)

    _, out = _scan_chunks(step, None, (xs, txs, vs, t_xs), True)
    return _rows(out, N, True).astype(t_x.dtype)


_FUSED_STATIC = ("chunk", "beta", "temperature")
_ljsd = defop(
    "linear_jensen_shannon",
    forward=jax.jit(_fused_forward, static_argnames=_FUSED_STATIC),
    tangent=jax.jit(_fused_tangent, static_argnames=_FUSED_STATIC),
    backward=jax.jit(_fused_backward, static_argnames=_FUSED_STATIC),
    nondiff_argnums=(2, 3, 4),
    residuals={
        "x": "the student inputs [N, D] (an input)",
        "w": "the student weights [D, V] (an input)",
        "tx": "the teacher inputs teacher_x [N, D_t] (an input)",
        "tw": "the teacher weights teacher_w [D_t, V] (an input)",
        "valid": "which rows count, bool [N] (from the labels)",
    },
    level=Level.RECOMPUTE,
    reuse=(),
)


# ------------------------------------------------------------------------------ fused, reduced
# reduction="sum" / "mean": the loss is a scalar, so its cotangent is one number and the
# gradients are that number times ones the forward can compute as it goes:
#   dx = s G w^T,  dw = s x^T G,  G = J_a / T on valid rows (s = 1, or 1 / count).
# The forward makes them chunk by chunk (4 products: both logits, G w^T and x^T G) and
# keeps them; the backward only scales. As linear_cross_entropy's reduced path.
def _reduced_forward(x, w, tx, tw, valid, *, chunk, beta, temperature, mean):
    acc = _acc(x, tx)
    scale = 1 / jnp.maximum(valid.sum(), 1).astype(acc) if mean else jnp.ones((), acc)
    local = bound(_reduced_rows, chunk=chunk, beta=beta, temperature=temperature)
    total, dx, dw = row_local(local, _REDUCED_LAYOUT, x, w, tx, tw, valid, scale)
    loss = (total.sum() * scale).astype(x.dtype)
    return loss, {"dx": dx, "dw": dw.astype(w.dtype)}


def _reduced_rows(x, w, tx, tw, valid, scale, *, chunk, beta, temperature, shards):
    """:func:`_reduced_forward` on one device's rows (and classes): the sum of its rows'
    losses (``[1]``, not scaled), ``dx`` and ``dw`` (scaled)."""
    acc, (D, V) = _acc(x, tx), w.shape
    xs, txs, vs, N = _fused_chunks(x, tx, valid, _local_chunk(chunk, x.shape[0]), False)
    kw = dict(beta=beta, temperature=temperature, acc=acc, shards=shards)

    def step(carry, c):
        total, dw = carry
        xc, txc, vc = c
        loss, da = _chunk_terms(xc, txc, w, tw, **kw)
        total = total + jnp.where(vc, loss, 0.0).sum()
        G = (da * jnp.where(vc, scale / temperature, 0.0)[:, None]).astype(x.dtype)
        dxc = dots.matmul_t(G, w, out_dtype=acc)
        return (total, dw + weight_grad(xc, G, acc)), _partial_rows(dxc, x.dtype, shards)

    init = varying_like((jnp.zeros((), acc), jnp.zeros((D, V), acc)), x, w, tx, tw, valid)
    (total, dw), dx = _scan_chunks(step, init, (xs, txs, vs), False)
    dx = shards.vocab_sum(_rows(dx, N, False)).astype(x.dtype)
    return [shards.rows_sum(total)[None], dx, shards.rows_sum(dw)]


_REDUCED_LAYOUT = Layout(ins=("nd", "dv", "nt", "tv", "n", ""), outs=("s", "nd", "dv"),
                         vocab_of=1)  # fmt: skip


def _reduced_backward(res, g, **static):
    return (g * res["dx"]).astype(res["dx"].dtype), (g * res["dw"]).astype(res["dw"].dtype)


def _reduced_tangent(res, t_x, t_w, **static):
    acc = compute_dtype(t_x.dtype)
    dot = jnp.vdot(res["dx"].astype(acc), t_x.astype(acc)) + jnp.vdot(
        res["dw"].astype(acc), t_w.astype(acc)
    )
    return dot.astype(t_x.dtype)


_ljsd_reduced = defop(
    "linear_jensen_shannon_reduced",
    forward=jax.jit(_reduced_forward, static_argnames=(*_FUSED_STATIC, "mean")),
    tangent=_reduced_tangent,
    backward=_reduced_backward,
    nondiff_argnums=(2, 3, 4),
    residuals={
        "dx": "the gradient of the loss w.r.t. x, [N, D]",
        "dw": "the gradient w.r.t. w, [D, V]",
    },
    level=Level.DERIVED,
    reuse=(),
)


# ------------------------------------------------------------------------------ fused, public
def _ljsd_reference(
    x,
    w,
    teacher_x,
    teacher_w,
    labels=None,
    *,
    beta=0.5,
    temperature=1.0,
    chunk_size=None,
    ignore_index=-100,
    reduction="mean",
):
    """Both logit arrays written out, the plain-jnp JSD per row, 0 where ignored, then
    summed or averaged over the rows not ignored."""
    del chunk_size
    loss = _jsd_reference(x @ w, teacher_x @ teacher_w, beta=beta, temperature=temperature)
    valid = jnp.ones(loss.shape, bool) if labels is None else labels != ignore_index
    loss = jnp.where(valid, loss, jnp.zeros((), loss.dtype))
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / jnp.maximum(valid.sum(), 1).astype(total.dtype) if reduction == "mean" else total


def _ljsd_sample(key):
    k = jax.random.split(key, 5)
    x = jax.random.normal(k[0], (6, 4), jnp.float32)
    w = jax.random.normal(k[1], (4, 5), jnp.float32)
    tx = jax.random.normal(k[2], (6, 3), jnp.float32)
    tw = jax.random.normal(k[3], (3, 5), jnp.float32)
    labels = jax.random.randint(k[4], (6,), 0, 5)
    return x, w, tx, tw, labels.at[2].set(-100)


def _ljsd_edges():
    x, w, tx, tw, labels = _ljsd_sample(jax.random.key(3))
    return [
        # Every row ignored: 0 (the mean over no row too), gradients 0.
        EdgeCase((x, w, tx, tw, jnp.full((6,), -100)), kwargs={"chunk_size": 4},
                 expected_value=jnp.zeros(6)),
        EdgeCase((x, w, tx, tw, jnp.full((6,), -100)), kwargs={"reduction": "mean"},
                 expected_value=jnp.zeros(())),
        # Large logits (|x @ w| ~ 1e2) and no labels.
        EdgeCase((x * 30.0, w, tx * 30.0, tw), kwargs={"chunk_size": 4}),
        # Leading dimensions [2, 3, D], the rows padded to whole chunks.
        EdgeCase((x.reshape(2, 3, 4), w, tx.reshape(2, 3, 3), tw, labels.reshape(2, 3)),
                 kwargs={"chunk_size": 4}),
        # The student equals the teacher: 0 and gradient 0.
        EdgeCase((x, w, x, w, labels), expected_value=jnp.zeros(6),
                 expected_grad=(jnp.zeros((6, 4)), jnp.zeros((4, 5)))),
    ]  # fmt: skip


def _fused_operands(x, w, teacher_x, teacher_w, labels, ignore_index):
    x, w = as_float(_LJSD, "x", x), as_float(_LJSD, "w", w)
    tx, tw = as_float(_LJSD, "teacher_x", teacher_x), as_float(_LJSD, "teacher_w", teacher_w)
    if x.ndim < 1:
        raise ValueError(f"{_LJSD}: x must have rank >= 1 (shape [..., D]), got a scalar")
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{_LJSD}: w must have shape (D, V) with D == x.shape[-1] == {x.shape[-1]}, got "
            f"{tuple(w.shape)}"
        )
    if tx.ndim != x.ndim or tx.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"{_LJSD}: teacher_x must have shape x.shape[:-1] + (D_t,) == "
            f"{tuple(x.shape[:-1])} + (D_t,) (one teacher row per student row), got "
            f"{tuple(tx.shape)}"
        )
    if tw.ndim != 2 or tw.shape != (tx.shape[-1], w.shape[1]):
        raise ValueError(
            f"{_LJSD}: teacher_w must have shape (D_t, V) == ({tx.shape[-1]}, {w.shape[1]}) "
            f"(D_t == teacher_x.shape[-1], V == w.shape[1]), got {tuple(tw.shape)}"
        )
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
        ignore_index, (int, np.integer)
    ):
        raise TypeError(f"{_LJSD}: ignore_index must be an int, got {ignore_index!r}")
    if labels is None:
        valid = jnp.ones(x.shape[:-1], bool)
    else:
        labels = labels if isinstance(labels, jax.Array) else jnp.asarray(labels)
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise TypeError(
                f"{_LJSD}: labels must be an integer array (rows equal to ignore_index "
                f"are left out) or None, got {labels.dtype.name}{list(labels.shape)}; use "
                "labels.astype(jnp.int32)"
            )
        if labels.shape != x.shape[:-1]:
            raise ValueError(
                f"{_LJSD}: labels must have shape x.shape[:-1] == {tuple(x.shape[:-1])}, "
                f"got labels.shape={tuple(labels.shape)}"
            )
        valid = labels != ignore_index
    dtype = jnp.promote_types(x.dtype, w.dtype)
    tdtype = jnp.promote_types(tx.dtype, tw.dtype)
    return x.astype(dtype), w.astype(dtype), tx.astype(tdtype), tw.astype(tdtype), valid


def _fused_chunk_rows(chunk_size, n, V):
    """Rows per chunk, validated here (errors name this function). The default is
    :func:`cannjax._src.ops.linear_cross_entropy._chunk`'s for ``2 V`` logits per row
    (a row holds a student and a teacher row of logits): the same bytes of logits per
    chunk as linear_cross_entropy's, 256 rows at ``V = 32768``."""
    if chunk_size is None:
        if is_symbolic_dim(V):
            raise ValueError(
                f"{_LJSD}: the default chunk_size is chosen from the vocabulary size "
                f"V = w.shape[1], which is symbolic ({V}); pass chunk_size (rows per step) "
                "explicitly to export with a symbolic V"
            )
    elif isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(f"{_LJSD}: chunk_size must be an int or None, got {chunk_size!r}")
    elif chunk_size < 1:
        raise ValueError(f"{_LJSD}: chunk_size must be >= 1, got {chunk_size}")
    return _chunk(chunk_size, n, 2 * V)


@registered(
    _ljsd,
    reference=_ljsd_reference,
    sample=_ljsd_sample,
    residuals={
        **_ljsd.residuals,
        "dx": "reduction='sum'/'mean' only (instead of all the above): "
        + _ljsd_reduced.residuals["dx"],
        "dw": "reduction='sum'/'mean' only: " + _ljsd_reduced.residuals["dw"],
    },
    configs=(
        {},
        {"reduction": "none", "beta": 0.0, "chunk_size": 4},
        {"reduction": "sum", "beta": 1.0, "temperature": 2.0, "chunk_size": 1},
    ),
    # Each edge point states every option, so the self-check runs it once (the configs
    # cover beta, temperature and the reductions at the sample).
    edges=written_for(
        {"reduction": "none", "beta": 0.5, "temperature": 1.0, "chunk_size": None}, _ljsd_edges
    ),
    doc="Fused x @ w and teacher_x @ teacher_w + generalized JSD, chunked; never holds "
    "the [N, V] logits.",
)
def linear_jensen_shannon(
    x: ArrayLike,
    w: ArrayLike,
    teacher_x: ArrayLike,
    teacher_w: ArrayLike,
    labels: ArrayLike | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> jax.Array:
    """Generalized JSD of the logits ``x @ w`` against ``teacher_x @ teacher_w``, chunked.

    The loss of :func:`jensen_shannon` with the student's logits ``x @ w`` and the
    teacher's ``teacher_x @ teacher_w``, computed ``chunk_size`` rows at a time in a
    ``lax.scan`` so that neither ``[N, V]`` logit array is ever held (Liger-Kernel's
    FusedLinearJSD)::

      loss[n] = jensen_shannon(x[n] @ w, teacher_x[n] @ teacher_w, beta, temperature)
      loss[n] = 0 where labels[n] == ignore_index        # and no gradient from that row

    then summed or averaged over the rows not ignored. ``beta = 0`` is the forward KL
    ``KL(q || p)`` of the teacher's ``q`` against the student's ``p``, ``beta = 1`` the
    reverse KL.

    Only ``x`` and ``w`` are differentiated: the teacher is frozen, as in Liger-Kernel,
    so ``teacher_x`` and ``teacher_w`` are constants of the loss, like the labels (a
    gradient taken with respect to them is 0).

    With ``reduction="none"`` the forward keeps the inputs only; the backward recomputes
    each chunk's two logit blocks and the JSD's local gradient
    ``J = (1 - beta) p (log p - log m - KL(p || m)) / T`` and accumulates
    ``dx = (g J) w^T`` and ``dw += x^T (g J)`` chunk by chunk. With ``"sum"`` or
    ``"mean"`` the loss is a scalar, so the forward computes the gradients as it goes
    (4 products per chunk: both logit blocks, ``G w^T`` and ``x^T G``, ``G = s J``) and
    keeps ``dx [N, D]`` and ``dw [D, V]``, as :func:`linear_cross_entropy` does; the
    backward only scales them. Either way the memory beyond inputs and outputs is
    ``O(chunk_size * V)``, not ``O(N * V)``.

    Args:
      x: the student's inputs ``[..., D]``, floating point.
      w: the student's weights ``[D, V]`` (promoted with ``x`` to a common dtype).
      teacher_x: the teacher's inputs ``[..., D_t]``, the same leading shape as ``x``.
      teacher_w: the teacher's weights ``[D_t, V]``.
      labels: optional integer labels of shape ``x.shape[:-1]``; rows equal to
        ``ignore_index`` are left out. Only compared with ``ignore_index``; not
        differentiated. None: every row counts.
      beta: the teacher's weight in the mixture, in ``[0, 1]`` (see
        :func:`jensen_shannon`).
      temperature: ``T > 0``, dividing both logit arrays.
      chunk_size: rows per step; by default about 64 MiB of float32 logits per chunk
        (student and teacher together: :func:`linear_cross_entropy`'s rule for ``2 V``
        classes), between 64 and 512 rows and at most the number of rows.
      ignore_index: the label value of rows left out (default -100, as PyTorch and
        Liger-Kernel).
      reduction: ``"mean"`` (the default, as Liger-Kernel: the sum over the rows not
        ignored divided by their number, 0 when every row is ignored), ``"sum"`` or
        ``"none"`` (per-row losses).

    Returns:
      A scalar, or the per-row losses of shape ``x.shape[:-1]`` for
      ``reduction="none"``, in the common dtype of ``x`` and ``w``. The logits are
      computed with float32 accumulation at least, and the JSD in float32 at least.

    Raises:
      TypeError: non-floating ``x``, ``w``, ``teacher_x`` or ``teacher_w``, labels that
        are not integer, or options of the wrong type.
      ValueError: ``w`` not ``[D, V]`` with ``D == x.shape[-1]``, ``teacher_x`` with
        other leading dimensions than ``x``, ``teacher_w`` not ``[D_t, V]``, labels of
        another shape than ``x.shape[:-1]``, ``beta`` outside ``[0, 1]``,
        ``temperature <= 0``, ``chunk_size < 1``, an unknown ``reduction``, or
        ``chunk_size=None`` with a symbolic vocabulary size (under ``jax.export``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import linear_jensen_shannon
      >>> x, w = jnp.ones((4, 3)), jnp.zeros((3, 5))
      >>> linear_jensen_shannon(x, w, x, w)  # the same distributions
      Array(0., dtype=float32)
      >>> tw = jnp.zeros((3, 5)).at[:, 0].set(1.0)
      >>> loss, (gx, gw) = jax.value_and_grad(linear_jensen_shannon, (0, 1))(x, w, x, tw)
      >>> gw.shape
      (3, 5)

    References:
      Agarwal et al., "On-Policy Distillation of Language Models: Learning from
      Self-Generated Mistakes" (GKD), ICLR 2024. https://arxiv.org/abs/2306.13649
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024
      (FusedLinearJSD). https://arxiv.org/abs/2410.10989
      Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024.
      https://arxiv.org/abs/2411.09009
    """
    x, w, tx, tw, valid = _fused_operands(x, w, teacher_x, teacher_w, labels, ignore_index)
    beta = _beta(_LJSD, beta)
    temperature = _temperature(_LJSD, temperature)
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"{_LJSD}: reduction must be one of {', '.join(map(repr, _REDUCTIONS))}, got "
            f"{reduction!r}"
        )
    lead, (D, V) = x.shape[:-1], w.shape
    n = math.prod(lead)  # symbolic under jax.export
    chunk = _fused_chunk_rows(chunk_size, n, V)
    args = (x.reshape(n, D), w, tx.reshape(n, tx.shape[-1]), tw, valid.reshape(n))
    static = {"chunk": chunk, "beta": beta, "temperature": temperature}
    if reduction != "none":
        return needs_devices(_ljsd_reduced(*args, **static, mean=reduction == "mean"))
    return needs_devices(_ljsd(*args, **static)).reshape(lead)
