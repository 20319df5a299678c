"""Distillation losses: kl_divergence, jensen_shannon and linear_jensen_shannon.

Fast: optax agreement (values and gradients of both inputs), the edge conventions
(masked classes, infinite KL, logits of 1e4, identical distributions), the generalized
JSD's endpoints and symmetry, temperature, jit/vmap/scan/checkpoint against plain
autodiff, half precision, residuals, the fused loss against both logit arrays written
out (values, gradients and tangents of both reductions' operators, ignore_index, no
labels, a frozen teacher), its residuals and compiled memory, and bad input.

Extended (``make test-extended``): check_op at every config in float64, at random and
edge points (float32: ``cannjax ops``, in tests/test_cli.py), second derivatives against
plain autodiff and at masked and infinite rows, the transforms of tests/_opchecks.py,
the fused loss's other configurations and transforms, and the memory at the benchmark
size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import compiled_memory, residuals
from cannjax.ops import jensen_shannon, kl_divergence, linear_jensen_shannon
from cannjax.testing import check_op
from tests import _rng as rand
from tests._opchecks import TRANSFORMS, transform_matches_plain
from tests._ops import cast, op_configs

INF = np.inf
NAMES = ("kl_divergence", "jensen_shannon", "linear_jensen_shannon")


def _pair(shape=(4, 6), seed=0, scale=2.0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return rand.normal(k1, shape) * scale, rand.normal(k2, shape) * scale


def _grads(f, *args):
    """Gradients of ``<f(*args), c>`` w.r.t. every argument, ``c`` fixed and non-uniform."""
    c = jnp.cos(jnp.arange(np.prod(jax.eval_shape(f, *args).shape), dtype=jnp.float32))
    c = c.reshape(jax.eval_shape(f, *args).shape)
    return jax.grad(lambda *a: jnp.vdot(f(*a), c), tuple(range(len(args))))(*args)


def _np_log_softmax(x, t=1.0):
    x = np.asarray(x, np.float64) / t
    m = x.max(-1, keepdims=True)
    z = x - np.where(np.isfinite(m), m, 0.0)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


# ---------------------------------------------------------------- kl_divergence
def test_kl_matches_optax_values_and_gradients_of_both_inputs():
    logits, target = _pair()
    ours = kl_divergence(logits, target)

    def with_probs(a, b):
        return optax.kl_divergence(jax.nn.log_softmax(a), jax.nn.softmax(b))

    def with_log_targets(a, b):
        return optax.losses.kl_divergence_with_log_targets(
            jax.nn.log_softmax(a), jax.nn.log_softmax(b)
        )

    for theirs in (with_probs, with_log_targets):
        np.testing.assert_allclose(ours, theirs(logits, target), rtol=1e-5, atol=1e-6)
        for g, want in zip(_grads(kl_divergence, logits, target), _grads(theirs, logits, target)):
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    # The documented closed forms: (p - q) and q (log q - log p - KL), per unit cotangent.
    lp, lq = _np_log_softmax(logits), _np_log_softmax(target)
    p, q = np.exp(lp), np.exp(lq)
    kl = (q * (lq - lp)).sum(-1, keepdims=True)
    gl, gt = jax.grad(lambda a, b: kl_divergence(a, b).sum(), (0, 1))(logits, target)
    np.testing.assert_allclose(gl, p - q, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gt, q * (lq - lp - kl), rtol=1e-5, atol=1e-6)


def test_kl_masked_classes_infinite_rows_and_empty_teachers():
    student = jnp.array(
        [
            [0.5, -1.0, -INF, 2.0],  # both mask class 2; the teacher masks class 0 too
            [0.5, -1.0, -INF, 2.0],  # the teacher has mass on class 2: KL = +inf
            [0.3, 0.1, 0.2, 0.0],  # an empty teacher row
        ]
    )
    teacher = jnp.array([[-INF, 1.5, -INF, 0.0], [0.0, 1.0, 0.5, -INF], [-INF] * 4])
    out = kl_divergence(student, teacher)
    lp, lq = _np_log_softmax(student[0]), _np_log_softmax(teacher[0])
    q = np.exp(lq)
    want0 = (q[[1, 3]] * (lq[[1, 3]] - lp[[1, 3]])).sum()
    np.testing.assert_allclose(out, [want0, INF, 0.0], rtol=1e-6)
    gs, gt = jax.grad(lambda a, b: kl_divergence(a, b).sum(), (0, 1))(student, teacher)
    np.testing.assert_allclose(gs[0], np.exp(lp) - q, rtol=1e-6, atol=1e-7)
    # The infinite row (a constant +inf near this point) and the empty teacher: 0.
    np.testing.assert_array_equal(gs[1:], 0.0)
    np.testing.assert_array_equal(gt[1:], 0.0)
    assert np.isfinite(gt[0]).all() and gt[0, 0] == gt[0, 2] == 0.0
    # Plain autodiff of optax gives the teacher NaN gradients (log 0 at the masked classes).
    plain = jax.grad(
        lambda b: optax.kl_divergence(jax.nn.log_softmax(student[:1]), jax.nn.softmax(b)).sum()
    )(teacher[:1])
    assert np.isnan(plain).all()


@pytest.mark.extended
def test_kl_second_derivatives_at_masked_and_infinite_rows():
    student = jnp.array([[0.5, -1.0, -INF, 2.0], [0.5, -1.0, -INF, 2.0], [0.3, 0.1, 0.2, 0.0]])
    teacher = jnp.array([[-INF, 1.5, -INF, 0.0], [0.0, 1.0, 0.5, -INF], [-INF] * 4])
    for argnums in (0, 1):
        h = jax.hessian(lambda *a: kl_divergence(*a).sum(), argnums)(student, teacher)
        assert np.isfinite(np.asarray(h)).all()
        # Rows with a constant loss (+inf, or an empty teacher): 0.
        np.testing.assert_array_equal(np.asarray(h)[1:], 0.0)


def test_kl_large_logits_are_exact_and_identical_distributions_give_zero():
    s = jnp.array([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 3.0, -1e4 + 1.0, -1e4]])
    t = jnp.array([[1e4 - 2.0, 1e4, -1e4, 0.0], [-1e4 + 2.0, -1e4, -1e4 + 1.0, -1e4 + 0.5]])
    lp, lq = _np_log_softmax(s), _np_log_softmax(t)
    want = (np.exp(lq) * (lq - lp)).sum(-1)
    np.testing.assert_allclose(np.asarray(kl_divergence(s, t), np.float64), want, rtol=1e-6)
    gs, gt = jax.grad(lambda a, b: kl_divergence(a, b).sum(), (0, 1))(s, t)
    np.testing.assert_allclose(gs, np.exp(lp) - np.exp(lq), atol=1e-6)
    assert np.isfinite(gt).all()
    # p == q: exactly 0, with gradient exactly 0; at a temperature, the max is subtracted
    # before dividing, so only the rounding of the small differences remains.
    out, g = jax.value_and_grad(lambda a, b: kl_divergence(a, b).sum(), (0, 1))(s, s)
    assert float(out) == 0.0
    np.testing.assert_array_equal(g[0], 0.0)
    np.testing.assert_array_equal(g[1], 0.0)
    out, g = jax.value_and_grad(lambda a, b: kl_divergence(a, b, temperature=0.7).sum(), (0, 1))(
        s, s
    )
    assert abs(float(out)) <= 1e-6 and np.abs(g).max() <= 1e-6


def test_nan_propagates():
    # A NaN logit is neither a masked class nor an infinite KL: its row is NaN.
    a = jnp.array([[0.0, np.nan, 1.0], [0.0, 1.0, 2.0]])
    b = jnp.array([[0.0, 0.5, 1.0], [1.0, 0.0, -1.0]])
    for fn in (kl_divergence, jensen_shannon):
        for out in (fn(a, b), fn(b, a)):
            assert np.isnan(out[0]) and np.isfinite(out[1])


def test_temperature_divides_the_logits():
    logits, target = _pair()
    for fn in (kl_divergence, jensen_shannon):
        np.testing.assert_allclose(
            fn(logits, target, temperature=2.5), fn(logits / 2.5, target / 2.5), rtol=1e-6
        )
    # The gradients carry the 1 / T of the chain rule (the rules are shared by both ops).
    got = _grads(lambda a, b: jensen_shannon(a, b, temperature=2.5), logits, target)
    want = _grads(lambda a, b: jensen_shannon(a / 2.5, b / 2.5), logits, target)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- jensen_shannon
def _plain_jsd(logits, target, beta):
    # m from probabilities (a different formula from the op's log1p/expm1 form).
    lp, lq = jax.nn.log_softmax(logits), jax.nn.log_softmax(target)
    p, q = jnp.exp(lp), jnp.exp(lq)
    lm = jnp.log(beta * q + (1 - beta) * p)
    return beta * jnp.sum(q * (lq - lm), -1) + (1 - beta) * jnp.sum(p * (lp - lm), -1)


@pytest.mark.parametrize("beta", [0.5, 0.2])
def test_jsd_matches_the_formula_in_both_gradients(beta):
    logits, target = _pair(seed=1)
    ours = lambda a, b: jensen_shannon(a, b, beta=beta)  # noqa: E731
    plain = lambda a, b: _plain_jsd(a, b, beta)  # noqa: E731
    np.testing.assert_allclose(ours(logits, target), plain(logits, target), rtol=1e-5)
    for g, w in zip(_grads(ours, logits, target), _grads(plain, logits, target)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_jsd_endpoints_are_the_two_kls_and_half_is_symmetric():
    logits, target = _pair(seed=2)
    np.testing.assert_array_equal(
        jensen_shannon(logits, target, beta=0.0), kl_divergence(logits, target)
    )
    np.testing.assert_array_equal(
        jensen_shannon(logits, target, beta=1.0), kl_divergence(target, logits)
    )
    g1 = jax.grad(lambda a, b: jensen_shannon(a, b, beta=1.0).sum(), (0, 1))(logits, target)
    g2 = jax.grad(lambda a, b: kl_divergence(b, a).sum(), (0, 1))(logits, target)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a, b)
    # Near the ends the loss vanishes like beta KL(q || p) and (1 - beta) KL(p || q).
    np.testing.assert_allclose(
        jensen_shannon(logits, target, beta=1e-4) / 1e-4, kl_divergence(logits, target), rtol=1e-2
    )
    np.testing.assert_allclose(
        jensen_shannon(logits, target, beta=1 - 1e-4) / 1e-4,
        kl_divergence(target, logits),
        rtol=1e-2,
    )
    half = jensen_shannon(logits, target)
    np.testing.assert_allclose(half, jensen_shannon(target, logits), rtol=1e-6)
    assert (half > 0).all() and (half <= np.log(2)).all()


def test_jsd_masks_disjoint_supports_large_logits_and_identical_rows():
    s = jnp.array([[0.0, -INF, 1.0, -INF], [-INF, 0.0, -INF, 2.0], [1e4, -1e4, 0.0, 1e4 - 3]])
    t = jnp.array([[-INF, 0.0, -INF, -INF], [-INF, 1.0, -INF, -INF], [0.0, 1e4, -1e4, 1e4]])
    # Disjoint supports: log 2 at beta = 1/2; otherwise finite. Compared with float64.
    lp, lq = _np_log_softmax(s), _np_log_softmax(t)
    p, q = np.exp(lp), np.exp(lq)
    m = 0.5 * (p + q)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = 0.5 * np.where(q > 0, q * np.log(q / m), 0).sum(-1) + 0.5 * np.where(
            p > 0, p * np.log(p / m), 0
        ).sum(-1)
    got = jensen_shannon(s, t)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-6)
    assert float(got[0]) == pytest.approx(np.log(2), rel=1e-6)
    g = jax.grad(lambda a, b: jensen_shannon(a, b, beta=0.9).sum(), (0, 1))(s, t)
    assert all(np.isfinite(x).all() for x in g)
    # Identical rows: exactly 0 and gradient 0 for any beta (not 1e-7 of rounding).
    for beta in (0.3, 0.5, 0.9):
        loss = lambda a, b, beta=beta: jensen_shannon(a, b, beta=beta).sum()  # noqa: E731
        out, g = jax.value_and_grad(loss, (0, 1))(s, s)
        assert float(out) == 0.0
        np.testing.assert_array_equal(g[0], 0.0)
        np.testing.assert_array_equal(g[1], 0.0)


@pytest.mark.extended
def test_second_order_and_forward_mode_match_plain_autodiff():
    with jax.enable_x64(True):
        logits, target = (a.astype(jnp.float64) for a in _pair((2, 5), seed=3))
        fns = [
            (kl_divergence,
             lambda a, b: optax.kl_divergence(jax.nn.log_softmax(a), jax.nn.softmax(b))),
            (lambda a, b: jensen_shannon(a, b, beta=0.3), lambda a, b: _plain_jsd(a, b, 0.3)),
        ]  # fmt: skip
        for ours, plain in fns:
            for argnums in (0, 1):
                h, h_ref = (
                    jax.hessian(lambda *a, f=f: jnp.sum(f(*a) ** 2), argnums)(logits, target)
                    for f in (ours, plain)
                )
                np.testing.assert_allclose(h, h_ref, rtol=1e-9, atol=1e-12)
            t = (jnp.sin(logits), jnp.cos(target))
            np.testing.assert_allclose(
                jax.jvp(ours, (logits, target), t)[1],
                jax.jvp(plain, (logits, target), t)[1],
                rtol=1e-10,
            )


@pytest.mark.extended
def test_jsd_second_derivatives_at_masked_classes_are_finite():
    s = jnp.array([[0.0, -INF, 1.0, -INF], [-INF, 0.0, -INF, 2.0], [1e4, -1e4, 0.0, 1e4 - 3]])
    t = jnp.array([[-INF, 0.0, -INF, -INF], [-INF, 1.0, -INF, -INF], [0.0, 1e4, -1e4, 1e4]])
    for beta in (0.5, 0.9):
        for argnums in (0, 1):
            loss = lambda *a, beta=beta: jensen_shannon(*a, beta=beta).sum()  # noqa: E731
            assert np.isfinite(np.asarray(jax.hessian(loss, argnums)(s, t))).all()


def test_jit_vmap_scan_and_checkpoint():
    logits, target = _pair((3, 4, 5), seed=4)

    def total(fn):
        def step(c, ab):
            return c + jax.checkpoint(fn)(*ab).sum(), None

        return jax.jit(lambda a, b: jax.lax.scan(step, 0.0, (a, b))[0])

    ours = lambda a, b: jensen_shannon(a, b, beta=0.3)  # noqa: E731
    plain = lambda a, b: _plain_jsd(a, b, 0.3)  # noqa: E731
    np.testing.assert_allclose(
        jax.vmap(ours)(logits, target), jax.vmap(plain)(logits, target), rtol=1e-5
    )
    got = jax.grad(total(ours), (0, 1))(logits, target)
    want = jax.grad(total(plain), (0, 1))(logits, target)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_half_precision_computes_in_float32():
    logits, target = _pair()
    half = cast((logits, target), jnp.bfloat16)
    for fn in (kl_divergence, jensen_shannon):
        out = fn(*half)
        assert out.dtype == jnp.bfloat16
        # The float32 result at the bfloat16 values themselves, rounded.
        want = fn(*cast(half, jnp.float32))
        np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=1e-2, atol=1e-3)
        g = jax.grad(lambda a, fn=fn: fn(a, half[1]).astype(jnp.float32).sum())(half[0])
        assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()
    # Mixed dtypes promote as jnp does.
    assert kl_divergence(logits.astype(jnp.bfloat16), target).dtype == jnp.float32


def test_residuals_are_the_two_inputs():
    logits, target = _pair((64, 16))
    for fn in (kl_divergence, jensen_shannon):
        report = residuals(lambda a, b, fn=fn: fn(a, b).sum(), logits, target)
        assert report.total_bytes == logits.nbytes + target.nbytes, str(report)
        plain = residuals(lambda a, b: _plain_jsd(a, b, 0.5).sum(), logits, target)
        assert plain.total_bytes >= 3 * logits.nbytes, str(plain)


# ---------------------------------------------------------------- linear_jensen_shannon
def _lin_data(N=13, D=4, Dt=3, V=7, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    x, tx = rand.normal(k[0], (N, D)), rand.normal(k[1], (N, Dt))
    w, tw = rand.normal(k[2], (D, V)), rand.normal(k[3], (Dt, V))
    labels = rand.randint(k[4], (N,), 0, V).at[::4].set(-100)
    return x, w, tx, tw, labels


def _lin_plain(x, w, tx, tw, labels, beta=0.5, temperature=1.0, reduction="mean"):
    a, b = x @ w / temperature, tx @ tw / temperature
    if beta == 0:
        rows = kl_divergence(a, b)
    elif beta == 1:
        rows = kl_divergence(b, a)
    else:
        rows = _plain_jsd(a, b, beta)
    valid = labels != -100
    rows = jnp.where(valid, rows, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() / (valid.sum() if reduction == "mean" else 1)


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param({"chunk_size": 4, "reduction": "none"}, id="none,chunk=4"),
        pytest.param({"chunk_size": 5, "reduction": "mean", "beta": 1.0}, id="mean,beta=1"),
        pytest.param(
            {"chunk_size": 1, "reduction": "mean"}, id="mean,chunk=1", marks=pytest.mark.extended
        ),
        pytest.param(
            {"reduction": "sum", "beta": 0.0, "temperature": 2.0},
            id="sum,beta=0,T=2",
            marks=pytest.mark.extended,
        ),
    ],
)
def test_linear_matches_both_logits_written_out(kw):
    x, w, tx, tw, labels = _lin_data()
    plain_kw = {k: v for k, v in kw.items() if k != "chunk_size"}

    def ours(x, w):
        return linear_jensen_shannon(x, w, tx, tw, labels, **kw)

    def plain(x, w):
        return _lin_plain(x, w, tx, tw, labels, **plain_kw)

    np.testing.assert_allclose(ours(x, w), plain(x, w), rtol=1e-5, atol=1e-7)
    for g, want in zip(_grads(ours, x, w), _grads(plain, x, w)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6)
    t = (jnp.sin(x), jnp.cos(w))
    np.testing.assert_allclose(
        jax.jvp(ours, (x, w), t)[1], jax.jvp(plain, (x, w), t)[1], rtol=1e-4, atol=1e-6
    )


def test_linear_ignored_rows_no_labels_and_a_frozen_teacher():
    x, w, tx, tw, labels = _lin_data(N=12)
    rows = linear_jensen_shannon(x, w, tx, tw, labels, reduction="none", chunk_size=5)
    ignored = np.asarray(labels == -100)
    np.testing.assert_array_equal(rows[ignored], 0.0)
    every = linear_jensen_shannon(x, w, tx, tw, reduction="none", chunk_size=5)
    np.testing.assert_allclose(rows[~ignored], every[~ignored], rtol=1e-6)
    np.testing.assert_allclose(linear_jensen_shannon(x, w, tx, tw), every.mean(), rtol=1e-6)
    gx = jax.grad(lambda x: linear_jensen_shannon(x, w, tx, tw, labels))(x)
    np.testing.assert_array_equal(gx[ignored], 0.0)
    custom = linear_jensen_shannon(x, w, tx, tw, jnp.where(labels == -100, 3, 0), ignore_index=3)
    np.testing.assert_allclose(custom, rows.sum() / (~ignored).sum(), rtol=1e-6)
    # Every row ignored: 0 (not 0 / 0), gradient 0.
    none = jnp.full_like(labels, -100)
    out, g = jax.value_and_grad(linear_jensen_shannon, (0, 1))(x, w, tx, tw, none)
    assert float(out) == 0.0 and not np.asarray(g[0]).any() and not np.asarray(g[1]).any()
    # The teacher is a constant of the loss: its gradients are 0.
    gtx, gtw = jax.grad(lambda a, b: linear_jensen_shannon(x, w, a, b, labels), (0, 1))(tx, tw)
    assert not np.asarray(gtx).any() and not np.asarray(gtw).any()


@pytest.mark.extended
def test_linear_vmap_scan_checkpoint_and_hessian():
    x, w, tx, tw, labels = _lin_data(N=6)

    def ours(x, w):
        return linear_jensen_shannon(x, w, tx, tw, labels, chunk_size=4, reduction="sum")

    def plain(x, w):
        return _lin_plain(x, w, tx, tw, labels, reduction="sum")

    ws = jnp.stack([w, 0.5 * w])

    def total(f):
        return lambda ws: jax.lax.scan(lambda c, w: (c + jax.checkpoint(f)(x, w), None), 0.0, ws)[0]

    np.testing.assert_allclose(jax.grad(total(ours))(ws), jax.grad(total(plain))(ws), rtol=1e-4)
    np.testing.assert_allclose(
        jax.vmap(ours, (None, 0))(x, ws), jax.vmap(plain, (None, 0))(x, ws), rtol=1e-5
    )
    with jax.enable_x64(True):
        args64 = [a.astype(jnp.float64) for a in (x, w, tx, tw)]

        def hess(f):
            return jax.hessian(lambda w: f(*args64, labels, reduction="none").sum() ** 2)(args64[1])

        h = hess(lambda *a, **k: linear_jensen_shannon(*a, chunk_size=4, **k))
        np.testing.assert_allclose(h, hess(_lin_plain), rtol=1e-9, atol=1e-12)


def test_linear_residuals_hold_no_logits():
    x, w, tx, tw, labels = _lin_data(N=64, D=8, Dt=4, V=256)
    per_row = residuals(
        lambda x, w: linear_jensen_shannon(x, w, tx, tw, labels, reduction="none").sum(), x, w
    )
    computed = [r for r in per_row.rows if not r.source.startswith(("from the ", "from a "))]
    assert not [r for r in computed if r.shape == (64, 256)], str(per_row)
    assert per_row.total_bytes <= sum(a.nbytes for a in (x, w, tx, tw)) + 64, str(per_row)
    mean = residuals(lambda x, w: linear_jensen_shannon(x, w, tx, tw, labels), x, w)
    named = {r.source.split("'")[1] for r in mean.rows if "named" in r.source}
    assert named == {
        "cannjax.linear_jensen_shannon_reduced.dx",
        "cannjax.linear_jensen_shannon_reduced.dw",
    }, str(mean)
    assert mean.total_bytes == x.nbytes + w.nbytes, str(mean)
    plain = residuals(lambda x, w: _lin_plain(x, w, tx, tw, labels), x, w)
    assert any(r.shape == (64, 256) for r in plain.rows)


def _temps(N, D, V, chunk_size=None):
    """Compiled temp bytes of value_and_grad (w.r.t. x and w): (ours, plain)."""
    S = jax.ShapeDtypeStruct
    args = [S((N, D), jnp.float32), S((D, V), jnp.float32)] * 2 + [S((N,), jnp.int32)]

    def temp(f):
        vg = jax.value_and_grad(f, (0, 1))
        return jax.jit(vg).lower(*args).compile().memory_analysis().temp_size_in_bytes

    ours = temp(lambda *a: linear_jensen_shannon(*a, chunk_size=chunk_size))
    return ours, temp(lambda *a: _lin_plain(*a))


def test_linear_value_and_grad_temp_memory_is_under_a_quarter_of_plain():
    ours, plain = _temps(512, 64, 4096, chunk_size=64)
    assert ours * 4 <= plain, (ours, plain)
    assert compiled_memory  # the helper the benchmark-size figure is reported with


@pytest.mark.extended
def test_linear_value_and_grad_temp_memory_at_benchmark_size():
    ours, plain = _temps(4096, 256, 32768)  # default chunk: 256 rows
    assert ours * 4 <= plain, (ours, plain)


# ---------------------------------------------------------------- bad input
def test_bad_input():
    logits, target = _pair()
    kl = r"cannjax\.ops\.kl_divergence: "
    with pytest.raises(ValueError, match=kl + r"target_logits must have the shape of logits"):
        kl_divergence(logits, target[:, :3])
    with pytest.raises(TypeError, match=kl + r"logits must be a floating-point array"):
        kl_divergence(jnp.ones((2, 3), jnp.int32), target)
    with pytest.raises(TypeError, match=kl + r"target_logits must be a floating-point array"):
        kl_divergence(logits, jnp.ones((4, 6), bool))
    with pytest.raises(ValueError, match=kl + r"logits must have at least one dimension"):
        kl_divergence(1.0, 2.0)
    with pytest.raises(ValueError, match=kl + r"temperature must be a finite number > 0, got 0"):
        kl_divergence(logits, target, temperature=0)
    with pytest.raises(TypeError, match=kl + r"temperature must be a Python number"):
        kl_divergence(logits, target, temperature=jnp.ones(2))
    js = r"cannjax\.ops\.jensen_shannon: "
    with pytest.raises(ValueError, match=js + r"beta must be in \[0, 1\] .*got 1.5"):
        jensen_shannon(logits, target, beta=1.5)
    with pytest.raises(ValueError, match=js + r"beta must be in \[0, 1\]"):
        jensen_shannon(logits, target, beta=-0.1)
    with pytest.raises(TypeError, match=js + r"beta must be a Python number"):
        jensen_shannon(logits, target, beta="half")
    with pytest.raises(ValueError, match=js + r"temperature must be a finite number > 0"):
        jensen_shannon(logits, target, temperature=-1.0)

    x, w, tx, tw, labels = _lin_data()
    lj = r"cannjax\.ops\.linear_jensen_shannon: "
    with pytest.raises(ValueError, match=lj + r"w must have shape \(D, V\) with D == "):
        linear_jensen_shannon(x, w.T, tx, tw)
    with pytest.raises(ValueError, match=lj + r"teacher_x must have shape x.shape\[:-1\]"):
        linear_jensen_shannon(x, w, tx[:5], tw)
    with pytest.raises(ValueError, match=lj + r"teacher_w must have shape \(D_t, V\) == \(3, 7\)"):
        linear_jensen_shannon(x, w, tx, tw[:, :5])
    with pytest.raises(TypeError, match=lj + r"teacher_w must be a floating-point array"):
        linear_jensen_shannon(x, w, tx, tw.astype(jnp.int32))
    with pytest.raises(TypeError, match=lj + r"x must be a floating-point array"):
        linear_jensen_shannon(x.astype(jnp.int32), w, tx, tw)
    with pytest.raises(TypeError, match=lj + r"labels must be an integer array .*float32\[13\]"):
        linear_jensen_shannon(x, w, tx, tw, labels.astype(jnp.float32))
    with pytest.raises(ValueError, match=lj + r"labels must have shape x.shape\[:-1\] == \(13,\)"):
        linear_jensen_shannon(x, w, tx, tw, labels[:4])
    with pytest.raises(ValueError, match=lj + r"chunk_size must be >= 1, got 0"):
        linear_jensen_shannon(x, w, tx, tw, chunk_size=0)
    with pytest.raises(TypeError, match=lj + r"chunk_size must be an int or None"):
        linear_jensen_shannon(x, w, tx, tw, chunk_size=2.0)
    with pytest.raises(ValueError, match=lj + r"beta must be in \[0, 1\]"):
        linear_jensen_shannon(x, w, tx, tw, beta=2)
    with pytest.raises(ValueError, match=lj + r"temperature must be a finite number > 0"):
        linear_jensen_shannon(x, w, tx, tw, temperature=float("inf"))
    with pytest.raises(ValueError, match=lj + r"reduction must be one of 'none', 'sum', 'mean'"):
        linear_jensen_shannon(x, w, tx, tw, reduction="max")
    with pytest.raises(TypeError, match=lj + r"ignore_index must be an int"):
        linear_jensen_shannon(x, w, tx, tw, labels, ignore_index=None)


def test_registered_and_exported():
    for name in NAMES:
        assert getattr(cannjax.ops, name) is registry()[name].fn


# ---------------------------------------------------------------- extended: check_op
# float32: `cannjax ops` runs check_op at the sample under every config and at each edge
# point (tests/test_cli.py::test_ops_self_check_passes_for_every_operator, extended).
@pytest.mark.extended
@pytest.mark.parametrize("name,cfg", op_configs("distillation"))
def test_check_op_random_points_float64(name, cfg):
    spec = registry()[name]
    with jax.enable_x64(True):
        check_op(name, *cast(spec.sample(jax.random.key(1)), "float64"), seed=1, **cfg)


@pytest.mark.extended
@pytest.mark.parametrize("name", NAMES)
def test_check_op_edge_points_float64(name):
    spec = registry()[name]
    with jax.enable_x64(True):
        for case in spec.edges():
            check_op(name, *cast(case.args, "float64"), **case.check_kwargs())


@pytest.mark.extended
@pytest.mark.parametrize("name", ["kl_divergence", "jensen_shannon"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_composes_with_transforms(name, transform):
    transform_matches_plain(name, {}, transform)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_linear_zero_rows(reduction):
    x, w = jnp.zeros((0, 8)), jnp.ones((8, 16))

    def loss(x, w):
        return linear_jensen_shannon(x, w, x, w, reduction=reduction)

    got = loss(x, w)
    assert got.shape == ((0,) if reduction == "none" else ())
    np.testing.assert_array_equal(got, 0.0)
    gx, gw = jax.grad(lambda x, w: loss(x, w).sum(), (0, 1))(x, w)
    assert gx.shape == (0, 8)
    np.testing.assert_array_equal(gw, 0.0)
