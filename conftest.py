"""Strict JAX settings for the whole suite (tests and doctests), set before any backend
starts: 8 CPU devices, so that sharded programs and their examples run on one host."""

import os

os.environ.setdefault("XLA_FLAGS", "")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")
