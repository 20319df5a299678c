"""optimize's structural cross-entropy finder (optimization/finders/cross_entropy.py)
and its dense layers in other layouts (finders/dense.py's _reordered_product): the
libraries' spellings are found and fused with their head, the result equals the original in value
and gradient, and near misses are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cannjax
from tests import _rng as rand

NB, T, D, V = 2, 9, 16, 32
RTOL, ATOL = 2e-5, 2e-6
_k = jax.random.split(jax.random.key(3), 4)
X = rand.normal(_k[0], (NB, T, D))
W = 0.3 * rand.normal(_k[1], (D, V))
LABELS = rand.randint(_k[2], (NB, T), 0, V)


@pytest.fixture(autouse=True)
def _library_broadcasting():
    with jax.numpy_rank_promotion("allow"):
        yield


def _log_softmax_by_hand(z):  # penzai / jax.nn.log_softmax, spelled out
    s = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return s - jnp.log(jnp.sum(jnp.exp(s), axis=-1, keepdims=True))


def _batched_take(logp, labels):  # penzai's indexing: a gather batched over every row axis
    return jax.vmap(jax.vmap(lambda row, i: row[i]))(logp, labels)


def penzai(x, w, labels):
    logp = jax.nn.log_softmax(x @ w)
    labels = jnp.where(labels < 0, labels + V, labels)
    return -jnp.mean(_batched_take(logp, labels))


def penzai_capped(x, w, labels):  # Gemma 2's final soft cap
    z = 30.0 * jnp.tanh((x @ w) / 30.0)
    return -jnp.mean(_batched_take(_log_softmax_by_hand(z), labels))


def haliax(x, w_vd, labels):  # the weight [V, D], a one-hot contraction
    z = jnp.einsum("btd,vd->btv", x, w_vd) * 1.0
    one_hot = (labels[..., None] == jnp.arange(V)[None, None, :]).astype(z.dtype)
    lse = jax.nn.logsumexp(z, axis=-1)
    return jnp.mean(jnp.einsum("btv,btv->bt", one_hot, lse[..., None] - z))


def haliax_negated(x, w, labels):  # z - lse: the log-likelihood, negated after
    z = x @ w
    one_hot = (labels[..., None] == jnp.arange(V)).astype(z.dtype)
    ll = jnp.einsum("btv,btv->bt", one_hot, z - jax.nn.logsumexp(z, -1, keepdims=True))
    return -jnp.mean(ll)


def transformers_sliced(x, w, labels):  # logits[..., :-1, :] before optax's loss
    z = (x @ w)[:, :-1, :]
    return optax.softmax_cross_entropy_with_integer_labels(z, labels[:, 1:]).mean()


def optax_one_hot(x, w, labels):  # optax's loss of jax.nn.one_hot targets
    z = x @ w
    return optax.softmax_cross_entropy(z, jax.nn.one_hot(labels, V)).mean()


def optax_smoothed(x, w, labels):  # optax.smooth_labels: (1 - eps) one_hot + eps / V
    z = x @ w
    targets = optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1)
    return optax.softmax_cross_entropy(z, targets).mean()


def flax_onehot(x, w, labels):  # flax.training.common_utils.onehot(on, off): a select
    from flax.training.common_utils import onehot

    z = x @ w
    targets = onehot(labels, V, on_value=0.8, off_value=0.2 / V)
    return optax.softmax_cross_entropy(z, targets).mean()


def _z_loss(z, weight=1e-4):  # PaLM's z-loss, as t5x and levanter add it
    return weight * jnp.square(jax.nn.logsumexp(z, axis=-1))


def integer_z_loss(x, w, labels):
    z = x @ w
    ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
    return jnp.mean(ce + _z_loss(z))


def smoothed_z_loss(x, w, labels):
    z = x @ w
    ce = optax.softmax_cross_entropy(z, optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1))
    return jnp.mean(ce + _z_loss(z, 3e-4))


def _take(a, labels):
    return jnp.take_along_axis(a, labels[..., None], axis=-1)[..., 0]


def lse_minus_label_logit(x, w, labels):  # logsumexp - the label's logit, as written
    z = x @ w
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - _take(z, labels))


def lse_minus_one_hot_logit(x, w, labels):  # the label's logit read by a one-hot
    z = x @ w
    lse = jax.scipy.special.logsumexp(z, axis=-1)
    return jnp.mean(lse - jnp.sum(jax.nn.one_hot(labels, V) * z, axis=-1))


def lse_by_hand_minus_smoothed(x, w, labels):  # log(sum(exp(z - m))) + m, smoothed targets
    z = x @ w
    m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
    lse = jnp.log(jnp.sum(jnp.exp(z - m[..., None]), axis=-1)) + m
    targets = 0.9 * jax.nn.one_hot(labels, V) + 0.1 / V
    return jnp.mean(lse - jnp.sum(targets * z, axis=-1))


def take_of_z_minus_lse(x, w, labels):  # take_along_axis(z - logsumexp(keepdims))
    z = x @ w
    return -jnp.mean(_take(z - jax.nn.logsumexp(z, -1, keepdims=True), labels))


def take_plus_squared_z_loss(x, w, labels):  # the z-loss beside a squeezed, scaled gather
    z = x @ w
    ce = -1.0 * _take(jax.nn.log_softmax(z), labels)
    return jnp.mean(ce + 1e-4 * jnp.square(jax.nn.logsumexp(z, axis=-1)))


def numpy_indexing(x, w, labels):  # log_softmax(z)[arange(N), labels], logits flattened
    logp = jax.nn.log_softmax((x @ w).reshape(-1, V))
    return -jnp.mean(logp[jnp.arange(NB * T), labels.reshape(-1)])


def numpy_indexing_3d(x, w, labels):  # one arange per row axis
    logp = jax.nn.log_softmax(x @ w)
    return -jnp.mean(logp[jnp.arange(NB)[:, None], jnp.arange(T)[None, :], labels])


def flattened_after_log_softmax(x, w, labels):  # the log-probabilities' rows regrouped
    logp = jax.nn.log_softmax(x @ w).reshape(-1, V)
    return -jnp.mean(jnp.take_along_axis(logp, labels.reshape(-1, 1), axis=-1))


def flattened_after_z_minus_lse(x, w, labels):  # the unshifted form, then regrouped
    z = x @ w
    logp = (z - jnp.log(jnp.sum(jnp.exp(z), -1, keepdims=True))).reshape(-1, V)
    return jnp.mean(0.0 - jnp.take_along_axis(logp, labels.reshape(-1, 1), axis=-1))


def flattened_reshaped_back_plus_z_loss(x, w, labels):  # the loss [N] back to [NB, T]
    z = x @ w
    lse = jnp.log(jnp.sum(jnp.exp(z), -1, keepdims=True))  # shared with the z-loss
    logp = (z - lse).reshape(-1, V)
    ce = -jnp.take_along_axis(logp, labels.reshape(-1, 1), axis=-1)[..., 0].reshape(NB, T)
    return jnp.mean(ce + 1e-4 * jnp.square(lse[..., 0]))


def flattened_after_log_softmax_indexed(x, w, labels):
    logp = jax.nn.log_softmax(x @ w).reshape(NB * T, V)
    return -jnp.mean(logp[jnp.arange(NB * T), labels.reshape(-1)])


def flattened_after_log_softmax_one_hot(x, w, labels):
    logp = jax.nn.log_softmax(x @ w).reshape(-1, V)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels.reshape(-1), V) * logp, axis=-1))


FORMS = {
    "penzai gather": (penzai, "W", "log_softmax[label] (structural) of x @ w"),
    "penzai gather, capped": (penzai_capped, "W", "soft-capped of x @ w"),
    "haliax one-hot": (haliax, "WT", "one-hot . (logsumexp - logits) (structural) of x @ w"),
    "one-hot, z - lse": (haliax_negated, "W", "one-hot . (logsumexp - logits)"),
    "transformers sliced": (transformers_sliced, "W", "of x @ w"),
    "optax one_hot": (optax_one_hot, "W", "sum(targets * log_softmax) (structural) of x @ w"),
    "optax smooth_labels": (optax_smoothed, "W", "label-smoothed (structural) of x @ w"),
    "flax onehot on/off": (flax_onehot, "W", "label-smoothed (structural) of x @ w"),
    "integer labels + z-loss": (integer_z_loss, "W", "+ z-loss of x @ w"),
    "smoothed + z-loss": (smoothed_z_loss, "W", "label-smoothed + z-loss (structural) of x @ w"),
    "lse - take_along_axis(z)": (
        lse_minus_label_logit, "W", "logsumexp - take_along_axis(logits, label) (structural)",
    ),
    "lse - one-hot . z": (lse_minus_one_hot_logit, "W", "logsumexp - sum(targets * logits)"),
    "lse by hand - smoothed . z": (lse_by_hand_minus_smoothed, "W", "label-smoothed"),
    "take_along_axis(z - lse)": (
        take_of_z_minus_lse, "W", "take_along_axis(log_softmax, label) (structural)",
    ),
    "take + square(lse) z-loss": (take_plus_squared_z_loss, "W", "+ z-loss"),
    "numpy indexing": (numpy_indexing, "W", "log_softmax[arange, label] (structural) of x @ w"),
    "numpy indexing, 3-d": (numpy_indexing_3d, "W", "log_softmax[arange, label]"),
    "flattened after log_softmax": (
        flattened_after_log_softmax, "W", "take_along_axis(log_softmax, label) (structural)",
    ),
    "flattened after z - log(sum(exp(z)))": (
        flattened_after_z_minus_lse, "W", "take_along_axis(log_softmax, label) (structural)",
    ),
    "flattened, reshaped back, + z-loss": (
        flattened_reshaped_back_plus_z_loss, "W", "+ z-loss (structural) of x @ w",
    ),
    "flattened after log_softmax, indexed": (
        flattened_after_log_softmax_indexed, "W", "log_softmax[arange, label]",
    ),
    "flattened after log_softmax, one-hot": (
        flattened_after_log_softmax_one_hot, "W", "sum(targets * log_softmax)",
    ),
}  # fmt: skip


def _weights(kind):
    return W.T if kind == "WT" else W


def _check_equal(loss, w, labels=LABELS):
    opt = cannjax.optimize(loss)
    got = jax.jit(jax.value_and_grad(opt, (0, 1)))(X, w, labels)
    want = jax.jit(jax.value_and_grad(loss, (0, 1)))(X, w, labels)
    np.testing.assert_allclose(got[0], want[0], RTOL, ATOL)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, RTOL, ATOL)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_found_fused_with_the_head_and_equal(name):
    loss, kind, source = FORMS[name]
    w = _weights(kind)
    report = cannjax.inspect.optimize(loss, X, w, LABELS)
    rows = [r for r in report.replaced if r.kind == "loss"]
    assert [r.op for r in rows] == ["linear_cross_entropy"], str(report)
    assert source in rows[0].source
    _check_equal(loss, w)


def test_one_hot_rows_of_labels_outside_the_classes_stay_zero():
    # labels[...] == iota reads nothing for a label outside [0, V): the row's loss is 0.
    labels = LABELS.at[0, 3].set(V + 5).at[1, 0].set(-7)
    _check_equal(haliax, W.T, labels)


# Labels that read no class: -100 and -1 (the ignore markers of other libraries), V and
# beyond. jax.nn.one_hot gives them an all-zero row, so optax's loss is eps-smoothing
# only (0 unsmoothed) and finite; the fused loss must say the same, not wrap or NaN.
ODD_LABELS = LABELS.at[0, 1].set(-100).at[0, 4].set(-1).at[1, 2].set(V).at[1, 5].set(V + 9)


@pytest.mark.parametrize("loss", [optax_one_hot, optax_smoothed, smoothed_z_loss])
def test_one_hot_labels_outside_the_classes_read_as_one_hot_reads_them(loss):
    _check_equal(loss, W, ODD_LABELS)
    rows = jax.jit(cannjax.optimize(loss))(X, W, ODD_LABELS)
    assert np.isfinite(rows)


# take_along_axis reads a label in [-V, 0) from the end and gives NaN beyond: the
# substituted loss must read them the same way.
INDEX_LABELS = LABELS.at[0, 1].set(-1).at[0, 4].set(-V).at[1, 2].set(V).at[1, 5].set(-V - 3)


def _lse_minus_take_rows(x, w, labels):
    z = x @ w
    return jax.nn.logsumexp(z, axis=-1) - _take(z, labels)


def _take_of_z_minus_lse_rows(x, w, labels):
    z = x @ w
    return -_take(z - jax.nn.logsumexp(z, -1, keepdims=True), labels)


def _numpy_indexed_rows(x, w, labels):
    logp = jax.nn.log_softmax(x @ w)
    return -logp[jnp.arange(NB)[:, None], jnp.arange(T)[None, :], labels]


def test_numpy_indexing_wraps_negative_labels_and_clamps_the_rest():
    report = cannjax.inspect.optimize(_numpy_indexed_rows, X, W, INDEX_LABELS)
    assert [r.op for r in report.replaced if r.kind == "loss"] == ["linear_cross_entropy"]
    got = jax.jit(cannjax.optimize(_numpy_indexed_rows))(X, W, INDEX_LABELS)
    want = jax.jit(_numpy_indexed_rows)(X, W, INDEX_LABELS)
    np.testing.assert_allclose(got, want, RTOL, ATOL)


def test_indexing_rows_other_than_their_positions_is_left_alone():
    def shuffled(x, w, labels):  # rows read in reverse: not each row's own label
        logp = jax.nn.log_softmax(x @ w)
        return -logp[jnp.arange(NB)[::-1, None], jnp.arange(T)[None, :], labels]

    report = cannjax.inspect.optimize(shuffled, X, W, LABELS)
    assert not [r for r in report.replaced if r.kind == "loss"], str(report)
    _check_equal(lambda x, w, labels: jnp.sum(shuffled(x, w, labels)), W)


@pytest.mark.parametrize("rows", [_lse_minus_take_rows, _take_of_z_minus_lse_rows])
def test_take_along_axis_labels_outside_the_classes_read_as_numpy_indexing(rows):
    report = cannjax.inspect.optimize(rows, X, W, INDEX_LABELS)
    assert [r.op for r in report.replaced if r.kind == "loss"] == ["linear_cross_entropy"]
    got = jax.jit(cannjax.optimize(rows))(X, W, INDEX_LABELS)
    want = jax.jit(rows)(X, W, INDEX_LABELS)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(want).any() and not np.isnan(want).all()
    np.testing.assert_allclose(got, want, RTOL, ATOL)


def test_logits_without_a_head_get_softmax_cross_entropy():
    def loss(x, w, labels):  # sin(x @ w): no head product to fuse
        z = jnp.sin(x @ w) * 4.0
        ce = optax.softmax_cross_entropy(z, optax.smooth_labels(jax.nn.one_hot(labels, V), 0.2))
        return jnp.mean(ce + _z_loss(z))

    report = cannjax.inspect.optimize(loss, X, W, ODD_LABELS)
    rows = [r for r in report.replaced if r.kind == "loss"]
    assert [r.op for r in rows] == ["softmax_cross_entropy"], str(report)
    assert "label-smoothed + z-loss" in rows[0].source
    _check_equal(loss, W, ODD_LABELS)


def test_log_probabilities_regrouped_without_a_head():
    def loss(x, w, labels):  # sin(x @ w): no head; the [NB, T, V] log-probs flattened
        logp = jax.nn.log_softmax(jnp.sin(x @ w) * 4.0).reshape(-1, V)
        return -jnp.mean(jnp.take_along_axis(logp, labels.reshape(-1, 1), axis=-1))

    report = cannjax.inspect.optimize(loss, X, W, LABELS)
    assert [r.op for r in report.replaced if r.kind == "loss"] == ["softmax_cross_entropy"]
    _check_equal(loss, W)


def test_log_probabilities_regrouped_across_the_classes_are_left_alone():
    def loss(x, w, labels):  # [NB, T, V] -> [NB * T * 2, V / 2]: classes split, not a CE
        logp = jax.nn.log_softmax(x @ w).reshape(-1, V // 2)
        rows = jnp.take_along_axis(logp, (labels.reshape(-1, 1) % (V // 2)).repeat(2, 0), -1)
        return -jnp.mean(rows)

    report = cannjax.inspect.optimize(loss, X, W, LABELS)
    assert not [r for r in report.replaced if r.kind == "loss"], str(report)
    _check_equal(loss, W)


def test_logits_read_elsewhere_keep_their_head():
    # The logits are also returned (a metric): fusing the head would not save them, so
    # the loss is found on the logits as they are.
    def loss(x, w, labels):
        z = x @ w
        ce = optax.softmax_cross_entropy(z, optax.smooth_labels(jax.nn.one_hot(labels, V), 0.1))
        return jnp.mean(ce) + 1e-3 * jnp.mean(jnp.square(z))

    report = cannjax.inspect.optimize(loss, X, W, LABELS)
    rows = [r for r in report.replaced if r.kind == "loss"]
    assert [r.op for r in rows] == ["softmax_cross_entropy"], str(report)
    _check_equal(loss, W)


# ------------------------------------------------------------------ near misses
def shift_along_classes(x, w, labels):  # the shift varies along the classes: not log p
    z = x @ w
    s = z - jnp.max(z, axis=0, keepdims=True)
    logp = s - jnp.log(jnp.sum(jnp.exp(s), axis=-1, keepdims=True))
    return -jnp.mean(_batched_take(logp, labels))


def one_hot_over_positions(x, w, labels):  # the "one-hot" compares against positions
    z = x @ w
    hot = (labels[..., None] == jnp.arange(T)[None, :, None]).astype(z.dtype)
    hot = jnp.broadcast_to(hot, z.shape)
    return jnp.mean(jnp.einsum("btv,btv->bt", hot, jax.nn.logsumexp(z, -1, keepdims=True) - z))


def lse_of_other_logits(x, w, labels):  # logsumexp of z, minus 2 z: not a cross-entropy
    z = x @ w
    hot = (labels[..., None] == jnp.arange(V)).astype(z.dtype)
    return jnp.mean(jnp.einsum("btv,btv->bt", hot, jax.nn.logsumexp(z, -1, keepdims=True) - 2 * z))


def negative_off_value(x, w, labels):  # targets one_hot - 0.01: not a smoothed one-hot
    z = x @ w
    return optax.softmax_cross_entropy(z, jax.nn.one_hot(labels, V) - 0.01).mean()


NEAR_MISSES = {
    "shift along classes": shift_along_classes,
    "one-hot over positions": one_hot_over_positions,
    "logsumexp of other logits": lse_of_other_logits,
    "negative off value": negative_off_value,
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_left_alone(name):
    loss = NEAR_MISSES[name]
    report = cannjax.inspect.optimize(loss, X, W, LABELS)
    assert [r for r in report.replaced if r.kind == "loss"] == [], str(report)
    _check_equal(loss, W)


def test_negative_targets_are_said_why():
    report = cannjax.inspect.optimize(negative_off_value, X, W, LABELS)
    said = [r for r in report.left if "not a one-hot with label smoothing" in r.source]
    assert len(said) == 1, str(report)


def test_z_loss_of_other_logits_is_not_fused():
    # The cross-entropy of z plus the z-loss of 2 z: the loss is found, the z-loss kept.
    def loss(x, w, labels):
        z = x @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(z, labels)
        return jnp.mean(ce + _z_loss(2 * z))

    report = cannjax.inspect.optimize(loss, X, W, LABELS)
    rows = [r for r in report.replaced if r.kind == "loss"]
    assert len(rows) == 1 and "z-loss" not in rows[0].source, str(report)
    _check_equal(loss, W)


# ------------------------------------------------------------------ dense layouts
def weight_out_first(x, w_vd, labels):  # haliax: [heads, head_dim, embed] weights
    w3 = w_vd.reshape(4, V // 4, D)
    return jnp.sum(jnp.sin(jnp.einsum("btd,hkd->bthk", x, w3))) + 0 * labels[0, 0]


def weight_first(x, w_vd, labels):  # equinox's Linear under vmap: w @ x, features leading
    y = jax.lax.dot_general(w_vd, x, (((1,), (2,)), ((), ())))  # [V, B, T]
    return jnp.sum(jnp.sin(y)) + 0 * labels[0, 0]


@pytest.mark.parametrize("f, source", [(weight_out_first, "x @ w"), (weight_first, "w @ x")])
def test_products_in_other_layouts_are_linear(f, source):
    report = cannjax.inspect.optimize(f, X, W.T, LABELS)
    rows = [r for r in report.replaced if r.kind == "dense"]
    assert [r.op for r in rows] == ["linear"], str(report)
    assert rows[0].source.startswith(f"{source} (axes reordered)")
    _check_equal(f, W.T)
