"""Losses: softmax cross-entropy with integer labels, and its LLM-training options.

Shape letters: ``C`` classes; ``...`` any batch shape (possibly empty).

The options (label smoothing, z-loss, final-logit soft-capping, ignored rows) are shared
with :func:`cannjax.ops.linear_cross_entropy`: :func:`loss_options` validates them,
:func:`soft_cap` and :func:`ignored_rows` compute the pieces both operators use and
:func:`plain_loss` is the plain optax formulation both are checked against.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.operator import defop, registered
from cannjax._src.core.registry import EdgeCase, Level, written_for
from cannjax._src.core.validate import as_int
from cannjax._src.ops.rowwise import exp_shifted, float_input, inv_sum, reduction, shifted_exp

INF = float("inf")
_FN = "cannjax.ops.softmax_cross_entropy"


# ------------------------------------------------------------------ options
def _static_float(fn: str, arg: str, value) -> float:
    # Hyperparameters are static: they select the operator's code, so a traced value
    # (a jax array under jit) cannot be one.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{fn}: {arg} must be a Python float (a static hyperparameter), got "
            f"{type(value).__name__} {value!r}"
        )
    return float(value)


def loss_options(fn: str, label_smoothing, z_loss, logit_cap) -> tuple[float, float, float | None]:
    """``(label_smoothing, z_loss, logit_cap)`` as Python floats, or TypeError/ValueError
    naming ``fn`` and the argument."""
    eps = _static_float(fn, "label_smoothing", label_smoothing)
    if not 0.0 <= eps < 1.0:
        raise ValueError(
            f"{fn}: label_smoothing must be in [0, 1) (the weight of the uniform target; "
            f"1 would leave no label), got {label_smoothing!r}"
        )
    zl = _static_float(fn, "z_loss", z_loss)
    if not (math.isfinite(zl) and zl >= 0.0):
        raise ValueError(
            f"{fn}: z_loss must be a finite number >= 0 (the weight of logsumexp^2; PaLM "
            f"uses 1e-4), got {z_loss!r}"
        )
    if logit_cap is None:
        return eps, zl, None
    cap = _static_float(fn, "logit_cap", logit_cap)
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(
            f"{fn}: logit_cap must be a finite number > 0 (logits become "
            f"cap * tanh(logits / cap); Gemma 2 uses 30.0) or None, got {logit_cap!r}"
        )
    return eps, zl, cap


def check_ignore_index(fn: str, ignore_index, *, optional: bool) -> int | None:
    """``ignore_index`` as a Python int (or None where ``optional``), or TypeError."""
    if ignore_index is None and optional:
        return None
    if isinstance(ignore_index, (bool, np.bool_)) or not isinstance(
        ignore_index, (int, np.integer)
    ):
        allowed = "an int or None" if optional else "an int"
        raise TypeError(f"{fn}: ignore_index must be {allowed}, got {ignore_index!r}")
    return int(ignore_index)


def ignored_rows(labels: jax.Array, ignore_index: int) -> jax.Array:
    """``labels == ignore_index``; all False when the labels' dtype cannot hold it (-100
    with uint8 labels)."""
    info = jnp.iinfo(labels.dtype)
    if not info.min <= ignore_index <= info.max:
        return jnp.zeros(labels.shape, bool)
    return labels == ignore_index


def soft_cap(x: jax.Array, cap: float | None) -> tuple[jax.Array, jax.Array | None]:
    """``(z, t)``: ``z = cap * tanh(x / cap)`` and ``t = tanh(x / cap)`` (``dz/dx =
    (1 - t)(1 + t)``), or ``(x, None)`` without a cap."""
    if cap is None:
        return x, None
    t = jnp.tanh(x / cap)
    return cap * t, t


def cap_slope(t: jax.Array) -> jax.Array:
    """``dz/dx = 1 - tanh(x / cap)^2`` from ``t = tanh(x / cap)``, as ``(1 - t)(1 + t)``
    (no cancellation where ``t`` is near 1)."""
    return (1 - t) * (1 + t)


def plain_loss(logits, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None):
    """The options in plain optax: per-row loss of ``logits [..., C]`` and ``labels [...]``
    (labels in ``[-C, C)``), no ignored rows. The reference of both cross-entropies."""
    import optax

    c = logits.shape[-1]
    z = logits if logit_cap is None else logit_cap * jnp.tanh(logits / logit_cap)
    labels = jnp.where(labels < 0, labels + c, labels)
    if label_smoothing:
        target = optax.smooth_labels(jax.nn.one_hot(labels, c, dtype=z.dtype), label_smoothing)
        loss = optax.softmax_cross_entropy(z, target)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(z, labels)
    if z_loss:
        loss = loss + z_loss * jax.nn.logsumexp(z, axis=-1) ** 2
    return loss


# ------------------------------------------------------------------ softmax_cross_entropy
def _wrap(labels, c):
    # Labels in [-C, 0) count from the end, as numpy indexing (and optax); others stay.
    return jnp.where(labels < 0, labels + c, labels)


def _onehot(labels, like):
    # Zero for labels outside [0, C), as jax.nn.one_hot.
    classes = jax.lax.broadcasted_iota(labels.dtype, like.shape, like.ndim - 1)
    return (classes == labels[..., None]).astype(like.dtype)


def _xent_forward(logits, labels):
    x = upcast(logits)
    c = x.shape[-1]
    z, _, e, s = shifted_exp(x, None, -1)  # z = x - max(x), see shifted_exp at +-inf
    labels = _wrap(labels, c)
    valid = (labels >= 0) & (labels < c)
    picked = jnp.take_along_axis(z, jnp.clip(labels, 0, c - 1)[..., None], -1)
    # log(s) - (x - m)[label]: exact for logits of 1e4, where m + log(s) would round, and
    # log(k) (not inf - inf) when the label is one of k logits at +inf.
    loss = jnp.where(valid, (jnp.log(s) - picked)[..., 0], jnp.nan)
    res = {"exp": e.astype(logits.dtype), "inv_sum": inv_sum(s), "labels": labels}
    return loss.astype(logits.dtype), res


def _xent_grad(res):
    # d loss / d logits = softmax - onehot, the softmax from the forward's exp(x - m) and
    # 1 / s.
    p = upcast(res["exp"]) * res["inv_sum"]
    return p - _onehot(res["labels"], p)


_xent = reduction(
    "softmax_cross_entropy",
    _xent_forward,
    _xent_grad,
    nondiff_argnums=(1,),
    residuals={
        "exp": "exp(logits - max(logits)), same shape and dtype as logits",
        "inv_sum": "1 / sum(exp(logits - max(logits))) per row, float32, [..., 1]",
        "labels": "the integer labels (an input), shape [...]",
    },
    level=Level.DERIVED,
    reuse=(0,),
)


# With any option: one operator whose forward keeps the logits (an input), not exp(z - m).
# Label smoothing needs to tell a masked class (logit -inf) from one whose exp(z - m)
# underflows to 0, which the kept exp cannot; keeping the logits costs the same bytes as
# the exp (nothing when the caller keeps them anyway) plus one exp (and one tanh with a
# cap) per entry in the backward.
def _ignored_or_none(labels, ignore_index):
    return None if ignore_index is None else ignored_rows(labels, ignore_index)


def _unmasked(z):
    # The classes label smoothing spreads over (z > -inf) and their count C' (>= 1, so
    # that a fully masked row divides by 1), per row.
    kept = z != -jnp.inf
    return kept, jnp.maximum(jnp.sum(kept, -1, keepdims=True), 1).astype(z.dtype)


def _spread(z, one_hot):
    # One-hot targets (optax's smooth_labels) spread over every class; otherwise over
    # the unmasked ones.
    return (True, z.shape[-1]) if one_hot else _unmasked(z)


def _options_forward(logits, labels, *, smoothing, z_loss, cap, ignore_index, one_hot=False):
    # one_hot: the labels are read as jax.nn.one_hot reads them (for cannjax.optimize): a
    # label outside [0, C), negative ones too, picks no class and its row is not NaN.
    x = upcast(logits)
    c = x.shape[-1]
    z, _ = soft_cap(x, cap)
    zs, m, e, s = shifted_exp(z, None, -1)  # zs = z - m, see shifted_exp at +-inf
    log_s = jnp.log(s)
    wrapped = labels if one_hot else _wrap(labels, c)
    valid = (wrapped >= 0) & (wrapped < c)
    picked = jnp.take_along_axis(zs, jnp.clip(wrapped, 0, c - 1)[..., None], -1)
    # Each term in shifted form: (1 - eps)(log s - zs[y]) + eps (log s - mean(zs)) is
    # lse - (1 - eps) z[y] - eps mean(z), exact for logits of 1e4.
    loss = log_s - picked
    if one_hot:
        loss = jnp.where(valid[..., None], loss, 0.0)
    if smoothing:
        kept, n = _spread(z, one_hot)
        mean = jnp.sum(jnp.where(kept, zs, 0.0), -1, keepdims=True) / n
        loss = (1 - smoothing) * loss + smoothing * (log_s - mean)
    if z_loss:
        loss = loss + z_loss * jnp.square(m + log_s)  # lse = m + log(s)
    loss = loss[..., 0] if one_hot else jnp.where(valid, loss[..., 0], jnp.nan)
    ignored = _ignored_or_none(labels, ignore_index)
    if ignored is not None:
        loss = jnp.where(ignored, jnp.zeros((), loss.dtype), loss)
    res = {"logits": logits, "max": m, "inv_sum": inv_sum(s), "labels": labels}
    return loss.astype(logits.dtype), res


def _options_grad(res, *, smoothing, z_loss, cap, ignore_index, one_hot=False):
    # d loss / d z = p (mass + 2 z_loss lse) - (1 - eps) onehot - eps / C' [z > -inf]
    # (mass = sum of the target = 1, or eps on a one-hot row that picks no class), then
    # times dz/dx = 1 - tanh(x / cap)^2 through the cap; 0 on ignored rows.
    x = upcast(res["logits"])
    c = x.shape[-1]
    z, t = soft_cap(x, cap)
    m, r = res["max"], res["inv_sum"]
    e = exp_shifted(z, m)
    mass = 1.0  # the target's sum: 1, but eps on a one-hot row whose label picks no class
    if one_hot:
        labels = res["labels"][..., None]
        mass = jnp.where((labels >= 0) & (labels < c), 1.0, smoothing)
    if z_loss:
        # lse = m + log(s) = m - log(1 / s); an empty row (1 / s = 0) has p = 0.
        empty = r == 0
        lse = m - jnp.log(jnp.where(empty, 1.0, r))
        r = jnp.where(empty, 0.0, r * (mass + 2 * z_loss * lse))
        # 0 where exp(z - m) is 0, also when lse is +inf (a row with +inf logits).
        p = jnp.where(e == 0, 0.0, e * r)
    else:
        p = e * (r * mass)
    onehot = _onehot(res["labels"] if one_hot else _wrap(res["labels"], c), p)
    if smoothing:
        kept, n = _spread(z, one_hot)
        grad = p - (1 - smoothing) * onehot - jnp.where(kept, smoothing / n, 0.0)
    else:
        grad = p - onehot
    if t is not None:
        grad = grad * cap_slope(t)
    ignored = _ignored_or_none(res["labels"], ignore_index)
    if ignored is not None:
        grad = jnp.where(ignored[..., None], jnp.zeros((), grad.dtype), grad)
    return grad


def _options_tangent(res, t, **static):
    return jnp.sum(upcast(t) * _options_grad(res, **static), -1).astype(t.dtype)


def _options_backward(res, g, **static):
    return ((upcast(g)[..., None] * _options_grad(res, **static)).astype(g.dtype),)


_xent_options = defop(
    "softmax_cross_entropy_options",
    forward=_options_forward,
    tangent=_options_tangent,
    backward=_options_backward,
    nondiff_argnums=(1,),
    residuals={
        "logits": "the logits (an input)",
        "max": "the row max of the (capped) logits, float32, [..., 1]",
        "inv_sum": "1 / sum(exp(z - max)) per row of the (capped) logits z, float32, [..., 1]",
        "labels": "the integer labels (an input), shape [...]",
    },
    level=Level.DERIVED,
    reuse=(),
)


def _reference(logits, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None,
               ignore_index=None):  # fmt: skip
    """optax: ``softmax_cross_entropy_with_integer_labels``, or with an option
    ``softmax_cross_entropy(z, smooth_labels(one_hot(labels), label_smoothing))`` of the
    capped logits ``z`` plus ``z_loss * logsumexp(z)^2``; NaN for invalid labels (as
    optax's integer form), 0 on ignored rows."""
    import optax

    if (label_smoothing, z_loss, logit_cap, ignore_index) == (0.0, 0.0, None, None):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    c = logits.shape[-1]
    loss = plain_loss(
        logits, labels, label_smoothing=label_smoothing, z_loss=z_loss, logit_cap=logit_cap
    )
    loss = jnp.where((labels >= -c) & (labels < c), loss, jnp.nan)
    if ignore_index is not None:
        loss = jnp.where(ignored_rows(labels, ignore_index), 0.0, loss)
    return loss


def _sample(key):
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (4, 6), jnp.float32) * 2
    # Row 3 has label 5, which the ignore_index configs ignore.
    return logits, jax.random.randint(k2, (4,), 0, 6).at[3].set(5)


_DEFAULTS = {"label_smoothing": 0.0, "z_loss": 0.0, "logit_cap": None, "ignore_index": None}


def _edges():
    big = jnp.asarray([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4 - 1], [-1e4, -1e4, -1e4]], jnp.float32)
    masked = jnp.asarray([[0.0, -INF, -INF], [-INF, 2.0, 1.0], [3.0, -INF, 0.0]], jnp.float32)
    labels = jnp.asarray([0, 1, 2])
    # softmax - onehot of the masked rows, in float64.
    x = np.asarray(masked, np.float64)  # exactly the float32 inputs
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = p - np.eye(3)[[0, 1, 2]]
    # Exact losses at logits of 1e4 (optax rounds logsumexp to a float32 ulp of 1e4 before
    # subtracting the label logit: 2e-4 off here in float32).
    b = np.asarray(big, np.float64)
    mb = b.max(-1, keepdims=True)
    exact = (mb[:, 0] - b[[0, 1, 2], [0, 1, 2]]) + np.log(np.exp(b - mb).sum(-1))
    return [
        EdgeCase((big, labels), reference_value=False, expected_value=exact),
        EdgeCase((big[..., None, :], labels[..., None]), reference_value=False,
                 expected_value=exact[..., None]),
        EdgeCase((masked, labels), finite_differences=False,
                 expected_grad=(want,)),
    ]  # fmt: skip


def _exact_loss(x, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None, ignore_index=None):
    """Loss and gradient (of the sum) in float64 numpy, with the documented conventions
    (a class at ``-inf`` is out of the row, smoothing spreads over the others); for rows
    with a finite max."""
    del ignore_index  # rows with a finite max only; ignored rows are the caller's
    x = np.asarray(x, np.float64)
    t = None if logit_cap is None else np.tanh(x / logit_cap)
    z = x if t is None else logit_cap * t
    kept = z != -np.inf
    m = np.max(z, -1, keepdims=True)
    e = np.exp(z - m)
    lse = m + np.log(e.sum(-1, keepdims=True))
    onehot = np.eye(x.shape[-1])[np.asarray(labels)]
    q = (1 - label_smoothing) * onehot + label_smoothing * kept / kept.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        terms = np.where(q > 0, q * (lse - z), 0.0)
    loss = terms.sum(-1) + z_loss * lse[..., 0] ** 2
    grad = e / e.sum(-1, keepdims=True) * (1 + 2 * z_loss * lse) - q
    return loss, grad if t is None else grad * (1 - t**2)


def _options_edges():
    masked = jnp.asarray([[0.0, -INF, -INF], [-INF, 2.0, 1.0], [3.0, -INF, 0.0],
                          [0.5, -1.0, 2.0]], jnp.float32)  # fmt: skip
    big = jnp.asarray([[1e4, -1e4, 0.5], [-1e4, 3.0, 1e4 - 1], [-1e4, -1e4, -1e4]], jnp.float32)
    labels = jnp.asarray([0, 1, 2])
    smooth = {**_DEFAULTS, "label_smoothing": 0.1, "z_loss": 0.01, "ignore_index": -100}
    capped = {**_DEFAULTS, "label_smoothing": 0.1, "z_loss": 1e-3, "logit_cap": 30.0}
    uncapped = {**_DEFAULTS, "label_smoothing": 0.1, "z_loss": 1e-4}
    loss, grad = _exact_loss(masked[:3], labels, **smooth)
    big_loss, big_grad = _exact_loss(big, labels, **uncapped)
    return [
        # -inf logits with smoothing: the class is out of the row (loss and gradient
        # finite; optax's smoothed loss is +inf). The last row is ignored: loss 0,
        # gradient 0.
        EdgeCase((masked, jnp.asarray([0, 1, 2, -100])), kwargs=smooth,
                 finite_differences=False, reference_value=False, reference_grad=False,
                 expected_value=np.append(loss, 0.0),
                 expected_grad=(np.concatenate([grad, np.zeros((1, 3))]),)),
        # Logits of 1e4 soft-capped at 30: tanh saturates, gradient 0 there.
        EdgeCase((big, labels), kwargs=capped),
        # Logits of 1e4 uncapped, with a z-loss of 1e-4 lse^2 ~ 1e4: exact.
        EdgeCase((big, labels), kwargs=uncapped, reference_value=False,
                 expected_value=big_loss, expected_grad=(big_grad,)),
    ]  # fmt: skip


def _all_edges():
    return written_for(_DEFAULTS, _edges)() + _options_edges()


@registered(
    _xent,
    reference=_reference,
    sample=_sample,
    edges=_all_edges,
    residuals={
        **_xent.residuals,
        "inv_sum": _xent.residuals["inv_sum"] + " (with any option: of the capped logits)",
        "logits": "with any option (instead of exp): " + _xent_options.residuals["logits"],
        "max": "with any option: " + _xent_options.residuals["max"],
    },
    configs=(
        {},
        {"label_smoothing": 0.1},
        {"z_loss": 0.01, "ignore_index": 5},
        {"logit_cap": 2.0},
        {"label_smoothing": 0.2, "z_loss": 0.05, "logit_cap": 3.0, "ignore_index": 5},
    ),
    doc="Softmax cross-entropy with integer labels.",
)
def softmax_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    logit_cap: float | None = None,
    ignore_index: int | None = None,
) -> jax.Array:
    """Cross-entropy of ``softmax(logits)`` against integer class labels.

    By default the same math as ``optax.softmax_cross_entropy_with_integer_labels``::

      loss = logsumexp(logits) - logits[label]     (over the last axis, C classes)

    With the options (per row; the defaults leave the loss above unchanged, bit for bit)::

      z    = logit_cap * tanh(logits / logit_cap)  if logit_cap else logits
      lse  = logsumexp(z)
      loss = lse - (1 - eps) z[label] - (eps / C) sum_c z_c + z_loss * lse^2
      loss = 0                                      where label == ignore_index

    ``eps = label_smoothing``: the cross-entropy against the target
    ``(1 - eps) onehot(label) + eps / C`` (``optax.smooth_labels``; Szegedy et al.);
    ``z_loss * lse^2`` pulls ``logsumexp`` towards 0 (PaLM); the cap bounds the logits
    smoothly to ``(-cap, cap)`` (Gemma 2's final-logit soft-capping).

    Backward: ``dlogits = dloss * (1 - (z / cap)^2) * (p (1 + 2 z_loss lse) - (1 - eps)
    onehot - eps / C)`` with ``p = softmax(z)`` (the first factor only with a cap), and
    0 on ignored rows. By default the forward keeps ``e = exp(logits - m)`` (``m`` the row
    max; the forward computes it anyway), ``1/s`` per row (``s = sum(e)``) and the labels:
    one full-size array plus two numbers per row, fewer bytes than plain autodiff keeps,
    and no ``exp`` in the backward (see :func:`cannjax.ops.logsumexp` for the
    alternatives and why this one). With any option it keeps the logits themselves (an
    input: the same bytes as ``e``, none when the caller keeps them anyway), ``m`` and
    ``1/s`` per row and the labels, and the backward makes ``p`` again (one ``exp``, and
    one ``tanh`` with a cap, per entry): smoothing must tell a masked class from one
    whose ``e`` underflows, and the cap's derivative needs the logits. Labels get no
    gradient.

    Edge conventions:

    * Non-label logits equal to ``-inf`` (a hard mask) give a finite loss and gradient:
      those classes have probability exactly 0. With label smoothing such a class is out
      of the row: ``eps`` is spread over the ``C'`` classes whose logit is not ``-inf``
      (``C`` in the formula above becomes ``C'``; the target is still a distribution),
      so the loss stays finite, where optax's smoothed cross-entropy (the formula taken
      literally) gives ``+inf``: target mass on a class of probability 0. The gradient
      is 0 at the masked logits.
    * Under ``logit_cap`` every logit is capped, ``-inf`` included: it becomes ``-cap``
      (the formula's value and its limit), a class like the others, no longer a mask.
    * Logits of magnitude 1e4 are exact (the max is subtracted before ``exp``; each term
      above is computed from ``z - m``). With a cap they saturate: ``z = +-cap``, and
      the gradient there is 0 (``tanh'`` underflows), as in the formula.
    * Logits at ``+inf``: the limit as they grow together, a loss of ``log(k)`` when the
      label is one of ``k`` such logits and ``+inf`` otherwise, with the finite gradient
      ``p - onehot`` (``p`` uniform over them); plain JAX gives NaN. With smoothing the
      loss is ``+inf`` unless every logit is ``+inf`` (gradient ``p - target``, finite);
      with ``z_loss`` it is ``+inf`` and so is the gradient at those logits
      (``lse = +inf``). NaN propagates.
    * Labels outside ``[0, C)``, defined as optax defines them (through
      ``jnp.take_along_axis``): a label in ``[-C, 0)`` counts from the end, as numpy
      indexing (``-1`` is class ``C - 1``); a label ``>= C`` or ``< -C`` gives a NaN loss,
      so an invalid label does not pass silently as a finite number, and the gradient
      ``dloss * softmax(logits)`` (its one-hot is zero; with the options, the formula
      above with a zero one-hot). A label equal to ``ignore_index`` is ignored before
      any of this: loss 0 and gradient 0, whatever its value (``-100`` too).

    Args:
      logits: float array ``[..., C]``.
      labels: integer array ``[...]`` (``logits.shape[:-1]``), values in ``[0, C)``
        (see above for others).
      label_smoothing: ``eps`` in ``[0, 1)``, a Python float; 0 (the default) is plain
        cross-entropy.
      z_loss: weight of ``logsumexp(z)^2``, a Python float ``>= 0`` (PaLM used 1e-4);
        default 0.
      logit_cap: ``None`` (the default) or a Python float ``> 0``: the logits become
        ``logit_cap * tanh(logits / logit_cap)`` before the softmax (Gemma 2: 30.0).
      ignore_index: ``None`` (the default, as optax: no row ignored) or an int: rows
        whose label equals it give loss 0 and no gradient (PyTorch uses -100).

    Returns:
      The loss per example, shape ``[...]``, in ``logits``' dtype (half-precision logits
      are reduced in float32).

    Raises:
      TypeError: if ``logits`` is not floating point, ``labels`` not integer, a
        hyperparameter not a Python number (a traced value cannot select the code) or
        ``ignore_index`` not an int.
      ValueError: if ``labels.shape != logits.shape[:-1]``, ``label_smoothing`` is
        outside ``[0, 1)``, ``z_loss < 0`` or ``logit_cap <= 0`` (or either is not
        finite).

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> logits = jnp.array([[0.0, 0.0], [0.0, -jnp.inf]])
      >>> cannjax.ops.softmax_cross_entropy(logits, jnp.array([0, 0]))
      Array([0.6931472, 0.       ], dtype=float32)
      >>> jax.grad(lambda l: cannjax.ops.softmax_cross_entropy(l, jnp.array([0, 0])).sum())(
      ...     logits)
      Array([[-0.5,  0.5],
             [ 0. ,  0. ]], dtype=float32)
      >>> cannjax.ops.softmax_cross_entropy(  # row 0 ignored; no smoothing on -inf
      ...     logits, jnp.array([-100, 0]), label_smoothing=0.1, ignore_index=-100)
      Array([0., 0.], dtype=float32)
      >>> cannjax.ops.softmax_cross_entropy(
      ...     jnp.array([[1e4, 0.0]]), jnp.array([1]), z_loss=1e-4, logit_cap=30.0)
      Array([30.09], dtype=float32)

    References:
      Szegedy et al., "Rethinking the Inception Architecture for Computer Vision", 2016
      (label smoothing). https://arxiv.org/abs/1512.00567
      Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", 2022 (z-loss).
      https://arxiv.org/abs/2204.02311
      Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size", 2024
      (final-logit soft-capping). https://arxiv.org/abs/2408.00118
      Hsu et al., "Liger Kernel: Efficient Triton Kernels for LLM Training", 2024 (the
      same options in a fused cross-entropy kernel). https://arxiv.org/abs/2410.10989
      Huawei CANN operator SoftmaxCrossEntropyWithLogits (which takes dense labels;
      integer labels here are its one-hot case).
    """
    logits = float_input(_FN, "logits", logits)
    labels = as_int(_FN, "labels", labels)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{_FN}: labels must have shape logits.shape[:-1] = {logits.shape[:-1]} (one "
            f"integer class per row of logits {logits.shape}), got labels.shape={labels.shape}"
        )
    eps, zl, cap = loss_options(_FN, label_smoothing, z_loss, logit_cap)
    ignore = check_ignore_index(_FN, ignore_index, optional=True)
    if (eps, zl, cap, ignore) == (0.0, 0.0, None, None):
        return _xent(logits, labels)
    return _xent_options(logits, labels, smoothing=eps, z_loss=zl, cap=cap, ignore_index=ignore)


def one_hot_cross_entropy(logits, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None):
    """Per-row :func:`softmax_cross_entropy` of labels read as one-hot targets, as optax's
    ``softmax_cross_entropy(logits, smooth_labels(one_hot(labels), eps))`` reads them: a
    label outside ``[0, C)``, negative ones included, picks no class (its row is
    ``eps (lse - mean(z)) + z_loss lse^2``, not NaN) and smoothing spreads over all ``C``
    classes. For :func:`cannjax.optimize`; the arguments are trusted (checked where the
    match was made)."""
    return _xent_options(
        logits,
        labels,
        smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        cap=None if logit_cap is None else float(logit_cap),
        ignore_index=None,
        one_hot=True,
    )
