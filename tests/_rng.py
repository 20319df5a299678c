"""``jax.random.normal``, ``uniform`` and ``randint``: the same values, compiled less.

Each new shape of a ``jax.random`` draw compiles a threefry program on XLA:CPU (0.15-0.6 s
each), and make test draws a few hundred shapes: about a sixth of its compile time. With
partitionable threefry (``jax_threefry_partitionable``, jax's default), entry ``i`` of a
draw depends only on the key and ``i``, so a draw of ``shape`` is the first
``prod(shape)`` entries of a flat draw of any larger size. These functions draw a
power-of-two size (one program per size class, dtype and bounds) and cut it with numpy;
``tests/test_random_helpers.py`` checks that the values equal jax.random's. Under a
trace (the key is a tracer), with array bounds, or with another PRNG, they are
jax.random's own functions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def _shape(shape) -> tuple[int, ...]:
    return (int(shape),) if np.ndim(shape) == 0 else tuple(int(d) for d in shape)


def _prefix_holds(key, *bounds) -> bool:
    return (
        jax.config.jax_threefry_partitionable
        and not isinstance(key, jax.core.Tracer)
        and str(jax.random.key_impl(key)) == "threefry2x32"
        and all(np.ndim(b) == 0 and not isinstance(b, jax.core.Tracer) for b in bounds)
    )


def _cut(draw, key, shape):
    """``draw(key, shape)`` as the prefix of ``draw(key, (size class,))``."""
    n = math.prod(shape)
    flat = draw(key, (max(256, 1 << max(n - 1, 0).bit_length()),))
    return jnp.asarray(np.asarray(flat)[:n].reshape(shape))


def normal(key, shape=(), dtype=jnp.float32):
    shape = _shape(shape)
    if not _prefix_holds(key):
        return jax.random.normal(key, shape, dtype)
    return _cut(lambda k, s: jax.random.normal(k, s, dtype), key, shape)


def uniform(key, shape=(), dtype=jnp.float32, minval=0.0, maxval=1.0):
    shape = _shape(shape)
    if not _prefix_holds(key, minval, maxval):
        return jax.random.uniform(key, shape, dtype, minval, maxval)
    return _cut(lambda k, s: jax.random.uniform(k, s, dtype, minval, maxval), key, shape)


def randint(key, shape, minval, maxval, dtype=jnp.int32):
    shape = _shape(shape)
    if not _prefix_holds(key, minval, maxval):
        return jax.random.randint(key, shape, minval, maxval, dtype)
    return _cut(lambda k, s: jax.random.randint(k, s, minval, maxval, dtype), key, shape)
