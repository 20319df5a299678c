"""Fused linear + preference losses (DPO, ORPO, SimPO, CPO, KTO) that never hold the
``[B, T, V]`` logits.

A preference loss reads a language model's per-sequence log-likelihoods
``logp[b] = sum_t log softmax(x[b, t] @ w)[y[b, t]]`` (over the completion's tokens, the
prompt and padding carrying ``ignore_index``) and is a mean over the batch of a function
of each pair ``(logp_chosen[b], logp_rejected[b])`` (of each sequence alone for KTO),
plus, for ORPO and CPO, the NLL of the chosen tokens. It is a *sum over groups* (a pair,
or one KTO sequence) whose terms depend on that group's log-likelihoods only. So the
loss and its gradients are made in one walk over the groups, as Liger-Kernel's chunked
preference losses do, with 3 products instead of plain autodiff's 3 over ``[2BT, V]``
logits held whole:

* per chunk of a group's tokens: the logits ``x_c @ w``, their row statistics (max,
  ``log sum exp``), the label's log-probability, and ``P = onehot - softmax``, the
  derivative of a token's log-probability by its logits; then ``u = P w^T`` (the rows'
  ``dx`` up to a factor) and, per sequence ``s`` of the group, ``A_s += x_s^T P_s``;
* at the group's end its log-likelihoods are known, so is its loss term ``l`` and
  ``c_s = dl / dlogp_s``; then ``dx_s = c_s u_s`` and ``dw += sum_s c_s A_s``.

The NLL term is also a function of the chosen log-likelihoods (``-sum_b logp_c[b] /
tokens``), so it enters ``c`` the same way. The output is a scalar, so its cotangent is
one number: the forward keeps ``dx``, ``dw`` and ``d/dref`` (as
``linear_cross_entropy(reduction="mean")`` does) and the backward scales them; the
tangent is their inner product with the input tangents. Memory beyond the inputs and
outputs: one ``[chunk, V]`` chain of logits (see ``linear_cross_entropy``) and ``k + 1``
``[D, V]`` accumulators (``k`` = 2 sequences per pair, 1 for KTO).

Under a sharded program the walk runs on each device's own groups
(:func:`cannjax._src.core.partitioned.row_local`), with the vocabulary of ``w`` split
over the mesh axes the groups do not use (Megatron-LM's vocabulary-parallel
cross-entropy: the row statistics and ``u`` are summed over those devices).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from cannjax._src.core import dots
from cannjax._src.core.dtypes import compute_dtype
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.partitioned import Layout, bound, needs_devices, row_local
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_float
from cannjax._src.core.vma import varying_like
from cannjax._src.ops.linalg import weight_grad
from cannjax._src.ops.linear_cross_entropy import _chunk, _local_labels, _onehot, _row_stats
from cannjax._src.ops.losses import _static_float, check_ignore_index

_FN = "cannjax.ops.linear_preference_loss"
KINDS = ("dpo", "orpo", "simpo", "cpo", "kto")
_WITH_REFERENCE = ("dpo", "kto")  # kinds that compare with a frozen reference model
_LENGTH_NORMALIZED = ("orpo", "simpo")  # log-likelihoods averaged over the tokens
_NLL_DEFAULT = {"orpo": 1.0, "cpo": 1.0}  # TRL's ORPO always adds it; CPO's cpo_alpha = 1


class PreferenceMetrics(NamedTuple):
    """What preference trainers log (TRL's ``rewards/*`` and ``logps/*``), per example.

    Every field is ``lax.stop_gradient``-ed: metrics are logged, not differentiated.
    ``B`` chosen examples, ``B'`` rejected ones (``B' = B`` except for KTO).

    Attributes:
      chosen_logps: ``[B]`` the policy's log-likelihood of each chosen completion (summed
        over its tokens; averaged for ORPO and SimPO, as they use it).
      rejected_logps: ``[B']`` the same for the rejected completions.
      chosen_rewards: ``[B]`` the implicit reward: ``beta (logp - ref_logp)`` with a
        reference (DPO, KTO), ``beta logp`` without.
      rejected_rewards: ``[B']`` the same for the rejected completions.
      margins: ``[B]`` ``chosen_rewards - rejected_rewards`` (paired kinds; None for KTO).
      accuracies: ``[B]`` 1.0 where the chosen reward is the larger (paired; None for KTO).
      nll_loss: ``[]`` the chosen tokens' mean negative log-likelihood (whether or not
        the loss includes it).
      log_odds_ratio: ``[B]`` ORPO's ``log sigmoid(log odds ratio)``; None otherwise.
    """

    chosen_logps: jax.Array
    rejected_logps: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array
    margins: jax.Array | None
    accuracies: jax.Array | None
    nll_loss: jax.Array
    log_odds_ratio: jax.Array | None


@dataclasses.dataclass(frozen=True)
class _Head:
    """The static hyperparameters of the loss on the per-sequence log-likelihoods."""

    kind: str
    beta: float
    gamma: float = 0.0
    label_smoothing: float = 0.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


# ---------------------------------------------------------------------------- the math
def _log1mexp(v):
    """``log(1 - exp(v))`` for ``v <= 0``, accurate at both ends (Maechler, 2012)."""
    return jnp.where(v > -math.log(2.0), jnp.log(-jnp.expm1(v)), jnp.log1p(-jnp.exp(v)))


def _sigmoid_loss(h, smoothing):
    """``-(1 - eps) log sigmoid(h) - eps log sigmoid(-h)`` (DPO's conservative form)."""
    loss = -jax.nn.log_sigmoid(h)
    return loss if not smoothing else (1 - smoothing) * loss - smoothing * jax.nn.log_sigmoid(-h)


def _log_odds(pc, pr, valid):
    """ORPO's ``log odds(pc) - log odds(pr)``, ``log odds(p) = p - log(1 - e^p)``, of
    average log-likelihoods ``p < 0``; 0 where not ``valid`` (a completion without tokens
    has likelihood 1: infinite odds), with no NaN in its gradient."""
    pc, pr = jnp.where(valid, pc, -1.0), jnp.where(valid, pr, -1.0)
    return jnp.where(valid, (pc - pr) - (_log1mexp(pc) - _log1mexp(pr)), 0.0)


def paired_losses(head: _Head, pc, pr, rc, rr, valid=True):
    """Per-pair losses ``[B]`` of the policy's log-likelihoods ``pc``, ``pr`` (summed, or
    averaged for the length-normalized kinds) and the reference's ``rc``, ``rr``:

    * DPO:   ``h = beta ((pc - rc) - (pr - rr))``, loss ``-log sigmoid(h)``;
    * SimPO: ``h = beta (pc - pr) - gamma``, the same;
    * CPO:   ``h = beta (pc - pr)``, the same;
    * ORPO:  ``-beta log sigmoid(log odds)``, ``log odds = (pc - pr) - (log(1 - e^pc) -
      log(1 - e^pr))``, 0 for a pair that is not ``valid`` (a completion without tokens);

    with label smoothing ``eps`` (DPO, SimPO, CPO) the loss is ``-(1 - eps) log
    sigmoid(h) - eps log sigmoid(-h)``.
    """
    if head.kind == "orpo":
        return jnp.where(valid, -head.beta * jax.nn.log_sigmoid(_log_odds(pc, pr, valid)), 0.0)
    if head.kind == "dpo":
        h = head.beta * ((pc - rc) - (pr - rr))
    elif head.kind == "simpo":
        h = head.beta * (pc - pr) - head.gamma
    else:  # cpo
        h = head.beta * (pc - pr)
    return _sigmoid_loss(h, head.label_smoothing)


def kto_losses(head: _Head, p, ref, kl, desirable):
    """KTO's per-example losses: ``w_d (1 - sigmoid(beta (p - ref - kl)))`` for a
    desirable completion, ``w_u (1 - sigmoid(beta (kl - (p - ref))))`` for an undesirable
    one (``1 - sigmoid(h) = sigmoid(-h)``).

    ``sigmoid(-h)`` is evaluated as ``exp(log sigmoid(-h))``: its derivative is then
    ``-sigmoid(-h) sigmoid(h)``, both factors accurate, where autodiff of ``sigmoid``
    forms ``s (1 - s)`` and loses the digits of ``1 - s`` once ``s`` nears 1 (a 1%
    error at ``h = 13`` in float32, a reward 130 nats from the reference at beta 0.1).
    """
    r = p - ref
    good = head.desirable_weight * jnp.exp(jax.nn.log_sigmoid(-head.beta * (r - kl)))
    bad = head.undesirable_weight * jnp.exp(jax.nn.log_sigmoid(-head.beta * (kl - r)))
    return jnp.where(desirable, good, bad)


def _policy(head: _Head, sums, counts):
    """The log-likelihoods the kind uses: sums, or means over the completion's tokens."""
    if head.kind in _LENGTH_NORMALIZED:
        return sums / jnp.maximum(counts, 1).astype(sums.dtype)
    return sums


def _group_loss(sums, ref, kl, counts, desirable, scales, *, head: _Head):
    """One group's term of the loss: ``sums [k]`` its log-likelihood sums (a pair: chosen,
    rejected; KTO: one sequence), ``desirable [k]`` which are chosen completions,
    ``scales = [1 / examples, nll_weight / chosen tokens]``."""
    p = _policy(head, sums, counts)
    if head.kind == "kto":
        term = kto_losses(head, p, ref, kl, desirable).sum()
    else:
        term = paired_losses(head, p[0], p[1], ref[0], ref[1], (counts > 0).all())
    nll = jnp.where(desirable, sums, 0.0).sum() * scales[1]
    return term * scales[0] - nll


# ----------------------------------------------------------------------------- the walk
def _forward(x, w, labels, ref, kl, desirable, counts, scales, *, chunk, ignore_index,
             head):  # fmt: skip
    local = bound(_groups, chunk=chunk, ignore_index=ignore_index, head=head)
    loss, sums, dx, dw, dref = row_local(
        local, _LAYOUT, x, w, labels, ref, kl, desirable, counts, scales
    )
    res = {"dx": dx, "dw": dw.astype(w.dtype), "dref": dref.astype(ref.dtype)}
    return (loss.sum().astype(x.dtype), lax.stop_gradient(sums)), res


def _groups(x, w, labels, ref, kl, desirable, counts, scales, *, chunk, ignore_index,
            head, shards):  # fmt: skip
    """The walk on one device's groups ``x [G, k, T, D]`` (and columns of ``w``):
    per-group loss terms ``[G]``, log-likelihood sums ``[G, k]``, ``dx``, ``dw`` (summed
    over the devices' groups) and ``d/dref [G, k]``."""
    acc, (G, k, T, D), Vl = compute_dtype(x.dtype), x.shape, w.shape[1]
    tc = max(1, min(T, chunk // k))  # tokens of each sequence per step
    n = -(-T // tc)
    pad = n * tc - T
    x = jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(G, k, n, tc, D)
    labels = jnp.pad(labels, ((0, 0), (0, 0), (0, pad)), constant_values=ignore_index)
    labels = labels.reshape(G, k, n, tc)

    def chunk_step(parts, j, xg, lg):
        xc, lc = xg[:, j], lg[:, j]  # [k, tc, D], [k, tc]
        rows, lr = xc.reshape(k * tc, D), lc.reshape(k * tc)
        stats, e, s, _ = _row_stats(dots.matmul(rows, w, out_dtype=acc), lr, 0.0, None, shards)
        kept = lr != ignore_index
        logp = jnp.where(kept, stats.picked - stats.log_s, 0.0)
        # d logp / d logits = onehot - softmax, on the kept rows.
        onehot = _onehot(_local_labels(lr, shards, Vl), Vl).astype(acc)
        p = (onehot - e / s) * kept[:, None].astype(acc)
        p = p.astype(x.dtype)
        u = dots.matmul_t(p, w, out_dtype=acc)
        parts = tuple(
            a + weight_grad(xc[i], p[i * tc : (i + 1) * tc], acc) for i, a in enumerate(parts)
        )
        return parts, (u.reshape(k, tc, D), logp.reshape(k, tc))

    def group_step(dw, g):
        xg, lg, rg, dg, cg = g
        parts0 = varying_like(tuple(jnp.zeros((D, Vl), acc) for _ in range(k)), x, w, labels)
        parts, (u, logp) = lax.scan(lambda a, j: chunk_step(a, j, xg, lg), parts0, jnp.arange(n))
        sums = logp.sum((0, 2))  # [k]
        term, pullback = jax.vjp(
            lambda s_, r_, kl_: _group_loss(s_, r_, kl_, cg, dg, scales, head=head),
            sums,
            rg.astype(acc),
            kl.astype(acc),
        )
        coef, dref, _ = pullback(jnp.ones_like(term))
        for i, a in enumerate(parts):
            dw = dw + coef[i] * a
        dxg = (coef[:, None, None] * u.swapaxes(0, 1).reshape(k, n * tc, D))[:, :T]
        return dw, (term, sums, dxg, dref)

    dw0 = varying_like(jnp.zeros((D, Vl), acc), x, w, labels, ref)
    dw, (loss, sums, dx, dref) = lax.scan(group_step, dw0, (x, labels, ref, desirable, counts))
    dx = shards.vocab_sum(dx).astype(x.dtype)
    return [loss, sums, dx, shards.rows_sum(dw), dref]


# Groups (n) stay where the program put them, the vocabulary (v) of w too where its axes
# are not the groups'; the sequences of a group (k), tokens (t) and width (d) are whole.
_LAYOUT = Layout(
    ins=("nktd", "dv", "nkt", "nk", "", "nk", "nk", "s"),
    outs=("n", "nk", "nktd", "dv", "nk"),
    vocab_of=1,
)


def _backward(res, g, *, chunk, ignore_index, head):
    # The loss is a scalar: its gradients are g times the ones the forward made. The
    # log-likelihood sums are stop_gradient-ed outputs (metrics): their cotangent is 0.
    g = g[0].astype(compute_dtype(g[0].dtype))
    return tuple((g * res[k].astype(g.dtype)).astype(res[k].dtype) for k in ("dx", "dw", "dref"))


def _tangent(res, tx, tw, tref, *, chunk, ignore_index, head):
    acc = compute_dtype(tx.dtype)
    dot = sum(
        jnp.vdot(res[k].astype(acc), t.astype(acc))
        for k, t in (("dx", tx), ("dw", tw), ("dref", tref))
    )
    # kl is stop_gradient-ed by the public function (TRL detaches it); no tangent here.
    return dot.astype(tx.dtype), jnp.zeros(res["dref"].shape, res["dref"].dtype)


_pref = defop(
    "linear_preference_loss",
    forward=jax.jit(_forward, static_argnames=("chunk", "ignore_index", "head")),
    tangent=_tangent,
    backward=_backward,
    nondiff_argnums=(2, 4, 5, 6, 7),
    num_outputs=2,
    residuals={
        "dx": "the gradient of the loss w.r.t. the hidden states, [B + B', T, D]",
        "dw": "the gradient w.r.t. w, [D, V]",
        "dref": "the gradient w.r.t. the reference log-likelihoods, [B + B']",
    },
    level=Level.DERIVED,
    reuse=(),
)


# ------------------------------------------------------------------------------ inputs
def _hidden(arg, x, D):
    x = as_float(_FN, arg, x)
    if x.ndim != 3 or x.shape[-1] != D:
        raise ValueError(
            f"{_FN}: {arg} must have shape [B, T, D] with D == w.shape[0] == {D}, got "
            f"{tuple(x.shape)}"
        )
    return x


def _labels(arg, y, x):
    dtype = getattr(y, "dtype", None)
    y = jnp.asarray(y)
    if not jnp.issubdtype(y.dtype if dtype is None else dtype, jnp.integer):
        raise TypeError(
            f"{_FN}: {arg} must be an integer array of token ids, got "
            f"{jnp.dtype(y.dtype).name}{list(y.shape)}; use {arg}.astype(jnp.int32)"
        )
    if y.shape != x.shape[:-1]:
        raise ValueError(
            f"{_FN}: {arg} must have shape [B, T] == {x.shape[:-1]} (its hidden states' "
            f"leading axes), got {tuple(y.shape)}"
        )
    return y


def _reference_logps(kind, ref_c, ref_r, xc, xr):
    if kind not in _WITH_REFERENCE:
        if ref_c is not None or ref_r is not None:
            raise ValueError(
                f"{_FN}: kind={kind!r} is reference-free and takes no ref_chosen_logps or "
                f"ref_rejected_logps; the kinds with a reference are {_WITH_REFERENCE}"
            )
        return jnp.zeros(xc.shape[:1], xc.dtype), jnp.zeros(xr.shape[:1], xr.dtype)
    out = []
    for arg, ref, x in (("ref_chosen_logps", ref_c, xc), ("ref_rejected_logps", ref_r, xr)):
        if ref is None:
            raise ValueError(
                f"{_FN}: kind={kind!r} needs {arg}, the frozen reference model's "
                f"log-likelihood of each sequence ([B], computed by the caller, e.g. with "
                f"this function's metrics under the reference's weights), got None"
            )
        ref = as_float(_FN, arg, ref)
        if ref.shape != x.shape[:1]:
            raise ValueError(
                f"{_FN}: {arg} must have shape [B] == {x.shape[:1]}, got {tuple(ref.shape)}"
            )
        out.append(ref)
    return tuple(out)


def _options(kind, beta, gamma, label_smoothing, nll_weight, kl, desirable_weight,
             undesirable_weight):  # fmt: skip
    """The hyperparameters as Python floats, each checked; kind-specific ones given to
    another kind are an error (a likely mix-up)."""
    if kind not in KINDS:
        raise ValueError(f"{_FN}: kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    only = {"gamma": ("simpo", gamma), "kl": ("kto", kl),
            "desirable_weight": ("kto", desirable_weight),
            "undesirable_weight": ("kto", undesirable_weight)}  # fmt: skip
    for arg, (owner, value) in only.items():
        if value is not None and kind != owner:
            raise ValueError(f"{_FN}: {arg} applies to kind={owner!r} only, got kind={kind!r}")
    if label_smoothing and kind in ("orpo", "kto"):
        raise ValueError(f"{_FN}: label_smoothing applies to dpo, simpo and cpo, got kind={kind!r}")
    beta = _static_float(_FN, "beta", beta)
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"{_FN}: beta must be a finite number > 0, got {beta!r}")
    eps = _static_float(_FN, "label_smoothing", label_smoothing)
    if not 0.0 <= eps <= 0.5:
        raise ValueError(f"{_FN}: label_smoothing must be in [0, 0.5], got {label_smoothing!r}")
    nll = _NLL_DEFAULT.get(kind, 0.0) if nll_weight is None else nll_weight
    nll = _static_float(_FN, "nll_weight", nll)
    if not (math.isfinite(nll) and nll >= 0):
        raise ValueError(f"{_FN}: nll_weight must be a finite number >= 0, got {nll_weight!r}")
    weights = []
    for arg, value in (("desirable_weight", desirable_weight),
                       ("undesirable_weight", undesirable_weight)):  # fmt: skip
        value = _static_float(_FN, arg, 1.0 if value is None else value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{_FN}: {arg} must be a finite number > 0, got {value!r}")
        weights.append(value)
    g = _static_float(_FN, "gamma", 0.5 if gamma is None else gamma)
    if not math.isfinite(g):
        raise ValueError(f"{_FN}: gamma must be a finite number, got {gamma!r}")
    return dict(kind=kind, beta=beta, gamma=g, label_smoothing=eps,
                desirable_weight=weights[0], undesirable_weight=weights[1]), nll  # fmt: skip


def _chunk_size(chunk_size, rows, V):
    if chunk_size is not None and (
        isinstance(chunk_size, (bool, np.bool_)) or not isinstance(chunk_size, (int, np.integer))
    ):
        raise TypeError(f"{_FN}: chunk_size must be an int or None, got {chunk_size!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"{_FN}: chunk_size must be >= 1, got {chunk_size}")
    return _chunk(chunk_size, rows, V)


def _metrics(head, nll_weight, sums, counts, ref, B, paired):
    """:class:`PreferenceMetrics` from the (stop-gradient) sums ``[B + B']``."""
    p = _policy(head, sums, counts)
    reward = head.beta * (p - ref) if head.kind in _WITH_REFERENCE else head.beta * p
    chosen_tokens = jnp.maximum(counts[:B].sum(), 1).astype(sums.dtype)
    nll = -sums[:B].sum() / chosen_tokens
    margins = accuracies = log_odds = None
    if paired:
        margins = reward[:B] - reward[B:]
        accuracies = (margins > 0).astype(sums.dtype)
    if head.kind == "orpo":
        pc, pr = p[:B], p[B:]
        log_odds = jax.nn.log_sigmoid(_log_odds(pc, pr, (counts[:B] > 0) & (counts[B:] > 0)))
    m = PreferenceMetrics(p[:B], p[B:], reward[:B], reward[B:], margins, accuracies, nll, log_odds)
    return jax.tree.map(lax.stop_gradient, m)


# ------------------------------------------------------------------------------ public
def _plain_logps(x, w, y, ignore_index):
    """Per-sequence ``(sum of token log-probabilities, token count)``, written plainly:
    the full ``[B, T, V]`` logits, ``log_softmax``, ``take_along_axis``."""
    logp = jax.nn.log_softmax(x @ w, axis=-1)
    kept = y != ignore_index
    tok = jnp.take_along_axis(logp, jnp.where(kept, y, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(kept, tok, 0.0).sum(-1), kept.sum(-1)


def _reference(x_chosen, x_rejected, w, y_chosen, y_rejected, ref_chosen_logps=None,
               ref_rejected_logps=None, *, kind="dpo", beta=0.1, gamma=None, label_smoothing=0.0,
               nll_weight=None, kl=None, desirable_weight=None, undesirable_weight=None,
               ignore_index=-100, chunk_size=None, return_metrics=True):  # fmt: skip
    """The same losses from the whole logits, as TRL's trainers compute them."""
    del chunk_size
    opts, nll_w = _options(kind, beta, gamma, label_smoothing, nll_weight, kl, desirable_weight,
                           undesirable_weight)  # fmt: skip
    sc, nc = _plain_logps(x_chosen, w, y_chosen, ignore_index)
    sr, nr = _plain_logps(x_rejected, w, y_rejected, ignore_index)
    B, Br = sc.shape[0], sr.shape[0]
    head = _Head(**opts)
    rc = jnp.zeros_like(sc) if ref_chosen_logps is None else ref_chosen_logps
    rr = jnp.zeros_like(sr) if ref_rejected_logps is None else ref_rejected_logps
    pc, pr = _policy(head, sc, nc), _policy(head, sr, nr)
    if kind == "kto":
        kl = lax.stop_gradient(jnp.zeros((), sc.dtype) if kl is None else kl)
        terms = jnp.concatenate(
            [kto_losses(head, pc, rc, kl, True), kto_losses(head, pr, rr, kl, False)]
        )
        loss = terms.sum() / (B + Br)
    else:
        loss = paired_losses(head, pc, pr, rc, rr, (nc > 0) & (nr > 0)).mean()
    loss = loss + nll_w * (-sc.sum() / jnp.maximum(nc.sum(), 1).astype(sc.dtype))
    if not return_metrics:
        return loss
    sums, counts = jnp.concatenate([sc, sr]), jnp.concatenate([nc, nr])
    ref = jnp.concatenate([rc, rr])
    return loss, _metrics(head, nll_w, sums, counts, ref, B, kind != "kto")


def _sample(key):
    kx, kr, kw, ky, kc, kf = jax.random.split(key, 6)
    B, T, D, V = 2, 5, 4, 7
    xc = jax.random.normal(kx, (B, T, D), jnp.float32)
    xr = jax.random.normal(kr, (B, T, D), jnp.float32)
    w = jax.random.normal(kw, (D, V), jnp.float32)
    y = jax.random.randint(ky, (2, B, T), 0, V)
    prompt = jnp.arange(T) < 2  # the first two tokens are the prompt
    yc, yr = (jnp.where(prompt, -100, y[i]) for i in range(2))
    refs = jax.random.normal(kf, (2, B), jnp.float32) - 8.0
    return xc, xr, w, yc, yr, refs[0], refs[1]


def _edges():
    xc, xr, w, yc, yr, rc, rr = _sample(jax.random.key(5))
    return [
        # A pair whose completions are all ignored: its log-likelihoods are 0, and x gets
        # no gradient from it.
        EdgeCase((xc, xr, w, yc.at[0].set(-100), yr.at[0].set(-100), rc, rr)),
        # Large logits (|x @ w| ~ 1e2): the log-sum-exp must not overflow.
        EdgeCase((xc * 30.0, xr * 30.0, w, yc, yr, rc, rr)),
        # Reference log-likelihoods far apart: h = beta * 1e4 saturates the sigmoid, the
        # loss is 1e3 or 0 and the gradient stays finite (log sigmoid written stably).
        EdgeCase((xc, xr, w, yc, yr, rc + jnp.array([1e4, -1e4]), rr)),
        # One token per chunk.
        EdgeCase((xc, xr, w, yc, yr, rc, rr), kwargs={"chunk_size": 1}),
    ]


_CONFIGS = (
    {"kind": "dpo", "return_metrics": False},
    {"kind": "dpo", "label_smoothing": 0.1, "nll_weight": 0.5, "chunk_size": 2,
     "return_metrics": False},
    # KTO's own options (kl, weights) are checked in tests/test_preference.py: the edge
    # points, written for DPO, run under every config here.
    {"kind": "kto", "return_metrics": False},
)  # fmt: skip


@registered(
    _pref,
    reference=_reference,
    sample=_sample,
    configs=_CONFIGS,
    edges=lambda: [
        dataclasses.replace(e, kwargs={**e.kwargs, "kind": "dpo", "return_metrics": False})
        for e in _edges()
    ],
    doc="Fused x @ w + DPO / ORPO / SimPO / CPO / KTO loss, chunked; never holds the logits.",
)
def linear_preference_loss(
    x_chosen: ArrayLike,
    x_rejected: ArrayLike,
    w: ArrayLike,
    y_chosen: ArrayLike,
    y_rejected: ArrayLike,
    ref_chosen_logps: ArrayLike | None = None,
    ref_rejected_logps: ArrayLike | None = None,
    *,
    kind: str = "dpo",
    beta: float = 0.1,
    gamma: float | None = None,
    label_smoothing: float = 0.0,
    nll_weight: float | None = None,
    kl: ArrayLike | None = None,
    desirable_weight: float | None = None,
    undesirable_weight: float | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    return_metrics: bool = True,
) -> tuple[jax.Array, PreferenceMetrics] | jax.Array:
    """Preference loss of a language model head ``w`` on hidden states, computed in chunks.

    With ``logp(x, y) = sum_t log softmax(x[t] @ w)[y[t]]`` over the tokens not equal to
    ``ignore_index`` (prompt and padding), ``pc = logp(x_chosen[b], y_chosen[b])``,
    ``pr`` likewise, ``rc``, ``rr`` the frozen reference's and ``sigma`` the sigmoid::

      dpo:   mean_b -log sigma(beta ((pc - rc) - (pr - rr)))
      simpo: mean_b -log sigma(beta (pc' - pr') - gamma)         pc' = pc / tokens
      cpo:   mean_b -log sigma(beta (pc - pr))        + nll_weight * NLL
      orpo:  mean_b -beta log sigma(log odds)         + nll_weight * NLL
             log odds = (pc' - pr') - (log(1 - exp(pc')) - log(1 - exp(pr')))
             (a pair with an empty completion, likelihood 1, adds 0)
      kto:   mean over both sets of  w_d sigma(-beta (pc - rc - kl))   (chosen)
                                     w_u sigma(-beta (kl - (pr - rr))) (rejected)

    ``NLL = -sum_b pc[b] / (chosen tokens)``, the chosen completions' token-mean
    cross-entropy (``nll_weight`` adds it to any kind). With ``label_smoothing`` ``eps``
    (DPO, SimPO, CPO) ``-log sigma(h)`` becomes ``-(1 - eps) log sigma(h) - eps log
    sigma(-h)``. These are the losses of TRL's ``DPOTrainer`` (``loss_type="sigmoid"``),
    ``ORPOTrainer``, ``CPOTrainer`` (``"sigmoid"`` and ``"simpo"``) and ``KTOTrainer``.

    The ``[B, T, V]`` logits are never held: the loss is a sum of one term per pair (per
    sequence for KTO), so the walk over a pair's tokens, ``chunk_size`` rows at a time,
    accumulates its log-likelihoods and, per sequence, ``x^T (onehot - softmax)``; at the
    pair's end its term's derivatives scale them into ``dx`` and ``dw`` (module
    docstring). 3 products of ``[rows, D] x [D, V]``, as plain autodiff; the gradients
    are made in the forward and kept.

    Shape letters: ``B`` pairs (chosen examples), ``B'`` rejected examples (``B`` but for
    KTO, whose examples are unpaired), ``T`` tokens, ``D`` model width, ``V`` vocabulary.
    Hidden states and labels are aligned: ``y[b, t]`` is the token ``x[b, t]`` predicts
    (shift them as for ``linear_cross_entropy``).

    Args:
      x_chosen: hidden states ``[B, T, D]`` of the chosen completions (with prompt).
      x_rejected: ``[B', T, D]``, the rejected ones; the shape of ``x_chosen`` but for KTO.
      w: the head ``[D, V]``.
      y_chosen: integer labels ``[B, T]``, ``ignore_index`` on prompt and padding tokens.
      y_rejected: ``[B', T]``.
      ref_chosen_logps: ``[B]`` the reference model's summed log-likelihoods of the chosen
        completions (DPO and KTO; computed by the caller, e.g. from this function's
        ``metrics.chosen_logps`` under the reference's weights). Differentiable.
      ref_rejected_logps: ``[B']``, likewise.
      kind: ``"dpo"`` (default), ``"orpo"``, ``"simpo"``, ``"cpo"`` or ``"kto"``.
      beta: the inverse temperature (ORPO: the weight of the odds-ratio term), ``> 0``;
        TRL's default 0.1 (SimPO's paper uses 2.0 to 2.5).
      gamma: SimPO's target reward margin; default 0.5 (TRL's ``simpo_gamma``).
      label_smoothing: ``eps`` in ``[0, 0.5]`` for DPO, SimPO and CPO (cDPO); default 0.
      nll_weight: weight of the chosen tokens' NLL; default 1 for ORPO and CPO (TRL's
        ORPO term and ``cpo_alpha``), 0 for the others (DPO: RPO's ``rpo_alpha``).
      kl: KTO's reference point, a scalar (TRL's batch estimate of the policy-reference
        KL, clamped at 0, computed by the caller); default 0. No gradient flows into it
        (TRL detaches it).
      desirable_weight: KTO's ``w_d``, default 1.
      undesirable_weight: KTO's ``w_u``, default 1.
      ignore_index: the label of tokens that are not part of a completion; default -100.
      chunk_size: rows of logits per step (split over the pair's two sequences); by
        default about 64 MiB of float32 logits, 64 to 512 rows, as ``linear_cross_entropy``.
      return_metrics: return ``(loss, metrics)`` (default) or the loss alone.

    Returns:
      ``(loss, metrics)``: the scalar loss in the common dtype of ``x`` and ``w``, and a
      :class:`PreferenceMetrics` of per-example rewards, margins, accuracies and
      log-likelihoods (stop-gradient-ed), for ``jax.value_and_grad(..., has_aux=True)``.
      The loss alone with ``return_metrics=False``.

    Raises:
      TypeError: non-floating hidden states, head or reference log-likelihoods,
        non-integer labels, a hyperparameter that is not a Python number.
      ValueError: an unknown ``kind``; shapes that do not match (``x_rejected`` not the
        shape of ``x_chosen`` for a paired kind, ``w`` not ``[D, V]``, labels not
        ``[B, T]``); reference log-likelihoods missing for DPO or KTO, or given to a
        reference-free kind; ``beta <= 0``; an option of another kind.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from cannjax.ops import linear_preference_loss
      >>> x, w = jnp.ones((2, 4, 3)), jnp.zeros((3, 5))  # uniform: logp = -log 5 per token
      >>> y = jnp.array([[-100, 1, 2, 3], [-100, -100, 0, 4]])
      >>> loss, m = linear_preference_loss(x, x, w, y, y, jnp.zeros(2), jnp.zeros(2), kind="dpo")
      >>> round(float(loss), 6)  # equal likelihoods: -log sigmoid(0) = log 2
      0.693147
      >>> m.chosen_logps  # -3 log 5 and -2 log 5
      Array([-4.828314, -3.218876], dtype=float32)
      >>> jax.grad(lambda w: linear_preference_loss(x, x, w, y, y, kind="simpo")[0])(w).shape
      (3, 5)

    References:
      Rafailov et al., "Direct Preference Optimization", 2023. https://arxiv.org/abs/2305.18290
      Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
      2024. https://arxiv.org/abs/2403.07691
      Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
      2024. https://arxiv.org/abs/2405.14734
      Xu et al., "Contrastive Preference Optimization", 2024. https://arxiv.org/abs/2401.08417
      Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", 2024.
      https://arxiv.org/abs/2402.01306
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024 (chunked
      fused preference losses). https://arxiv.org/abs/2410.10989
    """
    opts, nll_w = _options(kind, beta, gamma, label_smoothing, nll_weight, kl, desirable_weight,
                           undesirable_weight)  # fmt: skip
    w = as_float(_FN, "w", w)
    if w.ndim != 2:
        raise ValueError(f"{_FN}: w must have shape [D, V], got {tuple(w.shape)}")
    D, V = w.shape
    xc, xr = _hidden("x_chosen", x_chosen, D), _hidden("x_rejected", x_rejected, D)
    paired = kind != "kto"
    if (xc.shape if paired else xc.shape[1:]) != (xr.shape if paired else xr.shape[1:]):
        want = "the shape of x_chosen" if paired else "[B', T, D] with T, D as x_chosen's"
        raise ValueError(
            f"{_FN}: x_rejected must have {want} {tuple(xc.shape)} for kind={kind!r}, got "
            f"{tuple(xr.shape)}"
        )
    yc, yr = _labels("y_chosen", y_chosen, xc), _labels("y_rejected", y_rejected, xr)
    ignore_index = check_ignore_index(_FN, ignore_index, optional=False)
    rc, rr = _reference_logps(kind, ref_chosen_logps, ref_rejected_logps, xc, xr)
    dtype = jnp.result_type(xc.dtype, xr.dtype, w.dtype)
    ref_dtype = compute_dtype(dtype)
    kl = jnp.zeros((), ref_dtype) if kl is None else lax.stop_gradient(as_float(_FN, "kl", kl))
    if kl.shape != ():
        raise ValueError(f"{_FN}: kl must be a scalar, got shape {tuple(kl.shape)}")
    B, Br, T = xc.shape[0], xr.shape[0], xc.shape[1]
    head = _Head(**opts)
    k = 2 if paired else 1
    chunk = _chunk_size(chunk_size, k * T, V)
    xc, xr, w = xc.astype(dtype), xr.astype(dtype), w.astype(dtype)
    rc, rr = rc.astype(ref_dtype), rr.astype(ref_dtype)
    if paired:  # groups: the pairs, [B, 2, ...] (chosen first)
        x, y = jnp.stack([xc, xr], 1), jnp.stack([yc, yr], 1).astype(jnp.int32)
        ref = jnp.stack([rc, rr], 1)
        desirable = jnp.broadcast_to(jnp.array([[True, False]]), (B, 2))
    else:  # groups: each example, [B + B', 1, ...]
        x, y = (
            jnp.concatenate([xc, xr])[:, None],
            jnp.concatenate([yc, yr])[:, None].astype(jnp.int32),
        )
        ref = jnp.concatenate([rc, rr])[:, None]
        desirable = (jnp.arange(B + Br) < B)[:, None]
    counts = (y != ignore_index).sum(-1)
    examples = jnp.asarray(B + Br if kind == "kto" else B, ref_dtype)
    tokens = jnp.maximum(counts[:B, 0].sum(), 1).astype(ref_dtype)
    scales = jnp.stack([1 / examples, jnp.asarray(nll_w, ref_dtype) / tokens])
    loss, sums = _pref(x, w, y, ref, kl.astype(ref_dtype), desirable, counts, scales,
                       chunk=chunk, ignore_index=ignore_index, head=head)  # fmt: skip
    loss = needs_devices(loss)
    if not return_metrics:
        return loss
    flat = lambda v: v.swapaxes(0, 1).reshape(-1) if paired else v.reshape(-1)  # noqa: E731
    return loss, _metrics(head, nll_w, flat(sums), flat(counts), flat(ref), B, paired)
