"""cannjax.ops.rope: check_op, the two layouts against the complex form and each other,
scaling (linear, Llama 3.1) against the published formula, the rotation's properties
(inverse, relative positions), transforms, residuals (the positions only) and bad input;
cannjax.ops.apply_rope (the rotation from given tables): the same, against rope."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cannjax
from cannjax.core import registry
from cannjax.inspect import compiled_memory, residuals
from cannjax.ops import apply_rope, rope, rope_frequencies
from cannjax.testing import check_op
from tests._opchecks import transform_matches_plain
from tests._ops import cast, check_half_forward, op_configs

SPEC = registry()["rope"]
LINEAR = {"rope_type": "linear", "factor": 4.0}
LLAMA3 = {  # Llama 3.1's published values
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _random_params():
    # The normal suite checks the default config in float32 and the last one (interleaved,
    # llama3 scaling) in float64; the others (the same rules with other constants and
    # slices, whose values the tests below check) run in the extended suite.
    out = []
    configs = [p for p in op_configs("positional") if p.values[0] == "rope"]
    for dtype in ("float32", "float64"):
        for n, p in enumerate(configs):
            fast = n == (0 if dtype == "float32" else len(configs) - 1)
            marks = () if fast else (pytest.mark.extended,)
            out.append(pytest.param(dtype, p.values[1], id=f"{dtype}-{p.id}", marks=marks))
    return out


def _x(shape=(2, 5, 3, 8), seed=0, dtype=jnp.float32):
    # numpy's generator: jax.random.normal in float64 alone takes seconds to compile.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ------------------------------------------------------------- the harness
@pytest.mark.parametrize("dtype,cfg", _random_params())
def test_check_op_random_points(dtype, cfg):
    with jax.enable_x64(dtype == "float64"):
        check_op("rope", *cast(SPEC.sample(jax.random.key(1)), dtype), **cfg)


# float32 edge points run under every config in `cannjax ops rope` (tests/test_cli.py).
@pytest.mark.extended
@pytest.mark.parametrize("index", range(len(SPEC.edges())))
def test_check_op_edge_points_float64(index):
    case = SPEC.edges()[index]
    with jax.enable_x64(True):
        check_op("rope", *cast(case.args, "float64"), **case.check_kwargs())


def test_bfloat16_values():
    check_half_forward("rope", {}, "bfloat16")
    x, p = SPEC.sample(jax.random.key(0))
    g = jax.grad(lambda x: rope(x, p).astype(jnp.float32).sum())(x.astype(jnp.bfloat16))
    assert g.dtype == jnp.bfloat16 and np.isfinite(np.asarray(g, np.float32)).all()


# check_op covers jit, vmap, jvp/vjp and second order (hessian-vector products).
@pytest.mark.parametrize("transform", ["grad", "jvp", "jacfwd", "vmap", "scan", "checkpoint"])
def test_transforms_match_plain_jax(transform):
    transform_matches_plain("rope", {"interleaved": True, "rotary_dim": 6}, transform)


def test_traced_positions_and_scaling_under_jit():
    # Positions are data (a KV-cache offset inside a jitted decode step); the scaling
    # dict is static, converted to a hashable form inside.
    x = _x((2, 1, 3, 8))
    traces = []

    def decode(x, p):
        traces.append(p.shape)  # runs once per trace, not per call
        return rope(x, p, scaling=LLAMA3, theta=5e5)

    step = jax.jit(decode)
    for offset in (3, 4000):
        p = jnp.array([[offset], [offset + 7]])
        want = rope(x, p, scaling=LLAMA3, theta=5e5)  # eager, at concrete positions
        np.testing.assert_allclose(step(x, p), want, rtol=1e-6, atol=1e-6)
    assert traces == [(2, 1)]  # one trace (and compilation) for every offset


# ------------------------------------------------------------- layouts and math
def test_interleaved_layout_is_the_complex_form():
    # (x[2i] + i x[2i+1]) e^(i p f_i), in float64 at positions up to 1e6: float64 inputs
    # get float64 angles.
    with jax.enable_x64(True):
        x = np.asarray(_x((2, 4, 3, 8), dtype=jnp.float64))
        p = np.array([0, 5, 4321, 1_000_000])
        f = np.asarray(rope_frequencies(8, dtype=jnp.float64))
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * p[:, None] * f)[None, :, None]
        want = np.stack([z.real, z.imag], -1).reshape(x.shape)
        got = rope(jnp.asarray(x), jnp.asarray(p), interleaved=True)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rotary_dim", [None, 6])
def test_layouts_agree_up_to_the_feature_permutation(rotary_dim):
    H = 8
    R = rotary_dim or H
    # Interleaved feature 2i is half-split feature i, 2i + 1 is i + R/2; the rest stay.
    perm = np.concatenate([np.stack([np.arange(R // 2), np.arange(R // 2) + R // 2], -1).ravel(),
                           np.arange(R, H)])  # fmt: skip
    assert sorted(perm) == list(range(H)) and (perm != np.arange(H)).any()
    x, p = _x((2, 5, 3, H)), jnp.array([0, 3, 17, 250, 9999])
    half = rope(x, p, rotary_dim=rotary_dim, scaling=LINEAR)
    inter = rope(x[..., perm], p, rotary_dim=rotary_dim, scaling=LINEAR, interleaved=True)
    np.testing.assert_allclose(inter, half[..., perm], rtol=1e-6, atol=1e-6)


def test_half_split_matches_rotate_half_written_out():
    # HF Llama: q * cos + rotate_half(q) * sin, with cos = cat(cos(pf), cos(pf)).
    x, p = _x((1, 3, 2, 4)), jnp.array([1, 2, 30])
    f = np.array([1.0, 0.01])  # theta = 1e4, R = 4
    a = np.asarray(p)[:, None] * f
    cos = np.concatenate([np.cos(a), np.cos(a)], -1)[None, :, None]
    sin = np.concatenate([np.sin(a), np.sin(a)], -1)[None, :, None]
    xn = np.asarray(x, np.float64)
    turned = np.concatenate([-xn[..., 2:], xn[..., :2]], -1)
    np.testing.assert_allclose(rope(x, p), xn * cos + turned * sin, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cfg", [{}, {"interleaved": True, "scaling": LLAMA3, "rotary_dim": 6}])
def test_inverse_rotation_and_norm(cfg):
    x, p = _x(), jnp.array([0, 1, 100, 70000, -5])
    y = rope(x, p, **cfg)
    np.testing.assert_allclose(rope(y, -p, **cfg), x, rtol=1e-5, atol=1e-5)
    # A rotation: every token's norm is kept.
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # The backward is the same inverse rotation of the cotangent.
    g = jax.vjp(lambda x: rope(x, p, **cfg), x)[1](y)[0]
    np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [{}, {"interleaved": True, "scaling": LLAMA3}])
def test_scores_depend_only_on_the_relative_position(cfg):
    with jax.enable_x64(True):
        q, k = _x((1, 1, 1, 16), 1, jnp.float64), _x((1, 1, 1, 16), 2, jnp.float64)

        def score(m, n):
            qm = rope(q, jnp.array([m]), theta=500000.0, **cfg)
            kn = rope(k, jnp.array([n]), theta=500000.0, **cfg)
            return float(jnp.vdot(qm, kn))

        base = score(5, 2)
        for m in (105, 8003, 300_000):
            np.testing.assert_allclose(score(m, m - 3), base, rtol=1e-9)
        assert abs(score(5, 1) - base) > 1e-3  # a different offset gives another score


def test_partial_rotary_passes_the_rest_through():
    x, p = _x(), jnp.arange(5) + 3
    y = rope(x, p, rotary_dim=4)
    np.testing.assert_array_equal(y[..., 4:], x[..., 4:])
    np.testing.assert_allclose(y[..., :4], rope(x[..., :4], p), rtol=1e-6, atol=1e-6)
    g = jax.grad(lambda x: (rope(x, p, rotary_dim=4) * x).sum())(x)
    np.testing.assert_allclose(g[..., 4:], 2 * x[..., 4:], rtol=1e-6)


def test_position_zero_is_the_identity_and_large_positions_are_finite():
    x = _x()
    np.testing.assert_array_equal(rope(x, jnp.zeros(5, jnp.int32)), x)
    big = jnp.array([10**6, -(10**6), 2**24, 2**31 - 1, 0])
    y, g = jax.value_and_grad(lambda x: rope(x, big).sum())(x)
    assert np.isfinite(y) and np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(rope(x, big), SPEC.reference(x, big), rtol=1e-6, atol=1e-6)


def test_float32_angle_error_is_within_the_documented_bound():
    # The docstring's bound: the float32 angle p f is off by up to about p f eps (f <= 1),
    # which moves a pair (a, c) by |(a, c)| times that.
    x, p = _x((1, 3, 1, 8)), jnp.array([1000, 30000, 100000])
    y32 = np.asarray(rope(x, p), np.float64)
    with jax.enable_x64(True):
        y64 = np.asarray(rope(jnp.asarray(x, jnp.float64), p))
    eps = np.finfo(np.float32).eps
    err = np.abs(y32 - y64).max(axis=(0, 2, 3))  # per position
    bound = (np.asarray(p) * eps + 4 * eps) * np.sqrt(2) * np.abs(x).max()
    assert (err <= bound).all(), (err, bound)
    assert err[-1] > 10 * err[0]  # and it grows with the position


# ------------------------------------------------------------- frequencies and scaling
def test_frequencies():
    np.testing.assert_allclose(rope_frequencies(8), [1.0, 0.1, 0.01, 0.001], rtol=1e-7)
    assert rope_frequencies(8).dtype == jnp.float32
    f = rope_frequencies(128, theta=500000.0)
    np.testing.assert_allclose(f, 500000.0 ** (-np.arange(0, 128, 2) / 128), rtol=1e-7)
    np.testing.assert_allclose(rope_frequencies(8, scaling=LINEAR), rope_frequencies(8) / 4)
    same = rope_frequencies(8, scaling={"type": "linear", "factor": 4})
    np.testing.assert_array_equal(same, rope_frequencies(8, scaling=LINEAR))
    default = rope_frequencies(8, scaling={"rope_type": "default"})
    np.testing.assert_array_equal(default, rope_frequencies(8))


def test_linear_scaling_divides_the_positions():
    x, p = _x(), jnp.array([0, 4, 8, 400, 4000])
    np.testing.assert_allclose(rope(x, p, scaling=LINEAR), rope(x, p // 4), rtol=1e-6, atol=1e-6)


def _llama3_published(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
    """The Llama 3.1 frequency scaling, written as its reference code states it, per
    frequency (Meta's llama-models ``apply_scaling``; Hugging Face's "llama3" rope type)."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama3_scaling_matches_the_published_formula():
    base = [500000.0 ** (-i / 128) for i in range(0, 128, 2)]
    want = _llama3_published(base, 8.0, 1.0, 4.0, 8192)
    got = rope_frequencies(128, theta=500000.0, scaling=LLAMA3)
    np.testing.assert_allclose(got, want, rtol=1e-7)
    # All three bands occur: kept, divided by the factor, interpolated.
    ratio = np.asarray(got, np.float64) / np.array(base)
    kept, divided = np.isclose(ratio, 1, rtol=1e-6), np.isclose(ratio, 1 / 8, rtol=1e-6)
    assert kept.sum() > 10 and divided.sum() > 10 and (~kept & ~divided).sum() >= 3
    # rope uses those frequencies.
    x, p = _x((1, 2, 1, 128)), jnp.array([7, 50000])
    a = np.asarray(p)[:, None] * want
    cos, sin = np.cos(a)[None, :, None], np.sin(a)[None, :, None]
    xn = np.asarray(x, np.float64)
    want_y = np.concatenate(
        [xn[..., :64] * cos - xn[..., 64:] * sin, xn[..., 64:] * cos + xn[..., :64] * sin], -1
    )
    got_y = rope(x, p, theta=500000.0, scaling=LLAMA3)
    # float32 angles up to 5e4 rad: off by up to ~5e4 eps (the docstring's bound)
    atol = (50000 + 4) * np.finfo(np.float32).eps * np.sqrt(2) * float(jnp.abs(x).max())
    np.testing.assert_allclose(got_y, want_y, rtol=0, atol=atol)


# ------------------------------------------------------------- what the backward keeps
def _layer(B=2, T=256, N=4, H=64):
    x = _x((B, T, N, H))
    return x, jnp.arange(T, dtype=jnp.int32)


def test_residuals_are_the_positions_only():
    x, p = _layer()
    report = residuals(lambda x, p: rope(x, p, scaling=LLAMA3).sum(), x, p)
    assert [(r.shape, r.dtype, r.source) for r in report.rows] == [
        ((256,), "int32", "from the argument p")
    ], str(report)
    packed = jnp.tile(p[None], (2, 1)) % 128  # [B, T] positions: still only them
    report = residuals(lambda x: rope(x, packed, interleaved=True).sum(), x)
    assert [(r.shape, r.dtype) for r in report.rows] == [((2, 256), "int32")], str(report)
    # Plain JAX keeps its cos and sin tables: 2 * T * H floats (256 KiB against 1 KiB).
    plain = residuals(lambda x: SPEC.reference(x, p).sum(), x).total_bytes
    assert plain >= 2 * 256 * 64 * 4, plain


def test_gradient_temp_memory_is_no_more_than_plain():
    x, p = _layer()

    def loss(f):
        return lambda x: jnp.sum(jnp.sin(f(x, p)))

    ours = compiled_memory(jax.grad(loss(rope)), x).temp_bytes
    plain = compiled_memory(jax.grad(loss(SPEC.reference)), x).temp_bytes
    assert ours <= plain, (ours, plain)


# ------------------------------------------------------------- bad input
_X = jnp.ones((2, 5, 3, 8))
_P = jnp.arange(5)


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((jnp.ones((2, 5, 3, 7)), _P), {}, ValueError, r"H = x.shape\[3\] = 7 is odd"),
        ((_X, _P), {"rotary_dim": 5}, ValueError, r"rotary_dim must be a positive even int"),
        ((_X, _P), {"rotary_dim": 0}, ValueError, r"rotary_dim must be a positive even int"),
        ((_X, _P), {"rotary_dim": 10}, ValueError, r"rotary_dim must be <= .* = 8, got 10"),
        ((_X, _P), {"rotary_dim": 4.0}, TypeError, r"rotary_dim must be an int or None"),
        ((_X, jnp.arange(4)), {}, ValueError, r"positions must have shape \[T\] = \(5,\)"),
        ((_X, jnp.zeros((3, 5), int)), {}, ValueError, r"\[B, T\] = \(2, 5\).* got \(3, 5\)"),
        ((_X, jnp.zeros((2, 5, 1), int)), {}, ValueError, r"positions must have shape"),
        ((_X, jnp.array(3)), {}, ValueError, r"positions must have shape .* got \(\)"),
        ((_X, _P * 1.0), {}, TypeError, r"positions must be an integer array, got float32"),
        ((_X, _P > 2), {}, TypeError, r"positions must be an integer array, got bool"),
        ((jnp.ones((5, 3, 8)), _P), {}, ValueError, r"x must have rank 4 \(\[B, T, N, H\]\)"),
        ((_X.astype(int), _P), {}, TypeError, r"x must be a floating-point array"),
        ((_X, _P), {"theta": 0.0}, ValueError, r"theta must be finite and > 0 .*, got 0.0"),
        ((_X, _P), {"theta": -1}, ValueError, r"theta must be finite and > 0"),
        ((_X, _P), {"theta": jnp.ones(())}, TypeError, r"theta must be a Python number"),
        ((_X, _P), {"interleaved": 1}, TypeError, r"interleaved must be a bool"),
        ((_X, _P), {"scaling": "linear"}, TypeError, r"scaling must be None or a dict"),
        ((_X, _P), {"scaling": {"factor": 2.0}}, ValueError, r"name its type once"),
        (
            (_X, _P),
            {"scaling": {"rope_type": "yarn", "factor": 2.0}},
            ValueError,
            r"type 'yarn' is not supported; supported: \['default', 'linear', 'llama3'\]",
        ),
        (
            (_X, _P),
            {"scaling": {"rope_type": "linear", "factor": 2.0, "alpha": 1}},
            ValueError,
            r"takes the keys \['factor'\]; unknown \['alpha'\]",
        ),
        (
            (_X, _P),
            {"scaling": {"rope_type": "llama3", "factor": 8.0}},
            ValueError,
            r"missing \['high_freq_factor', 'low_freq_factor', 'original_max_pos",
        ),
        (
            (_X, _P),
            {"scaling": {"rope_type": "linear", "factor": 0.0}},
            ValueError,
            r"scaling\['factor'\] must be finite and > 0, got 0.0",
        ),
        (
            (_X, _P),
            {"scaling": {"rope_type": "linear", "factor": "2"}},
            TypeError,
            r"scaling\['factor'\] must be a number",
        ),
        (
            (_X, _P),
            {"scaling": {**LLAMA3, "high_freq_factor": 1.0}},
            ValueError,
            r"high_freq_factor > low_freq_factor",
        ),
        (
            (_X, _P),
            {"scaling": {"type": "linear", "rope_type": "llama3", "factor": 2.0}},
            ValueError,
            r"name its type once",
        ),
    ],
)
def test_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=r"cannjax\.ops\.rope: .*" + match):
        rope(*args, **kwargs)


def test_bad_frequency_arguments():
    fn = r"cannjax\.ops\.rope_frequencies: "
    with pytest.raises(ValueError, match=fn + r"rotary_dim must be a positive even int .*, got 7"):
        rope_frequencies(7)
    with pytest.raises(TypeError, match=fn + r"rotary_dim must be an int"):
        rope_frequencies(8.0)
    with pytest.raises(ValueError, match=fn + r"theta must be finite and > 0"):
        rope_frequencies(8, theta=float("inf"))
    with pytest.raises(TypeError, match=fn + r"dtype must be a floating dtype"):
        rope_frequencies(8, dtype=jnp.int32)


def test_registered_and_exported():
    assert cannjax.ops.rope is SPEC.fn and SPEC.nondiff_argnums == (1,)
    assert dict(SPEC.residuals) == {"positions": SPEC.residuals["positions"]}


# ------------------------------------------------------------- apply_rope
APPLY = registry()["apply_rope"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cfg", APPLY.configs, ids=["half-split", "interleaved"])
def test_apply_rope_check_op_random_points(dtype, cfg):
    with jax.enable_x64(dtype == "float64"):
        check_op("apply_rope", *cast(APPLY.sample(jax.random.key(2)), dtype), **cfg)


@pytest.mark.parametrize("index", range(len(APPLY.edges())))
def test_apply_rope_check_op_edge_points_float64(index):
    case = APPLY.edges()[index]
    with jax.enable_x64(True):
        check_op("apply_rope", *cast(case.args, "float64"), **case.check_kwargs())


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_apply_rope_with_rope_tables_is_rope(interleaved, rotary_dim):
    x, p = _x(seed=3), jnp.array([3, 0, 17, 5, 4096])
    angle = (
        p[:, None, None].astype(jnp.float32) * rope_frequencies(rotary_dim)[None, None]
    )  # [T, 1, R/2]
    got = apply_rope(x, jnp.cos(angle), jnp.sin(angle), interleaved=interleaved)
    want = rope(x, p, interleaved=interleaved, rotary_dim=rotary_dim)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(apply_rope(x, jnp.cos(angle), jnp.sin(angle)))))(x)
    want_g = jax.grad(lambda x: jnp.sum(jnp.sin(rope(x, p, rotary_dim=rotary_dim))))(x)
    np.testing.assert_allclose(g, want_g, rtol=1e-5, atol=1e-5)


def test_apply_rope_is_the_same_map_for_tables_that_are_not_rotations():
    # YaRN scales its tables; any tables give x c + rotate_half(x) s, gradient included.
    x = _x(seed=4)
    c, s = _x((5, 1, 4), seed=5), _x((2, 5, 1, 4), seed=6)
    c = jnp.broadcast_to(c, s.shape)
    np.testing.assert_allclose(apply_rope(x, c, s), APPLY.reference(x, c, s), rtol=1e-6, atol=1e-6)
    transform_matches_plain("apply_rope", {"interleaved": True}, "grad")


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "vmap", "scan", "checkpoint"])
def test_apply_rope_transforms_match_plain_jax(transform):
    transform_matches_plain("apply_rope", {}, transform)


def test_apply_rope_residuals_are_the_tables_only():
    x, p = _layer()
    angle = p[:, None, None].astype(jnp.float32) * rope_frequencies(64)[None, None]  # [T, 1, 32]
    c, s = jnp.cos(angle), jnp.sin(angle)
    report = residuals(lambda x: apply_rope(x, c, s).sum(), x)
    assert [(r.shape, r.dtype) for r in report.rows] == [((256, 1, 32), "float32")] * 2, str(report)


def test_apply_rope_bfloat16_values():
    check_half_forward("apply_rope", {}, "bfloat16")


_C = jnp.ones((5, 1, 4))


@pytest.mark.parametrize(
    "args,kwargs,error,match",
    [
        ((_X.astype(int), _C, _C), {}, TypeError, r"x must be a floating-point array"),
        ((_X, _C.astype(int), _C), {}, TypeError, r"cos must be a floating-point array"),
        ((_X, _C, _C[:, :, :2]), {}, ValueError, r"cos and sin must have the same shape"),
        ((_X, jnp.ones((5, 1, 5)), jnp.ones((5, 1, 5))), {}, ValueError, r"2 \* 5 <= x.shape"),
        ((_X, jnp.ones((4, 1, 4)), jnp.ones((4, 1, 4))), {}, ValueError, r"do not broadcast"),
        ((_X, jnp.ones((5, 4)), jnp.ones((5, 4))), {}, ValueError, r"use \[T, 1, 4\]"),
        ((_X, jnp.ones(()), jnp.ones(())), {}, ValueError, r"cos must have rank 1 to"),
        ((_X, _C, _C), {"interleaved": "yes"}, TypeError, r"interleaved must be a bool"),
    ],
)
def test_apply_rope_bad_input(args, kwargs, error, match):
    with pytest.raises(error, match=r"cannjax\.ops\.apply_rope: .*" + match):
        apply_rope(*args, **kwargs)
