"""cannjax.ops.linear_cross_entropy: check_op, optax agreement, ignore_index, transforms,
memory (no [N, V] residual, compiled temp of value_and_grad) and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import compiled_memory, residuals
from cannjax.ops import linear_cross_entropy
from cannjax.testing import check_op
from tests import _rng as rand
from tests._ops import cast, op_configs

SPEC = registry()["linear_cross_entropy"]
CONFIGS = op_configs("linear_cross_entropy")


def _random_params():
    # make test: the default config in both dtypes; the other configs (same rules, more
    # compiles) in make test-extended (CI).
    out = []
    for dtype in ("float32", "float64"):
        for p in CONFIGS:
            name, cfg = p.values
            marks = (pytest.mark.extended,) if cfg else ()
            out.append(pytest.param(name, cfg, dtype, id=f"{dtype}-{p.id}", marks=marks))
    return out


@pytest.mark.parametrize("name,cfg,dtype", _random_params())
def test_check_op_random_points(name, cfg, dtype):
    with jax.enable_x64(dtype == "float64"):
        check_op(name, *cast(SPEC.sample(jax.random.key(1)), dtype), **cfg)


# float32 edge points: `cannjax ops` runs check_op at each of them, under every config,
# for every operator (tests/test_cli.py::test_ops_self_check_passes_for_every_operator).
# These float64 sweeps are long: `make test-extended` (CI) runs them.
@pytest.mark.parametrize("dtype", [pytest.param("float64", marks=pytest.mark.extended)])
@pytest.mark.parametrize("index", range(len(SPEC.edges())))
def test_check_op_edge_points(dtype, index):
    case = SPEC.edges()[index]
    with jax.enable_x64(dtype == "float64"):
        check_op(SPEC.name, *cast(case.args, dtype), **case.check_kwargs())


def _data(N=37, D=8, V=19, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    x = rand.normal(ks[0], (N, D))
    w = rand.normal(ks[1], (D, V)) * 0.5
    labels = rand.randint(ks[2], (N,), 0, V)
    return x, w, labels


def _plain(x, w, labels):
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)


@pytest.mark.parametrize("chunk_size", [None, 1, 8, 10, 37, 100])
def test_matches_optax(chunk_size):
    x, w, labels = _data()
    got = linear_cross_entropy(x, w, labels, chunk_size=chunk_size)
    np.testing.assert_allclose(got, _plain(x, w, labels), rtol=1e-5, atol=1e-6)
    cot = rand.normal(jax.random.key(5), labels.shape)

    def grads(f):
        return jax.grad(lambda x, w: jnp.vdot(f(x, w, labels), cot), (0, 1))(x, w)

    ours = grads(lambda *a: linear_cross_entropy(*a, chunk_size=chunk_size))
    for a, b in zip(ours, grads(_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_leading_dimensions():
    x, w, labels = _data(N=12)
    got = linear_cross_entropy(x.reshape(3, 4, 8), w, labels.reshape(3, 4), chunk_size=5)
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got.reshape(-1), _plain(x, w, labels), rtol=1e-5, atol=1e-6)


def test_ignore_index_gives_zero_loss_and_no_gradient():
    x, w, labels = _data()
    ignored = jnp.zeros(labels.shape, bool).at[::3].set(True)
    masked = jnp.where(ignored, -100, labels)
    loss = linear_cross_entropy(x, w, masked, chunk_size=8)
    np.testing.assert_array_equal(loss[ignored], 0.0)
    np.testing.assert_allclose(loss[~ignored], _plain(x, w, labels)[~ignored], rtol=1e-5)
    gx, gw = jax.grad(lambda x, w: linear_cross_entropy(x, w, masked, chunk_size=8).sum(), (0, 1))(
        x, w
    )
    np.testing.assert_array_equal(gx[ignored], 0.0)
    keep = np.flatnonzero(~np.asarray(ignored))
    gw_kept = jax.grad(lambda w: _plain(x[keep], w, labels[keep]).sum())(w)
    np.testing.assert_allclose(gw, gw_kept, rtol=1e-4, atol=1e-5)
    # A custom ignore_index.
    custom = linear_cross_entropy(x, w, jnp.where(ignored, 7, labels), ignore_index=7)
    np.testing.assert_array_equal(custom[ignored], 0.0)


def test_large_logits_are_stable():
    x, w, labels = _data()
    x = x * 1e3  # logits ~1e3: exp overflows without the max shift
    got = linear_cross_entropy(x, w, labels, chunk_size=8)
    np.testing.assert_allclose(got, _plain(x, w, labels), rtol=1e-5)
    g = jax.grad(lambda w: linear_cross_entropy(x, w, labels).sum())(w)
    assert np.isfinite(g).all()


def test_bfloat16_and_mixed_dtypes():
    x, w, labels = _data()
    got = linear_cross_entropy(x.astype(jnp.bfloat16), w, labels)  # promoted to float32
    assert got.dtype == jnp.float32
    got16 = linear_cross_entropy(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), labels)
    assert got16.dtype == jnp.bfloat16
    np.testing.assert_allclose(got16.astype(jnp.float32), _plain(x, w, labels), rtol=5e-2)


# ------------------------------------------------------------- transforms
def _ours(x, w, labels):
    return linear_cross_entropy(x, w, labels, chunk_size=4)


def test_jit_vmap_jvp():
    x, w, labels = _data(N=10)
    np.testing.assert_allclose(jax.jit(_ours)(x, w, labels), _plain(x, w, labels), rtol=1e-5)
    xs, ls = jnp.stack([x, -x]), jnp.stack([labels, labels[::-1]])
    np.testing.assert_allclose(
        jax.vmap(_ours, (0, None, 0))(xs, w, ls),
        jax.vmap(_plain, (0, None, 0))(xs, w, ls),
        rtol=1e-5,
    )
    gw = jax.grad(lambda w: jax.vmap(_ours, (0, None, 0))(xs, w, ls).sum())(w)
    gw_ref = jax.grad(lambda w: jax.vmap(_plain, (0, None, 0))(xs, w, ls).sum())(w)
    np.testing.assert_allclose(gw, gw_ref, rtol=1e-4, atol=1e-5)
    tx, tw = rand.normal(jax.random.key(2), x.shape), jnp.cos(w)
    _, jo = jax.jvp(lambda x, w: _ours(x, w, labels), (x, w), (tx, tw))
    _, jr = jax.jvp(lambda x, w: _plain(x, w, labels), (x, w), (tx, tw))
    np.testing.assert_allclose(jo, jr, rtol=1e-4, atol=1e-5)


def test_hessian_vector_products():
    with jax.enable_x64(True):
        x, w, labels = (a.astype(jnp.float64) if a.dtype.kind == "f" else a for a in _data(N=6))
        t = (jnp.sin(x), jnp.cos(w))

        def hvp(f):
            g = jax.grad(lambda x, w: jnp.sum(f(x, w, labels) ** 2), (0, 1))
            return jax.jvp(g, (x, w), t)[1]

        for a, b in zip(hvp(_ours), hvp(_plain)):
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
        h = jax.hessian(lambda w: _ours(x, w, labels).sum())(w)
        h_ref = jax.hessian(lambda w: _plain(x, w, labels).sum())(w)
        np.testing.assert_allclose(h, h_ref, rtol=1e-8, atol=1e-10)


def test_scan_and_checkpoint():
    x, w, labels = _data(N=10)
    ws = jnp.stack([w, 0.5 * w, -w])

    def total(f):
        def step(c, w):
            return c + jax.checkpoint(f)(x, w, labels).sum(), None

        return lambda ws: jax.lax.scan(step, 0.0, ws)[0]

    np.testing.assert_allclose(
        jax.grad(total(_ours))(ws), jax.grad(total(_plain))(ws), rtol=1e-4, atol=1e-5
    )


# ------------------------------------------------------------- reduction
@pytest.mark.parametrize("chunk_size", [None, 1, 10])
def test_reductions_match_optax_sum_and_mean_over_rows_not_ignored(chunk_size):
    x, w, labels = _data()
    labels = labels.at[::4].set(-100)
    per_row = jnp.where(labels >= 0, _plain(x, w, jnp.maximum(labels, 0)), 0.0)
    expected = {"sum": per_row.sum(), "mean": per_row.sum() / (labels >= 0).sum()}
    for reduction, want in expected.items():

        def ours(x, w, reduction=reduction):
            return linear_cross_entropy(x, w, labels, chunk_size=chunk_size, reduction=reduction)

        def ref(x, w, want_fn={"sum": jnp.sum, "mean": None}[reduction]):
            rows = jnp.where(labels >= 0, _plain(x, w, jnp.maximum(labels, 0)), 0.0)
            return rows.sum() / (1 if want_fn else (labels >= 0).sum())

        np.testing.assert_allclose(ours(x, w), want, rtol=1e-6)
        for g, r in zip(jax.grad(ours, (0, 1))(x, w), jax.grad(ref, (0, 1))(x, w)):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
        t = (jnp.ones_like(x), jnp.ones_like(w))
        np.testing.assert_allclose(
            jax.jvp(ours, (x, w), t)[1], jax.jvp(ref, (x, w), t)[1], rtol=1e-5
        )


def test_reduced_path_keeps_the_gradients_not_the_logits_and_does_three_products():
    x, w, labels = _data(N=64, D=8, V=512)
    report = residuals(lambda x, w: linear_cross_entropy(x, w, labels, reduction="mean"), x, w)
    named = {r.source.split("'")[1] for r in report.rows if "named" in r.source}
    assert named == {
        "cannjax.linear_cross_entropy_reduced.dx",
        "cannjax.linear_cross_entropy_reduced.dw",
    }
    assert report.total_bytes == x.nbytes + w.nbytes, str(report)  # [N, D] + [D, V]

    def dots(f):
        return jax.jit(jax.grad(f, (0, 1))).lower(x, w).compile().as_text().count(" dot(")

    reduced = dots(lambda x, w: linear_cross_entropy(x, w, labels, chunk_size=16, reduction="sum"))
    per_row = dots(lambda x, w: linear_cross_entropy(x, w, labels, chunk_size=16).sum())
    assert (reduced, per_row) == (3, 4)


def test_reduced_value_alone_compiles_to_the_forward_only():
    # Without differentiation the gradient products are dead code for XLA.
    x, w, labels = _data(N=256, D=16, V=64)

    def flops(reduction):
        f = jax.jit(lambda x, w: linear_cross_entropy(x, w, labels, reduction=reduction).sum())
        return f.lower(x, w).compile().cost_analysis()["flops"]

    grad_flops = (
        jax.jit(jax.grad(lambda x, w: linear_cross_entropy(x, w, labels, reduction="mean"), (0, 1)))
        .lower(x, w)
        .compile()
        .cost_analysis()["flops"]
    )
    assert flops("mean") < 0.5 * grad_flops
    assert flops("mean") == pytest.approx(flops("none"), rel=0.05)


# ------------------------------------------------------------- memory
def test_residuals_hold_no_logits():
    x, w, labels = _data(N=64, D=8, V=512)
    report = residuals(lambda x, w: _ours(x, w, labels).sum(), x, w)
    computed = {r.op for r in report.rows if not r.source.startswith(("from the ", "from a "))}
    assert computed == {"linear_cross_entropy"}, str(report)
    assert report.total_bytes == x.nbytes + w.nbytes + labels.nbytes + 64 * 4
    plain = residuals(lambda x, w: _plain(x, w, labels).sum(), x, w)
    assert any(r.shape == (64, 512) for r in plain.rows)  # plain JAX keeps [N, V]


def _temp(f, x, w, labels):
    vg = jax.value_and_grad(lambda x, w: f(x, w, labels).mean(), (0, 1))
    return compiled_memory(vg, x, w).temp_bytes


def test_value_and_grad_temp_memory_is_under_a_quarter_of_plain():
    x, w, labels = _data(N=512, D=64, V=4096)
    ours = _temp(lambda *a: linear_cross_entropy(*a, chunk_size=64), x, w, labels)
    plain = _temp(_plain, x, w, labels)
    assert ours * 4 <= plain, (ours, plain)


@pytest.mark.slow
def test_value_and_grad_temp_memory_at_benchmark_size():
    x, w, labels = _data(N=4096, D=256, V=32768)
    ours = _temp(linear_cross_entropy, x, w, labels)  # default chunk: 512 rows
    plain = _temp(_plain, x, w, labels)
    assert ours * 4 <= plain, (ours, plain)


# XLA:CPU's fusion passes choose differently on different CPUs: the same value_and_grad
# compiled to 13.1 MB of temp on one machine and 25.7 MB on another (issue 26). Its
# library-fusion options make such choices here; under each, the temp must stay what the
# algorithm needs, whatever XLA fuses. Per chunk of c rows: one [c, V] array (logits,
# probabilities and d loss / d logits, each written over the last), the [D, V] product
# x^T G before it is added to dw (unless XLA fuses the add into the dot), and a little
# more: the transposed [c, D] rows and [N] vectors. dx and dw are outputs, not temp.
_YNN = "xla_cpu_experimental_ynn_fusion_type"
_FUSIONS = {
    "default": {},
    "no library fusion": {_YNN: ""},
    "library elementwise": {_YNN: "LIBRARY_FUSION_TYPE_ELTWISE"},
    "library dot": {_YNN: "LIBRARY_FUSION_TYPE_DOT"},
    "library dot and reduce": {_YNN: "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"},
}


def _temp_under(fusion, f, x, w):
    lowered = jax.jit(jax.value_and_grad(f, (0, 1))).lower(x, w)
    try:
        compiled = lowered.compile(compiler_options=_FUSIONS[fusion])
    except jax.errors.JaxRuntimeError as e:  # an option this jaxlib does not know
        pytest.skip(f"XLA option unavailable: {e}")
    return compiled.memory_analysis().temp_size_in_bytes


def _needed(N, D, V, c, chunk_arrays):
    """Bytes of temp the chunked algorithm needs (float32): ``chunk_arrays`` [c, V]
    arrays, the [D, V] weight-gradient product, two [c, D] and four [N] arrays."""
    return 4 * (chunk_arrays * c * V + D * V + 2 * c * D + 4 * N)


def _memory_check(fusion, reduction, chunk_arrays, N=1024, D=128, V=2048, c=256, **kw):
    x, w, labels = _data(N=N, D=D, V=V)
    if reduction == "none":

        def f(x, w):
            return linear_cross_entropy(x, w, labels, chunk_size=c, **kw).mean()
    else:

        def f(x, w):
            return linear_cross_entropy(x, w, labels, chunk_size=c, reduction=reduction, **kw)

    temp, needed = _temp_under(fusion, f, x, w), _needed(N, D, V, c, chunk_arrays)
    assert temp <= needed, f"{fusion}: temp {temp:,} bytes > {needed:,} needed"


# The per-row path kept an earlier [c, V] array live beside the next wherever XLA made
# z - m or exp(z - m) in a fusion of its own: zs[label] was read after exp, and the +inf
# test of the shift read z again after z - m.
@pytest.mark.parametrize("fusion", ["default", "no library fusion"])
def test_per_row_temp_is_one_chunk_whatever_xla_fuses(fusion):
    _memory_check(fusion, "none", chunk_arrays=1)


@pytest.mark.extended
@pytest.mark.parametrize("fusion", list(_FUSIONS))
@pytest.mark.parametrize(
    "reduction,kw,chunk_arrays",
    [
        ("none", {}, 1),
        ("none", {"label_smoothing": 0.1, "z_loss": 1e-4}, 1),
        # The capped gradient is (p - onehot) * (1 - t^2): two functions of the logits
        # multiplied, two [c, V] arrays where XLA makes one in a fusion of its own.
        ("none", {"logit_cap": 30.0}, 2),
        # The reduced path makes the gradient in the forward from e and the one-hot,
        # which XLA's elementwise library fusion makes an array of its own.
        ("mean", {}, 2),
        ("sum", {}, 2),
    ],
    ids=["none", "none-smoothing-zloss", "none-cap", "mean", "sum"],
)
def test_temp_is_what_the_algorithm_needs_whatever_xla_fuses(fusion, reduction, kw, chunk_arrays):
    _memory_check(fusion, reduction, chunk_arrays, **kw)


@pytest.mark.extended
@pytest.mark.parametrize("fusion", list(_FUSIONS))
def test_per_row_temp_at_the_benchmark_size(fusion):
    # benchmarks/attention.py's _lce_loss("ours") at V=4096 (512 rows, the default chunk
    # there): 12.5 MiB here, 24.5 MiB on the machine of issue 26 before the fix.
    _memory_check(fusion, "none", chunk_arrays=1, N=4096, D=256, V=4096, c=512)


# ------------------------------------------------------------- bad input
def test_bad_input():
    x, w, labels = _data()
    fn = r"cannjax\.ops\.linear_cross_entropy: "
    with pytest.raises(
        ValueError,
        match=fn + r"w must have shape \(D, V\) with D == x.shape\[-1\] == 8, got \(19, 8\)",
    ):
        linear_cross_entropy(x, w.T, labels)
    with pytest.raises(ValueError, match=fn + r"labels must have shape .*\(37,\), got labels"):
        linear_cross_entropy(x, w, labels[:5])
    with pytest.raises(ValueError, match=fn + r"labels must have shape"):
        linear_cross_entropy(x, w, labels[:, None])
    with pytest.raises(TypeError, match=fn + r"labels must be an integer array .*float32\[37\]"):
        linear_cross_entropy(x, w, labels.astype(jnp.float32))
    with pytest.raises(TypeError, match=fn + r"x must be a floating-point array"):
        linear_cross_entropy(jnp.ones((37, 8), jnp.int32), w, labels)
    with pytest.raises(TypeError, match=fn + r"w must be a floating-point array"):
        linear_cross_entropy(x, jnp.ones((8, 19), bool), labels)
    with pytest.raises(ValueError, match=fn + r"chunk_size must be >= 1, got 0"):
        linear_cross_entropy(x, w, labels, chunk_size=0)
    with pytest.raises(TypeError, match=fn + r"ignore_index must be an int or None, got 1.5"):
        linear_cross_entropy(x, w, labels, ignore_index=1.5)
    with pytest.raises(ValueError, match=fn + r"reduction must be one of 'none', 'sum', 'mean'"):
        linear_cross_entropy(x, w, labels, reduction="max")


def test_registered_and_exported():
    assert cannjax.ops.linear_cross_entropy is registry()["linear_cross_entropy"].fn


@pytest.mark.parametrize("chunk_size", [None, 4])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_zero_rows(reduction, chunk_size):
    # No rows (an empty batch): optax's shapes, no error; "mean" of nothing is 0, as
    # when every row is ignored.
    x, w, labels = jnp.zeros((0, 8)), jnp.ones((8, 16)), jnp.zeros((0,), jnp.int32)

    def loss(x, w):
        return linear_cross_entropy(x, w, labels, reduction=reduction, chunk_size=chunk_size)

    want = optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)
    got = loss(x, w)
    assert got.shape == (want.shape if reduction == "none" else ())
    np.testing.assert_array_equal(got, 0.0)
    gx, gw = jax.grad(lambda x, w: loss(x, w).sum(), (0, 1))(x, w)
    assert gx.shape == (0, 8)
    np.testing.assert_array_equal(gw, 0.0)
    np.testing.assert_array_equal(jax.jvp(loss, (x, w), (x, w))[1], 0.0)
    assert jax.jit(loss)(x, w).shape == got.shape
