"""optimize runs a top-level scan that computes in half precision unrolled where the
platform writes stacked half arrays through float32 (XLA:CPU), and leaves other scans
rolled. Read off the rewritten program and the compiled HLO (deterministic)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from tests import _rng as rand
from tests.test_layer_unroll import _stack_round_trips

L, B, D = 3, 16, 32


def _params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": rand.normal(k1, (L, D, 4 * D), jnp.float32) * 0.1,
        "w2": rand.normal(k2, (L, 4 * D, D), jnp.float32) * 0.1,
        "scale": jnp.ones((L, D), jnp.float32),
    }


def _loss(compute):
    """A residual MLP stack under lax.scan, float32 master weights cast in each layer,
    as a mixed-precision user writes it."""

    def layer(x, p):
        w1, w2, scale = (p[k].astype(compute) for k in ("w1", "w2", "scale"))
        m = jnp.mean(x, -1, keepdims=True)
        v = jnp.var(x, -1, keepdims=True)
        h = (x - m) * jax.lax.rsqrt(v + 1e-5) * scale[None, :]
        return x + jax.nn.gelu(h @ w1) @ w2, None

    def loss(params, x):
        y, _ = jax.lax.scan(layer, x.astype(compute), params)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    return loss


def _x():
    return rand.normal(jax.random.key(1), (B, D), jnp.float32)


@pytest.mark.parametrize("compute, unrolled", [(jnp.bfloat16, 1), (jnp.float32, 0)])
def test_optimize_unrolls_half_precision_scans_only(compute, unrolled):
    loss = _loss(compute)
    report = cannjax.inspect.optimize(loss, _params(), _x())
    assert report.unrolled_loops == unrolled
    assert ("half-precision loop(s) unrolled" in str(report)) == bool(unrolled)
    jaxpr = jax.make_jaxpr(cannjax.optimize(loss))(_params(), _x())
    scans = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    lengths = [e.params["length"] for e in scans if e.params["length"] == L]
    assert lengths, "the layer scan is gone"
    unrolls = {e.params["unroll"] for e in scans if e.params["length"] == L}
    assert unrolls == ({L} if unrolled else {1})


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the programs in its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for v in e.params.values():
            inner = getattr(v, "jaxpr", v)  # a ClosedJaxpr's program, or a Jaxpr
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def test_unrolled_half_scan_converts_no_stack_and_keeps_values():
    loss = _loss(jnp.bfloat16)
    params, x = _params(), _x()
    plain = jax.jit(jax.value_and_grad(loss))
    opt = jax.jit(jax.value_and_grad(cannjax.optimize(loss)))
    assert _stack_round_trips(plain.lower(params, x).compile().as_text(), L)
    assert not _stack_round_trips(opt.lower(params, x).compile().as_text(), L)
    (lp, gp), (lo, go) = plain(params, x), opt(params, x)
    np.testing.assert_allclose(lo, lp, rtol=2e-2)
    for a, b in zip(jax.tree.leaves(go), jax.tree.leaves(gp)):
        assert float(jnp.max(jnp.abs(a - b))) <= 0.05 * float(jnp.max(jnp.abs(b)))
