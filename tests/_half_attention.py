"""Half-precision attention where the queries, keys and values share a mean: how far
an attention's gradient and tangent are from the exact ones (shared by the tests of
cannjax.ops.attention and of ring attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cannjax.core import registry
from tests import _rng as rand


def shared_mean(dtype, B=1, T=512, N=4, K=2, H=64, mean=5.0):
    """``q, k, v, dO`` of ``dtype`` whose queries, keys and values share a mean ``mean``
    times their spread along one direction per head (the residual stream's common
    direction of trained transformers), with logits of standard deviation about 1."""
    ks = jax.random.split(jax.random.key(7), 7)
    q, g = (rand.normal(k, (B, T, N, H), jnp.float32) for k in (ks[0], ks[3]))
    k, v = (rand.normal(k, (B, T, K, H), jnp.float32) for k in ks[1:3])
    q = 0.3 * (q + mean * rand.normal(ks[4], (1, 1, N, H), jnp.float32))
    k = 0.3 * (k + mean * rand.normal(ks[5], (1, 1, K, H), jnp.float32))
    v = v + mean * rand.normal(ks[6], (1, 1, K, H), jnp.float32)
    return tuple(x.astype(dtype) for x in (q, k, v, g))


def errors_in_eps(attend, dtype):
    """``([dq, dk, dv], tangent)``: the relative 2-norm distance of ``attend(q, k, v)``'s
    gradients and tangent (causal attention of :func:`shared_mean`'s inputs) from the
    exact ones at the same inputs (float64), in units of ``dtype``'s eps."""
    q, k, v, g = shared_mean(dtype)
    t = tuple(0.5 * x for x in shared_mean(dtype, mean=0.0)[:3])
    eps = float(jnp.finfo(dtype).eps)
    _, vjp = jax.vjp(attend, q, k, v)
    grads, tangent = vjp(g), jax.jvp(attend, (q, k, v), t)[1]
    reference = registry()["attention"].reference

    def exact(q, k, v):
        return reference(q, k, v, causal=True)

    def rel(a, b):
        a = np.asarray(a.astype(jnp.float32), np.float64)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b)) / eps

    with jax.enable_x64(True):
        wide = [x.astype(jnp.float64) for x in (q, k, v, g, *t)]
        _, vjp64 = jax.vjp(exact, *wide[:3])
        want = [np.asarray(x) for x in vjp64(wide[3])]
        want_t = np.asarray(jax.jvp(exact, tuple(wide[:3]), tuple(wide[4:]))[1])
    return [rel(a, b) for a, b in zip(grads, want)], rel(tangent, want_t)


def float32_shapes(attend, rule, q, k, shapes):
    """Those of ``shapes`` that some float32 array of the compiled ``attend(q, k, k)``
    (``rule="forward"``) or of its tangent has: copies of the operands that a loop over
    half-precision blocks should not hold."""
    if rule == "forward":
        fn = attend
    else:

        def fn(q, k, v):
            return jax.jvp(attend, (q, k, v), (q, k, v))[1]

    hlo = jax.jit(fn).lower(q, k, k).compile().as_text()
    return [s for s in shapes if f"= f32[{','.join(map(str, s))}]" in hlo]
