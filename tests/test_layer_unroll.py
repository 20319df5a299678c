"""The models' layer loop in half precision: unrolled where the platform writes stacked
half arrays through float32 (XLA:CPU), so that no step converts a whole stack.

What is asserted is read off the compiled program (its HLO and temp size), which is
deterministic; the time it saves is ``benchmarks/gpt.py``'s.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cannjax import backend, models
from cannjax._src.models.compute import layer_unroll
from tests import _rng as rand

GPT = models.GPTConfig(vocab=64, width=32, heads=2, layers=3, seq_len=16, dtype="bfloat16")
LLAMA = models.LlamaConfig(
    vocab=64, width=32, heads=4, kv_heads=2, layers=3, seq_len=16, hidden=64, dtype="bfloat16"
)
CASES = {
    "gpt": (GPT, models.init_gpt, models.gpt_loss),
    "llama": (LLAMA, models.init_llama, models.llama_loss),
}


def _compiled_step(name, **changes):
    cfg, init, loss = CASES[name]
    cfg = dataclasses.replace(cfg, **changes)
    params = init(jax.random.key(0), cfg)
    tokens = rand.randint(jax.random.key(1), (2, cfg.seq_len), 0, cfg.vocab)
    step = jax.jit(jax.value_and_grad(loss), static_argnums=3)
    compiled = step.lower(params, tokens, tokens, cfg).compile()
    return compiled, lambda: compiled(params, tokens, tokens)


def _stack_round_trips(hlo: str, layers: int) -> list[str]:
    """Slice writes into a stacked half array (``bf16[L, ...]``) made in float32: a
    ``dynamic-update-slice`` of the whole stack converted to float32."""
    stack = rf"\[{layers},[0-9,]*\]"
    halves = set(re.findall(rf"%([\w.\-]+) = bf16{stack}", hlo))
    widened = {
        out
        for out, src in re.findall(rf"%([\w.\-]+) = f32{stack}\S* convert\(%([\w.\-]+)\)", hlo)
        if src in halves
    }
    updates = re.findall(rf"= f32{stack}\S* dynamic-update-slice\(%([\w.\-]+),", hlo)
    return [u for u in updates if u in widened]


def test_cpu_writes_half_stacks_through_float32_and_other_platforms_do_not():
    assert backend.facts("cpu").half_stacks_convert
    assert not backend.facts("cuda").half_stacks_convert
    assert not backend.facts("ascend").half_stacks_convert


@pytest.mark.parametrize(
    "unroll, dtype, want",
    [(None, jnp.bfloat16, 5), (None, jnp.float16, 5), (None, jnp.float32, 1), (2, jnp.bfloat16, 2)],
)
def test_layer_unroll_unrolls_half_precision_on_cpu_only(unroll, dtype, want):
    assert jax.default_backend() == "cpu"
    assert layer_unroll(unroll, 5, dtype) == want


@pytest.mark.parametrize("name", sorted(CASES))
def test_half_step_converts_no_stack_and_needs_less_temp_than_the_rolled_loop(name):
    auto, run_auto = _compiled_step(name)
    rolled, run_rolled = _compiled_step(name, unroll=1)
    layers = CASES[name][0].layers
    # The rolled loop writes each layer's bf16 residual by a float32 round trip of the
    # whole stack (the check's premise); the automatic choice has no stack to convert.
    assert _stack_round_trips(rolled.as_text(), layers)
    assert not _stack_round_trips(auto.as_text(), layers)
    assert auto.memory_analysis().temp_size_in_bytes < rolled.memory_analysis().temp_size_in_bytes
    (loss_a, grads_a), (loss_r, grads_r) = run_auto(), run_rolled()
    np.testing.assert_allclose(loss_a, loss_r, rtol=1e-2)
    for a, r in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_r)):
        scale = float(jnp.max(jnp.abs(r))) + 1e-30
        assert float(jnp.max(jnp.abs(a - r))) <= 0.05 * scale


def test_float32_step_keeps_the_rolled_loop():
    cfg = dataclasses.replace(GPT, dtype=None)
    params = models.init_gpt(jax.random.key(0), cfg)
    tokens = jnp.zeros((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: models.gpt_loss(p, tokens, tokens, cfg))(params)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["unroll"] == 1 and scan.params["length"] == cfg.layers


@pytest.mark.parametrize("config", [models.GPTConfig, models.LlamaConfig])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "all"])
def test_configs_reject_a_bad_unroll(config, bad):
    kwargs = {} if config is models.GPTConfig else dict(LLAMA.__dict__, dtype=None)
    kwargs.pop("unroll", None)
    with pytest.raises(ValueError, match=rf"{config.__name__}: unroll must be"):
        config(**kwargs, unroll=bad)
