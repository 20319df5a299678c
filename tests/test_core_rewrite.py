"""The jaxpr rewriting layer under fuse, optimize and the level-3 budget (core/rewrite.py):
steps run as written, and bodies of scan, while, cond and checkpoint rewritten with new
constants spliced in, each equal to the program it replaces in value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core import rewrite as R

W = jnp.linspace(0.5, 1.5, 4)  # a closed-over constant: bodies get constants of their own


def _scan(x):
    return jax.lax.scan(lambda c, w: (jnp.sin(c * w), c.sum()), x, jnp.stack([W, W]))[0]


def _while(x):
    step = lambda ic: (ic[0] + 1, jnp.sin(ic[1] * W))  # noqa: E731
    return jax.lax.while_loop(lambda ic: ic[0] < 3, step, (0, x))[1]


def _cond(x):
    return jax.lax.cond(x.sum() > 0, lambda c: jnp.sin(c * W), lambda c: jnp.cos(c) * W, x)


def _checkpoint(x):
    return jax.checkpoint(lambda c: jnp.sin(c * W))(x)


PROGRAMS = {"scan": _scan, "while": _while, "cond": _cond, "checkpoint": _checkpoint}


def _program(f, x):
    return R.normalize(J.trace(lambda x: [f(x)], [J.sds(jax.typeof(x))]))


def _with_sin_replaced(jaxpr):
    """Steps with every ``sin`` computed by a call that captures a new constant, in the
    bodies too (so every body takes constants it did not take before)."""
    steps = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sin":
            ones = jnp.ones(eqn.invars[0].aval.shape, eqn.invars[0].aval.dtype)
            steps.append(R.Call(lambda x, ones=ones: jnp.sin(x) * ones, (eqn.invars[0],),
                                (eqn.outvars[0],), context=eqn))  # fmt: skip
        elif R.has_bodies(eqn):
            new = []
            for body in R.bodies(eqn):
                inner, consts = R.normalize(body)
                found = any(e.primitive.name == "sin" for e in inner.eqns)
                if found:
                    new_jaxpr, extra = R.retrace(inner, _with_sin_replaced(inner))
                    new.append((new_jaxpr, (*extra, *consts)))
                else:
                    new.append(None)
            steps.append(R.with_bodies(eqn, new) if any(new) else R.Bind(eqn))
        else:
            steps.append(R.Bind(eqn))
    return steps


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_steps_as_written_run_the_program(name):
    x = jnp.linspace(-1.0, 1.0, 4)
    jaxpr, consts = _program(PROGRAMS[name], x)
    (y,) = R.run(jaxpr, R.as_written(jaxpr), [*consts, x])
    np.testing.assert_array_equal(y, PROGRAMS[name](x))


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("sign", [1.0, -1.0])  # both branches of the cond
def test_rewritten_bodies_take_their_new_constants(name, sign):
    x = sign * jnp.linspace(0.1, 1.0, 4)
    jaxpr, consts = _program(PROGRAMS[name], x)
    assert {e.primitive.name for e in jaxpr.eqns} & {name, "remat2"}
    steps = _with_sin_replaced(jaxpr)
    spliced = [s for s in steps if isinstance(s, R.Bind) and s.params is not None]
    assert len(spliced) == 1 and spliced[0].extra  # the body now takes constants
    new, new_consts = R.retrace(jaxpr, steps)

    def rewritten(x):
        return R.run(new, R.as_written(new), [*new_consts, *consts, x])[0]

    np.testing.assert_allclose(rewritten(x), PROGRAMS[name](x), rtol=1e-6)
    t = jnp.arange(1.0, 5.0)
    got, want = jax.jvp(rewritten, (x,), (t,))[1], jax.jvp(PROGRAMS[name], (x,), (t,))[1]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if name != "while":  # reverse mode of a while loop is not defined
        g = jax.grad(lambda x: rewritten(x).sum())(x)
        np.testing.assert_allclose(g, jax.grad(lambda x: PROGRAMS[name](x).sum())(x), rtol=1e-6)


def test_cond_with_one_branch_rewritten_keeps_the_other():
    jaxpr, consts = _program(_cond, jnp.ones(4))
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    branches = R.bodies(eqn)
    i = next(i for i, b in enumerate(branches) if "sin" in str(b))
    # Branch i now multiplies by a new constant k; the other branch must ignore it.
    k = jnp.full((4,), 2.0)
    times_k, extra = R.normalize(
        J.trace(
            lambda *a: [jcore.jaxpr_as_fun(branches[i])(*a)[0] * k],
            [v.aval for v in branches[i].jaxpr.invars],
        )  # fmt: skip
    )
    new = [None] * len(branches)
    new[i] = (times_k, extra)
    step = R.with_bodies(eqn, new)
    assert step.position == 1 and len(step.extra) == len(extra) >= 1
    steps = [step if e is eqn else R.Bind(e) for e in jaxpr.eqns]
    for x in (jnp.linspace(0.1, 1.0, 4), -jnp.linspace(0.1, 1.0, 4)):
        (y,) = R.run(jaxpr, steps, [*consts, x])
        np.testing.assert_allclose(y, _cond(x) * (2.0 if x.sum() > 0 else 1.0), rtol=1e-6)
