"""Losses: softmax cross-entropy with integer labels.

Shape letters: ``C`` classes; ``...`` any batch shape (possibly empty).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from cannjax._src.core.dtypes import upcast
from cannjax._src.core.operator import registered
from cannjax._src.core.registry import EdgeCase, Level
from cannjax._src.core.validate import as_int
from cannjax._src.ops.rowwise import float_input, inv_sum, reduction, shifted_exp

INF = float("inf")
_FN = "cannjax.ops.softmax_cross_entropy"


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


def _reference(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def _sample(key):
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (4, 6), jnp.float32) * 2
    return logits, jax.random.randint(k2, (4,), 0, 6)


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


@registered(
    _xent,
    reference=_reference,
    sample=_sample,
    edges=_edges,
    doc="Softmax cross-entropy with integer labels.",
)
def softmax_cross_entropy(logits: ArrayLike, labels: ArrayLike) -> jax.Array:
    """Cross-entropy of ``softmax(logits)`` against integer class labels.

    Same math as ``optax.softmax_cross_entropy_with_integer_labels``::

      loss = logsumexp(logits) - logits[label]     (over the last axis, C classes)

    Backward: ``dlogits = dloss * (softmax(logits) - onehot(label))``. The forward keeps
    ``e = exp(logits - m)`` (``m`` the row max; the forward computes it anyway), ``1/s``
    per row (``s = sum(e)``) and the labels (an input): one full-size array plus two
    numbers per row, fewer bytes than plain autodiff keeps, and no ``exp`` in the
    backward (see :func:`cannjax.ops.logsumexp` for the alternatives and why this one).
    Labels get no gradient.

    Edge conventions:

    * Non-label logits equal to ``-inf`` (a hard mask) give a finite loss and gradient:
      those classes have probability exactly 0.
    * Logits of magnitude 1e4 are exact (the max is subtracted before ``exp``).
    * Logits at ``+inf``: the limit as they grow together, a loss of ``log(k)`` when the
      label is one of ``k`` such logits and ``+inf`` otherwise, with the finite gradient
      ``p - onehot`` (``p`` uniform over them); plain JAX gives NaN. NaN propagates.
    * Labels outside ``[0, C)``, defined as optax defines them (through
      ``jnp.take_along_axis``): a label in ``[-C, 0)`` counts from the end, as numpy
      indexing (``-1`` is class ``C - 1``); a label ``>= C`` or ``< -C`` gives a NaN loss,
      so an invalid label does not pass silently as a finite number, and the gradient
      ``dloss * softmax(logits)`` (its one-hot is zero).

    Args:
      logits: float array ``[..., C]``.
      labels: integer array ``[...]`` (``logits.shape[:-1]``), values in ``[0, C)``
        (see above for others).

    Returns:
      The loss per example, shape ``[...]``, in ``logits``' dtype (half-precision logits
      are reduced in float32).

    Raises:
      TypeError: if ``logits`` is not floating point or ``labels`` not integer.
      ValueError: if ``labels.shape != logits.shape[:-1]``.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> logits = jnp.array([[0.0, 0.0], [0.0, -jnp.inf]])
      >>> cannjax.ops.softmax_cross_entropy(logits, jnp.array([0, 0]))
      Array([0.6931472, 0.       ], dtype=float32)
      >>> jax.grad(lambda l: cannjax.ops.softmax_cross_entropy(l, jnp.array([0, 0])).sum())(
      ...     logits)
      Array([[-0.5,  0.5],
             [ 0. ,  0. ]], dtype=float32)

    References:
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
    return _xent(logits, labels)
