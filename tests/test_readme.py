"""The README's example: what it does beyond the output it shows.

tests/test_docs.py runs the example (a pycon block) and compares each line's output with
the README's; here, the same session is checked for what the output does not show.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tests.test_docs import ROOT, run_page


def test_readme_example_fuses_into_one_operator():
    namespace, counts = run_page(ROOT / "README.md")
    assert counts["checked"] >= 1
    act, x = namespace["act"], namespace["x"]
    ones = jnp.ones(3)
    eqns = jax.make_jaxpr(act)(ones).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["cannjax_op"], eqns
    np.testing.assert_allclose(act(ones), jnp.tanh(ones) * jax.nn.sigmoid(ones), rtol=1e-6)
    assert x.shape == (3,) and not np.isfinite(x[1])  # the example's point: -inf
