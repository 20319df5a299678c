"""cannjax.backend.keep_freed_memory: glibc keeps freed memory, so steps stop faulting.

The allocator is a setting of the whole process: the effect is checked in child
processes (one with the call, one without), by the page faults per execution of a jitted
function with a 32 MiB temp buffer. Fault counts do not depend on the machine's load.
"""

import os
import platform
import subprocess
import sys
import textwrap

import pytest

import cannjax

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# A jitted function whose compiled temp is 32 MiB; runs 20 times to let the heap settle,
# then prints the temp's page count and the fewest minor faults per run of 6 windows of
# 5 runs (where threads' timing fragments the heap, it may take longer to settle).
CHILD = textwrap.dedent(
    """
    import resource, sys
    import cannjax
    if sys.argv[1] == "keep":
        assert cannjax.backend.keep_freed_memory() is True
    import jax, jax.numpy as jnp
    f = jax.jit(lambda x: jnp.sin(jnp.cos(x) @ x.T).sum(0) + jnp.tanh(x).sum(0))
    x = jnp.ones((2048, 2048))
    temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
    for _ in range(20):
        f(x).block_until_ready()
    windows = []
    for _ in range(6):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            f(x).block_until_ready()
        windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 5)
    print(temp // 4096, min(windows))
    """
)


def _pages_and_faults(mode: str) -> tuple[int, float]:
    # The glibc variables would make both children keep freed memory.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    pages, faults = out.stdout.split()
    return int(pages), float(faults)


@pytest.mark.skipif(not GLIBC, reason="keep_freed_memory sets glibc's allocator")
def test_keep_freed_memory_stops_the_page_faults_of_each_execution():
    pages, faults = _pages_and_faults("default")
    # Without it, every execution first-touches its fresh temp again.
    assert pages >= 8192 and faults > 0.5 * pages, (pages, faults)
    pages, faults = _pages_and_faults("keep")
    assert faults < 0.02 * pages, (pages, faults)


def test_keep_freed_memory_refuses_once_a_backend_has_started():
    import jax

    jax.numpy.zeros(1).block_until_ready()  # the test process's backend is running
    with pytest.raises(RuntimeError, match=r"keep_freed_memory: a JAX backend has already"):
        cannjax.backend.keep_freed_memory()


@pytest.mark.parametrize(
    ("top_pad", "error", "match"),
    [
        ("256", TypeError, r"keep_freed_memory: top_pad must be an int \(bytes\), got str"),
        (True, TypeError, r"top_pad must be an int \(bytes\), got bool"),
        (-1, ValueError, r"keep_freed_memory: top_pad must be in \[0, 2\*\*31\) bytes, got -1"),
        (2**31, ValueError, r"got 2147483648"),
    ],
)
def test_keep_freed_memory_rejects_bad_top_pad(top_pad, error, match):
    with pytest.raises(error, match=match):
        cannjax.backend.keep_freed_memory(top_pad=top_pad)
