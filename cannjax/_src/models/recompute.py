"""Running a norm or an activation together with the projection that reads it, so the
backward recomputes the inner value instead of saving it (the models' layers)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from cannjax._src.remat.policies import save_operator_residuals


def recomputed(f: Callable[..., jax.Array], on: bool) -> Callable[..., jax.Array]:
    """``f`` (a norm or an activation, then the projection that reads it) under
    ``jax.checkpoint`` when ``on``: the backward recomputes the inner value (elementwise,
    or a row reduction) and the pair saves its inputs and the operators' named residuals
    (``cannjax.remat.policies.save_operator_residuals``: a gated MLP keeps its
    pre-activations) only. ``gelu(h)`` and ``ln(x)`` are otherwise saved twice over: by
    the projection (its input) beside ``h`` or ``x``, which the inner op's own backward
    keeps; one ``[B, T, 4D]`` and two ``[B, T, D]`` residuals less per layer. XLA drops
    the recomputed products, which nothing reads. Under ``lax.scan`` the forward and the
    backward are separate loops, so the recomputation is real
    (``cannjax/_src/optimization/rewrite.py`` says why ``optimize`` pairs them in loop
    bodies only)."""
    return jax.checkpoint(f, policy=save_operator_residuals) if on else f
