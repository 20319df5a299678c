"""The suite's cheap codegen (conftest.py's FAST_CODEGEN) changes XLA:CPU's machine code,
never the optimized HLO the tests inspect: a program with a norm, matmuls, gelu and a
softmax compiles to the same HLO and the same temp memory under the user's flags."""

import os
import re
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import re
    import jax, jax.numpy as jnp
    from cannjax import ops

    def loss(x, w, w2):
        g = jnp.ones(x.shape[-1])
        h = jax.nn.gelu(ops.layer_norm(x, g, g) @ w) @ w2
        return jnp.sum(jax.nn.softmax(h, -1) * x)

    args = (jnp.ones((4, 32, 64)), jnp.ones((64, 256)), jnp.ones((256, 64)))
    c = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile()
    hlo = re.sub(r", metadata=\\{[^}]*\\}", "", c.as_text())
    print(c.memory_analysis().temp_size_in_bytes)
    print(hlo)
    """
)


def _compiled(flags: str) -> str:
    env = dict(os.environ, XLA_FLAGS=flags)
    r = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_the_suites_codegen_keeps_the_hlo_and_memory_of_the_users():
    fast = _compiled(os.environ["XLA_FLAGS"])
    user = _compiled(os.environ["CANNJAX_TEST_USER_XLA_FLAGS"])
    temp_fast, temp_user = int(fast.split("\n", 1)[0]), int(user.split("\n", 1)[0])
    assert temp_fast == temp_user > 0
    assert len(re.findall(r" fusion\(", fast)) > 3
    assert fast == user
