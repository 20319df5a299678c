"""tests/_rng.py draws exactly what jax.random draws (its reason to exist)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import _rng as rand

# Few shapes: each costs the jax.random compiles the helpers exist to save.
SHAPES = [(), (2, 5, 4, 3), (300,)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.extended)])
def test_normal_and_uniform_equal_jax_random(shape, dtype):
    for key in (jax.random.key(3), jax.random.PRNGKey(7)):
        want = jax.random.normal(key, shape, dtype)
        got = rand.normal(key, shape, dtype)
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        want = jax.random.uniform(key, shape, dtype, -2.0, 3.0)
        np.testing.assert_array_equal(np.asarray(rand.uniform(key, shape, dtype, -2.0, 3.0)), want)


@pytest.mark.parametrize("shape", SHAPES)
def test_randint_equals_jax_random(shape):
    key = jax.random.key(5)
    want = jax.random.randint(key, shape, -3, 50)
    got = rand.randint(key, shape, -3, 50)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_float64_and_array_bounds_and_traced_keys():
    key = jax.random.key(2)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(
            rand.normal(key, (6, 5), jnp.float64), jax.random.normal(key, (6, 5), jnp.float64)
        )
    hi = jnp.arange(1, 13).reshape(3, 4)
    np.testing.assert_array_equal(
        rand.randint(key, (3, 4), 0, hi), jax.random.randint(key, (3, 4), 0, hi)
    )
    traced = jax.jit(lambda k: rand.normal(k, (4, 3)))(key)
    np.testing.assert_array_equal(traced, jax.random.normal(key, (4, 3)))
