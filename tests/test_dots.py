"""The dot-form table: half-precision products in the platform's fast form, same values.

Which form runs is read off the compiled HLO (the dtypes of every ``dot``'s operands),
a deterministic property; the speed of each form is ``benchmarks/dot_forms.py``'s.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cannjax
from cannjax import models
from cannjax._src.core import dots
from cannjax.core import dot_form, dot_form_table, register_dot_form
from tests import _rng as rand

BF16, F32 = jnp.bfloat16, jnp.float32

NN = (((1,), (0,)), ((), ()))
NT = (((1,), (1,)), ((), ()))
TN = (((0,), (0,)), ((), ()))
BATCHED_TN = (((1,), (1,)), ((0,), (0,)))  # p^T do: [b, q, s] . [b, q, h] -> [b, s, h]
FORMS = {
    "nn": (NN, (48, 32), (32, 40)),
    "nt": (NT, (48, 40), (32, 40)),
    "tn": (TN, (48, 32), (48, 40)),
    "batched_tn": (BATCHED_TN, (3, 24, 16), (3, 24, 8)),
}


def operands(lhs, rhs, dtype=BF16, seed=0):
    ka, kb = jax.random.split(jax.random.key(seed))
    return (
        rand.normal(ka, lhs, F32).astype(dtype),
        rand.normal(kb, rhs, F32).astype(dtype),
    )


def hlo_dot_operand_dtypes(compiled_text: str) -> list[tuple[str, str]]:
    """The operand dtypes of every ``dot`` of an optimized HLO module."""
    dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", compiled_text))
    found = []
    for ops in re.findall(r" dot\(([^)]*)\)", compiled_text):
        a, b = (o.strip().split(" ")[-1].lstrip("%") for o in ops.split(","))
        found.append((dtypes[a], dtypes[b]))
    return found


@pytest.fixture
def cpu_form_restored():
    """Puts back the host CPU's bf16 entry that a test replaced."""
    old = dot_form("cpu", BF16)
    yield
    register_dot_form("cpu", BF16, old.form, transpose=old.transpose, source=old.source)


# ------------------------------------------------------------------ the table
def test_host_cpu_entry_follows_its_instruction_set():
    flags = dots.host_cpu_flags()
    entry = dot_form_table()[("cpu", "bfloat16")]
    fast = any(f in flags for f in ("avx512_bf16", "amx_bf16", "bf16"))
    assert entry.form == ("half" if fast else "float32"), entry
    assert entry.transpose is fast
    # float16 has no fast CPU product anywhere: converted to float32 first.
    assert dot_form("cpu", jnp.float16).form == "float32"
    # Platforms without an entry multiply half operands as they are.
    assert dot_form("tpu", BF16) == dots.DotForm("tpu", "bfloat16", "half", source="default")


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(platform="cpu", dtype=F32, form="half"), ValueError, "dtype must be one of"),
        (dict(platform="cpu", dtype=BF16, form="fast"), ValueError, "form must be one of"),
        (dict(platform="gpu", dtype=BF16, form="half"), ValueError, "use 'cuda' or 'rocm'"),
        (
            dict(platform="cpu", dtype=BF16, form="half", transpose=1),
            TypeError,
            "transpose must be a bool, got 1",
        ),
        (
            dict(platform="cpu", dtype=BF16, form="half", overwrite=False),
            ValueError,
            "has an entry; pass overwrite=True",
        ),
    ],
)
def test_register_dot_form_rejects_bad_input(kwargs, error, match):
    with pytest.raises(error, match=f"cannjax.core.register_dot_form: .*{match}"):
        register_dot_form(**kwargs)


# ------------------------------------------------------------------ values
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("out", [None, F32])
def test_half_products_equal_the_float32_product_of_the_same_operands(form, out):
    dims, lhs, rhs = FORMS[form]
    a, b = operands(lhs, rhs)
    want = lax.dot_general(a.astype(F32), b.astype(F32), dims, precision="highest")
    got = jax.jit(lambda a, b: dots.dot_general(a, b, dims, out_dtype=out))(a, b)
    assert got.dtype == (out or BF16)
    # float32 accumulation, rounded once to the output dtype.
    tol = 1e-5 if out == F32 else 2**-8
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want), rtol=tol, atol=tol)


@pytest.mark.parametrize("k,p", [(32, 40), (40, 32)])  # either operand is the smaller
def test_weight_grad_transposes_the_smaller_operand_and_gives_x_t_g(k, p):
    x, g = operands((64, k), (64, p))
    want = np.asarray(x, F32).T @ np.asarray(g, F32)
    got = jax.jit(lambda x, g: dots.weight_grad(x, g, out_dtype=F32))(x, g)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # Its result can be transposed and multiplied again: the constraint on the result
    # keeps XLA from folding the transpose into a product its kernels cannot run.
    m = jnp.ones((k, 8), F32)
    again = jax.jit(lambda x, g: dots.weight_grad(x, g, out_dtype=F32).T @ m)(x, g)
    np.testing.assert_allclose(np.asarray(again), want.T @ np.ones((k, 8)), rtol=1e-5)


def test_transposed_form_composes_with_grad_vmap_and_jvp():
    dims, lhs, rhs = FORMS["tn"]
    a, b = operands(lhs, rhs, F32)

    def f(a, b, dtype):
        return jnp.sum(dots.dot_general(a.astype(dtype), b.astype(dtype), dims, out_dtype=F32))

    for dtype, tol in ((BF16, 2**-7), (F32, 1e-6)):
        ga, gb = jax.jit(jax.grad(f, (0, 1)), static_argnums=2)(a, b, dtype)
        # d/da sum(a^T b) = the row sums of b, broadcast (of the operands as rounded).
        ar, br = a.astype(dtype).astype(F32), b.astype(dtype).astype(F32)
        want_a = jnp.broadcast_to(br.sum(1, keepdims=True), a.shape)
        want_b = jnp.broadcast_to(ar.sum(1, keepdims=True), b.shape)
        np.testing.assert_allclose(ga, want_a, rtol=tol, atol=tol * 8)
        np.testing.assert_allclose(gb, want_b, rtol=tol, atol=tol * 8)
    batched = jax.vmap(lambda a, b: dots.dot_general(a, b, dims, out_dtype=F32))
    a3, b3 = operands((2, *lhs), (2, *rhs))
    want = jnp.einsum("bnk,bnp->bkp", a3.astype(F32), b3.astype(F32))
    np.testing.assert_allclose(jax.jit(batched)(a3, b3), want, rtol=1e-5, atol=1e-5)
    t = jax.jvp(
        lambda a: dots.dot_general(a, b.astype(BF16), dims), (a.astype(BF16),), (a.astype(BF16),)
    )
    np.testing.assert_allclose(np.asarray(t[0], F32), np.asarray(t[1], F32), rtol=1e-2)


# ------------------------------------------------------------------ forms in the HLO
def _expected_operand_dtype() -> str:
    return "bf16" if dot_form("cpu", BF16).form == "half" else "f32"


@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_half_product_runs_in_the_platform_form(form):
    dims, lhs, rhs = FORMS[form]
    a, b = operands(lhs, rhs)
    text = jax.jit(lambda a, b: dots.dot_general(a, b, dims)).lower(a, b).compile().as_text()
    want = _expected_operand_dtype()
    assert hlo_dot_operand_dtypes(text) == [(want, want)]


def test_plain_transposed_half_product_is_upcast_by_xla():
    # Why the table's transpose flag exists: XLA:CPU runs x^T g with bf16 operands as a
    # float32 product (on this jaxlib). If this starts failing, XLA keeps it in bf16 now
    # and the flag's copies may be dropped.
    if dot_form("cpu", BF16).form != "half":
        pytest.skip("the host CPU converts every bf16 product to float32 (no fast form)")
    a, b = operands((48, 32), (48, 40))
    f = jax.jit(lambda a, b: lax.dot_general(a, b, TN, preferred_element_type=F32))
    assert hlo_dot_operand_dtypes(f.lower(a, b).compile().as_text()) == [("f32", "f32")]


def test_float32_form_converts_first_and_is_chosen_at_lowering(cpu_form_restored):
    a, b = operands((48, 32), (32, 40))
    register_dot_form("cpu", BF16, "float32", source="test")
    f = jax.jit(lambda a, b: dots.dot_general(a, b, NN))
    # Different forms on different platforms: staged out for each, one kept at lowering.
    assert "platform_index" in str(jax.make_jaxpr(f)(a, b))
    text = f.lower(a, b).compile().as_text()
    assert hlo_dot_operand_dtypes(text) == [("f32", "f32")]
    want = lax.dot_general(a.astype(F32), b.astype(F32), NN).astype(BF16)
    np.testing.assert_array_equal(np.asarray(f(a, b), F32), np.asarray(want, F32))
    # The operators' rules follow the table: a changed entry is a new trace.
    x, w = operands((4, 6, 32), (32, 40))
    grad = jax.jit(jax.grad(lambda x, w: cannjax.ops.linear(x, w).astype(F32).sum(), (0, 1)))
    text = grad.lower(x, w).compile().as_text()
    assert {d for pair in hlo_dot_operand_dtypes(text) for d in pair} == {"f32"}


def test_wide_products_are_untouched():
    a, b = operands((48, 32), (48, 40), F32)
    plain = jax.jit(lambda a, b: lax.dot_general(a, b, TN)).lower(a, b).as_text()
    ours = jax.jit(lambda a, b: dots.weight_grad(a, b)).lower(a, b).as_text()
    strip = lambda t: re.sub(r"loc\(.*?\)|#loc\d*( = .*)?", "", t)  # noqa: E731
    assert strip(plain).count("dot_general") == strip(ours).count("dot_general") == 1
    assert "layout" not in ours.lower().replace("#loc", "")


# ------------------------------------------------------------------ the bf16 GPT step
def test_every_matrix_product_of_the_bf16_gpt_step_takes_the_fast_form():
    cfg = models.GPTConfig(vocab=64, width=32, heads=2, layers=2, seq_len=16, dtype="bfloat16")
    params = models.init_gpt(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 16), jnp.int32)
    step = jax.jit(jax.value_and_grad(models.gpt_loss), static_argnums=3)
    text = step.lower(params, tokens, tokens, cfg).compile().as_text()
    shapes = dict(re.findall(r"%([\w.\-]+) = \w+\[([0-9,]*)\]", text))
    want = _expected_operand_dtype()
    matrix_products = 0
    for ops in re.findall(r" dot\(([^)]*)\)", text):
        names = [o.strip().split(" ")[-1].lstrip("%") for o in ops.split(",")]
        if min(int(n) for name in names for n in shapes[name].split(",")) == 1:
            continue  # matrix-vector products: the norms' float32 sums
        matrix_products += 1
        dtypes = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
        assert [dtypes[n] for n in names] == [want, want], ops
    # 6 per layer forward and 11 backward (attention's blocks, projections), the head.
    assert matrix_products >= 2 * 10


def test_bf16_model_keeps_half_the_residual_bytes_and_float32_gradients():
    cfg = models.GPTConfig(vocab=64, width=32, heads=2, layers=2, seq_len=16)
    params = models.init_gpt(jax.random.key(0), cfg)
    tokens = rand.randint(jax.random.key(1), (2, 16), 0, 64)

    def residual_bytes(c):
        loss = lambda p: models.gpt_loss(p, tokens, tokens, c)  # noqa: E731
        return cannjax.inspect.residuals(loss, params).total_bytes

    half = dataclasses.replace(cfg, dtype="bfloat16")
    loss16, g16 = jax.value_and_grad(models.gpt_loss)(params, tokens, tokens, half)
    loss32, g32 = jax.value_and_grad(models.gpt_loss)(params, tokens, tokens, cfg)
    assert loss16.dtype == F32 and all(g.dtype == F32 for g in jax.tree.leaves(g16))
    np.testing.assert_allclose(loss16, loss32, rtol=1e-2)
    cos = [
        float(jnp.vdot(a, b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))
        for a, b in zip(jax.tree.leaves(g16), jax.tree.leaves(g32))
        if jnp.linalg.norm(b) > 0
    ]
    assert min(cos) > 0.99, cos
    # Saved for the backward: the activations in bf16, the norms' statistics in f32.
    assert residual_bytes(half) < 0.6 * residual_bytes(cfg)
