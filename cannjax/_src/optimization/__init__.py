"""cannjax.optimize: operator substitution, fusion and remat for unmodified JAX code."""
