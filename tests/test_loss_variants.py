"""Label smoothing, z-loss, logit soft-capping and ignore_index in softmax_cross_entropy and
linear_cross_entropy: values and gradients against plain optax (both ops, so they agree
with each other), ignored rows, check_op at the new configs, bfloat16 values, edge
conventions, reductions, second order, residuals, the memory target and bad input.

More runs from the registry: check_op at every config and edge point of both ops in float32
(`cannjax ops`, tests/test_cli.py, extended), their float64 edge points in
tests/test_losses.py and tests/test_linear_cross_entropy.py, and linear_cross_entropy's
configs (the new ones included) in float32 and float64 there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.test_util import check_grads

from cannjax.core import registry
from cannjax.inspect import compiled_memory, residuals
from cannjax.ops import linear_cross_entropy, softmax_cross_entropy
from cannjax.testing import check_op
from tests import _rng as rand
from tests._ops import cast

INF = np.inf
SCE = registry()["softmax_cross_entropy"]
LCE = registry()["linear_cross_entropy"]

OPTIONS = {
    "smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 0.02},
    "cap": {"logit_cap": 2.5},
    "all": {"label_smoothing": 0.2, "z_loss": 0.05, "logit_cap": 3.0},
}


def _plain(logits, labels, *, label_smoothing=0.0, z_loss=0.0, logit_cap=None):
    """Written out here, independently of the ops' own references: optax.smooth_labels +
    optax.softmax_cross_entropy of the capped logits, plus the z-loss."""
    c = logits.shape[-1]
    z = logits if logit_cap is None else logit_cap * jnp.tanh(logits / logit_cap)
    target = optax.smooth_labels(jax.nn.one_hot(labels, c), label_smoothing)
    loss = optax.softmax_cross_entropy(z, target)
    return loss + z_loss * jax.nn.logsumexp(z, -1) ** 2


def _data(N=9, D=4, V=7, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = rand.normal(ks[0], (N, D))
    w = rand.normal(ks[1], (D, V))
    return x, w, rand.randint(ks[2], (N,), 0, V)


def _assert_close(got, want, rtol=2e-5, atol=2e-6):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _value_and_grads(f, *args, argnums):
    shape = jax.eval_shape(f, *args).shape
    cot = jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)
    return jax.value_and_grad(lambda *a: jnp.vdot(f(*a), cot), argnums)(*args)


# ------------------------------------------------------------------ against plain optax
@pytest.mark.parametrize("option", list(OPTIONS))
def test_both_ops_match_plain_optax_and_ignore_rows(option):
    # Values and gradients of each option alone and combined, for both ops (so they
    # agree with each other), with ignored rows: loss 0 and gradient 0 there.
    opts = OPTIONS[option]
    x, w, labels = _data()
    ignored = np.arange(labels.size) % 4 == 1
    masked = jnp.where(ignored, -100, labels)

    def sce(x, w):
        return softmax_cross_entropy(x @ w, masked, ignore_index=-100, **opts)

    def lce(x, w):
        return linear_cross_entropy(x, w, masked, chunk_size=4, **opts)

    def plain(x, w):
        return jnp.where(ignored, 0.0, _plain(x @ w, labels, **opts))

    want = _value_and_grads(plain, x, w, argnums=(0, 1))
    for ours in (sce, lce):
        _assert_close(_value_and_grads(ours, x, w, argnums=(0, 1)), want, rtol=1e-4, atol=1e-5)
        loss = ours(x, w)
        np.testing.assert_array_equal(loss[ignored], 0.0)
        gx = jax.grad(lambda x, w, f=ours: f(x, w).sum())(x, w)
        np.testing.assert_array_equal(gx[ignored], 0.0)
        assert np.abs(gx[~ignored]).min() > 0


# ------------------------------------------------------------------ check_op
# All float32 configs run in `cannjax ops` (tests/test_cli.py, extended); here float64, the
# combined config in the normal set. linear_cross_entropy's configs run in
# tests/test_linear_cross_entropy.py.
_SCE_OPTION_CONFIGS = [c for c in SCE.configs if c]


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(c, id="-".join(c), marks=() if len(c) == 4 else pytest.mark.extended)
        for c in _SCE_OPTION_CONFIGS
    ],
)
def test_check_op_softmax_cross_entropy_configs_float64(cfg):
    with jax.enable_x64(True):
        check_op(SCE, *cast(SCE.sample(jax.random.key(0)), "float64"), **cfg)


def test_new_configs_are_registered():
    keys = {k for c in SCE.configs for k in c}
    assert {"label_smoothing", "z_loss", "logit_cap", "ignore_index"} <= keys
    lce_keys = {k for c in LCE.configs for k in c}
    assert {"label_smoothing", "z_loss", "logit_cap"} <= lce_keys
    # The options have edge points of their own (-inf with smoothing, 1e4 with the cap,
    # ignored rows), written for them.
    assert sum(c.kwargs.get("label_smoothing", 0) > 0 for c in SCE.edges()) >= 3
    assert sum(c.kwargs.get("logit_cap") is not None for c in LCE.edges()) >= 1


@pytest.mark.parametrize("name", ["softmax_cross_entropy", "linear_cross_entropy"])
def test_bfloat16_values_at_the_option_configs(name):
    spec = registry()[name]
    args = cast(spec.sample(jax.random.key(0)), "bfloat16")
    for cfg in [c for c in spec.configs if {"label_smoothing", "logit_cap"} & set(c)]:
        assert spec.fn(*args, **cfg).dtype == jnp.bfloat16
        check_op(spec, *args, **cfg)  # values only in half precision


# ------------------------------------------------------------------ edge conventions
def test_minus_inf_classes_take_no_smoothing():
    # A -inf logit is a hard mask: the loss is that of the row without the masked
    # classes, smoothing spread over the others; optax's smoothed loss is +inf.
    logits = jnp.array([[1.0, -INF, 0.5, -INF, 2.0], [-INF, 0.0, 3.0, 1.0, -INF]])
    labels = jnp.array([2, 3])
    opts = {"label_smoothing": 0.3, "z_loss": 0.01}
    got = softmax_cross_entropy(logits, labels, **opts)
    # The rows without their -inf classes: [1, 0.5, 2] label 1, [0, 3, 1] label 2.
    kept = logits[np.isfinite(np.asarray(logits))].reshape(2, 3)
    np.testing.assert_allclose(got, _plain(kept, jnp.array([1, 2]), **opts), rtol=1e-6)
    assert np.isposinf(_plain(logits, labels, **opts)).all()
    g = jax.grad(lambda z: softmax_cross_entropy(z, labels, **opts).sum())(logits)
    assert np.isfinite(g).all()
    np.testing.assert_array_equal(g[~np.isfinite(np.asarray(logits))], 0.0)
    np.testing.assert_allclose(g.sum(-1), 2 * 0.01 * jax.nn.logsumexp(logits, -1), rtol=1e-5)
    # Under a cap, -inf is capped to -cap like any logit: no longer a mask.
    capped = softmax_cross_entropy(logits, labels, logit_cap=5.0, **opts)
    np.testing.assert_allclose(capped, _plain(logits, labels, logit_cap=5.0, **opts), rtol=1e-6)


def test_huge_logits_with_cap_saturate_with_finite_gradients():
    logits = jnp.array([[1e4, -1e4, 0.5, 1e4 - 1], [3e4, 2.0, -5e3, 1.0]])
    labels = jnp.array([2, 1])
    opts = {"label_smoothing": 0.1, "z_loss": 1e-4, "logit_cap": 30.0}
    got, g = jax.value_and_grad(lambda z: softmax_cross_entropy(z, labels, **opts).sum())(logits)
    np.testing.assert_allclose(got, _plain(logits, labels, **opts).sum(), rtol=1e-6)
    np.testing.assert_array_equal(g[np.abs(np.asarray(logits)) > 1e3], 0.0)
    assert np.isfinite(g).all() and np.abs(g).max() > 0.1
    # linear_cross_entropy with the same logits (x @ identity is exact).
    lce = linear_cross_entropy(logits, jnp.eye(4), labels, **opts)
    np.testing.assert_allclose(lce, softmax_cross_entropy(logits, labels, **opts), rtol=1e-6)


def test_ignore_index_is_any_int():
    small = jnp.array([[0.0, 1.0], [2.0, 0.0]])
    # -100 is out of range for uint8 labels: nothing is ignored.
    out = softmax_cross_entropy(small, jnp.array([1, 0], jnp.uint8), ignore_index=-100)
    np.testing.assert_allclose(out, softmax_cross_entropy(small, jnp.array([1, 0])), rtol=1e-6)
    # An ignored label need not be a valid class; without ignore_index such a label is
    # NaN, as in optax (unchanged).
    out = softmax_cross_entropy(small, jnp.array([7, 1]), ignore_index=7, z_loss=0.1)
    assert out[0] == 0.0 and np.isfinite(out[1])
    assert np.isnan(softmax_cross_entropy(small, jnp.array([7, 1]), z_loss=0.1)[0])


def test_every_row_ignored():
    x, w, _ = _data(N=5)
    labels = jnp.full((5,), -100)
    opts = OPTIONS["all"]
    loss, (gx, gw) = jax.value_and_grad(
        lambda x, w: linear_cross_entropy(x, w, labels, reduction="mean", **opts), (0, 1)
    )(x, w)
    assert loss == 0.0 and not np.asarray(gx).any() and not np.asarray(gw).any()
    loss, g = jax.value_and_grad(
        lambda z: softmax_cross_entropy(z, labels, ignore_index=-100, **opts).sum()
    )(x @ w)
    assert loss == 0.0 and not np.asarray(g).any()


# ------------------------------------------------------------------ reductions
def test_mean_divides_by_rows_not_ignored_with_options():
    x, w, labels = _data(N=10)
    labels = labels.at[::4].set(-100)
    keep = labels != -100
    opts = OPTIONS["all"]

    def ours(x, w):
        return linear_cross_entropy(x, w, labels, chunk_size=3, reduction="mean", **opts)

    def plain(x, w):
        rows = jnp.where(keep, _plain(x @ w, jnp.maximum(labels, 0), **opts), 0.0)
        return rows.sum() / keep.sum()

    _assert_close(jax.value_and_grad(ours, (0, 1))(x, w), jax.value_and_grad(plain, (0, 1))(x, w),
                  rtol=1e-5, atol=1e-6)  # fmt: skip
    total = linear_cross_entropy(x, w, labels, chunk_size=3, reduction="sum", **opts)
    np.testing.assert_allclose(total, ours(x, w) * keep.sum(), rtol=1e-6)


# ------------------------------------------------------------------ second order
# softmax_cross_entropy's (hessian, jacfwd of grad, grad of grad) run in check_op above;
# linear_cross_entropy's also in check_op at its configs (tests/test_linear_cross_entropy.py).
@pytest.mark.parametrize("reduction", [pytest.param("none", marks=pytest.mark.extended), "mean"])
def test_hessian_vector_products_with_options(reduction):
    with jax.enable_x64(True):
        x, w, labels = (a.astype(jnp.float64) if a.dtype.kind == "f" else a
                        for a in _data(N=6))  # fmt: skip
        opts = OPTIONS["all"]

        def lce(x, w):
            out = linear_cross_entropy(x, w, labels, chunk_size=4, reduction=reduction, **opts)
            return jnp.sum(out**2)

        def plain(x, w):
            out = _plain(x @ w, labels, **opts)
            return jnp.sum((out.mean() if reduction == "mean" else out) ** 2)

        t = (jnp.sin(x), jnp.cos(w))

        def hvp(f):
            return jax.jvp(jax.grad(f, (0, 1)), (x, w), t)[1]

        _assert_close(hvp(lce), hvp(plain), rtol=1e-8, atol=1e-10)


def test_scan_checkpoint_and_vmap_with_options():
    x, w, labels = _data(N=6)
    ws = jnp.stack([w, 0.5 * w])
    opts = OPTIONS["all"]

    def total(f):
        def step(c, w):
            return c + jax.checkpoint(f)(x, w).sum(), None

        return lambda ws: jax.lax.scan(step, 0.0, ws)[0]

    want = jax.grad(total(lambda x, w: _plain(x @ w, labels, **opts)))(ws)
    for f in (
        lambda x, w: softmax_cross_entropy(x @ w, labels, **opts),
        lambda x, w: linear_cross_entropy(x, w, labels, chunk_size=4, **opts),
    ):
        _assert_close(jax.grad(total(f))(ws), want, rtol=1e-4, atol=1e-5)
        got = jax.vmap(jax.grad(lambda w, f=f: f(x, w).sum()))(ws)
        _assert_close(got, jax.vmap(jax.grad(lambda w: _plain(x @ w, labels, **opts).sum()))(ws),
                      rtol=1e-4, atol=1e-5)  # fmt: skip


# ------------------------------------------------------------------ residuals and memory
def test_residuals_of_each_variant():
    logits = rand.normal(jax.random.key(0), (64, 16))
    labels = rand.randint(jax.random.key(1), (64,), 0, 16)
    for opts in [*OPTIONS.values(), {"ignore_index": 3}]:
        rep = residuals(lambda z, o=opts: softmax_cross_entropy(z, labels, **o).sum(), logits)
        # The logits (an input), the row max and 1 / sum per row, the labels: the same
        # bytes as the default's exp, 1 / sum and labels.
        assert rep.total_bytes == 64 * 16 * 4 + 2 * 64 * 4 + 64 * 4, str(rep)
        named = {r.source.split("'")[1] for r in rep.rows if "named" in r.source}
        assert named == {"cannjax.softmax_cross_entropy_options.max",
                         "cannjax.softmax_cross_entropy_options.inv_sum"}, str(rep)  # fmt: skip
    x, w, labels = _data(N=64, D=8, V=512)
    for opts in OPTIONS.values():
        # As without options: x, w, labels and the lse per row; no [N, V] array.
        rep = residuals(lambda x, w, o=opts: linear_cross_entropy(x, w, labels, **o).sum(), x, w)
        assert rep.total_bytes == x.nbytes + w.nbytes + labels.nbytes + 64 * 4, str(rep)
        rep = residuals(
            lambda x, w, o=opts: linear_cross_entropy(x, w, labels, reduction="mean", **o), x, w
        )
        assert rep.total_bytes == x.nbytes + w.nbytes, str(rep)


def test_smoothed_z_loss_temp_memory_under_a_quarter_of_plain_at_vocabulary_32768():
    # The target, at its benchmark size (compiled only: nothing is allocated).
    # Measured: 96.5 MiB (reduction="mean": 128.5 MiB) against 2048 MiB.
    N, D, V = 4096, 256, 32768
    x, w = jax.ShapeDtypeStruct((N, D), jnp.float32), jax.ShapeDtypeStruct((D, V), jnp.float32)
    labels = jnp.arange(N) % V
    opts = {"label_smoothing": 0.1, "z_loss": 1e-4}

    def temp(loss):
        return compiled_memory(jax.value_and_grad(loss, (0, 1)), x, w).temp_bytes

    plain = temp(lambda x, w: _plain(x @ w, labels, **opts).mean())
    for reduction in ("none", "mean"):

        def loss(x, w, reduction=reduction):
            return linear_cross_entropy(x, w, labels, reduction=reduction, **opts).mean()

        ours = temp(loss)
        assert ours * 4 <= plain, (reduction, ours, plain)


# ------------------------------------------------------------------ bad input
BAD = [
    ({"label_smoothing": 1.0}, ValueError, r"label_smoothing must be in \[0, 1\).*got 1.0"),
    ({"label_smoothing": -0.1}, ValueError, r"label_smoothing must be in \[0, 1\)"),
    ({"label_smoothing": float("nan")}, ValueError, r"label_smoothing must be in \[0, 1\)"),
    ({"label_smoothing": jnp.float32(0.1)}, TypeError, r"label_smoothing must be a Python float"),
    ({"label_smoothing": "0.1"}, TypeError, r"label_smoothing must be a Python float"),
    ({"z_loss": -1e-4}, ValueError, r"z_loss must be a finite number >= 0.*got -0.0001"),
    ({"z_loss": INF}, ValueError, r"z_loss must be a finite number >= 0"),
    ({"z_loss": True}, TypeError, r"z_loss must be a Python float.*bool"),
    ({"z_loss": None}, TypeError, r"z_loss must be a Python float"),
    ({"logit_cap": 0.0}, ValueError, r"logit_cap must be a finite number > 0.*got 0.0"),
    ({"logit_cap": -30.0}, ValueError, r"logit_cap must be a finite number > 0"),
    ({"logit_cap": INF}, ValueError, r"logit_cap must be a finite number > 0"),
    ({"logit_cap": jnp.array(30.0)}, TypeError, r"logit_cap must be a Python float"),
    ({"ignore_index": 1.0}, TypeError, r"ignore_index must be an int"),
    ({"ignore_index": True}, TypeError, r"ignore_index must be an int"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_options(kwargs, error, match):
    x, w, labels = _data(N=3)
    with pytest.raises(error, match=r"cannjax\.ops\.softmax_cross_entropy: " + match):
        softmax_cross_entropy(x @ w, labels, **kwargs)
    with pytest.raises(error, match=r"cannjax\.ops\.linear_cross_entropy: " + match):
        linear_cross_entropy(x, w, labels, **kwargs)


def test_ignore_index_none_counts_every_row():
    # optax's semantics: no label is ignored and the mean divides by the number of rows
    # (known at trace time: no count reduced across devices, test_sharding.py).
    x, w, labels = _data(N=3)
    np.testing.assert_array_equal(
        softmax_cross_entropy(x @ w, labels, ignore_index=None),
        softmax_cross_entropy(x @ w, labels),
    )
    with jax.enable_x64(True):
        x, w, labels = _data(N=11, V=9)
        x, w = x.astype(jnp.float64), w.astype(jnp.float64)
        plain = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
        for reduction, want in (("none", plain), ("sum", plain.sum()), ("mean", plain.mean())):
            got = linear_cross_entropy(
                x, w, labels, ignore_index=None, reduction=reduction, chunk_size=4
            )
            np.testing.assert_allclose(got, want, rtol=1e-12)

            def loss(x, w, reduction=reduction):
                out = linear_cross_entropy(x, w, labels, ignore_index=None, reduction=reduction,
                                           chunk_size=4)  # fmt: skip
                return jnp.sum(jnp.sin(out))

            check_grads(loss, (x, w), order=1, modes=["fwd", "rev"])
        # A label equal to the default ignore_index is a class index like any other (clipped).
        minus = labels.at[0].set(-100)
        got = linear_cross_entropy(x, w, minus, ignore_index=None, reduction="mean")
        want = optax.softmax_cross_entropy_with_integer_labels(x @ w, minus.at[0].set(0)).mean()
        np.testing.assert_allclose(got, want, rtol=1e-12)
        with pytest.raises(
            TypeError, match=r"linear_cross_entropy: ignore_index must be an int or "
        ):
            linear_cross_entropy(x, w, labels, ignore_index="-100")


def test_explicit_defaults_take_the_default_path_and_options_are_static():
    x, w, labels = _data()
    logits = x @ w
    zero = {"label_smoothing": 0.0, "z_loss": 0.0, "logit_cap": None}
    np.testing.assert_array_equal(
        softmax_cross_entropy(logits, labels, **zero), softmax_cross_entropy(logits, labels)
    )
    np.testing.assert_array_equal(
        linear_cross_entropy(x, w, labels, chunk_size=4, **zero),
        linear_cross_entropy(x, w, labels, chunk_size=4),
    )
    f = jax.jit(lambda z: softmax_cross_entropy(z, labels, label_smoothing=0.1, logit_cap=5.0))
    np.testing.assert_allclose(f(logits), _plain(logits, labels, label_smoothing=0.1,
                                                 logit_cap=5.0), rtol=1e-6)  # fmt: skip
    with pytest.raises(TypeError, match="z_loss must be a Python float"):
        jax.jit(lambda z, c: softmax_cross_entropy(z, labels, z_loss=c))(logits, 1e-4)


# ------------------------------------------------------------------ one-hot labels
# cannjax.optimize replaces optax.softmax_cross_entropy(z, smooth_labels(one_hot(labels)))
# by these private entry points, so they read labels as jax.nn.one_hot does: a label
# outside [0, V), negative ones included, picks no class (no wrap, no NaN).
from cannjax._src.ops.linear_cross_entropy import one_hot_linear_cross_entropy  # noqa: E402
from cannjax._src.ops.losses import one_hot_cross_entropy  # noqa: E402


def _odd_labels(labels, V):
    return labels.at[1].set(-1).at[3].set(-100).at[5].set(V).at[7].set(V + 3)


@pytest.mark.parametrize("option", ["none", *OPTIONS])
def test_one_hot_readings_match_optax_of_one_hot_targets_float64(option):
    opts = OPTIONS.get(option, {})
    with jax.enable_x64(True):
        x, w, labels = _data()
        x, w = x.astype(jnp.float64), w.astype(jnp.float64)
        labels = _odd_labels(labels, w.shape[1])

        def sce(x, w):
            return one_hot_cross_entropy(x @ w, labels, **opts)

        def lce(x, w):
            return one_hot_linear_cross_entropy(x, w, labels, **opts)

        def plain(x, w):
            return _plain(x @ w, labels, **opts)

        want = _value_and_grads(plain, x, w, argnums=(0, 1))
        t = (jnp.sin(x), jnp.cos(w))
        want_t = jax.jvp(plain, (x, w), t)
        for ours in (sce, lce):
            got = _value_and_grads(ours, x, w, argnums=(0, 1))
            _assert_close(got, want, rtol=1e-10, atol=1e-12)
            _assert_close(jax.jvp(ours, (x, w), t), want_t, rtol=1e-10, atol=1e-12)
            check_grads(ours, (x, w), order=1, modes=("fwd", "rev"))
        if not opts.get("label_smoothing") and not opts.get("z_loss"):  # nothing picked: 0
            np.testing.assert_array_equal(sce(x, w)[np.array([1, 3, 5, 7])], 0.0)


def test_one_hot_reading_at_masked_and_huge_logits():
    # -inf logits (masked classes) and logits of 1e4. optax's one-hot loss is NaN on every
    # row (0 * -inf in its sum over classes); the limit is finite: the integer-label loss
    # where a class is picked, 0 where none is. The gradient of a masked class is 0.
    x, w, labels = _data()
    z = (x @ w).at[:, 2].set(-INF).at[0].multiply(1e4)
    labels = _odd_labels(jnp.where(labels == 2, 0, labels), w.shape[1])
    picked = (labels >= 0) & (labels < w.shape[1])
    assert np.isnan(_plain(z, labels)).all()
    for opts in ({}, {"z_loss": 0.01}):
        ours = one_hot_cross_entropy(z, labels, **opts)
        ce = optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(picked, labels, 0))
        want = jnp.where(picked, ce, 0.0) + opts.get("z_loss", 0.0) * jax.nn.logsumexp(z, -1) ** 2
        np.testing.assert_allclose(ours, want, rtol=1e-5)
        g = jax.grad(lambda z, o=opts: one_hot_cross_entropy(z, labels, **o).sum())(z)
        assert np.isfinite(g).all() and (g[:, 2] == 0).all()
    smoothed = one_hot_cross_entropy(z, labels, label_smoothing=0.1)
    assert np.isposinf(smoothed).all()  # eps / V of the target on a -inf logit
