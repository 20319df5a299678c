"""optimize's attention finder (cannjax/_src/optimization/finders/attention.py): attention is found
however the corpus's libraries write it (layouts, grouped-query heads, scales, soft caps,
masks as ``where`` or as an additive bias, causal and sliding-window bands), the result
equals the original in value and gradient, and near misses are left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax._src.optimization.finders.attention import _band
from tests import _rng as rand

B, T, N, K, H = 2, 16, 4, 2, 8
G = N // K
RTOL, ATOL = 2e-5, 2e-6
_keys = jax.random.split(jax.random.key(0), 4)
Q = rand.normal(_keys[0], (B, T, N, H))
KV = rand.normal(_keys[1], (B, T, K, H))
V = rand.normal(_keys[2], (B, T, K, H))
W = rand.normal(_keys[3], (B, T, N, H))
# Right padding in the second sequence: every row still sees its first key.
PAD = jnp.ones((B, T), jnp.int32).at[1, 11:].set(0)
CAUSAL = jnp.tril(jnp.ones((T, T), bool))
MIN = jnp.finfo(jnp.float32).min


@pytest.fixture(autouse=True)
def _library_broadcasting():
    with jax.numpy_rank_promotion("allow"):  # the libraries broadcast implicitly
        yield


def _repeat_kv(x):  # transformers' repeat_kv: a broadcast to a new axis, then a reshape
    return jnp.broadcast_to(x[:, :, :, None, :], (B, T, K, G, H)).reshape(B, T, N, H)


def transformers(q, k, v, pad):
    k, v = _repeat_kv(k), _repeat_kv(v)
    mask = jnp.logical_and(CAUSAL[None, None], pad[:, None, None, :] != 0)
    bias = jnp.where(mask, 0.0, MIN)  # additive 0 / finfo.min
    q = q / jnp.sqrt(jnp.float32(H))
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) + bias
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v)


def repeated(q, k, v, pad):  # jnp.repeat: a broadcast straight to the new axis
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    s = jnp.where(CAUSAL, s, MIN)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


def group_axis(q, k, v, pad):  # flax.nnx / haliax: q's heads split into (K, G)
    qg = q.reshape(B, T, K, G, H)
    s = jnp.einsum("btkgh,bskh->bktgs", qg, k) * (H**-0.5)
    s = jnp.where(CAUSAL[None, None, :, None, :], s, MIN * 0.7)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bktgs,bskh->btkgh", p, v).reshape(B, T, N, H) + 0 * pad[0, 0]


def named_axes(q, k, v, pad):  # penzai: keys axis not last, softmax moves it, capped
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("btnh,bsnh->tsbn", q, k) / jnp.sqrt(jnp.float32(H))
    s = 30.0 * jnp.tanh(s / 30.0)
    s = jnp.where(CAUSAL[:, :, None, None], s, -1e30)
    m = jax.lax.stop_gradient(jnp.max(s, axis=1))
    e = jnp.exp(jnp.moveaxis(s, 1, -1) - m[..., None])
    p = e / jnp.sum(e, axis=-1, keepdims=True)  # [t, b, n, s]
    return jnp.einsum("tbns,bsnh->btnh", p, v) + 0 * pad[0, 0]


def sliding_window(q, k, v, pad):  # haliax's where with -1e9, a causal window of 5 keys
    t, s_ = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    band = (t >= s_) & (t - s_ < 5)
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bqnk", q * (H**-0.5), k)
    s = jnp.where(band[None, :, None, :], s, -1e9)
    return jnp.einsum("bqnk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


def anti_causal(q, k, v, pad):  # keys at or after the query: a band on the other side
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    s = jnp.where(CAUSAL.T, s, MIN)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


def left_padding(q, k, v, pad):  # padded queries see no key at all: their rows are empty
    k, v = _repeat_kv(k), _repeat_kv(v)
    pad = pad[:, ::-1]
    mask = CAUSAL[None, None] & (pad[:, None, None, :] != 0)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    s = jnp.where(mask, s, MIN)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v)


def log_space_softmax(q, k, v, pad):  # p = exp(s - logsumexp(s)): the softmax in log space
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(jnp.float32(H))
    s = jnp.where(CAUSAL, s, MIN)
    p = jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
    return jnp.einsum("bnqk,bknh->bqnh", p, v) + 0 * pad[0, 0]


ALIBI_SLOPES = jnp.asarray([2.0 ** (-8 * (h + 1) / N) for h in range(N)])
DISTANCE = (jnp.arange(T)[None, :] - jnp.arange(T)[:, None]).astype(jnp.float32)


def alibi_and_additive_mask(q, k, v, pad):  # two float biases: ALiBi, then a 0 / min mask
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q * H**-0.5, k)
    s = s + ALIBI_SLOPES[:, None, None] * DISTANCE
    s = s + jnp.where(CAUSAL, 0.0, MIN)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


FORMS = {
    "transformers": (transformers, "k and v repeated per query group"),
    "softmax as exp(s - logsumexp)": (log_space_softmax, "softmax(q k^T) v"),
    "ALiBi and an additive mask": (alibi_and_additive_mask, "softmax(q k^T) v"),
    "jnp.repeat": (repeated, "k and v repeated per query group"),
    "group axis": (group_axis, "softmax(q k^T) v"),
    "named axes, capped": (named_axes, "logits soft-capped"),
    "sliding window": (sliding_window, "softmax(q k^T) v"),
    "anti-causal": (anti_causal, "softmax(q k^T) v"),
    "left padding": (left_padding, "softmax(q k^T) v"),
}


def _loss(f):
    return lambda q, k, v, pad: jnp.sum(f(q, k, v, pad) * W)


def _check_equal(loss, opt):
    got = jax.jit(jax.value_and_grad(opt, (0, 1, 2)))(Q, KV, V, PAD)
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(Q, KV, V, PAD)
    np.testing.assert_allclose(got[0], want[0], RTOL, ATOL)
    for a, b in zip(got[1], want[1]):
        assert bool(jnp.all(jnp.isfinite(a)))
        # atol in units of the gradient's scale: float32 rounding is relative to it.
        np.testing.assert_allclose(a, b, RTOL, ATOL * max(1.0, float(jnp.max(jnp.abs(b)))))


@pytest.mark.parametrize("name", sorted(FORMS))
def test_found_however_written_and_equal(name):
    f, source = FORMS[name]
    loss = _loss(f)
    opt = cannjax.optimize(loss)
    report = cannjax.inspect.optimize(loss, Q, KV, V, PAD)
    rows = [r for r in report.replaced if r.kind == "attention"]
    assert [r.op for r in rows] == ["attention"], str(report)
    assert source in rows[0].source
    _check_equal(loss, opt)


def test_left_padding_rows_hold_the_mean_of_v():
    out = jax.jit(cannjax.optimize(left_padding))(Q, KV, V, PAD)
    # Query 0 of sequence 1 sees no key: the written code averages v over all keys.
    want = jnp.mean(_repeat_kv(V)[1, :, 0], axis=0)
    np.testing.assert_allclose(out[1, 0, 0], want, 1e-5, 1e-6)


# ------------------------------------------------------------------ near misses
def cap_after_mask(q, k, v, pad):  # the cap turns the fill into -30: keys stay visible
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    s = 30.0 * jnp.tanh(jnp.where(CAUSAL, s, -1e30) / 30.0)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


def weak_fill(q, k, v, pad):  # exp(-10 - m) is not 0: the "masked" keys keep weight
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    s = jnp.where(CAUSAL, s, -10.0)
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


def shift_over_queries(q, k, v, pad):  # the max taken over queries: not a softmax
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5)
    e = jnp.exp(s - jnp.max(s, axis=2, keepdims=True))
    p = e / jnp.sum(e, axis=-1, keepdims=True)
    return jnp.einsum("bnqk,bknh->bqnh", p, v) + 0 * pad[0, 0]


def weights_also_used(q, k, v, pad):  # the probabilities are read again
    k, v = _repeat_kv(k), _repeat_kv(v)
    p = jax.nn.softmax(jnp.einsum("bqnh,bknh->bnqk", q, k) * (H**-0.5), axis=-1)
    out = jnp.einsum("bnqk,bknh->bqnh", p, v)
    return out + jnp.sum(p**2) + 0 * pad[0, 0]


def scale_after_cap(q, k, v, pad):  # 2 * cap(s): not cap(scale * s) for any scale
    k, v = _repeat_kv(k), _repeat_kv(v)
    s = jnp.einsum("bqnh,bknh->bnqk", q, k)
    s = 2.0 * (30.0 * jnp.tanh(s / 30.0))
    return jnp.einsum("bnqk,bknh->bqnh", jax.nn.softmax(s, axis=-1), v) + 0 * pad[0, 0]


# Each near miss, and what the report says of it (None: no softmax, so no attention row).
NEAR_MISSES = {
    "cap after the mask": (cap_after_mask, "the soft cap comes after a mask or bias"),
    "weak fill": (weak_fill, "a jnp.where fill that is not a constant <= -1e+09"),
    "shift over queries": (shift_over_queries, None),
    "weights also used": (weights_also_used, "the logits or probabilities are also read"),
    "scale after the cap": (scale_after_cap, "the logits are scaled after the soft cap"),
}


@pytest.mark.parametrize("name", sorted(NEAR_MISSES))
def test_near_misses_left_alone_and_said_why(name):
    f, why = NEAR_MISSES[name]
    loss = _loss(f)
    report = cannjax.inspect.optimize(loss, Q, KV, V, PAD)
    assert [r for r in report.replaced if r.kind == "attention"] == [], str(report)
    said = [
        r.source for r in report.left if r.source.startswith("attention (softmax(q k^T) v) but")
    ]
    if why is None:
        assert said == [], said
    else:
        assert len(said) == 1 and why in said[0], said
    _check_equal(loss, cannjax.optimize(loss))


# ------------------------------------------------------------------ bands
def _tri(n, left, right):
    t, s = np.indices((n, n))
    return (t - s <= left) & (s - t <= right)


@pytest.mark.parametrize(
    "mask, want",
    [
        (_tri(6, 5, 0), (True, None)),  # causal
        (_tri(6, 2, 0), (True, (2, 0))),  # causal, 3 keys
        (_tri(6, 1, 3), (False, (1, 3))),
        (_tri(6, 0, 5), (False, (0, 5))),  # anti-causal
        (_tri(6, 5, 5), (False, None)),  # everything
    ],
)
def test_band_reads_causal_and_window(mask, want):
    assert _band(mask) == want


@pytest.mark.parametrize(
    "mask",
    [
        _tri(6, 5, 0) & ~np.eye(6, dtype=bool),  # the diagonal hidden
        np.tril(np.ones((6, 6), bool)) & (np.arange(6) % 2 == 0),  # gaps
        np.zeros((6, 6), bool),
        np.ones((4, 6), bool),  # not square
    ],
)
def test_band_rejects_other_masks(mask):
    assert _band(mask) is None
