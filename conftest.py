"""Strict JAX settings for the whole suite (tests and doctests), set before any backend
starts: 8 CPU devices, so that sharded programs and their examples run on one host.

Two settings make the suite compile less (make test's time is mostly XLA:CPU compiling
small programs):

- XLA:CPU compiles cheaply (``FAST_CODEGEN``): LLVM at -O0 without its expensive passes,
  and the elemental IR emitters in place of the newer fusion emitters. The HLO the tests
  inspect (fusions, residuals, memory) is the same; the machine code is slower and may
  round differently in the last bits (a different ``tanh`` approximation, no FMA
  contraction), which the tests' float32 tolerances allow. This halves the suite's time.
  Notebooks run in kernels with the user's own settings, since their stored outputs are
  what a user sees (tests/test_notebooks.py). ``XLA_FLAGS= make test`` runs the whole
  suite with XLA's defaults.
- One persistent compilation cache for the run, shared by its pytest-xdist workers and
  deleted at its end: many tests compile the same program again (a fresh lambda over the
  same operator and shapes), and load it instead.
"""

import atexit
import collections
import os
import shutil
import tempfile

FAST_CODEGEN = (
    "--xla_llvm_disable_expensive_passes=true --xla_backend_optimization_level=0 "
    "--xla_cpu_use_fusion_emitters=false"
)
# The flags the user runs with (none: XLA's defaults), for processes that must see them.
os.environ.setdefault("CANNJAX_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("XLA_FLAGS", FAST_CODEGEN)
# optimize's finders raise instead of reporting "finder failed" (a finder bug is a bug).
os.environ.setdefault("CANNJAX_STRICT_FINDERS", "1")
if "CANNJAX_TEST_JAX_CACHE" not in os.environ:  # the first process; workers inherit it
    os.environ["CANNJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="cannjax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["CANNJAX_TEST_JAX_CACHE"], ignore_errors=True)
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_compilation_cache_dir", os.environ["CANNJAX_TEST_JAX_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_terminal_summary(terminalreporter):
    """One line for tests/test_docs.py: the code blocks of the pages run and checked.

    The counts come with the passed tests' reports (``record_property``), so they add up
    over pytest-xdist's workers too.
    """
    counts, pages = collections.Counter(), 0
    for report in terminalreporter.stats.get("passed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "docs code blocks":
                counts.update(value)
                pages += "run" in value
    if counts:
        terminalreporter.write_line(
            f"docs code blocks: {counts['run']} run on {pages} pages ({counts['checked']} "
            f"sessions with their output compared), {counts['not run']} marked not run"
        )


@pytest.fixture(autouse=True, scope="session")
def _backend_started():
    """Starts the test process's JAX backend (8 CPU devices) before the first test.

    So no test depends on the order it runs in: what a process may do only before its
    backend starts (choosing the device count as ``cannjax demo --mesh`` does, or
    ``cannjax.backend.keep_freed_memory``, which the demo calls) leaves the test process
    alone and is tested in child processes.
    """
    jax.devices()
