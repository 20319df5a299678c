"""No operator makes a NaN or inf that its result does not hold (issue 26, bug 3).

Under ``jax.debug_nans(True)`` and ``jax.debug_infs(True)`` JAX raises at the first
primitive that outputs one, so an op that builds a NaN placeholder and selects it away,
or divides by a zero it then masks, fails there although its result is finite. Each
registered operator runs at its sample and edge points (value, gradient and JVP):
``debug_nans`` wherever the checked result holds no NaN, ``debug_infs`` wherever it and
the inputs are finite (an input inf flows through any op). Keyword arguments that the
configs do not reach (``b``, ``where``, an attention row with no key) have their own
points. A subset runs in ``make test``; the sweep is extended.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from tests import _rng as rand
from tests._modes import all_finite, of_diff_args, ones, op_params, scalar_loss

ops = cannjax.ops
# make test: ops that made a NaN or inf of their own (the last through the shared
# max-shifted exp of the softmax family).
QUICK = {
    "arctan2": {},
    "kl_divergence": {},
    "jensen_shannon": {},
    "softmax_cross_entropy": {"label_smoothing": 0.1},
}


def _has_nan(tree) -> bool:
    leaves = [np.asarray(x, np.complex128) for x in jax.tree_util.tree_leaves(tree)]
    return any(np.isnan(x).any() for x in leaves)


def _checked(fn, nans: bool, infs: bool):
    """Runs ``fn`` plainly, then again with the debug flags that its result (and
    ``nans``, ``infs``) allow; returns the result."""
    result = fn()
    nans, infs = nans and not _has_nan(result), infs and all_finite(result)
    with jax.debug_nans(nans), jax.debug_infs(infs):
        fn()
    return result


def check_point(name, args, kwargs):
    """Value, gradient and JVP of the op at one point, each under the debug flags. The
    gradient and JVP compute the value too: its NaN or inf rules them out as well."""
    fn = registry()[name].fn
    arrays = [a for a in (*args, *jax.tree_util.tree_leaves(kwargs)) if hasattr(a, "dtype")]
    out = _checked(lambda: fn(*args, **kwargs), True, all_finite(arrays))
    loss, primals = scalar_loss(name, args, kwargs)
    if primals:
        nans, infs = not _has_nan(out), all_finite(arrays) and all_finite(out)
        nums = tuple(range(len(primals)))
        _checked(lambda: jax.grad(loss, nums)(*primals), nans, infs)
        f, _ = of_diff_args(name, args, kwargs)
        _checked(lambda: jax.jvp(f, primals, ones(primals))[1], nans, infs)


def registered_points(name):
    """``{label: (args, kwargs)}``: the op's sample and edge points."""
    spec = registry()[name]
    points = {"sample": (spec.sample(jax.random.key(0)), {})}
    for i, case in enumerate(spec.edges()):
        points[f"edge {i}"] = (case.args, dict(case.kwargs))
    return points


def check_registered_points(name, cfg):
    for args, kwargs in registered_points(name).values():
        check_point(name, args, {**cfg, **kwargs})


# The points where an op made a NaN or inf of its own (the cross-entropy's
# through the max-shifted exp that the softmax family shares); True: extended.
FOUND = [
    ("arctan2", {}, "edge 1", False),  # the origin: 1 / 0, masked
    ("kl_divergence", {}, "sample", False),  # -inf placeholder in x - max(x)
    ("kl_divergence", {}, "edge 0", False),  # -inf - (-inf) where both sides mask
    ("jensen_shannon", {}, "edge 0", True),
    ("softmax_cross_entropy", {"label_smoothing": 0.1}, "sample", True),
]


@pytest.mark.parametrize(
    "name,cfg,point",
    [
        pytest.param(n, c, p, id=f"{n}-{p}", marks=[pytest.mark.extended] if ext else [])
        for n, c, p, ext in FOUND
    ],
)
def test_registered_points_quick(name, cfg, point):
    args, kwargs = registered_points(name)[point]
    check_point(name, args, {**cfg, **kwargs})


@pytest.mark.extended
@pytest.mark.parametrize("name,cfg", op_params())
def test_registered_points_every_operator(name, cfg):
    check_registered_points(name, cfg)


# ---------------------------------------------------------------- keyword arguments
_X = jnp.array([[0.3, -1.0, 2.0, 0.5], [1.0, 2.0, -3.0, 0.0]])
_B = jnp.array([[1.0, 2.0, 0.0, 0.5], [1.0, -2.0, 0.5, 0.25]])
_MASK = jnp.array([[True, False, True, True], [True, True, True, False]])
_Q = rand.normal(jax.random.key(1), (1, 5, 2, 3))
_K = rand.normal(jax.random.key(2), (1, 7, 2, 3))
# Query 2 (segment 1) sees keys 0-2 causally, all of segment 0: a row with no key.
_SEGMENTS = (jnp.array([[0, 0, 1, 1, 1]]), jnp.array([[0, 0, 0, 1, 1, 1, 1]]))
KEYWORD_POINTS = {
    "logsumexp b=0 entries": ("logsumexp", (_X,), {"axis": -1, "b": jnp.abs(_B)}),
    "logsumexp negative sum": ("logsumexp", (_X,), {"axis": -1, "b": _B, "return_sign": True}),
    "logsumexp where": ("logsumexp", (_X,), {"axis": -1, "where": _MASK, "keepdims": True}),
    "softmax where": ("softmax", (_X,), {"where": _MASK}),
    "log_softmax where": ("log_softmax", (_X,), {"where": _MASK}),
    "attention empty row": ("attention", (_Q, _K, _K), {"causal": True, "segment_ids": _SEGMENTS}),
    "attention mask": ("attention", (_Q, _K, _K), {"mask": _K[:, None, :5, 0, 0, None] > 0}),
}


# make test: the points that made a NaN or inf of their own; the others are extended.
QUICK_POINTS = ("logsumexp negative sum", "attention empty row")


@pytest.mark.parametrize(
    "point",
    [
        p if p in QUICK_POINTS else pytest.param(p, marks=pytest.mark.extended)
        for p in sorted(KEYWORD_POINTS)
    ],
)
def test_keyword_points(point):
    name, args, kwargs = KEYWORD_POINTS[point]
    check_point(name, args, kwargs)


def test_logsumexp_b_as_reported():
    with jax.debug_nans(True):
        got = ops.logsumexp(jnp.zeros(2), b=jnp.array([1.0, 2.0]))
    np.testing.assert_allclose(got, jax.nn.logsumexp(jnp.zeros(2), b=jnp.array([1.0, 2.0])))
    np.testing.assert_allclose(got, np.log(3.0), rtol=1e-6)


def test_logsumexp_with_b_without_jit():
    # Without jit every jnp call runs alone: the negative-sum NaN must not be made as an
    # array of its own where the result holds none (jax.nn returns 1.0 here).
    with jax.debug_nans(True), jax.disable_jit():
        assert float(ops.logsumexp(1.0, b=1.0)) == 1.0
        g = jax.grad(lambda a: ops.logsumexp(a, b=jnp.array([1.0, 2.0])))(jnp.zeros(2))
    np.testing.assert_allclose(g, jax.grad(jax.nn.logsumexp)(jnp.zeros(2), b=jnp.array([1.0, 2.0])))
    a, b = jnp.array([0.0, 1.0]), jnp.array([1.0, -2.0])
    with jax.disable_jit():
        assert np.isnan(ops.logsumexp(a, b=b))
        np.testing.assert_array_equal(jax.grad(lambda a: ops.logsumexp(a, b=b))(a), 0.0)


def test_logsumexp_negative_sum_is_still_nan():
    # The NaN of a negative sum (jax.nn's convention) is the result's own.
    y = ops.logsumexp(jnp.zeros(2), b=jnp.array([1.0, -2.0]))
    assert np.isnan(y)


def test_attention_row_with_no_key_keeps_a_finite_residual():
    # Such a row gives output 0 and gradient 0; the lse it keeps is finite, so
    # jax.debug_infs sees no inf in the gradient's residuals.
    def loss(q):
        return ops.attention(q, _K, _K, causal=True, segment_ids=_SEGMENTS).sum()

    with jax.debug_infs(True):
        g = jax.grad(loss)(_Q)
    np.testing.assert_array_equal(g[:, 2], 0.0)
    assert np.isfinite(np.asarray(g)).all()
