"""``jax.export`` under symbolic batch and length dimensions (issue 18).

Every registered operator, a ``cannjax.fuse``d function, a ``cannjax.optimize``d loss
and the GPT training step are exported once with symbolic dimensions
(``jax.export.symbolic_shape("b, t")``); the exported module then runs at several
concrete sizes, and its values and gradients equal those of the program jitted at each
concrete shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import cannjax
import cannjax.models
from cannjax.core import registry
from cannjax.testing import tolerance
from tests import _rng as rand
from tests._tiers import sample

# Symbolic shape of each positional argument of an operator's sample (None: the
# sample's own, constant shape); operators not listed take "b, t" for every argument
# (elementwise, pairwise and row-wise ops on [3, 5] samples). Letters: b batch, t
# length, s key length.
_SYMBOLIC = {
    "attention": ("b, t, 4, 3", "b, s, 2, 3", "b, s, 2, 3"),
    "linear": ("b, t, 8", None, None),
    "matmul": ("b, t, 6", "b, 6, 5"),
    "linear_cross_entropy": ("b, t, 4", None, "b, t"),
    "softmax_cross_entropy": ("b, t, 6", "b, t"),
    "layer_norm": ("b, t, 8", None, None),
    "rms_norm": ("b, t, 8", None),
    "swiglu": ("b, t, 8", None, None, None),
    "geglu": ("b, t, 8", None, None, None),
    "rope": ("b, t, 3, 8", "t"),
    "apply_rope": ("b, t, 3, 8", "t, 1, 4", "t, 1, 4"),
    "kl_divergence": ("b, t, 5", "b, t, 5"),
    "jensen_shannon": ("b, t, 5", "b, t, 5"),
    "linear_jensen_shannon": ("b, t, 4", None, "b, t, 3", None, "b, t"),
    "lora_linear": ("b, t, 8", None, None, None, None),
    # pairs b (the sample's sequences have 5 tokens of width 4)
    "linear_preference_loss": ("b, 5, 4", "b, 5, 4", None, "b, 5", "b, 5", "b", "b"),
}
# Concrete sizes each exported module runs at: size 1 (a broadcasting size), and sizes
# off the block and chunk multiples.
_SIZES = ({"b": 1, "t": 1, "s": 2}, {"b": 2, "t": 5, "s": 3}, {"b": 3, "t": 4, "s": 9})
_BUILTIN = sorted(n for n, s in registry().items() if s.fn.__module__.startswith("cannjax."))


@functools.cache
def _sample(name):
    return tuple(jnp.asarray(a) for a in registry()[name].sample(jax.random.key(0)))


def _specs(shapes, dtypes):
    """ShapeDtypeStructs for ``shapes`` (strings: symbolic, in one scope; tuples: as is)."""
    scope = export.SymbolicScope()
    return [
        jax.ShapeDtypeStruct(export.symbolic_shape(s, scope=scope) if isinstance(s, str) else s, d)
        for s, d in zip(shapes, dtypes, strict=True)
    ]


def _concrete(shape, sizes):
    """A symbolic shape string at ``sizes`` ({"b": 2, ...})."""
    return tuple(
        sizes[d] if d.isidentifier() else int(d) for d in (x.strip() for x in shape.split(","))
    )


def _weights(out):
    """A fixed cotangent of ``out``'s shape (which may be symbolic)."""
    return jnp.sin(1.0 + jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)


def _value_and_vjp(fn, argnums):
    """``args -> (fn(*args), vjp of fn at _weights)``: one program for both."""

    def program(*args):
        out = fn(*args)

        def scalar(*diff):
            full = list(args)
            for i, d in zip(argnums, diff, strict=True):
                full[i] = d
            return sum(jnp.sum(_weights(o) * o) for o in jax.tree.leaves(fn(*full)))

        grads = jax.grad(scalar, argnums=tuple(range(len(argnums))))(*(args[i] for i in argnums))
        return out, grads

    return program


def _assert_tree_close(got, want, what, rtol, atol):
    leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves[0]) == len(leaves[1]), what
    for g, w in zip(*leaves, strict=True):
        assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(
            np.asarray(g, np.float64), np.asarray(w, np.float64), rtol=rtol, atol=atol, err_msg=what
        )


def _check_exported(program, specs, calls, *, rtol=None, atol=None):
    """Exports ``jit(program)`` at ``specs`` and runs it at each argument tuple of
    ``calls`` against ``jit(program)`` at the concrete shapes."""
    exported = export.export(jax.jit(program))(*specs)
    jitted = jax.jit(program)
    d_rtol, d_atol = tolerance(jnp.float32)
    for args in calls:
        shapes = [tuple(jnp.shape(a)) for a in jax.tree.leaves(args)]
        _assert_tree_close(
            exported.call(*args),
            jitted(*args),
            f"exported vs concrete at {shapes}",
            rtol or d_rtol,
            atol or d_atol,
        )
    return exported


# ---------------------------------------------------------------- every operator
def test_every_operator_is_covered():
    assert "attention" in _BUILTIN and "linear_cross_entropy" in _BUILTIN
    for name in _BUILTIN:
        shapes = _SYMBOLIC.get(name, ("b, t",) * len(_sample(name)))
        assert len(shapes) == len(_sample(name)), name


# attention's (30 s on 2 cores) runs with make test-extended; test_attention_symbolic_*
# below export it with symbolic lengths in make test. Of the others, every second
# operator in make test (tests/_tiers.py), all of them in make test-extended.
@pytest.mark.parametrize(
    "name",
    sample(
        [
            pytest.param(n, marks=pytest.mark.extended)
            if n in ("attention", "linear_cross_entropy", "linear_jensen_shannon")
            else n
            for n in _BUILTIN
        ],
        every=2,
    ),
)
def test_operator_exports_with_symbolic_dims(name):
    spec = registry()[name]
    sample = _sample(name)
    shapes = _SYMBOLIC.get(name, ("b, t",) * len(sample))
    argnums = tuple(
        i
        for i, a in enumerate(sample)
        if jnp.issubdtype(a.dtype, jnp.floating) and i not in spec.nondiff_argnums
    )
    # Each size's arguments: the sample's values tiled to the shape (np.resize), so they
    # stay in the operator's domain (positive for log, labels in range).
    calls = [
        tuple(
            jnp.asarray(np.resize(np.asarray(a), _concrete(s, sizes)) if s else a)
            for a, s in zip(sample, shapes, strict=True)
        )
        for sizes in _SIZES
    ]
    specs = _specs(
        [s or a.shape for a, s in zip(sample, shapes, strict=True)], [a.dtype for a in sample]
    )
    for n, cfg in enumerate(spec.configs):
        program = _value_and_vjp(lambda *a, cfg=cfg: spec.fn(*a, **cfg), argnums)
        # Every size for the first config, the last for the others (the file stays fast).
        _check_exported(program, specs, calls if n == 0 else calls[-1:])


# ---------------------------------------------------------------- attention, cross-entropy
@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_attention_symbolic_length_spans_default_blocks():
    # With a symbolic length the default blocks stay 128 x 128 and the length is padded:
    # lengths across the 128 boundary visit several blocks, the causal mask skips some.
    fn = lambda q, k, v: cannjax.ops.attention(q, k, v, causal=True)  # noqa: E731
    program = _value_and_vjp(fn, (0, 1, 2))
    specs = _specs(["b, t, 2, 4", "b, t, 1, 4", "b, t, 1, 4"], [jnp.float32] * 3)
    keys = jax.random.split(jax.random.key(1), 3)
    calls = [
        tuple(rand.normal(k, (b, t, n, 4)) for k, n in zip(keys, (2, 1, 1), strict=True))
        for b, t in ((1, 130), (2, 257))
    ]
    _check_exported(program, specs, calls)


@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_attention_symbolic_mask():
    def fn(q, k, v, mask):
        return cannjax.ops.attention(q, k, v, mask=mask, block_q=2, block_k=3)

    program = lambda q, k, v, m: _value_and_vjp(lambda *a: fn(*a, m), (0, 1, 2))(q, k, v)  # noqa: E731
    specs = _specs(
        ["b, t, 2, 4", "b, s, 2, 4", "b, s, 2, 4", "b, 1, t, s"],
        [jnp.float32] * 3 + [jnp.bool_],
    )
    calls = []
    for b, t, s in ((1, 5, 7), (2, 3, 2)):  # masked rows (no key) at some sizes
        keys = jax.random.split(jax.random.key(t), 4)
        q = rand.normal(keys[0], (b, t, 2, 4))
        k, v = (rand.normal(kk, (b, s, 2, 4)) for kk in keys[1:3])
        calls.append((q, k, v, jax.random.bernoulli(keys[3], 0.7, (b, 1, t, s))))
    _check_exported(program, specs, calls)


def test_symbolic_dimensions_that_cannot_work_raise():
    f32 = jnp.float32
    q = _specs(["b, t, 2, h"], [f32])[0]
    with pytest.raises(ValueError, match=r"attention: .*H = q.shape\[3\] is symbolic"):
        export.export(jax.jit(lambda q: cannjax.ops.attention(q, q, q)))(q)
    export.export(jax.jit(lambda q: cannjax.ops.attention(q, q, q, scale=0.5)))(q)

    x, w, labels = _specs(["b, 4", "4, v", "b"], [f32, f32, jnp.int32])
    lce = cannjax.ops.linear_cross_entropy
    with pytest.raises(ValueError, match=r"linear_cross_entropy: .*V = w.shape\[1\]"):
        export.export(jax.jit(lambda x, w, y: lce(x, w, y)))(x, w, labels)
    export.export(jax.jit(lambda x, w, y: lce(x, w, y, chunk_size=8)))(x, w, labels)


# ---------------------------------------------------------------- transforms and the GPT step
def _mlp(x, w1, w2):
    h = jnp.tanh(x @ w1) * jax.nn.sigmoid(x @ w1)
    return jnp.mean(jnp.sin(h @ w2) * jnp.exp(-jnp.square(h @ w2)))


def test_fused_function_exports():
    k1, k2, k3 = jax.random.split(jax.random.key(2), 3)
    w1, w2 = rand.normal(k1, (6, 8)), rand.normal(k2, (8, 3))
    step = lambda x, w1, w2: jax.value_and_grad(cannjax.fuse(_mlp), (0, 1, 2))(x, w1, w2)  # noqa: E731
    specs = _specs(["b, t, 6", (6, 8), (8, 3)], [jnp.float32] * 3)
    calls = [(rand.normal(k3, (b, t, 6)), w1, w2) for b, t in ((1, 1), (2, 5), (3, 4))]
    _check_exported(step, specs, calls)
    # The fused program equals the unfused one, too.
    x = calls[1][0]
    _assert_tree_close(
        step(x, w1, w2),
        jax.value_and_grad(_mlp, (0, 1, 2))(x, w1, w2),
        "fused vs plain",
        1e-5,
        1e-6,
    )


_CFG = cannjax.models.GPTConfig(vocab=16, width=8, heads=2, layers=1, seq_len=8)


def _gpt_specs():
    # The position table has seq_len rows: the length is constrained to fit it (without
    # the constraint, the model's own length check is undecidable).
    scope = export.SymbolicScope([f"t <= {_CFG.seq_len}"])
    tokens = jax.ShapeDtypeStruct(export.symbolic_shape("b, t", scope=scope), jnp.int32)
    params = cannjax.models.init_gpt(jax.random.key(0), _CFG)
    return params, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params), tokens


def _gpt_calls(params, sizes):
    calls = []
    for b, t in sizes:
        tokens = rand.randint(jax.random.key(t), (b, t), 0, _CFG.vocab)
        calls.append((params, tokens, jnp.flip(tokens, 1)))
    return calls


def test_gpt_step_exports():
    params, pspec, tokens = _gpt_specs()

    def step(p, x, y):
        return jax.value_and_grad(cannjax.models.gpt_loss)(p, x, y, _CFG)

    exported = _check_exported(step, (pspec, tokens, tokens), _gpt_calls(params, ((1, 1), (3, 8))))
    assert str(exported.in_avals[-1].shape) == "(b, t)"


@pytest.mark.extended  # long; make test-extended (CI) runs it
def test_optimized_loss_exports():
    params, pspec, tokens = _gpt_specs()
    loss = cannjax.optimize(cannjax.models.plain_gpt_loss)

    def step(p, x, y):
        return jax.value_and_grad(loss)(p, x, y, _CFG)

    _check_exported(step, (pspec, tokens, tokens), _gpt_calls(params, ((1, 3), (3, 8))))
