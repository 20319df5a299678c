"""Strict JAX settings for the whole suite (tests and doctests), set before any backend
starts: 8 CPU devices, so that sharded programs and their examples run on one host."""

import os

os.environ.setdefault("XLA_FLAGS", "")
# optimize's finders raise instead of reporting "finder failed" (a finder bug is a bug).
os.environ.setdefault("CANNJAX_STRICT_FINDERS", "1")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
