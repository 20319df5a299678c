"""Every operator inside ``jax.shard_map`` (check_vma on, as by default) on per-device
inputs: the value, the gradient and a JVP equal those outside it.

The scan-based operators started their loop carries from invariant zeros, which
shard_map's type check refuses once a varying input flows in (cannjax/_src/core/vma.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from cannjax.core import registry
from tests._tiers import sample

NAMES = sorted(registry())


def _float_argnums(spec, args):
    return tuple(
        i
        for i, a in enumerate(args)
        if i not in spec.nondiff_argnums and jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
    )


@pytest.mark.parametrize("name", sample(NAMES))
def test_operator_inside_shard_map_with_varying_inputs(name):
    spec = registry()[name]
    args = tuple(jnp.asarray(a) for a in spec.sample(jax.random.key(0)))
    argnums = _float_argnums(spec, args)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))

    def scalar(*a):
        return sum(jnp.sum(jnp.cos(o)) for o in jax.tree.leaves(spec.fn(*a)))

    def run(*a):
        # Per-device inputs: every float argument varies over "d".
        a = tuple(jax.lax.pcast(x, "d", to="varying") if i in argnums else x
                  for i, x in enumerate(a))  # fmt: skip
        return jax.tree.map(lambda x: x[None], _derivatives(scalar, a, argnums))

    sharded = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P(), out_specs=P("d")))(*args)
    unsharded = _derivatives(scalar, args, argnums)
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(unsharded)):
        for device in range(2):
            np.testing.assert_allclose(got[device], want, rtol=2e-5, atol=2e-5)


def _derivatives(scalar, args, argnums):
    """The value, the gradient and a JVP (along half the point) of ``scalar``."""
    primals = tuple(args[i] for i in argnums)
    tangent = jax.jvp(
        lambda *d: scalar(*_put(args, argnums, d)), primals, tuple(0.5 * p for p in primals)
    )[1]
    return scalar(*args), jax.grad(scalar, argnums)(*args), tangent


def _put(args, argnums, values):
    out = list(args)
    for i, v in zip(argnums, values):
        out[i] = v
    return tuple(out)
