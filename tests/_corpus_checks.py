"""The check that tests/test_optimize_corpus.py and tests/test_optimize_heldout.py run on
each third-party model in mixed precision."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import optimize_corpus  # noqa: E402


def assert_found_and_as_accurate_in_bfloat16(model, size, native: bool = False) -> dict:
    """optimize finds every idiom of ``model`` run in bfloat16 (its parameters cast in
    the loss, or ``native``: its library's own setting), and its gradients are no
    further from the float32 model's than the unoptimized bfloat16 step's
    (:func:`optimize_corpus.half_accuracy`). Returns the measurement."""
    with jax.numpy_rank_promotion("allow"):  # the libraries broadcast implicitly
        r = optimize_corpus.measure(
            model, size, timed=False, repeats=0, compute=jnp.bfloat16, native=native
        )
    assert r["found"] == r["present"], (r["found"], r["present"], r["left"])
    assert r["grad_err"]["finite"] and r["grad_err"]["within"], r["grad_err"]
    if native:  # the setting is in effect: the model's products are bfloat16 ones
        with jax.numpy_rank_promotion("allow"):
            params, batch, loss = model.build(size, 0, compute=jnp.bfloat16)
            eqns = jax.make_jaxpr(loss)(params, batch).eqns
        dots = [e for e in eqns if e.primitive.name == "dot_general"]
        assert sum(all(v.aval.dtype == jnp.bfloat16 for v in e.invars) for e in dots) >= 2
    return r
