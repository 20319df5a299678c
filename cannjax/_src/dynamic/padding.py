"""Padding a batch to its gear, with the per-token weights that keep the padding inert.

A padded position must change neither the loss nor the gradients. The weights carry
that: 1.0 on a real position, 0.0 on a padded one, and a loss written as
``sum(w * loss_per_token) / sum(w)`` (``cannjax.models.gpt_loss(..., weights=w)``) gives
a padded position a zero cotangent. Whatever else could read a padded position must be
kept from it; in a causal model with right padding nothing does (query ``t`` attends to
keys ``j <= t``, all real when ``t`` is), and in a non-causal one the attention takes the
key mask ``weights[:, None, None, :] > 0`` (``cannjax.ops.attention(..., mask=...)``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cannjax._src.dynamic.gears import _is_int, _positive_int

_FN = "cannjax.dynamic.pad_to_gear"


def pad_to_gear(
    batch: Any,
    size: int,
    *,
    axis: Any = 1,
    value: Any = 0,
    lengths: Any = None,
) -> tuple[Any, Any]:
    """Pads every leaf of ``batch`` along its sequence axis to ``size``, and weights it.

    Shape letters: ``B`` batch, ``T`` the batch's length, ``S = size`` the gear. A leaf
    ``x`` padded along axis ``a`` becomes ``x`` followed by ``S - T`` positions filled with
    ``value`` (right padding); the weights, of shape ``x.shape[:a] + (S,)`` (``[B, S]``
    for the usual ``a = 1``), are::

      weights[..., t] = 1.0  if t < lengths[...]  else 0.0      (lengths = T by default)

    Pass them as the per-token loss weights (``cannjax.models.gpt_loss(params, tokens,
    targets, cfg, weights=weights)``): a padded position's loss then gets a zero
    cotangent. In a causal model nothing real reads a padded position either (query
    ``t`` attends to keys ``j <= t``, all real when ``t`` is), so the padded positions
    contribute nothing to the loss or the gradients. A non-causal attention must be
    given the key mask ``weights[:, None, None, :] > 0`` (``cannjax.ops.attention(q, k,
    v, mask=mask)``, or ``jax.nn.dot_product_attention``'s ``mask``).

    Args:
      batch: a pytree of arrays (NumPy or JAX) holding the sequences.
      size: the gear, a positive int ``>= T``.
      axis: the sequence axis: an int for every leaf, or a pytree prefix of ``batch``
        with an int or None per subtree (None: leave it as it is), as ``jax.vmap``'s
        ``in_axes``. A leaf with fewer dimensions than its axis needs is left as it is.
      value: the scalar that fills the padded positions.
      lengths: optional real lengths per sequence, an int array broadcastable to the
        weights' leading shape (``[B]``), each ``<= T``, for rows padded already within
        the batch; None: every row has length ``T``.

    Returns:
      ``(padded, weights)``: ``batch`` with each padded leaf of length ``S`` (NumPy
      leaves stay NumPy), and the float32 weights (NumPy when every padded leaf is).

    Raises:
      TypeError: ``size`` not an int, or an axis that is neither an int nor None.
      ValueError: ``size < 1``, an ``axis`` that is not a prefix of ``batch``, no leaf
        to pad, padded leaves that disagree on ``T`` or on the leading shape, ``T >
        size``, or ``lengths`` outside ``[0, T]`` or of a shape that does not broadcast.

    Example:
      >>> import numpy as np
      >>> from cannjax.dynamic import pad_to_gear
      >>> batch = {"tokens": np.array([[5, 6, 7]]), "n": np.array([3])}
      >>> padded, weights = pad_to_gear(batch, 4, axis={"tokens": 1, "n": None})
      >>> padded["tokens"], padded["n"], weights
      (array([[5, 6, 7, 0]]), array([3]), array([[1., 1., 1., 0.]], dtype=float32))
    """
    size = _positive_int(_FN, "size", size)
    seq = _sequences(_FN, batch, axis)
    return _pad(_FN, seq, size, value, lengths)


class _Sequences(NamedTuple):
    """A batch split for padding: its leaves, which to pad along which axis, T, lead."""

    leaves: list[Any]
    treedef: Any
    todo: list[tuple[int, int]]  # (leaf index, non-negative axis)
    length: int  # T
    lead: tuple[int, ...]  # the dimensions before the sequence axis: (B,)


def _sequences(fn: str, batch: Any, axis: Any) -> _Sequences:
    leaves, treedef = jax.tree.flatten(batch)
    axes = _leaf_axes(fn, batch, axis)
    todo = [
        (i, a if a >= 0 else a + np.ndim(x))
        for i, (x, a) in enumerate(zip(leaves, axes))
        if a is not None and -np.ndim(x) <= a < np.ndim(x)
    ]
    if not todo:
        raise ValueError(
            f"{fn}: no leaf of batch has its sequence axis (axis={axis!r}); give the axis "
            "of the sequences, e.g. axis=1 for [B, T] arrays"
        )
    i0, a0 = todo[0]
    length, lead = np.shape(leaves[i0])[a0], np.shape(leaves[i0])[:a0]
    for i, a in todo:
        shape = np.shape(leaves[i])
        if shape[a] != length or shape[:a] != lead:
            raise ValueError(
                f"{fn}: the leaves padded disagree: a leaf of shape {shape} padded along "
                f"axis {a}, another of shape {np.shape(leaves[i0])} along axis {a0}; give "
                "their sequence axes by leaf (axis as a pytree prefix, None for a leaf to "
                "leave as it is)"
            )
    return _Sequences(leaves, treedef, todo, int(length), tuple(lead))


def _pad(fn: str, seq: _Sequences, size: int, value: Any, lengths: Any) -> tuple[Any, Any]:
    if seq.length > size:
        raise ValueError(
            f"{fn}: the batch has length {seq.length} > size {size}; pad to a gear that "
            "holds it (Gears.gear_for(length))"
        )
    on_host = all(isinstance(seq.leaves[i], np.ndarray) for i, _ in seq.todo)
    xp = np if on_host else jnp
    out = list(seq.leaves)
    for i, a in seq.todo:
        widths = [(0, 0)] * np.ndim(out[i])
        widths[a] = (0, size - seq.length)
        pad = np.pad if isinstance(out[i], np.ndarray) else jnp.pad
        out[i] = pad(out[i], widths, constant_values=value)
    weights = _weights(fn, xp, seq.lead, seq.length, size, lengths)
    return jax.tree.unflatten(seq.treedef, out), weights


def _weights(fn, xp, lead, length, size, lengths):
    if lengths is None:
        w = np.zeros(lead + (size,), np.float32)
        w[..., :length] = 1.0
        return w if xp is np else jnp.asarray(w)
    try:
        host = np.asarray(lengths)
    except jax.errors.TracerArrayConversionError:  # traced lengths: checked by dtype only
        host = None
    kind = (host if host is not None else lengths).dtype.kind
    if kind not in "iu":
        raise ValueError(f"{fn}: lengths must be ints, got {lengths!r}")
    try:
        fits = np.broadcast_shapes(np.shape(lengths), lead) == lead
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(
            f"{fn}: lengths of shape {np.shape(lengths)} does not broadcast to the "
            f"batch's leading shape {lead}"
        )
    if host is not None and host.size and (host.min() < 0 or host.max() > length):
        raise ValueError(
            f"{fn}: lengths must lie in [0, {length}] (the batch's length), got "
            f"{host.min()} .. {host.max()}"
        )
    n = xp.broadcast_to(host if xp is np else jnp.asarray(lengths), lead)
    positions = xp.arange(size).reshape((1,) * len(lead) + (size,))  # explicit rank
    return (positions < n[..., None]).astype(xp.float32)


def _leaf_axes(fn: str, batch: Any, axis: Any) -> list[int | None]:
    """One axis (or None) per leaf of ``batch``, from an int or a pytree prefix."""
    if axis is None or _is_int(axis):
        return [None if axis is None else int(axis)] * len(jax.tree.leaves(batch))
    try:
        full = jax.tree.broadcast(axis, batch, is_leaf=lambda x: x is None)
    except ValueError as e:
        raise ValueError(
            f"{fn}: axis must be an int or a pytree prefix of batch with an int or None "
            f"per subtree: {e}"
        ) from None
    axes = jax.tree.leaves(full, is_leaf=lambda x: x is None)
    for a in axes:
        if a is not None and not _is_int(a):
            raise TypeError(f"{fn}: axis entries must be ints or None, got {a!r}")
    return [None if a is None else int(a) for a in axes]
