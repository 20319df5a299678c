"""cannjax.ops.attention: check_op, agreement with jax.nn.dot_product_attention,
fully masked rows, transforms, memory (residual bytes, compiled temp) and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import compiled_memory, residuals
from cannjax.ops import attention
from cannjax.testing import check_op
from tests import _rng as rand
from tests._half_attention import errors_in_eps, float32_shapes
from tests._ops import cast, op_configs

SPEC = registry()["attention"]
CONFIGS = op_configs("attention")
FAST64 = {"-causal=True-block_q=2-block_k=3"}  # the default config's float64: extended


def _qkv(B=2, T=5, S=7, N=4, K=2, H=3, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = rand.normal(ks[0], (B, T, N, H), dtype)
    k = rand.normal(ks[1], (B, S, K, H), dtype)
    v = rand.normal(ks[2], (B, S, K, H), dtype)
    return q, k, v


def _random_params():
    out = []
    for dtype in ("float32", "float64"):
        for p in CONFIGS:
            name, cfg = p.values
            # make test: the default config, and FAST64's in float64; the rest runs in
            # make test-extended (CI).
            config = p.id[len(name) :]
            slow = config not in FAST64 or (dtype == "float32" and config)
            marks = (pytest.mark.extended,) if slow else ()
            out.append(pytest.param(dtype, name, cfg, id=f"{dtype}-{p.id}", marks=marks))
    return out


@pytest.mark.parametrize("dtype,name,cfg", _random_params())
def test_check_op_random_points(dtype, name, cfg):
    with jax.enable_x64(dtype == "float64"):
        check_op(name, *cast(SPEC.sample(jax.random.key(0)), dtype), **cfg)


# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
@pytest.mark.parametrize("index", range(len(SPEC.edges())))
def test_check_op_edge_points(dtype, index):
    case = SPEC.edges()[index]
    with jax.enable_x64(dtype == "float64"):
        check_op("attention", *cast(case.args, dtype), **case.check_kwargs())


def test_reference_is_jax_dot_product_attention():
    q, k, v = _qkv(T=6, S=6)
    mask = (
        jax.random.bernoulli(jax.random.key(1), 0.7, (2, 4, 6, 6))
        | jnp.eye(6, dtype=bool)[None, None]
    )
    for kw in ({}, {"causal": True}, {"mask": mask}):
        jmask = kw.get("mask")
        want = jax.nn.dot_product_attention(q, k, v, mask=jmask, is_causal=kw.get("causal", False))
        np.testing.assert_allclose(SPEC.reference(q, k, v, **kw), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------- against jax.nn directly
@pytest.mark.parametrize(
    "shape,causal,blocks",
    [
        ((2, 33, 33, 4, 1, 8), True, (8, 16)),  # MQA, blocks not dividing T
        ((1, 20, 29, 6, 3, 4), False, (7, 5)),  # GQA, T != S, padded keys
        ((1, 24, 24, 2, 2, 16), True, (None, None)),  # one block (defaults exceed T)
    ],
)
def test_matches_jax_dot_product_attention(shape, causal, blocks):
    B, T, S, N, K, H = shape
    q, k, v = _qkv(B, T, S, N, K, H)
    mask = jax.random.bernoulli(jax.random.key(3), 0.8, (B, 1, T, S)).at[..., 0].set(True)
    kw = dict(block_q=blocks[0], block_k=blocks[1])

    def ours(q, k, v):
        return attention(q, k, v, causal=causal, mask=mask, **kw)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    np.testing.assert_allclose(ours(q, k, v), ref(q, k, v), rtol=1e-5, atol=2e-6)
    w = rand.normal(jax.random.key(4), q.shape)
    g = jax.grad(lambda *a: jnp.vdot(ours(*a), w), (0, 1, 2))(q, k, v)
    gr = jax.grad(lambda *a: jnp.vdot(ref(*a), w), (0, 1, 2))(q, k, v)
    for a, b in zip(g, gr):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5)


def test_default_scale_and_explicit_scale():
    q, k, v = _qkv()
    want = jax.nn.dot_product_attention(q, k, v, scale=0.3)
    np.testing.assert_allclose(attention(q, k, v, scale=0.3), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        attention(q, k, v), attention(q, k, v, scale=1 / np.sqrt(3)), rtol=1e-6
    )


# ------------------------------------------------------------- edge conventions
@pytest.mark.parametrize("blocks", [(2, 3), (None, None)])
def test_fully_masked_rows_give_zero_output_and_gradient(blocks):
    q, k, v = _qkv()
    mask = jnp.ones((2, 4, 5, 7), bool).at[0, 1, 2].set(False).at[1, :, 4].set(False)
    kw = dict(mask=mask, block_q=blocks[0], block_k=blocks[1])
    out = attention(q, k, v, **kw)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0, 2, 1], 0.0)
    np.testing.assert_array_equal(out[1, 4], 0.0)
    gq, gk, gv = jax.grad(lambda *a: attention(*a, **kw).sum(), (0, 1, 2))(q, k, v)
    assert all(np.isfinite(g).all() for g in (gq, gk, gv))
    np.testing.assert_array_equal(gq[0, 2, 1], 0.0)
    np.testing.assert_array_equal(gq[1, 4], 0.0)
    # The other rows are untouched: same as attention on the rows alone.
    np.testing.assert_allclose(out[0, 2, 0], attention(q, k, v)[0, 2, 0], rtol=1e-5, atol=1e-6)
    _, t = jax.jvp(lambda *a: attention(*a, **kw), (q, k, v), _qkv(seed=5))
    assert np.isfinite(t).all()
    np.testing.assert_array_equal(t[1, 4], 0.0)


def test_all_masked_is_zero_not_nan():
    q, k, v = _qkv()
    mask = jnp.zeros((5, 7), bool)
    np.testing.assert_array_equal(attention(q, k, v, mask=mask), 0.0)
    g = jax.grad(lambda q: attention(q, k, v, mask=mask).sum())(q)
    np.testing.assert_array_equal(g, 0.0)


def test_huge_logits_do_not_overflow():
    q, k, v = _qkv(T=8, S=8)
    q = q * 1e3  # logits ~1e3: exp overflows without the running max
    out = attention(q, k, v, causal=True, block_q=4, block_k=4)
    np.testing.assert_allclose(out, SPEC.reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        q64, k64, v64 = (a.astype(jnp.float64) for a in (q, k, v))

        def loss(f):
            return lambda *a: jnp.sum(jnp.sin(f(*a, causal=True)))

        got = jax.grad(loss(lambda *a, **kw: attention(*a, block_q=4, block_k=4, **kw)), (0, 1))(
            q64, k64, v64
        )
        want = jax.grad(loss(SPEC.reference), (0, 1))(q64, k64, v64)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("magnitude", [1e9, 1e18])
@pytest.mark.parametrize("causal", [False, True])
def test_logits_near_the_float32_range_match_jax_nn(magnitude, causal):
    # float32 logits of ~1e9 (1e18: ~1e19) have ulps of hundreds: the row maximum and the
    # exponent must read the same rounded logits, or whole rows come out NaN or 0 (84 of
    # 256 rows did before the scale moved onto the queries).
    q, k, v = _qkv(B=1, T=256, S=256, N=1, K=1, H=128, seed=3)
    q = q * magnitude
    out = attention(q, k, v, causal=causal)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    assert bool(jnp.isfinite(out).all()) and bool((jnp.abs(out).sum(-1) > 0).all())
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)

    w = jnp.sin(jnp.arange(128.0)).reshape(1, 1, 1, 128)  # a cotangent not constant over H

    def loss(f, **kw):
        return lambda *a: jnp.sum(f(*a, **kw) * w)

    got = jax.grad(loss(attention, causal=causal), (0, 1, 2))(q, k, v)
    with jax.enable_x64(True):
        wide = [a.astype(jnp.float64) for a in (q, k, v)]
        ref = jax.grad(loss(jax.nn.dot_product_attention, is_causal=causal), (0, 1, 2))(*wide)
    # The softmax is one-hot here, so dq = dk = 0 exactly; FlashAttention's D = rowsum(dO*O)
    # leaves float32 rounding of dP = dO v^T (|dO| |v| sqrt(H)) in dS, times |k| in dq and
    # |q| in dk: nothing more. dv is the one-hot P^T dO, to float32 accuracy.
    rounding = 2e-7 * float(jnp.abs(w).max() * jnp.abs(v).max()) * 128**0.5
    for g, want, other in ((got[0], ref[0], k), (got[1], ref[1], q)):
        assert bool(jnp.isfinite(g).all())
        np.testing.assert_allclose(g, want, atol=rounding * float(jnp.abs(other).max()))
    np.testing.assert_allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "q_shape,k_shape",
    [
        ((0, 4, 2, 8), (0, 6, 1, 8)),  # no batch row
        ((2, 0, 2, 8), (2, 6, 1, 8)),  # no query
        ((2, 4, 2, 8), (2, 0, 1, 8)),  # no key: every row has nothing to attend
        ((2, 4, 2, 0), (2, 6, 1, 0)),  # no head dimension
        ((2, 4, 0, 8), (2, 6, 1, 8)),  # no query head
    ],
)
@pytest.mark.filterwarnings("ignore:divide by zero")  # jax.nn's default scale at H = 0
def test_empty_inputs_give_jax_nn_shapes(q_shape, k_shape):
    q, k, v = jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(k_shape)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    for f in (attention, jax.jit(attention, static_argnames="causal")):
        out = f(q, k, v, causal=True)
        assert out.shape == want.shape and out.dtype == want.dtype
        np.testing.assert_array_equal(out, 0.0)
    grads = jax.grad(lambda *a: attention(*a).sum(), (0, 1, 2))(q, k, v)
    assert [g.shape for g in grads] == [q_shape, k_shape, k_shape]
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)
    assert jax.vmap(attention)(q[None], k[None], v[None]).shape == (1,) + q_shape


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision(dtype):
    q, k, v = _qkv(T=16, S=16)
    q16, k16, v16 = (a.astype(dtype) for a in (q, k, v))
    out = attention(q16, k16, v16, causal=True, block_q=4, block_k=8)
    assert out.dtype == jnp.dtype(dtype)
    want = SPEC.reference(q, k, v, causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=5e-2, atol=5e-2)
    g = jax.grad(lambda q: attention(q, k16, v16, causal=True).astype(jnp.float32).sum())(q16)
    assert g.dtype == jnp.dtype(dtype) and np.isfinite(g.astype(jnp.float32)).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_gradients_where_keys_and_values_share_a_mean(dtype):
    # D = rowsum(dO * O) from the rounded output errs by an ulp of the values' mean,
    # which dP - D cancels: dq was 47 eps from the exact gradient (relative, in both half
    # dtypes), dk 1.4 and the tangent 3.5. D from round(O - mean_j v) (_softmax_finish)
    # leaves dq 1.8 eps (dS rounded for the fast product, times the keys' mean) and the
    # others 0.3.
    errs, err_t = errors_in_eps(lambda q, k, v: attention(q, k, v, causal=True), dtype)
    assert errs[0] <= 3 and max(errs[1:]) <= 1 and err_t <= 1, (errs, err_t)


@pytest.mark.parametrize("rule", ["forward", "tangent"])
def test_half_precision_loops_hold_no_float32_copy_of_the_operands(rule):
    # XLA:CPU's float normalization runs a bfloat16 transpose or dynamic-slice in
    # float32: the loops held float32 copies of k and v ([B, K, S, H]) and of q (18 such
    # arrays in the forward, 34 in the tangent) until the operands were read as uint16
    # bits (cannjax/_src/core/half_bits.py). Neither rule accumulates anything of that shape.
    B, T, N, K, H = 2, 32, 4, 2, 8
    q = jnp.ones((B, T, N, H), jnp.bfloat16)
    k = jnp.ones((B, T, K, H), jnp.bfloat16)

    def att(q, k, v):
        return attention(q, k, v, causal=True, block_q=8, block_k=8)

    assert float32_shapes(att, rule, q, k, [(B, T, N, H), (B, K, T, H)]) == []


# ------------------------------------------------------------- transforms
def _ref(q, k, v):
    return SPEC.reference(q, k, v, causal=True)


def _ours(q, k, v):
    return attention(q, k, v, causal=True, block_q=2, block_k=3)


def test_jit_vmap_and_jvp():
    q, k, v = _qkv()
    np.testing.assert_allclose(jax.jit(_ours)(q, k, v), _ref(q, k, v), rtol=1e-5, atol=1e-6)
    qs, ks, vs = (jnp.stack([a, 2 * a]) for a in (q, k, v))
    np.testing.assert_allclose(
        jax.vmap(_ours)(qs, ks, vs), jax.vmap(_ref)(qs, ks, vs), rtol=1e-5, atol=1e-6
    )
    # vmap with an unbatched k, v (in_axes=None): cotangents summed over the batch.
    gk = jax.grad(lambda k: jax.vmap(_ours, (0, None, None))(qs, k, v).sum())(k)
    gk_ref = jax.grad(lambda k: jax.vmap(_ref, (0, None, None))(qs, k, v).sum())(k)
    np.testing.assert_allclose(gk, gk_ref, rtol=1e-4, atol=1e-5)
    t = _qkv(seed=9)
    _, jo = jax.jvp(_ours, (q, k, v), t)
    _, jr = jax.jvp(_ref, (q, k, v), t)
    np.testing.assert_allclose(jo, jr, rtol=1e-4, atol=1e-5)


@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_hessian_vector_products():
    with jax.enable_x64(True):
        q, k, v = _qkv(B=1, T=4, S=5, N=2, K=1, H=3, dtype=jnp.float64)
        t = _qkv(B=1, T=4, S=5, N=2, K=1, H=3, seed=3, dtype=jnp.float64)

        def hvp(f):
            loss = lambda *a: jnp.sum(jnp.tanh(f(*a)))  # noqa: E731
            return jax.jvp(jax.grad(loss, (0, 1, 2)), (q, k, v), t)[1]

        for a, b in zip(hvp(_ours), hvp(_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
        # reverse over reverse
        loss = lambda f: lambda q: jnp.sum(jnp.tanh(f(q, k, v)))  # noqa: E731
        h = jax.jacrev(jax.jacrev(loss(_ours)))(q)
        h_ref = jax.jacrev(jax.jacrev(loss(_ref)))(q)
        np.testing.assert_allclose(h, h_ref, rtol=1e-8, atol=1e-10)


def test_scan_and_checkpoint():
    q, k, v = _qkv(B=1, T=6, S=6, N=2, K=2, H=4)
    ws = rand.normal(jax.random.key(2), (3, 4, 4)) * 0.5

    def net(f, remat):
        def layer(x, w):
            y = f(x @ w, x, x)
            return (jax.checkpoint(lambda x: x + y)(x) if remat else x + y), None

        return lambda q, ws: jnp.sum(jax.lax.scan(layer, q, ws)[0] ** 2)

    for remat in (False, True):
        go = jax.grad(net(_ours, remat), (0, 1))(q, ws)
        gr = jax.grad(net(_ref, remat), (0, 1))(q, ws)
        for a, b in zip(go, gr):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    go = jax.grad(lambda q: jax.checkpoint(_ours)(q, k, v).sum())(q)
    gr = jax.grad(lambda q: _ref(q, k, v).sum())(q)
    np.testing.assert_allclose(go, gr, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------- what the backward keeps
def _big(T, N=8, H=64):
    return _qkv(B=1, T=T, S=T, N=N, K=N, H=H)


def _loss_ours(q, k, v):
    return attention(q, k, v, causal=True).sum()


def _loss_plain(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla").sum()


def test_residuals_are_inputs_output_and_lse_only():
    q, k, v = _big(256)
    report = residuals(_loss_ours, q, k, v)
    # q, k, v are the op's own inputs, kept unnamed (docs/design.md), as given; the mask
    # is a broadcast boolean of one element here; everything computed is named.
    named = sorted(r.source.split("'")[1] for r in report.rows if r.op)
    assert named == ["cannjax.attention.lse", "cannjax.attention.out"], str(report)
    args = sorted(r.source for r in report.rows if r.source.startswith("from the argument"))
    assert args == ["from the argument k", "from the argument q", "from the argument v"]
    unnamed = [r for r in report.rows if r.op is None]
    unnamed = [r for r in unnamed if not r.source.startswith("from the arg")]
    assert sum(r.nbytes for r in unnamed) < 2**10, str(report)
    T = q.shape[1]
    assert all(r.shape.count(T) <= 1 for r in report.rows), str(report)  # nothing T x S


def test_residual_bytes_at_1024_are_under_an_eighth_of_plain():
    q, k, v = _big(1024)
    ours = residuals(_loss_ours, q, k, v).total_bytes
    plain = residuals(_loss_plain, q, k, v).total_bytes
    # q, k, v, out: 4 x 2 MiB; lse 32 KiB. Plain JAX also keeps the 8 x 1024^2 probabilities.
    assert ours == 4 * 1024 * 8 * 64 * 4 + 8 * 1024 * 4 + 1
    assert ours * 8 <= plain, (ours, plain)


def _temp_ratio(T):
    q, k, v = _big(T)
    ours = compiled_memory(jax.grad(_loss_ours, (0, 1, 2)), q, k, v).temp_bytes
    plain = compiled_memory(jax.grad(_loss_plain, (0, 1, 2)), q, k, v).temp_bytes
    return ours, plain


def test_gradient_temp_memory_at_2048_is_under_a_quarter_of_plain():
    ours, plain = _temp_ratio(2048)  # measured: 19 MiB against 392 MiB
    assert ours * 4 <= plain, (ours, plain)


def test_backward_accumulators_are_not_held_through_the_forward():
    # dq, dk, dv start from a zero computed from the backward's D (ops/attention.py
    # zeros_after): from plain zeros XLA:CPU made them at the top of the program, and
    # the gradient's temp was 6.0 times q's bytes here; 4.7 without.
    q = _big(2048)[0]
    ours, _ = _temp_ratio(2048)
    assert ours <= 5 * q.nbytes, (ours, q.nbytes)


def test_backward_runs_a_lone_pair_of_blocks_with_the_others(monkeypatch):
    # Causal T=256 in blocks of 128: one clean pair (keys 0-127 for queries 128-255) and
    # two on the diagonal. A loop of one pair is straight-line code to XLA, whose blocks
    # and probabilities read the forward's values only: XLA:CPU computed them in the
    # forward and held them to the backward. Run in the diagonal's loop, every unrolled
    # layer holds at least one [B, T, N, H] array less (measured: 21.5 against 27.6).
    import cannjax._src.ops.attention as A

    B, T, N, H, L = 4, 256, 4, 64, 4

    def loss(x, ws):
        for w in ws:
            q = (x @ w).reshape(B, T, N, H)
            out = attention(q, q, q, causal=True, block_q=128, block_k=128)
            x = x + out.reshape(B, T, N * H)
        return (x * x).sum()

    x = rand.normal(jax.random.key(0), (B, T, N * H)) / 4
    ws = [jnp.eye(N * H) + 0.01 * i for i in range(L)]

    def temp_and_grads():
        g = jax.jit(jax.grad(loss, (0, 1)))
        return g.lower(x, ws).compile().memory_analysis().temp_size_in_bytes, g(x, ws)

    merged, want = temp_and_grads()
    scan_pairs = A._Ctx.scan_pairs
    monkeypatch.setattr(
        A._Ctx, "scan_pairs", lambda c, *a, one_loop=False, **k: scan_pairs(c, *a, **k)
    )
    apart, got = temp_and_grads()
    assert merged <= apart - L * x.nbytes, (merged, apart)
    largest = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * largest)


@pytest.mark.slow
@pytest.mark.parametrize("T", [4096, 8192])
def test_gradient_temp_memory_long_sequences(T):
    ours, plain = _temp_ratio(T)
    assert ours * 4 <= plain, (ours, plain)
    # Ours grows like T (accumulators of T x N x H), plain like T^2.
    assert ours < T * 8 * 64 * 4 * 16, ours


# ------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape,match",
    [
        ((1, 4, 2, 8), (1, 4, 2, 6), (1, 4, 2, 6), r"same head dimension H.*\(1, 4, 2, 8\)"),
        ((1, 4, 6, 8), (1, 4, 4, 8), (1, 4, 4, 8), r"K=4 must divide .* N=6"),
        ((1, 4, 2, 8), (2, 4, 2, 8), (2, 4, 2, 8), r"same batch size"),
        ((1, 4, 2, 8), (1, 4, 2, 8), (1, 5, 2, 8), r"k and v must have the same shape"),
        ((4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8), r"q must have rank 4 \(\[B, T, N, H\]\)"),
    ],
)
def test_bad_shapes(q_shape, k_shape, v_shape, match):
    q, k, v = jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape)
    with pytest.raises(ValueError, match=r"cannjax\.ops\.attention: .*" + match):
        attention(q, k, v)


def test_bad_mask():
    q, k, v = _qkv()  # B=2, T=5, S=7, N=4
    with pytest.raises(ValueError, match=r"mask of shape \(3, 7\) does not broadcast to"):
        attention(q, k, v, mask=jnp.ones((3, 7), bool))
    with pytest.raises(ValueError, match=r"mask must be broadcastable .*rank 5"):
        attention(q, k, v, mask=jnp.ones((1, 1, 1, 5, 7), bool))
    with pytest.raises(TypeError, match=r"mask must be a boolean array .* float32\[5, 7\]"):
        attention(q, k, v, mask=jnp.ones((5, 7)))


def test_bad_dtypes_and_options():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"cannjax\.ops\.attention: q must be a floating-point"):
        attention(jnp.ones((2, 5, 4, 3), jnp.int32), k, v)
    with pytest.raises(TypeError, match=r"same dtype, got float32, bfloat16, float32"):
        attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match=r"causal must be a bool"):
        attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match=r"scale must be a Python float"):
        attention(q, k, v, scale=jnp.float32(0.5) * jnp.ones(()))
    with pytest.raises(ValueError, match=r"block_q must be >= 1, got 0"):
        attention(q, k, v, block_q=0)
    with pytest.raises(TypeError, match=r"block_k must be an int or None"):
        attention(q, k, v, block_k=2.0)


def test_registered_and_exported():
    assert cannjax.ops.attention is registry()["attention"].fn
    assert cannjax.ops.attention_block_sizes("cpu") == (128, 128)
