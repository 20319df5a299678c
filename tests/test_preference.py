"""cannjax.ops.linear_preference_loss: DPO, ORPO, SimPO, CPO and KTO, fused with the head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import cannjax
from cannjax import parallel
from cannjax.core import registry
from cannjax.inspect import residuals
from cannjax.ops import PreferenceMetrics, linear_preference_loss
from cannjax.testing import check_op
from tests import _rng as rand
from tests._ops import cast

SPEC = registry()["linear_preference_loss"]
KINDS = ("dpo", "orpo", "simpo", "cpo", "kto")
# Each kind's own options, beyond the defaults.
OPTIONS = {
    "dpo": [{}, {"label_smoothing": 0.2, "nll_weight": 0.3, "beta": 0.5}],
    "orpo": [{}, {"beta": 0.25, "nll_weight": 0.0}],
    "simpo": [{"beta": 2.0, "gamma": 0.7}, {"beta": 2.5, "gamma": 1.0, "label_smoothing": 0.1}],
    "cpo": [{}, {"beta": 0.3, "nll_weight": 0.5, "label_smoothing": 0.1}],
    "kto": [{}, {"kl": 0.4, "desirable_weight": 1.33, "undesirable_weight": 0.5, "beta": 0.2}],
}
CASES = [(kind, opts) for kind in KINDS for opts in OPTIONS[kind]]
IDS = [kind + "".join(f"-{k}={v}" for k, v in o.items()) for kind, o in CASES]
# make test checks each kind's defaults (and DPO's edge points); make test-extended (CI)
# the options and the other kinds' edge points.
CHECKED = [
    pytest.param(kind, opts, id=i, marks=() if opts is OPTIONS[kind][0] else pytest.mark.extended)
    for (kind, opts), i in zip(CASES, IDS)
]


def _args(kind, key=0, dtype="float32"):
    """The spec's sample, without the reference log-likelihoods for reference-free kinds."""
    args = cast(SPEC.sample(jax.random.key(key)), dtype)
    return args if kind in ("dpo", "kto") else args[:5]


def _kw(kind, opts):
    kw = {"kind": kind, **opts}
    if "kl" in kw:
        kw["kl"] = jnp.asarray(kw["kl"])
    return kw


# ------------------------------------------------------------------------------ check_op
@pytest.mark.parametrize("kind, opts", CHECKED)
def test_check_op_random_points_float64(kind, opts):
    with jax.enable_x64(True):
        args = _args(kind, 1, "float64")
        check_op(SPEC.name, *args, seed=1, **_kw(kind, opts), return_metrics=False)


@pytest.mark.parametrize(
    "kind", ["dpo", *(pytest.param(k, marks=pytest.mark.extended) for k in KINDS[1:])]
)
def test_check_op_edge_points_float64(kind):
    with jax.enable_x64(True):
        for case in SPEC.edges():
            args = cast(case.args, "float64")
            if kind not in ("dpo", "kto"):
                if float(jnp.abs(args[5]).max()) > 1e3:
                    continue  # the far-apart reference: a DPO/KTO case
                args = args[:5]
            check_op(SPEC.name, *args, **{**case.check_kwargs(), "kind": kind})


@pytest.mark.extended
@pytest.mark.parametrize("kind, opts", CASES, ids=IDS)
def test_check_op_random_points_float32(kind, opts):
    check_op(SPEC.name, *_args(kind, 2), seed=2, **_kw(kind, opts), return_metrics=False)


# ----------------------------------------------------------------- TRL's formulas, by hand
def _log_sigmoid(v):
    return -np.logaddexp(0.0, -v)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _trl(kind, xc, xr, w, yc, yr, rc=None, rr=None, beta=0.1, gamma=0.5, label_smoothing=0.0,
         nll_weight=None, kl=0.0, desirable_weight=1.0, undesirable_weight=1.0):  # fmt: skip
    """The losses as TRL's trainers write them, in float64 numpy."""

    def logps(x, y):
        z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        lp = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True))
        lp -= z.max(-1, keepdims=True)
        kept = y != -100
        tok = np.take_along_axis(lp, np.where(kept, y, 0)[..., None], -1)[..., 0]
        return np.where(kept, tok, 0).sum(-1), kept.sum(-1)

    (sc, nc), (sr, nr) = logps(xc, yc), logps(xr, yr)
    nll = -sc.sum() / nc.sum()
    eps = label_smoothing

    def sigmoid_loss(h):  # DPOTrainer / CPOTrainer, loss_type="sigmoid"
        return -_log_sigmoid(h) * (1 - eps) - _log_sigmoid(-h) * eps

    if kind == "dpo":
        logits = (sc - sr) - (np.asarray(rc) - np.asarray(rr))
        losses, chosen, rejected = sigmoid_loss(beta * logits), sc - rc, sr - rr
        loss = losses.mean() + (nll_weight or 0.0) * nll
        return loss, beta * chosen, beta * rejected
    if kind == "orpo":  # ORPOTrainer.odds_ratio_loss, average log-probabilities
        pc, pr = sc / nc, sr / nr
        log_odds = (pc - pr) - (np.log1p(-np.exp(pc)) - np.log1p(-np.exp(pr)))
        loss = (1.0 if nll_weight is None else nll_weight) * nll - (
            beta * _log_sigmoid(log_odds)
        ).mean()
        return loss, beta * pc, beta * pr
    if kind == "simpo":  # CPOTrainer, loss_type="simpo": gamma / beta subtracted from the logits
        pc, pr = sc / nc, sr / nr
        losses = sigmoid_loss(beta * ((pc - pr) - gamma / beta))
        return losses.mean() + (nll_weight or 0.0) * nll, beta * pc, beta * pr
    if kind == "cpo":  # CPOTrainer, loss_type="sigmoid", cpo_alpha
        losses = sigmoid_loss(beta * (sc - sr))
        loss = losses.mean() + (1.0 if nll_weight is None else nll_weight) * nll
        return loss, beta * sc, beta * sr
    # KTOTrainer.kto_loss
    chosen, rejected = sc - rc, sr - rr
    losses = np.concatenate(
        [
            desirable_weight * (1 - _sigmoid(beta * (chosen - kl))),
            undesirable_weight * (1 - _sigmoid(beta * (kl - rejected))),
        ]
    )
    return losses.mean(), beta * chosen, beta * rejected


@pytest.mark.parametrize("kind, opts", CASES, ids=IDS)
def test_loss_and_rewards_are_trls(kind, opts):
    args = _args(kind, 3)
    loss, m = linear_preference_loss(*args, **_kw(kind, opts))
    want, chosen, rejected = _trl(kind, *args, **opts)
    np.testing.assert_allclose(loss, want, rtol=2e-5)
    np.testing.assert_allclose(m.chosen_rewards, chosen, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(m.rejected_rewards, rejected, rtol=2e-5, atol=1e-6)
    if kind != "kto":
        np.testing.assert_allclose(m.margins, chosen - rejected, rtol=2e-5, atol=1e-5)
        np.testing.assert_array_equal(m.accuracies, (chosen > rejected).astype(np.float32))


def test_kto_takes_unpaired_examples():
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(4))
    xr, yr, rr = xr[:1], yr[:1], rr[:1]  # 2 desirable examples, 1 undesirable
    loss, m = linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="kto", kl=jnp.asarray(0.1))
    want, chosen, rejected = _trl("kto", xc, xr, w, yc, yr, rc, rr, kl=0.1)
    np.testing.assert_allclose(loss, want, rtol=2e-5)
    assert m.chosen_rewards.shape == (2,) and m.rejected_rewards.shape == (1,)
    assert m.margins is None and m.accuracies is None
    with jax.enable_x64(True):
        args = cast((xc, xr, w, yc, yr, rc, rr), "float64")
        check_op(SPEC.name, *args, kind="kto", return_metrics=False)


def test_metrics_are_logged_not_differentiated():
    args = _args("orpo", 0)
    loss, m = linear_preference_loss(*args, kind="orpo")
    assert isinstance(m, PreferenceMetrics)
    assert m.log_odds_ratio.shape == (2,) and m.nll_loss.shape == ()
    np.testing.assert_allclose(
        m.nll_loss, _trl("orpo", *args, nll_weight=1.0, beta=0.0)[0], rtol=1e-5
    )

    def logged(w):
        _, m = linear_preference_loss(*args[:2], w, *args[3:], kind="orpo")
        return sum(jnp.sum(v) for v in jax.tree.leaves(m))

    g = jax.grad(logged)(args[2])
    assert not np.any(g), "metrics are stop_gradient-ed"
    # has_aux, as trainers call it
    (value, aux), grads = jax.value_and_grad(
        lambda w: linear_preference_loss(*args[:2], w, *args[3:], kind="orpo"), has_aux=True
    )(args[2])
    assert float(value) == pytest.approx(float(loss)) and aux.chosen_logps.shape == (2,)


def test_every_completion_token_ignored_in_a_pair():
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(6))
    yc, yr = yc.at[1].set(-100), yr.at[1].set(-100)
    gx = jax.grad(lambda xc: linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="dpo")[0])(xc)
    assert np.all(np.isfinite(gx)) and not np.any(gx[1])
    # averaged kinds: an empty completion averages over max(1, 0) tokens (its logp is 0)
    loss, m = linear_preference_loss(xc, xr, w, yc, yr, kind="simpo")
    assert np.isfinite(loss) and m.chosen_logps[1] == 0


def test_kto_gradient_stays_accurate_where_the_sigmoid_saturates():
    # Rewards 130 nats from the reference (beta h = 13): autodiff of 1 - sigmoid(h) forms
    # s (1 - s) with s = 0.9999977 and keeps 1 - s to 2% in float32; the loss is written
    # as exp(log sigmoid(-h)), whose derivative has no such difference.
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(11))
    logps = linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="kto")[1]
    rc, rr = logps.chosen_logps + 130.0, logps.rejected_logps - 130.0

    def grad(dtype):
        args = cast((xc, xr, w, yc, yr, rc, rr), dtype)
        loss = lambda w: linear_preference_loss(*args[:2], w, *args[3:], kind="kto")[0]  # noqa: E731
        return np.asarray(jax.grad(loss)(args[2]), np.float64)

    with jax.enable_x64(True):
        exact = grad("float64")
    got = grad("float32")
    assert np.abs(got - exact).max() <= 1e-4 * np.abs(exact).max()


# -------------------------------------------------------------------- transforms, dtypes
def test_jit_vmap_jvp_and_hessian_vector_products():
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(7))
    ours = lambda xc, w: linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="dpo")[0]  # noqa: E731
    ref = lambda xc, w: SPEC.reference(xc, xr, w, yc, yr, rc, rr, kind="dpo")[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(ours)(xc, w), ref(xc, w), rtol=1e-6)
    batch = jnp.stack([xc, 2 * xc, -xc])
    np.testing.assert_allclose(
        jax.vmap(ours, (0, None))(batch, w), jax.vmap(ref, (0, None))(batch, w), rtol=1e-5
    )
    t = (jnp.cos(xc), jnp.sin(w))
    np.testing.assert_allclose(jax.jvp(ours, (xc, w), t)[1], jax.jvp(ref, (xc, w), t)[1], rtol=1e-5)

    def hvp(f):
        return jax.jvp(jax.grad(f, 1), (xc, w), t)[1]

    np.testing.assert_allclose(hvp(ours), hvp(ref), rtol=2e-4, atol=1e-6)


def test_scan_and_checkpoint():
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(8))

    def steps(w):
        def body(w, s):
            loss = linear_preference_loss(s * xc, xr, w, yc, yr, kind="cpo")[0]
            return w, loss

        return jax.lax.scan(jax.checkpoint(body), w, jnp.array([1.0, 0.5]))[1].sum()

    def plain(w):
        return sum(SPEC.reference(s * xc, xr, w, yc, yr, kind="cpo")[0] for s in (1.0, 0.5))

    np.testing.assert_allclose(jax.grad(steps)(w), jax.grad(plain)(w), rtol=1e-5, atol=1e-7)


def test_bfloat16():
    args = _args("simpo", 9)
    low = cast(args, "bfloat16")
    loss, m = linear_preference_loss(*low, kind="simpo", beta=2.0)
    assert loss.dtype == jnp.bfloat16 and m.chosen_logps.dtype == jnp.float32
    want = linear_preference_loss(*cast(low, "float32"), kind="simpo", beta=2.0)[0]
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-2)
    g = jax.grad(lambda w: linear_preference_loss(*low[:2], w, *low[3:], kind="simpo")[0])(low[2])
    assert g.dtype == jnp.bfloat16


# ------------------------------------------------------------------------------- memory
def _data(B, T, D, V, key=0):
    ks = jax.random.split(jax.random.key(key), 4)
    xc, xr = rand.normal(ks[0], (B, T, D)), rand.normal(ks[1], (B, T, D))
    w = 0.05 * rand.normal(ks[2], (D, V))
    y = rand.randint(ks[3], (2, B, T), 0, V)
    prompt = jnp.arange(T) < T // 4
    return xc, xr, w, jnp.where(prompt, -100, y[0]), jnp.where(prompt, -100, y[1])


def test_residuals_are_the_gradients_not_the_logits():
    xc, xr, w, yc, yr = _data(2, 32, 8, 512)
    rc, rr = -jnp.ones(2), -jnp.ones(2)
    report = residuals(
        lambda xc, xr, w: linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="dpo")[0],
        xc, xr, w,
    )  # fmt: skip
    named = {r.source.split("'")[1] for r in report.rows if "named" in r.source}
    assert named == {f"cannjax.linear_preference_loss.{k}" for k in ("dx", "dw", "dref")}
    assert report.total_bytes == xc.nbytes + xr.nbytes + w.nbytes + rc.nbytes + rr.nbytes


@pytest.mark.parametrize("kind", ["dpo", "orpo", "kto"])
def test_value_and_grad_temp_is_a_fraction_of_plain(kind):
    # Deterministic (compiled memory). Plain holds the [2BT, V] logits and their
    # log-softmax; ours a few [64, V] arrays of a chunk and k + 1 [D, V] accumulators.
    xc, xr, w, yc, yr = _data(2, 256, 64, 8192)
    refs = (-jnp.ones(2), -jnp.ones(2)) if kind in ("dpo", "kto") else ()

    def temp(f):
        g = jax.jit(jax.value_and_grad(
            lambda xc, xr, w: f(xc, xr, w, yc, yr, *refs, kind=kind, chunk_size=64)[0], (0, 1, 2)
        ))  # fmt: skip
        return g.lower(xc, xr, w).compile().memory_analysis().temp_size_in_bytes

    ours, plain = temp(linear_preference_loss), temp(SPEC.reference)
    assert ours <= 0.25 * plain, (ours, plain)


def test_value_alone_compiles_to_the_forward_only():
    xc, xr, w, yc, yr = _data(2, 64, 16, 256)

    def flops(f):
        return jax.jit(f).lower(xc, xr, w).compile().cost_analysis()["flops"]

    loss = lambda xc, xr, w: linear_preference_loss(xc, xr, w, yc, yr, kind="simpo")[0]  # noqa: E731
    assert flops(loss) < 0.5 * flops(jax.grad(loss, (0, 1, 2)))


# ----------------------------------------------------------------------------- sharding
@pytest.mark.parametrize("head", [P(), P(None, "model")], ids=["replicated", "vocab-parallel"])
def test_pairs_stay_on_their_devices_and_the_head_may_split_over_the_vocabulary(head):
    B, T, D, V = 8, 32, 32, 2048
    mesh = parallel.model_mesh(4, 2)
    xc, xr, w, yc, yr = _data(B, T, D, V)
    rc, rr = -jnp.ones(B), -2 * jnp.ones(B)
    rows = NamedSharding(mesh, P("data"))

    def loss(xc, xr, w, yc, yr, rc, rr):
        return cannjax.ops.linear_preference_loss(xc, xr, w, yc, yr, rc, rr, kind="dpo",
                                                  chunk_size=16)[0]  # fmt: skip

    step = jax.value_and_grad(loss, (0, 1, 2))
    f = jax.jit(step, in_shardings=(rows, rows, NamedSharding(mesh, head), rows, rows, rows, rows))
    compiled = f.lower(xc, xr, w, yc, yr, rc, rr).compile()
    moved = parallel.collective_bytes(compiled)
    assert moved["all-gather"] <= 4 * 2 * B, moved  # never the hidden states nor the head
    assert moved["all-reduce"] + moved["reduce-scatter"] <= 4 * D * V + 4 * 2 * B * T * D, moved
    for got, want in zip(jax.tree.leaves(f(xc, xr, w, yc, yr, rc, rr)),
                         jax.tree.leaves(step(xc, xr, w, yc, yr, rc, rr))):  # fmt: skip
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


# -------------------------------------------------------------------------------- errors
def test_bad_input_names_the_function_and_argument():
    xc, xr, w, yc, yr, rc, rr = SPEC.sample(jax.random.key(0))
    f = linear_preference_loss
    cases = [
        (lambda: f(xc, xr, w, yc, yr, rc, rr, kind="ipo"), ValueError, "kind must be one of"),
        (lambda: f(xc, xr[:1], w, yc, yr[:1], rc, rr[:1], kind="dpo"), ValueError, "x_rejected"),
        (lambda: f(xc, xr, w, yc, yr, kind="dpo"), ValueError, "needs ref_chosen_logps"),
        (lambda: f(xc, xr, w, yc, yr, rc, None, kind="kto"), ValueError, "ref_rejected_logps"),
        (lambda: f(xc, xr, w, yc, yr, rc, rr, kind="orpo"), ValueError, "reference-free"),
        (lambda: f(xc, xr, w, yc, yr, kind="cpo", beta=0.0), ValueError, "beta must be"),
        (lambda: f(xc, xr, w, yc, yr, kind="cpo", beta=-1.0), ValueError, "beta must be"),
        (lambda: f(xc, xr, w, yc, yr, rc, rr, kind="dpo", gamma=0.5), ValueError, "gamma"),
        (lambda: f(xc, xr, w, yc, yr, kind="simpo", kl=0.1), ValueError, "kl applies"),
        (lambda: f(xc, xr, w.T, yc, yr, kind="simpo"), ValueError, "x_chosen must have shape"),
        (lambda: f(xc, xr, w, yc * 1.0, yr, kind="simpo"), TypeError, "y_chosen must be an int"),
        (lambda: f(xc, xr, w, yc, yr[:, :2], kind="simpo"), ValueError, "y_rejected must have"),
        (lambda: f(xc, xr, w, yc, yr, rc[:1], rr, kind="dpo"), ValueError, "ref_chosen_logps"),
        (lambda: f(xc, xr, w, yc, yr, kind="simpo", chunk_size=0), ValueError, "chunk_size"),
        (lambda: f(xc, xr, w, yc, yr, kind="orpo", label_smoothing=0.1), ValueError, "label_s"),
        (lambda: f(xc.astype(int), xr, w, yc, yr, kind="cpo"), TypeError, "x_chosen"),
    ]
    for call, error, text in cases:
        with pytest.raises(error, match=text) as e:
            call()
        assert str(e.value).startswith("cannjax.ops.linear_preference_loss: "), str(e.value)
