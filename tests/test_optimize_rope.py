"""optimize's RoPE finder (cannjax/_src/optimization/finders/rope.py): rotary embeddings as the
libraries write them (Hugging Face, haliax, equinox, penzai, GPT-J; half-split and
interleaved) become one apply_rope, equal in value and gradient, keeping smaller tables;
rotations it cannot prove (tables whose halves differ, tables that carry a gradient, a
pairing that is not a rotation) are left as written."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from tests import _rng as rand

B, T, N, H = 2, 6, 3, 8
h = H // 2
RTOL, ATOL = 2e-5, 2e-6
_k = jax.random.split(jax.random.key(3), 3)
X = rand.normal(_k[0], (B, T, N, H))
Y = rand.normal(_k[1], (B, T, N, H))
POS = jnp.arange(T)
THETA = 10000.0


def _angle(pos):  # [T, h]: positions times inverse frequencies, from integers and literals
    inv = 1.0 / (THETA ** (jnp.arange(0, H, 2) / H))
    return pos.astype(jnp.float32)[:, None] * inv[None]


def _rotate_half(x):
    return jnp.concatenate([-x[..., h:], x[..., :h]], -1)


def _rotate_every_two(x):
    r = jnp.stack((-x[..., 1::2], x[..., ::2]), axis=-1)
    return r.reshape(r.shape[:-2] + (-1,))


def hf_llama(x, pos):  # cos/sin of the repeated angles, x cos + rotate_half(x) sin
    emb = jnp.concatenate([_angle(pos)] * 2, -1)
    cos, sin = jnp.cos(emb)[None, :, None], jnp.sin(emb)[None, :, None]
    return x * cos + _rotate_half(x) * sin


# transformers' Flax models: a float64 numpy table [max_pos, sin | cos], gathered by ids.
_MAX = 16
_inv = 1.0 / THETA ** (np.arange(0, H, 2) / H)
_emb = np.concatenate([np.arange(_MAX)[:, None] * _inv[None]] * 2, -1)
_TABLE = np.concatenate([np.sin(_emb), np.cos(_emb)], -1).astype(np.float32)  # [16, 2H]


def hf_gathered(x, pos):
    ids = jnp.broadcast_to(pos, (B, T))
    sincos = jnp.asarray(_TABLE)[ids][:, :, None]  # [B, T, 1, 2H]
    sin, cos = jnp.split(sincos, 2, axis=-1)
    return x * cos + _rotate_half(x) * sin


def equinox_tiled(x, pos):  # tables [T, h] tiled, heads before positions
    a = _angle(pos)
    cos, sin = jnp.tile(jnp.cos(a), (1, 2)), jnp.tile(jnp.sin(a), (1, 2))
    xt = jnp.swapaxes(x, 1, 2)  # [B, N, T, H]
    y = xt * cos[None, None] + _rotate_half(xt) * sin[None, None]
    return jnp.swapaxes(y, 1, 2)


def penzai_split(x, pos):  # angle = position / timescale, the halves of a split
    timescale = THETA ** (2 * jnp.arange(h) / H)
    a = pos.astype(jnp.float32)[:, None] / timescale[None]
    sin, cos = jnp.sin(a)[None, :, None], jnp.cos(a)[None, :, None]
    x0, x1 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1)


def gptj(x, pos):  # interleaved: jnp.repeat tables, rotate_every_two
    a = _angle(pos)[None, :, None]
    cos, sin = jnp.repeat(jnp.cos(a), 2, -1), jnp.repeat(jnp.sin(a), 2, -1)
    return x * cos + _rotate_every_two(x) * sin


def interleaved_pairs(x, pos):  # pairs (2i, 2i + 1) as a reshape, stacked back
    a = _angle(pos)[None, :, None]
    c, s = jnp.cos(a), jnp.sin(a)
    pairs = x.reshape(*x.shape[:-1], h, 2)
    u, w = pairs[..., 0], pairs[..., 1]
    return jnp.stack([u * c - w * s, w * c + u * s], -1).reshape(x.shape)


def inverse_rotation(x, pos):  # x cos - rotate_half(x) sin: the rotation by -angle
    emb = jnp.concatenate([_angle(pos)] * 2, -1)
    return x * jnp.cos(emb)[None, :, None] - _rotate_half(x) * jnp.sin(emb)[None, :, None]


FORMS = {
    "hf llama": (hf_llama, "x * cos + rotate_half(x) * sin"),
    "hf gathered table": (hf_gathered, "x * cos + rotate_half(x) * sin"),
    "equinox tiled, transposed": (equinox_tiled, "x * cos + rotate_half(x) * sin"),
    "penzai split": (penzai_split, "pairwise rotation of the two halves"),
    "gpt-j interleaved": (gptj, "x * cos + rotate_every_two(x) * sin"),
    "interleaved pairs": (interleaved_pairs, "pairwise rotation of interleaved pairs"),
    "inverse rotation": (inverse_rotation, "x * cos + rotate_half(x) * sin"),
}


def _loss(f):
    return lambda x, pos: jnp.sum(f(x, pos) * Y)


def _check_equal(loss, *args, argnums=0):
    got = jax.jit(jax.value_and_grad(cannjax.optimize(loss), argnums))(*args)
    want = jax.jit(jax.value_and_grad(loss, argnums))(*args)
    np.testing.assert_allclose(got[0], want[0], RTOL, ATOL)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(a, b, RTOL, ATOL)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_found_as_one_operator_and_equal(name):
    f, source = FORMS[name]
    report = cannjax.inspect.optimize(_loss(f), X, POS)
    assert report.counts() == {"rope": 1}, str(report)
    (row,) = report.replaced
    assert (row.op, row.source) == ("apply_rope", source), str(report)
    # The values themselves, not only the loss: the optimized function as written.
    np.testing.assert_allclose(cannjax.optimize(f)(X, POS), f(X, POS), RTOL, ATOL)
    _check_equal(_loss(f), X, POS)


@pytest.mark.parametrize("name", sorted(FORMS))
def test_the_operator_keeps_the_half_tables_not_repeated_ones(name):
    # Plain autodiff keeps what x is multiplied by (the tables repeated to H features in
    # the half-split and GPT-J forms); apply_rope keeps h features of each table, as the
    # program broadcast them ([T, h] of values), and the loss keeps Y.
    report = cannjax.inspect.optimize(_loss(FORMS[name][0]), X, POS)
    before, after = report.residual_bytes
    tables = 2 * T * h * 4 * (B if name == "hf gathered table" else 1)
    assert after == Y.nbytes + tables, (before, after)
    assert after <= before, (before, after)
    if name in ("hf llama", "gpt-j interleaved", "hf gathered table"):
        assert before - after >= tables, (before, after)


def test_found_in_a_model_with_projections_under_grad_of_the_weights():
    wq, wk = (0.3 * rand.normal(k, (H * N, H * N)) for k in jax.random.split(_k[2]))
    z = X.reshape(B, T, N * H)

    def loss(wq, wk, z, pos):
        q = (z @ wq).reshape(B, T, N, H)
        k = (z @ wk).reshape(B, T, N, H)
        return jnp.sum(hf_llama(q, pos) * hf_llama(k, pos))

    report = cannjax.inspect.optimize(loss, wq, wk, z, POS)
    assert report.counts().get("rope") == 2, str(report)
    _check_equal(loss, wq, wk, z, POS, argnums=(0, 1, 2))


# ------------------------------------------------------------------ near misses
def halves_differ(x, pos):  # the cos table's halves are different angles
    a = _angle(pos)
    cos = jnp.concatenate([jnp.cos(a), jnp.cos(2 * a)], -1)[None, :, None]
    sin = jnp.concatenate([jnp.sin(a)] * 2, -1)[None, :, None]
    return x * cos + _rotate_half(x) * sin


def no_negation(x, pos):  # [x1, x0] without the sign: a symmetric map, not a rotation
    emb = jnp.concatenate([_angle(pos)] * 2, -1)[None, :, None]
    return x * jnp.cos(emb) + jnp.concatenate([x[..., h:], x[..., :h]], -1) * jnp.sin(emb)


def two_tables_per_half(x, pos):  # pairwise, but the second half uses other cosines
    a = _angle(pos)[None, :, None]
    x0, x1 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate(
        [x0 * jnp.cos(a) - x1 * jnp.sin(a), x1 * jnp.cos(a + 1) + x0 * jnp.sin(a)], -1
    )


def repeat_not_interleaved(x, pos):  # jnp.repeat tables with rotate_half: pairs mixed up
    a = _angle(pos)[None, :, None]
    cos, sin = jnp.repeat(jnp.cos(a), 2, -1), jnp.repeat(jnp.sin(a), 2, -1)
    return x * cos + _rotate_half(x) * sin


@pytest.mark.parametrize(
    "f", [halves_differ, no_negation, two_tables_per_half, repeat_not_interleaved]
)
def test_other_maps_are_left_as_written(f):
    loss = _loss(f)
    report = cannjax.inspect.optimize(loss, X, POS)
    assert "rope" not in report.counts(), str(report)
    _check_equal(loss, X, POS)


def test_a_table_whose_halves_differ_is_reported():
    report = cannjax.inspect.optimize(_loss(halves_differ), X, POS)
    reasons = [r.source for r in report.left]
    assert any("two halves are not provably equal" in why for why in reasons), str(report)


def test_tables_that_carry_a_gradient_are_left_as_written():
    # Learned frequencies: apply_rope does not differentiate its tables, so a table
    # computed from a float input stays as written and its gradient stays exact.
    def learned(x, inv_freq, pos):
        a = pos.astype(jnp.float32)[:, None] * inv_freq[None]
        emb = jnp.concatenate([a, a], -1)[None, :, None]
        return jnp.sum((x * jnp.cos(emb) + _rotate_half(x) * jnp.sin(emb)) * Y)

    inv = 1.0 / (THETA ** (jnp.arange(0, H, 2) / H))
    report = cannjax.inspect.optimize(learned, X, inv, POS)
    assert "rope" not in report.counts(), str(report)
    _check_equal(learned, X, inv, POS, argnums=(0, 1))


def test_float_positions_are_a_differentiable_input():
    # Positions passed as floats could be differentiated: their tables are left alone.
    report = cannjax.inspect.optimize(_loss(hf_llama), X, POS.astype(jnp.float32))
    assert "rope" not in report.counts(), str(report)


def hf_llama_cast(x, pos):  # tables cast to x's dtype: the products in bfloat16
    emb = jnp.concatenate([_angle(pos)] * 2, -1)
    cos, sin = (t(emb)[None, :, None].astype(x.dtype) for t in (jnp.cos, jnp.sin))
    return x * cos + _rotate_half(x) * sin


@pytest.mark.parametrize("f", [hf_llama, hf_llama_cast])
def test_bfloat16_activations(f):
    # With float32 tables the program promotes x (the upcasts are read through); with
    # tables cast to bfloat16 it computes in bfloat16, and apply_rope in float32.
    x = X.astype(jnp.bfloat16)
    report = cannjax.inspect.optimize(lambda x, p: jnp.sum(f(x, p).astype(jnp.float32)), x, POS)
    assert report.counts() == {"rope": 1}, str(report)
    got, want = cannjax.optimize(f)(x, POS), f(x, POS)
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), 2e-2, 2e-2)
    g = jax.grad(lambda x: jnp.sum(f(x, POS).astype(jnp.float32) * Y))
    got_g = jax.grad(lambda x: jnp.sum(cannjax.optimize(f)(x, POS).astype(jnp.float32) * Y))(x)
    np.testing.assert_allclose(got_g.astype(jnp.float32), g(x).astype(jnp.float32), 2e-2, 5e-2)
