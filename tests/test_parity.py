"""Drop-in parity with jax.nn, jax.scipy.special, jnp, jax.lax and optax (issue 15).

For every registered op with a counterpart: the signature (names, order and defaults of
the counterpart's parameters), values and gradients on random inputs, integer and weak-type
promotion, zero-size, 0-d and size-1 shapes, and each float dtype. Ops without a
counterpart are listed with the reason; a registered op in neither list fails the test.
Every deliberate difference is written down here, next to the test that pins it, and in
``docs/ops_safe.md`` ("Deliberate differences from jax.nn, jnp and optax").
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import optax
import pytest

import cannjax
from cannjax.core import registry
from tests import _rng as rand
from tests._tiers import sample

INF = np.inf

# ---------------------------------------------------------------- the counterparts
UNARY = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "log_sigmoid": jax.nn.log_sigmoid,
    "softplus": jax.nn.softplus,
    "exp": jnp.exp,
    "log": jnp.log,
    "log1p": jnp.log1p,
    "expm1": jnp.expm1,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tanh": jnp.tanh,
    "square": jnp.square,
    "erf": jsp.erf,
}
ROWWISE = {
    "softmax": jax.nn.softmax,
    "log_softmax": jax.nn.log_softmax,
    "logsumexp": jax.nn.logsumexp,
}
BINARY = {"xlogy": jsp.xlogy, "arctan2": jnp.arctan2, "matmul": jnp.matmul}
OTHER = {
    "norm": jnp.linalg.norm,
    "cosine_similarity": optax.cosine_similarity,
    "softmax_cross_entropy": optax.softmax_cross_entropy_with_integer_labels,
}
COUNTERPARTS = {**UNARY, **ROWWISE, **BINARY, **OTHER}

NO_COUNTERPART = {
    "attention": "jax.nn.dot_product_attention takes bias and mask positionally, "
    "is_causal, local_window_size, sequence lengths and implementation options; "
    "cannjax.ops.attention takes them by keyword (causal, window), adds logit_cap, "
    "segment_ids and block sizes (values and gradients, bias included, are compared with "
    "jax.nn in tests/test_attention.py and tests/test_attention_llm.py)",
    "linear": "no jax.nn function (flax.linen.Dense / equinox.nn.Linear are modules)",
    "linear_cross_entropy": "a fused matmul + cross-entropy; jax.nn and optax have no fused form",
    "layer_norm": "no jax.nn function (flax / equinox LayerNorm are modules)",
    "rms_norm": "no jax.nn function (flax / equinox RMSNorm are modules)",
    "swiglu": "a whole gated MLP (three products and silu); jax.nn has only the activation "
    "(values and gradients compared with jax.nn.silu and @ in tests/test_gated.py)",
    "geglu": "a whole gated MLP (three products and gelu); jax.nn has only the activation "
    "(values and gradients compared with jax.nn.gelu and @ in tests/test_gated.py)",
    "apply_rope": "no jax.nn or jnp function (Hugging Face's apply_rotary_pos_emb lives in "
    "each model's module; values are compared with rope's in tests/test_rope.py)",
    "rope": "no jax.nn or jnp function (flax, keras-hub and HF implement RoPE inside their "
    "models; values are compared with a complex-number form in tests/test_rope.py)",
    "normalize": "torch.nn.functional.normalize's math; jax.nn and jnp have no such function",
    "entropy": "a row reduction; jax.scipy.special.entr is elementwise (values compared "
    "with -sum(xlogy(p, p)) in tests/test_safe.py)",
    "kl_divergence": "takes two arrays of logits and a temperature; optax.kl_divergence takes "
    "log-probabilities and probabilities (values and gradients compared with "
    "optax.kl_divergence(log_softmax(logits), softmax(target_logits)) and "
    "optax.losses.kl_divergence_with_log_targets in tests/test_distillation.py)",
    "jensen_shannon": "no jax.nn or optax function (values and gradients compared with the "
    "generalized JSD written out in plain jnp in tests/test_distillation.py)",
    "linear_jensen_shannon": "a fused pair of matmuls + generalized JSD; jax.nn and optax "
    "have no fused form",
    "lora_linear": "a frozen dense layer plus a low-rank update; flax.nnx.LoRALinear is a "
    "module (values and gradients compared with it in tests/test_lora.py)",
    "linear_preference_loss": "TRL's DPO, ORPO, CPO/SimPO and KTO losses are trainer methods "
    "in PyTorch; jax.nn and optax have none (values and rewards compared with TRL's formulas "
    "in tests/test_preference.py)",
}

# Counterpart parameters cannjax does not take, on purpose, with the reason.
SIGNATURE_DIFFERENCES = {
    "rsqrt": {"accuracy": "lax's accuracy hint for the transcendental kernel is not exposed"},
    "matmul": {
        p: "jnp.matmul's precision / dtype / sharding controls are not exposed"
        for p in ("precision", "preferred_element_type", "out_sharding")
    },
    "norm": {
        "ord": "the L2 norm over one axis only (no ord)",
        "axis": "default -1 (one row per vector), not None (every axis)",
        "keepdims": "not supported",
    },
    "cosine_similarity": {
        "predictions": "named a (first operand), as torch.nn.functional.cosine_similarity",
        "targets": "named b",
        "epsilon": "eps=1e-8 floors each norm (torch's convention); optax's epsilon=0 floors "
        "the squared norm and gives NaN for a zero vector",
        "axis": "positional-or-keyword third argument, default -1 as optax",
        "where": "not supported",
    },
    "softmax_cross_entropy": {
        "axis": "classes on the last axis only",
        "where": "not supported",
    },
}

# Integer inputs: where the counterpart raises TypeError, cannjax promotes them as jnp.exp
# does (a superset: code written for the counterpart never passes them).
ACCEPTS_INTEGERS_WHERE_COUNTERPART_RAISES = {"sigmoid", "silu", "rsqrt"}
# Counterparts that keep integer dtypes (jnp.maximum / jnp.square / jnp.matmul semantics).
INTEGER_OUTPUT = {"relu", "square"}
# Integer inputs whose counterpart value differs on purpose.
INTEGER_VALUE_DIFFERENCES = {
    ("log_sigmoid", "uint8"): "jax.nn.log_sigmoid negates the unsigned input before it "
    "promotes it (-x wraps around: log_sigmoid(1) = -255); cannjax promotes first",
}


def _fn(name):
    return registry()[name].fn


# ---------------------------------------------------------------- coverage
def test_every_registered_op_is_classified():
    names = set(registry())
    classified = set(COUNTERPARTS) | set(NO_COUNTERPART)
    assert not set(COUNTERPARTS) & set(NO_COUNTERPART)
    missing = sorted(n for n in names if n not in classified and registry()[n].fn.__module__
                     .startswith("cannjax."))  # fmt: skip
    assert not missing, f"registered ops with neither a counterpart nor a reason: {missing}"
    assert not classified - names, f"listed but not registered: {sorted(classified - names)}"


# ---------------------------------------------------------------- signatures
@pytest.mark.parametrize("name", sorted(COUNTERPARTS))
def test_signature_matches_the_counterpart(name):
    ours = inspect.signature(_fn(name)).parameters
    theirs = inspect.signature(COUNTERPARTS[name]).parameters
    allowed = SIGNATURE_DIFFERENCES.get(name, {})
    ours_pos = [p for p in ours.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    seen = []
    for i, (pname, p) in enumerate(theirs.items()):
        if pname in allowed:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.KEYWORD_ONLY:
            assert pname in ours, f"{name}: missing keyword argument {pname!r}"
            assert ours[pname].default == p.default, f"{name}: default of {pname!r}"
            continue
        # Positional: same place; the name too unless the counterpart's is positional-only.
        assert i < len(ours_pos), f"{name}: missing positional argument {pname!r}"
        q = ours_pos[i]
        if p.kind == p.POSITIONAL_OR_KEYWORD:
            assert q.name == pname, f"{name}: argument {i} is {q.name!r}, expected {pname!r}"
        assert q.default == p.default, (
            f"{name}: default of {pname!r}: {q.default!r} != {p.default!r}"
        )
        seen.append(q.name)
    # Whatever cannjax adds beyond the counterpart's arguments has a default, except
    # where a required argument is listed as renamed.
    renamed = [p for p in allowed if p in theirs and theirs[p].default is inspect.Parameter.empty]
    extra = [
        q.name
        for q in ours.values()
        if q.name not in seen and q.name not in theirs and q.default is q.empty
    ]
    assert len(extra) == len(renamed), f"{name}: extra required arguments {extra}"
    # Each listed difference is real (a stale entry would hide a future mismatch).
    for pname in allowed:
        same = (
            pname in ours
            and pname in theirs
            and ours[pname].default == theirs[pname].default
            and list(ours).index(pname) == list(theirs).index(pname)
        )
        assert not same, f"{name}: {pname!r} is listed as a difference but matches"


# ---------------------------------------------------------------- values and gradients
def _random(key, shape, name):
    if name in ("log", "sqrt", "rsqrt", "log1p"):
        return rand.uniform(key, shape, jnp.float32, 0.2, 3.0)
    return rand.normal(key, shape, jnp.float32) * 2


def _args_and_refs(name, key):
    """(cannjax call, counterpart call, args) on random inputs."""
    k1, k2 = jax.random.split(key)
    ours, theirs = _fn(name), COUNTERPARTS[name]
    if name in UNARY:
        return ours, theirs, (_random(k1, (3, 5), name),)
    if name in ("xlogy", "arctan2"):
        y = rand.uniform(k2, (3, 5), jnp.float32, 0.1, 3.0)
        return ours, theirs, (_random(k1, (3, 5), name), y)
    if name == "matmul":
        return ours, theirs, (_random(k1, (3, 4), name), _random(k2, (4, 5), name))
    if name == "norm":
        return ours, functools.partial(theirs, axis=-1), (_random(k1, (3, 5), name),)
    if name == "cosine_similarity":
        # optax floors the squared norms, cannjax each norm: the same for eps**2.
        ref = functools.partial(theirs, epsilon=1e-16)
        return ours, ref, (_random(k1, (3, 5), name), _random(k2, (3, 5), name))
    if name == "softmax_cross_entropy":
        labels = rand.randint(k2, (3,), 0, 5)
        return (
            (lambda x: ours(x, labels)),
            (lambda x: theirs(x, labels)),
            (_random(k1, (3, 5), name),),
        )
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(set(COUNTERPARTS) - set(ROWWISE)))
def test_values_and_gradients_match(name):
    ours, theirs, args = _args_and_refs(name, jax.random.key(len(name)))
    np.testing.assert_allclose(ours(*args), theirs(*args), rtol=2e-6, atol=1e-6)
    w = rand.normal(jax.random.key(1), jax.eval_shape(theirs, *args).shape)
    argnums = tuple(range(len(args)))
    g_ours = jax.grad(lambda *a: (ours(*a) * w).sum(), argnums)(*args)
    g_theirs = jax.grad(lambda *a: (theirs(*a) * w).sum(), argnums)(*args)
    for a, b in zip(g_ours, g_theirs):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


ROWWISE_CALLS = [
    {},
    {"axis": -1},
    {"axis": 0},
    {"axis": (0, 2)},
    {"axis": (-1, 0)},
    {"axis": None},
    {"axis": 1, "where": "mask"},
    {"axis": (1, 2), "where": "mask"},
]
LSE_CALLS = [
    {"keepdims": True},
    {"axis": (0, 2), "keepdims": True},
    {"b": "b"},
    {"b": "b", "axis": 1},
    {"b": "b", "axis": -1, "return_sign": True},
    {"b": "b", "axis": None, "keepdims": True, "return_sign": True},
    {"axis": 0, "return_sign": True},
    {"b": "b", "axis": -1, "where": "mask"},
]


@pytest.mark.parametrize("name", sample(sorted(ROWWISE)))
@pytest.mark.parametrize(
    "kwargs",
    ROWWISE_CALLS + LSE_CALLS,
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default",
)
def test_rowwise_values_and_gradients_match(name, kwargs):
    if name != "logsumexp" and set(kwargs) - {"axis", "where"}:
        pytest.skip("logsumexp-only arguments")
    x = rand.normal(jax.random.key(0), (3, 4, 5)) * 2
    mask = jax.random.bernoulli(jax.random.key(1), 0.7, (3, 4, 5))
    # Broadcasts against x (same rank: tests run with rank promotion refused); negative
    # entries too.
    b = rand.normal(jax.random.key(2), (1, 4, 5))
    kw = {
        k: {"mask": mask, "b": b}.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()
    }
    ours, theirs = _fn(name), COUNTERPARTS[name]
    got, want = ours(x, **kw), theirs(x, **kw)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-6), got, want)
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)

    def loss(f, x, b):
        out = f(x, **{**kw, **({"b": b} if "b" in kw else {})})
        out = out[0] if kw.get("return_sign") else out
        # log of a negative sum is NaN in both; compare the rest.
        return jnp.where(jnp.isnan(out), 0.0, out).sum()

    g_ours = jax.grad(functools.partial(loss, ours), (0, 1))(x, b)
    g_theirs = jax.grad(functools.partial(loss, theirs), (0, 1))(x, b)
    for a, c in zip(g_ours, g_theirs):
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------- findings 4, 6, 7
def test_finding_4_relu_keeps_float64_tangents_exact():
    with jax.enable_x64(True):
        y, t = jax.jvp(cannjax.ops.relu, (1.0,), (0.3,))
        assert t.dtype == jnp.float64 and float(t) == 0.3
        x = jnp.array([1.5, -2.0, 3.0], jnp.float64)
        tx = jnp.array([0.1, 0.7, 1 / 3], jnp.float64)
        _, t = jax.jvp(cannjax.ops.relu, (x,), (tx,))
        np.testing.assert_array_equal(t, [0.1, 0.0, 1 / 3])
        g = jax.grad(lambda x: (cannjax.ops.relu(x) * tx).sum())(x)
        np.testing.assert_array_equal(g, [0.1, 0.0, 1 / 3])


@pytest.mark.parametrize("name", sorted(UNARY))
def test_finding_4_float64_tangents_and_cotangents_are_not_rounded(name):
    # Every elementwise op: the tangent of a float64 input is computed in float64 (no
    # mask or constant in a fixed narrower dtype).
    with jax.enable_x64(True):
        x = jnp.array([0.7, 1.3, 2.9], jnp.float64)
        t = jnp.array([0.1, 1 / 3, 0.3], jnp.float64)
        _, tan = jax.jvp(_fn(name), (x,), (t,))
        _, want = jax.jvp(UNARY[name], (x,), (t,))
        assert tan.dtype == jnp.float64
        np.testing.assert_allclose(tan, want, rtol=1e-13)


def test_finding_6_logsumexp_reduces_all_axes_by_default():
    x = rand.normal(jax.random.key(0), (3, 4))
    y = cannjax.ops.logsumexp(x)
    assert y.shape == () == jax.nn.logsumexp(x).shape
    np.testing.assert_allclose(y, jax.nn.logsumexp(x), rtol=1e-6)
    # The last axis takes axis=-1, as with jax.nn.logsumexp.
    np.testing.assert_allclose(
        cannjax.ops.logsumexp(x, axis=-1), jax.nn.logsumexp(x, axis=-1), rtol=1e-6
    )
    # Tuples of axes, b, keepdims and return_sign, with jax.nn's values.
    b = jnp.array([[1.0, -1.0, 2.0, 0.5]])
    for kw in ({"axis": (0, 1)}, {"axis": 0, "keepdims": True}, {"b": b, "axis": -1},
               {"b": b, "axis": -1, "return_sign": True}):  # fmt: skip
        jax.tree.map(
            lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6),
            cannjax.ops.logsumexp(x, **kw),
            jax.nn.logsumexp(x, **kw),
        )
    assert list(inspect.signature(cannjax.ops.logsumexp).parameters) == list(
        inspect.signature(jax.nn.logsumexp).parameters
    )
    # softmax and log_softmax take tuples of axes too.
    for name in ("softmax", "log_softmax"):
        np.testing.assert_allclose(
            _fn(name)(x, axis=(0, 1)), COUNTERPARTS[name](x, axis=(0, 1)), rtol=1e-6
        )


def test_finding_6_logsumexp_keeps_its_edge_conventions_with_the_new_arguments():
    # A fully masked row: -inf, gradient 0 (finite), with keepdims and tuples of axes.
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]])
    where = jnp.array([[True, True], [False, False]])
    y = cannjax.ops.logsumexp(x, axis=(1,), keepdims=True, where=where)
    assert y.shape == (2, 1) and y[1, 0] == -np.inf
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1, where=where)[0])(x)
    np.testing.assert_array_equal(g[1], 0.0)
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1, where=where).sum())(x)
    assert np.isfinite(g).all()
    # An all -inf row: -inf with gradient 0 where jax.nn's is NaN; with b as well.
    x = jnp.array([[-INF, -INF], [0.0, 1.0]])
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1).sum())(x)
    assert np.isnan(jax.grad(lambda x: jax.nn.logsumexp(x, axis=-1).sum())(x)[0]).all()
    np.testing.assert_array_equal(g[0], 0.0)
    b = jnp.array([2.0, 1.0])
    g = jax.grad(lambda x: cannjax.ops.logsumexp(x, axis=-1, b=b).sum())(x)
    np.testing.assert_array_equal(g[0], 0.0)
    # Empty axes and 0-d inputs as jax.nn.
    np.testing.assert_array_equal(cannjax.ops.logsumexp(jnp.zeros((0,))), -np.inf)
    assert float(cannjax.ops.logsumexp(2.0)) == 2.0 == float(jax.nn.logsumexp(2.0))


INT_INPUTS = {
    "int32": lambda: jnp.arange(-2, 3),
    "int8": lambda: jnp.arange(-2, 3, dtype=jnp.int8),
    "uint8": lambda: jnp.arange(0, 5, dtype=jnp.uint8),
    "numpy_int64": lambda: np.arange(1, 4),
    "python_int": lambda: 2,
    "python_float": lambda: 1.5,
}


def _kind(out):
    return f"{jnp.dtype(out.dtype).name}{' weak' if out.weak_type else ''}"


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("name", sample(sorted(UNARY)))
def test_finding_7_integer_and_python_scalar_inputs_promote_as_the_counterpart(name, x64):
    with jax.enable_x64(x64):
        for label, make in INT_INPUTS.items():
            x = make()
            if name in ("log", "sqrt", "rsqrt", "log1p") and label != "python_float":
                x = abs(x) + 1 if not isinstance(x, int) else x + 3
            ours = _fn(name)(x)
            try:
                theirs = UNARY[name](x)
            except TypeError:
                assert name in ACCEPTS_INTEGERS_WHERE_COUNTERPART_RAISES, (name, label)
                # Promoted as jnp.exp promotes the same input.
                assert _kind(ours) == _kind(jnp.exp(x)), (name, label)
                np.testing.assert_allclose(ours, UNARY[name](jnp.asarray(x, ours.dtype)), rtol=1e-6)
                continue
            assert _kind(ours) == _kind(theirs), (name, label, _kind(ours), _kind(theirs))
            if (name, label) in INTEGER_VALUE_DIFFERENCES:
                theirs = UNARY[name](jnp.asarray(x, ours.dtype))
            np.testing.assert_allclose(ours, theirs, rtol=1e-6)
            if name in INTEGER_OUTPUT and label in ("int32", "int8", "uint8"):
                assert jnp.issubdtype(ours.dtype, jnp.integer)


MIXED = ["softmax", "log_softmax", "logsumexp", "norm", "xlogy", "arctan2",
         "cosine_similarity", "softmax_cross_entropy"]  # fmt: skip


@pytest.mark.parametrize("name", MIXED)
def test_finding_7_integer_arrays_in_rowwise_and_binary_ops(name):
    x = jnp.arange(6).reshape(2, 3)
    if name in ("xlogy", "arctan2"):
        for y in (jnp.arange(1, 7).reshape(2, 3), 2.0, jnp.ones((2, 3), jnp.float16)):
            ours, theirs = _fn(name)(x, y), COUNTERPARTS[name](x, y)
            assert _kind(ours) == _kind(theirs), (name, y)
            np.testing.assert_allclose(ours, theirs, rtol=1e-3)
        return
    if name == "cosine_similarity":
        # optax refuses integer inputs; cannjax promotes them (as jnp would).
        with pytest.raises((TypeError, ValueError)):
            optax.cosine_similarity(x, x)
        out = _fn(name)(x, x + 1)
        np.testing.assert_allclose(out, optax.cosine_similarity(x * 1.0, x + 1.0), rtol=1e-6)
        assert out.dtype == jnp.float32
        return
    if name == "softmax_cross_entropy":
        # optax refuses integer logits; cannjax promotes them (as jax.nn.log_softmax does).
        labels = jnp.array([0, 2])
        with pytest.raises(TypeError):
            COUNTERPARTS[name](x, labels)
        ours, theirs = _fn(name)(x, labels), COUNTERPARTS[name](x * 1.0, labels)
        assert ours.dtype == jnp.float32
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)
        return
    ref = functools.partial(COUNTERPARTS[name], axis=-1)
    ours, theirs = _fn(name)(x, axis=-1), ref(x)
    assert _kind(ours) == _kind(theirs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_finding_7_sequences_are_refused_as_in_jax_nn():
    with pytest.raises(TypeError):
        jax.nn.gelu([1.0, 2.0])
    for name in ("gelu", "relu", "square", "softmax", "logsumexp", "xlogy"):
        args = ([1.0, 2.0],) if name != "xlogy" else ([1.0], 2.0)
        with pytest.raises(TypeError, match=rf"cannjax\.ops\.{name}: .* must be an array or"):
            _fn(name)(*args)


def test_matmul_integer_inputs_are_a_known_gap():
    # jnp.matmul multiplies integer matrices exactly; cannjax.ops.matmul refuses them
    # (cannjax/_src/ops/linalg.py validates with as_float). When that changes, move
    # matmul into the integer-parity tests above.
    a = jnp.arange(6).reshape(2, 3)
    assert jnp.matmul(a, a.T).dtype == jnp.int32
    with pytest.raises(TypeError, match=r"cannjax\.ops\.matmul: a must be a floating-point"):
        cannjax.ops.matmul(a, a.T)


# ---------------------------------------------------------------- degenerate shapes
SHAPES = [(), (0,), (1,), (3, 0), (1, 1), (0, 4)]


@pytest.mark.parametrize("name", sample(sorted(UNARY)))
def test_unary_degenerate_shapes(name):
    for shape in SHAPES:
        x = jnp.full(shape, 0.7, jnp.float32)
        ours, theirs = _fn(name)(x), UNARY[name](x)
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, shape
        np.testing.assert_allclose(ours, theirs, rtol=1e-6)
        g_ours = jax.grad(lambda x: _fn(name)(x).sum())(x)
        g_theirs = jax.grad(lambda x: UNARY[name](x).sum())(x)
        np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-6)


ROW_SHAPES = [
    ((3, 0), -1), ((0, 4), -1), ((3, 0), 0), ((0,), 0), ((1,), -1), ((1, 1), -1),
    ((4, 1), -1), ((1, 4), 0), ((2, 0, 3), (0, 2)), ((2, 3), ()),
]  # fmt: skip


@pytest.mark.parametrize("name", sample(sorted(ROWWISE)))
@pytest.mark.parametrize("shape,axis", ROW_SHAPES)
def test_rowwise_degenerate_shapes(name, shape, axis):
    x = rand.normal(jax.random.key(0), shape)
    ours, theirs = _fn(name)(x, axis=axis), ROWWISE[name](x, axis=axis)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    g = functools.partial(lambda f, x: jax.grad(lambda x: f(x, axis=axis).sum())(x))
    np.testing.assert_allclose(g(_fn(name), x), g(ROWWISE[name], x), rtol=1e-6, atol=1e-7)


def test_logsumexp_of_a_scalar_is_the_scalar():
    for x in (2.0, jnp.float32(-1.5), jnp.asarray(0.25)):
        np.testing.assert_array_equal(cannjax.ops.logsumexp(x), jax.nn.logsumexp(x))
        assert jax.grad(cannjax.ops.logsumexp)(x) == 1.0


# ---------------------------------------------------------------- dtypes
FLOAT_DTYPES = ["float16", "bfloat16", "float32", "float64"]


@pytest.mark.parametrize(
    # float32, the dtype every other test runs in, with make test-extended (CI)
    "dtype",
    [pytest.param(d, marks=pytest.mark.extended) if d == "float32" else d for d in FLOAT_DTYPES],
)
@pytest.mark.parametrize("name", sample(sorted(UNARY) + sorted(ROWWISE)))
def test_outputs_and_tangents_keep_the_input_dtype(name, dtype):
    for x64 in [True] if dtype == "float64" else [False, True]:
        with jax.enable_x64(x64):
            x = (rand.uniform(jax.random.key(0), (2, 3), minval=0.3, maxval=2.0)).astype(dtype)
            f = _fn(name)
            ref = COUNTERPARTS[name]
            if name in ROWWISE:
                f, ref = functools.partial(f, axis=-1), functools.partial(ref, axis=-1)
            y, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
            assert y.dtype == t.dtype == ref(x).dtype == jnp.dtype(dtype), (y.dtype, t.dtype)
            g = jax.grad(lambda x, f=f: f(x).astype(jnp.float32).sum())(x)
            assert g.dtype == jnp.dtype(dtype)
            tol = {"float16": 2e-3, "bfloat16": 2e-2}.get(dtype, 1e-6)
            np.testing.assert_allclose(
                np.asarray(y, np.float64), np.asarray(ref(x), np.float64), rtol=tol, atol=tol
            )


# ---------------------------------------------------------------- deliberate differences
# (op, call, what the counterpart gives, what cannjax gives): each documented in the op's
# docstring and in docs/ops_safe.md.
def _g(f):
    return lambda x: jax.grad(lambda x: f(x).sum())(x)


DIFFERENCES = {
    "softmax: a row of -inf is 0, not NaN": (
        lambda f: f(jnp.array([-INF, -INF])), "softmax", [np.nan, np.nan], [0.0, 0.0]),
    "log_softmax: a row of -inf is -inf, not NaN": (
        lambda f: f(jnp.array([-INF, -INF])), "log_softmax", [np.nan, np.nan], [-INF, -INF]),
    "logsumexp: gradient 0 at a row of -inf, not NaN": (
        lambda f: _g(f)(jnp.array([-INF, -INF])), "logsumexp", [np.nan, np.nan], [0.0, 0.0]),
    "softmax: a row holding +inf is uniform over it, not NaN": (
        lambda f: f(jnp.array([INF, 0.0])), "softmax", [np.nan, np.nan], [1.0, 0.0]),
    "gelu: exact 0 at -inf, not NaN": (
        lambda f: f(jnp.array([-INF])), "gelu", [np.nan], [0.0]),
    "gelu: finite gradient at +-inf, not NaN": (
        lambda f: _g(f)(jnp.array([INF, -INF])), "gelu", [np.nan, np.nan], [1.0, 0.0]),
    "silu: exact 0 at -inf, not NaN": (
        lambda f: f(jnp.array([-INF])), "silu", [np.nan], [0.0]),
    "norm: gradient 0 at the zero vector, not NaN": (
        lambda f: _g(f)(jnp.zeros(3)), "norm", [np.nan] * 3, [0.0] * 3),
    "xlogy: y-gradient 0 at x = y = 0, not NaN": (
        lambda f: jax.grad(lambda y: f(jnp.zeros(1), y).sum())(jnp.zeros(1)), "xlogy",
        [np.nan], [0.0]),
    "arctan2: gradient 0 at the origin, not NaN": (
        lambda f: jax.grad(lambda y: f(y, jnp.zeros(1)).sum())(jnp.zeros(1)), "arctan2",
        [np.nan], [0.0]),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(DIFFERENCES))
def test_deliberate_differences(what):
    call, name, theirs, ours = DIFFERENCES[what]
    counterpart = COUNTERPARTS[name]
    if name in ("softmax", "log_softmax", "logsumexp", "norm"):
        counterpart = functools.partial(counterpart, axis=-1)
    np.testing.assert_array_equal(np.asarray(call(counterpart)), theirs)
    np.testing.assert_array_equal(np.asarray(call(_fn(name))), ours)
