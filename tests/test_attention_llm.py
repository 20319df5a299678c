"""cannjax.ops.attention's LLM arguments (issue 23): logit_cap, window, bias, segment_ids.

Parity with jax.nn.dot_product_attention (bias, mask, is_causal, scale,
local_window_size, grouped-query heads) and with the plain-jnp forms of soft-capping and
segment ids; the bias's gradient (broadcast dimensions, finite differences, second
order); block pairs skipped (counted for windows, proven by NaN keys for windows and
segments); compiled memory against plain JAX; transforms; jax.export; bad input.
check_op runs at the new configs and edge points through tests/test_attention.py and
`cannjax ops attention`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.test_util import check_grads

from cannjax._src.core import partitioned
from cannjax.core import registry
from cannjax.inspect import compiled_memory
from cannjax.ops import attention
from tests import _rng as rand

REF = registry()["attention"].reference


def _qkv(B=2, T=6, S=6, N=4, K=2, H=4, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 3)
    q = rand.normal(ks[0], (B, T, N, H), dtype)
    k = rand.normal(ks[1], (B, S, K, H), dtype)
    v = rand.normal(ks[2], (B, S, K, H), dtype)
    return q, k, v


def _close(a, b, rtol=1e-5, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(f, args, w):
    """``f(*args)`` and the gradient of ``<f(*args), w>`` with respect to every arg (one
    compiled program: the forward and the backward together)."""
    out, pull = jax.vjp(f, *args)
    return out, pull(w)


# ------------------------------------------------------------- jax.nn.dot_product_attention
@pytest.mark.parametrize(
    "shape,kw,blocks",
    [
        # GQA, bias per head, boolean mask, causal, explicit scale, window as an int.
        ((2, 7, 7, 4, 2, 4), {"bias": (1, 4, 7, 7), "mask": True, "causal": True,
                              "scale": 0.4, "window": 2}, (3, 4)),
        # T != S, two-sided window, a bias shared by the heads (broadcast over N).
        pytest.param(
            (1, 9, 12, 4, 2, 4), {"bias": (1, 1, 9, 12), "window": (2, 1)}, (4, 5),
            marks=pytest.mark.extended,
        ),
        # MQA, causal sliding window, bias per batch row, one block.
        pytest.param(
            (2, 10, 10, 4, 1, 8), {"bias": (2, 1, 1, 10), "window": (3, 0), "causal": True},
            (None, None), marks=pytest.mark.extended,
        ),
    ],
)  # fmt: skip
def test_matches_jax_dot_product_attention(shape, kw, blocks):
    B, T, S, N, K, H = shape
    q, k, v = _qkv(B, T, S, N, K, H)
    bias = rand.normal(jax.random.key(1), kw["bias"])
    mask = None
    if kw.get("mask"):
        mask = jax.random.bernoulli(jax.random.key(2), 0.8, (B, 1, T, S)).at[..., 0].set(True)
    common = dict(mask=mask, scale=kw.get("scale"))

    def ours(q, k, v, b):
        return attention(
            q, k, v, bias=b, causal=kw.get("causal", False), window=kw.get("window"),
            block_q=blocks[0], block_k=blocks[1], **common,
        )  # fmt: skip

    def theirs(q, k, v, b):
        return jax.nn.dot_product_attention(
            q, k, v, bias=b, is_causal=kw.get("causal", False),
            local_window_size=kw.get("window"), **common,
        )  # fmt: skip

    w = rand.normal(jax.random.key(3), q.shape)
    got = _value_and_grads(ours, (q, k, v, bias), w)
    want = _value_and_grads(theirs, (q, k, v, bias), w)
    _close(got[0], want[0])
    _close(got[1], want[1], rtol=1e-4, atol=2e-5)  # q, k, v and bias


def test_rows_with_nothing_to_attend_differ_from_jax_on_purpose():
    # window (0, 0) keeps only key t; the mask hides it from query 2, and a -inf bias
    # hides every key of query 4. There jax gives the mean of v; cannjax 0 (gradient 0).
    q, k, v = _qkv(B=1, T=6, S=6)
    mask = jnp.ones((6, 6), bool).at[2, 2].set(False)
    bias = jnp.zeros((1, 1, 6, 6)).at[..., 4, :].set(-jnp.inf)
    kw = dict(mask=mask, bias=bias)
    ours = attention(q, k, v, window=(0, 0), block_q=4, block_k=4, **kw)
    theirs = jax.jit(jax.nn.dot_product_attention, static_argnames="local_window_size")(
        q, k, v, local_window_size=(0, 0), **kw
    )
    empty = np.zeros(6, bool)
    empty[[2, 4]] = True
    np.testing.assert_array_equal(ours[:, empty], 0.0)
    assert not np.allclose(theirs[:, empty], 0.0)  # the mean of v
    _close(ours[:, ~empty], theirs[:, ~empty])
    gq, gb = jax.grad(
        lambda q, b: attention(q, k, v, window=(0, 0), mask=mask, bias=b).sum(), (0, 1)
    )(q, bias)
    assert np.isfinite(gq).all() and np.isfinite(gb).all()
    np.testing.assert_array_equal(gq[:, empty], 0.0)
    np.testing.assert_array_equal(gb[..., 4, :], 0.0)


# ------------------------------------------------------------- soft cap and segments, written out
def _plain(q, k, v, *, cap=None, bias=None, attend=None, scale=None):
    """Grouped-query attention with the cap and the mask written out in jnp."""
    G = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * (scale or 1 / np.sqrt(q.shape[-1]))
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    if bias is not None:
        s = s + bias
    if attend is not None:
        s = jnp.where(attend, s, -jnp.inf)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


def test_soft_cap_matches_tanh_written_out():
    q, k, v = _qkv(T=7, S=7)
    q = q * 4.0  # logits up to ~30: the cap of 5 bends them
    bias = rand.normal(jax.random.key(4), (1, 4, 7, 7))
    causal = jnp.tril(jnp.ones((7, 7), bool))
    w = rand.normal(jax.random.key(5), q.shape)

    def ours(q, k, v, b):
        return attention(q, k, v, logit_cap=5.0, bias=b, causal=True, block_q=3, block_k=2)

    def plain(q, k, v, b):
        return _plain(q, k, v, cap=5.0, bias=b, attend=causal)

    got = _value_and_grads(ours, (q, k, v, bias), w)
    want = _value_and_grads(plain, (q, k, v, bias), w)
    _close(got[0], want[0])
    _close(got[1], want[1], rtol=1e-4, atol=2e-5)
    # The cap binds: without it the values differ.
    assert not np.allclose(attention(q, k, v, causal=True), got[0], atol=1e-2)


@pytest.mark.parametrize("pair", [False, True])
def test_segment_ids_match_equality_mask_written_out(pair):
    B, T = 2, 9
    q, k, v = _qkv(B=B, T=T, S=T)
    ids = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 3]])
    kv_ids = ids.at[1, 8].set(4) if pair else ids  # query 8 of row 1 then meets no key
    seg = (ids, kv_ids) if pair else ids
    same = (ids[:, :, None] == kv_ids[:, None, :])[:, None]
    attend = same & jnp.tril(jnp.ones((T, T), bool))[None, None]
    w = rand.normal(jax.random.key(6), q.shape)

    def ours(q, k, v):
        return attention(q, k, v, segment_ids=seg, causal=True, block_q=2, block_k=3)

    got = _value_and_grads(ours, (q, k, v), w)
    want = _value_and_grads(lambda *a: _plain(*a, attend=attend), (q, k, v), w)
    if pair:  # the row with no key: 0 here, NaN in the written-out form
        np.testing.assert_array_equal(got[0][1, 8], 0.0)
        np.testing.assert_array_equal(got[1][0][1, 8], 0.0)
        keep = np.ones((B, T), bool)
        keep[1, 8] = False
        _close(got[0][keep], want[0][keep])
    else:
        _close(got, want, rtol=1e-4, atol=2e-5)
        # jax.nn with the same equality mask agrees too.
        theirs = jax.jit(jax.nn.dot_product_attention, static_argnames="is_causal")
        _close(got[0], theirs(q, k, v, mask=attend, is_causal=True))


# ------------------------------------------------------------- the bias's gradient
@pytest.mark.parametrize(
    "bshape",
    [(7, 9)] + [pytest.param(s, marks=pytest.mark.extended) for s in ((1, 4, 1, 9), (2, 1, 7, 1))],
)
def test_bias_gradient_sums_over_broadcast_dimensions(bshape):
    q, k, v = _qkv(T=7, S=9)
    bias = rand.normal(jax.random.key(7), bshape)

    def loss(f):
        return lambda b: jnp.sum(jnp.sin(f(q, k, v, bias=b, window=(3, 2), logit_cap=2.0)))

    t = rand.normal(jax.random.key(8), bshape)

    @functools.partial(jax.jit, static_argnums=0)
    def grad_and_tangent(f):
        return jax.grad(loss(f))(bias), jax.jvp(loss(f), (bias,), (t,))[1]

    g, tangent = grad_and_tangent(lambda *a, **kw: attention(*a, block_q=3, block_k=4, **kw))
    assert g.shape == bshape
    _close((g, tangent), grad_and_tangent(REF), rtol=1e-4, atol=1e-5)


@pytest.mark.extended
def test_finite_differences_and_second_order_with_every_argument():
    # jax's own check_grads (float64 central differences, both modes, order 2) with the
    # bias as a differentiated argument, under cap, window, segments and a mask.
    with jax.enable_x64(True):
        q, k, v = _qkv(B=1, T=5, S=5, N=2, K=1, H=3, dtype=jnp.float64)
        bias = rand.normal(jax.random.key(9), (1, 2, 5, 5), jnp.float64)
        ids = jnp.array([[0, 0, 1, 1, 1]])
        mask = jnp.ones((5, 5), bool).at[4, 2].set(False)

        def f(q, k, v, b):
            return attention(
                q, k, v, bias=b, mask=mask, segment_ids=ids, logit_cap=1.5, window=(2, 1),
                block_q=2, block_k=2,
            )  # fmt: skip

        check_grads(f, (q, k, v, bias), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------- what is skipped
def _scan_lengths(f, *args):
    """Trip counts of the scans in ``f``'s jaxpr (the backward's scans over block pairs)."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                found.append(e.params["length"])
            if e.primitive.name == "cannjax_row_local":  # the kernel, traced when lowered
                kernel = functools.partial(partitioned._whole, e.params["local"])
                walk(jax.make_jaxpr(kernel)(*(v.aval for v in e.invars)).jaxpr)
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(f)(*args).jaxpr)
    return found


def test_window_visits_only_pairs_inside_it():
    # T = 4096 with 128 x 128 blocks: causal visits 528 of the 32 x 32 pairs; a causal
    # window (512, 0) visits 5 per query block (fewer at the start): 150, 0.28 of causal.
    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.float32)

    def pairs(**kw):
        grad = jax.grad(lambda q, k, v: attention(q, k, v, **kw).sum(), (0, 1, 2))
        return sum(_scan_lengths(grad, q, kv, kv))

    causal, windowed = pairs(causal=True), pairs(causal=True, window=(512, 0))
    assert (causal, windowed) == (528, 150)
    assert windowed <= 0.35 * causal
    assert pairs(window=(512, 0)) == 150  # the same pairs: right = 0 is causal
    assert pairs(window=(256, 256)) == 32 * 5 - 6  # 2 blocks each side, less the ends


def _nan_keys(v, keys):
    return v.at[:, keys].set(jnp.nan)


def test_skipped_pairs_are_never_read():
    # A NaN value in a key that a query cannot attend reaches the query's output when
    # the pair holding both is visited (0 * NaN in P V), not when it is skipped. Keys
    # 4..7 are outside every window of queries 0..1 and in another segment.
    q, k, v = _qkv(B=1, T=8, S=8)
    v = _nan_keys(v, slice(4, 8))
    kw = dict(block_q=2, block_k=2)
    ids = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]])
    win = attention(q, k, v, window=(1, 1), **kw)
    seg = attention(q, k, v, segment_ids=ids, **kw)
    assert np.isfinite(win[:, :2]).all() and np.isfinite(seg[:, :4]).all()
    # The same masks given densely visit every pair: NaN leaks (the check can fail).
    rows, cols = jnp.arange(8)[:, None], jnp.arange(8)[None, :]
    dense = attention(q, k, v, mask=(cols >= rows - 1) & (cols <= rows + 1), **kw)
    assert not np.isfinite(dense[:, :2]).all()
    # The backward skips them too: the NaN cotangents of queries 4..7 (0 * NaN) reach
    # neither the queries nor the keys 0..3 of the other segment.
    gq, gk = jax.grad(lambda q, k: attention(q, k, v, segment_ids=ids, **kw)[:, :4].sum(), (0, 1))(
        q, k
    )
    assert np.isfinite(gq[:, :4]).all() and np.isfinite(gk[:, :4]).all()
    assert not np.isfinite(gq[:, 4:]).all()  # the NaN is there to leak


# ------------------------------------------------------------- memory
def test_bias_not_differentiated_costs_no_gradient_accumulator():
    # The bias's cotangent accumulator ([1, N, T, S] float32, 4 MiB here) is dead code
    # when the bias is a constant: the compiled temp equals that without a bias.
    q = jax.ShapeDtypeStruct((2, 512, 4, 16), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 512, 2, 16), jnp.float32)
    b = jax.ShapeDtypeStruct((1, 4, 512, 512), jnp.float32)

    def loss(q, k, v, b=None):
        return attention(q, k, v, bias=b, causal=True).sum()

    none = compiled_memory(jax.grad(loss, (0, 1, 2)), q, kv, kv).temp_bytes
    const = compiled_memory(jax.grad(loss, (0, 1, 2)), q, kv, kv, b).temp_bytes
    assert const <= none + 2**10, (const, none)
    # Differentiated, the gradient (4 MiB) is an output of the program.
    diff = compiled_memory(jax.grad(loss, (0, 1, 2, 3)), q, kv, kv, b)
    assert diff.output_bytes >= 4 * 512 * 512 * 4


def test_gqa_capped_window_gradient_temp_is_under_a_sixteenth_of_plain():
    # H=8 query heads, 2 kv heads, d=64, T=4096 (compile only). Measured: 30.6 MiB
    # against 2,072 MiB for plain JAX (1/68); at T=2048 16.4 MiB against 524 MiB (1/32).
    T, cap, left = 4096, 30.0, 512
    q = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)

    def ours(q, k, v):
        return attention(q, k, v, causal=True, logit_cap=cap, window=(left, 0)).sum()

    def plain(q, k, v):
        rows, cols = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        attend = (cols <= rows) & (cols >= rows - left)
        return _plain(q, k, v, cap=cap, attend=attend).sum()

    got = compiled_memory(jax.grad(ours, (0, 1, 2)), q, kv, kv).temp_bytes
    want = compiled_memory(jax.grad(plain, (0, 1, 2)), q, kv, kv).temp_bytes
    assert got * 16 <= want, (got, want)


# ------------------------------------------------------------- transforms
def _all_features(q, k, v, f=attention, **extra):
    ids = jnp.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    bias = jnp.linspace(-1.0, 1.0, 36).reshape(6, 6)
    kw = dict(segment_ids=ids, bias=bias, logit_cap=2.0, window=(2, 1), causal=True)
    return f(q, k, v, **kw, **extra)


def test_vmap_with_batched_segment_ids():
    # Batched segment ids under vmap: the cond becomes a select, values unchanged.
    q, k, v = _qkv()

    def per_example(q, k, v, ids):
        return attention(q[None], k[None], v[None], segment_ids=ids[None], block_q=2, block_k=2)

    ids = jnp.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    got = jax.jit(jax.vmap(per_example))(q, k, v, ids)[:, 0]
    _close(got, jax.jit(REF)(q, k, v, segment_ids=ids))


@pytest.mark.extended
def test_jit_vmap_scan_checkpoint_and_jvp():
    q, k, v = _qkv()
    ours = lambda q, k, v: _all_features(q, k, v, block_q=2, block_k=4)  # noqa: E731
    ref = lambda q, k, v: _all_features(q, k, v, f=REF)  # noqa: E731
    t = _qkv(seed=3)
    _close(jax.jit(ours)(q, k, v), ref(q, k, v))
    _close(jax.jvp(ours, (q, k, v), t)[1], jax.jvp(ref, (q, k, v), t)[1], rtol=1e-4, atol=1e-5)
    # vmap over a stack of (q, k, v): the segment ids stay unbatched (cond skips pairs).
    qs, ks, vs = (jnp.stack([a, -a]) for a in (q, k, v))
    _close(jax.vmap(ours)(qs, ks, vs), jax.vmap(ref)(qs, ks, vs))
    # scan over layers with checkpoint, gradients of q and the weights.
    ws = rand.normal(jax.random.key(2), (2, 4, 4)) * 0.5

    def net(f):
        def layer(x, w):
            y = jax.checkpoint(lambda x: f(x @ w, k, v))(x)
            return x + y, None

        return lambda q, ws: jnp.sum(jax.lax.scan(layer, q, ws)[0] ** 2)

    _close(jax.grad(net(ours), (0, 1))(q, ws), jax.grad(net(ref), (0, 1))(q, ws), 1e-4, 1e-4)


@pytest.mark.extended  # window and cap export through tests/test_export.py's configs
def test_symbolic_export_with_bias_and_segment_ids():
    def fn(q, k, v, bias, ids):
        def f(q, k, v, bias):
            out = attention(
                q, k, v, bias=bias, segment_ids=ids, causal=True, window=(3, 0), logit_cap=2.0,
                block_q=2, block_k=3,
            )  # fmt: skip
            return jnp.sum(jnp.sin(out))

        return f(q, k, v, bias), jax.grad(f, (0, 1, 2, 3))(q, k, v, bias)

    scope = export.SymbolicScope()
    shapes = ["b, t, 2, 4", "b, t, 1, 4", "b, t, 1, 4", "1, 2, t, t", "b, t"]
    specs = [
        jax.ShapeDtypeStruct(export.symbolic_shape(s, scope=scope), d)
        for s, d in zip(shapes, [jnp.float32] * 4 + [jnp.int32], strict=True)
    ]
    exported = export.export(jax.jit(fn))(*specs)
    for b, t in ((1, 5), (2, 9)):
        ks = jax.random.split(jax.random.key(t), 4)
        q = rand.normal(ks[0], (b, t, 2, 4))
        k, v = (rand.normal(kk, (b, t, 1, 4)) for kk in ks[1:3])
        bias = rand.normal(ks[3], (1, 2, t, t))
        ids = jnp.sort(rand.randint(ks[3], (b, t), 0, 3), axis=1)
        _close(exported.call(q, k, v, bias, ids), jax.jit(fn)(q, k, v, bias, ids), 1e-5, 1e-5)


# ------------------------------------------------------------- bad input
_BAD = [
    ({"window": -1}, ValueError, r"window sides must be >= 0 .*got \(-1, -1\)"),
    ({"window": (2, -1)}, ValueError, r"window sides must be >= 0"),
    ({"window": (1, 2, 3)}, TypeError, r"window must be an int or a pair \(left, right\)"),
    ({"window": 2.0}, TypeError, r"window must be an int or a pair"),
    ({"window": (1.0, 2)}, TypeError, r"window must hold Python ints"),
    ({"window": True}, TypeError, r"window must be an int or a pair"),
    ({"logit_cap": 0.0}, ValueError, r"logit_cap must be a finite float > 0, got 0.0"),
    ({"logit_cap": -5.0}, ValueError, r"logit_cap must be a finite float > 0"),
    ({"logit_cap": float("inf")}, ValueError, r"logit_cap must be a finite float > 0"),
    ({"logit_cap": "50"}, TypeError, r"logit_cap must be a Python float"),
    ({"logit_cap": jnp.float32(5.0) * jnp.ones(())}, TypeError, r"logit_cap must be a Python"),
    ({"bias": np.ones((3, 7))}, ValueError, r"bias of shape \(3, 7\) does not broadcast to"),
    ({"bias": np.ones((1, 1, 1, 5, 7))}, ValueError, r"bias must be broadcastable .*rank 5"),
    ({"bias": np.ones((5, 7), np.int32)}, TypeError, r"bias must be a floating-point array"),
    ({"bias": np.ones((5, 7), bool)}, TypeError, r"bias must be a floating-point .*mask="),
    ({"segment_ids": np.zeros((2, 5), np.float32)}, TypeError, r"segment_ids must be an integer"),
    ({"segment_ids": np.zeros((2, 5), np.int32)}, ValueError, r"needs T == S, got T=5 and S=7"),
    (
        {"segment_ids": (np.zeros((2, 5), np.int32), np.zeros((2, 5), np.int32))},
        ValueError,
        r"segment_ids\[1\] \(the key/value ids\) must have shape \[B, S\] = \[2, 7\], got \(2, 5\)",
    ),
    (
        {"segment_ids": (np.zeros((1, 5), np.int32), np.zeros((2, 7), np.int32))},
        ValueError,
        r"segment_ids\[0\] \(the query ids\) must have shape \[B, T\] = \[2, 5\]",
    ),
    (
        {"segment_ids": (np.zeros((2, 5), np.int32), np.zeros((2, 7), bool))},
        TypeError,
        r"segment_ids\[1\] .* must be an integer array, got bool",
    ),
    ({"segment_ids": (np.zeros((2, 5), np.int32),)}, ValueError, r"a pair .*sequence of 1"),
]


@pytest.mark.parametrize("kw,err,match", _BAD, ids=[str(i) for i in range(len(_BAD))])
def test_bad_arguments(kw, err, match):
    q, k, v = _qkv(T=5, S=7)
    with pytest.raises(err, match=r"cannjax\.ops\.attention: .*" + match):
        attention(q, k, v, **kw)


def test_shared_segment_ids_of_wrong_shape():
    q, k, v = _qkv(T=6, S=6)
    with pytest.raises(
        ValueError, match=r"segment_ids must have shape \[B, T\] = \[2, 6\], got \(6,\)"
    ):
        attention(q, k, v, segment_ids=jnp.zeros(6, jnp.int32))
