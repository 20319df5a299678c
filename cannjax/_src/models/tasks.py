"""Synthetic sequence tasks generated on the fly (no download), for the demo and notebooks.

``sort``: ``K`` random digits, a separator, then the same digits sorted. The model is
trained on next-token prediction, scored only on the sorted half (which is determined
by the first half, so a perfect model reaches accuracy 1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    """Inputs ``[B, T]``, next-token targets ``[B, T]`` and loss weights ``[B, T]``."""

    tokens: jax.Array
    targets: jax.Array
    weights: jax.Array


class SortTask(NamedTuple):
    """Sorting ``digits`` random digits in ``[0, base)``; the separator is token ``base``.

    The sequence length is ``2 * digits`` and the vocabulary ``base + 1``.
    """

    digits: int = 16
    base: int = 10

    @property
    def seq_len(self) -> int:
        """Model sequence length."""
        return 2 * self.digits

    @property
    def vocab(self) -> int:
        """Vocabulary size (digits and the separator)."""
        return self.base + 1

    def batch(self, key: jax.Array, size: int) -> Batch:
        """A batch of ``size`` examples."""
        x = jax.random.randint(key, (size, self.digits), 0, self.base)
        sep = jnp.full((size, 1), self.base, x.dtype)
        seq = jnp.concatenate([x, sep, jnp.sort(x, axis=-1)], axis=-1)  # [B, 2K + 1]
        tokens, targets = seq[:, :-1], seq[:, 1:]
        pos = jnp.arange(self.seq_len)
        weights = jnp.broadcast_to(pos >= self.digits, tokens.shape).astype(jnp.float32)
        return Batch(tokens, targets, weights)

    @staticmethod
    def accuracy(logits: jax.Array, batch: Batch) -> jax.Array:
        """Fraction of scored positions whose argmax is the target."""
        hit = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
        return jnp.sum(hit * batch.weights) / jnp.sum(batch.weights)
