"""``cannjax.optimize``: cannjax's backward rules, fusion and remat for unmodified code.

``optimize(fun, level=2)`` traces ``fun`` once per input signature and rewrites its
program in three stages, each level adding one:

1. elementwise fusion, as :func:`cannjax.fuse` (level 1);
2. operator substitution (level 2): attention, layer and RMS norms, dense layers,
   activations, the softmax family, cross-entropies and norms, found however the code
   was written (``jax.nn``, flax, equinox, optax, ``jnp``), become the cannjax operators
   of equal math (:mod:`cannjax._src.optimization.rewrite`), before fusion; and each
   top-level scan's carries are placed as their initial values under a sharded program,
   and a top-level scan computing in half precision runs unrolled where the platform
   writes stacked half arrays through float32 (:mod:`cannjax._src.optimization.loops`);
3. rematerialization under ``memory_budget`` (level 3): the bodies of ``lax.scan`` (the
   layers of a scanned model) are checkpointed with the cheapest policy whose compiled
   gradient fits the budget (:mod:`cannjax._src.optimization.budget`).

The result has ``fun``'s signature and values (up to float rounding, and the documented
edge conventions of the operators, ``docs/optimize.md``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from cannjax._src.core import rewrite as R
from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.core.signatures import (
    NeedsConcreteValues,
    PerSignature,
    is_dynamic,
    trace_signature,
)
from cannjax._src.fuse.transform import plan_jaxpr, run_plan
from cannjax._src.optimization import budget as B
from cannjax._src.optimization.loops import carries_placed_like_init, half_loops_unrolled
from cannjax._src.optimization.match import without_repeats
from cannjax._src.optimization.rewrite import SubPlan, plan_substitution

_FN = "cannjax.optimize"

LEVELS = (0, 1, 2, 3)
"""The values of ``optimize``'s ``level``.

* ``0``: ``fun`` unchanged.
* ``1``: elementwise fusion (:func:`cannjax.fuse`).
* ``2`` (default): operator substitution, then fusion of what remains.
* ``3``: level 2, then the layers of scanned models checkpointed to fit ``memory_budget``.
"""


@dataclasses.dataclass
class Entry:
    """What ``optimize`` made of one input signature.

    Attributes:
      substitution: the operator substitution (None below level 2).
      fusion: the fusion plan run at the end (None at level 0).
      remat: the policy chosen at level 3 (a :class:`cannjax._src.optimization.budget.Choice`).
      placed_loops: how many top-level scans have their carries placed as their initial
        values (:mod:`cannjax._src.optimization.loops`).
      unrolled_loops: how many top-level scans computing in half precision run unrolled
        (the same module).
      consts: constants passed before the inputs.
      out_tree: tree structure of the outputs.
    """

    substitution: SubPlan | None
    fusion: Any
    remat: Any
    consts: tuple
    out_tree: Any
    placed_loops: int = 0
    unrolled_loops: int = 0

    def run(self, dyn_leaves) -> list:
        return run_plan(self.fusion, [*self.consts, *dyn_leaves])


def _check_level(level: Any, memory_budget: Any) -> None:
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"{_FN}: level must be one of {LEVELS}, got {level!r}")
    if memory_budget is None:
        if level == 3:
            raise ValueError(f"{_FN}: level 3 needs memory_budget (bytes), got None")
        return
    if level != 3:
        raise ValueError(f"{_FN}: memory_budget applies to level 3 only, got level={level}")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)):
        raise TypeError(f"{_FN}: memory_budget must be an int (bytes), got {memory_budget!r}")
    if memory_budget <= 0:
        raise ValueError(f"{_FN}: memory_budget must be > 0 bytes, got {memory_budget}")


@keyword_decorator
def optimize(
    fun: Callable[..., Any], *, level: int = 2, memory_budget: int | None = None
) -> Callable[..., Any]:
    """Gives unmodified JAX, flax or equinox code cannjax's backward rules, fusion and remat.

    ``optimize(loss)`` has ``loss``'s signature and values; differentiate it as usual
    (``jax.value_and_grad(optimize(loss))``, ``nnx.value_and_grad``,
    ``eqx.filter_value_and_grad``). Its program is rewritten at the level asked
    (:data:`LEVELS`): the idioms of the code (attention, layer norm, dense layers,
    activations, softmax, cross-entropy...) become cannjax operators whose hand-written
    backward rules keep fewer residuals, the remaining elementwise chains are fused, and
    at level 3 scanned layers are checkpointed to fit ``memory_budget``.

    A replacement is made only where the equations are proven to compute the operator's
    math (same axes, eps, dtypes and mask); anything uncertain stays as written.
    ``cannjax.inspect.optimize`` reports every replacement with its source line, and what
    was left alone and why. ``fun`` is traced once per input signature (tree structure,
    shapes, dtypes, and the values of non-array leaves such as Python numbers, which are
    static as under ``eqx.filter_jit``); apply ``optimize`` to the function you
    differentiate, not to a function that already calls ``jax.grad``.

    Also a decorator: ``@cannjax.optimize`` or ``@cannjax.optimize(level=3, ...)``.

    Args:
      fun: the function; pytrees of arrays in (flax.nnx state or modules, equinox modules,
        dicts) and out.
      level: 0, 1, 2 or 3 (:data:`LEVELS`).
      memory_budget: level 3 only: bytes of compiled temp memory allowed for the gradient
        of ``fun``'s scalar output with respect to its floating inputs.

    Returns:
      A function with the signature and values of ``fun``.

    Raises:
      TypeError: if ``fun`` is not callable, ``memory_budget`` is not an int, or (when
        called) ``fun`` cannot be traced or returns something that is not an array.
      ValueError: for a level not in :data:`LEVELS`, a ``memory_budget`` without level 3
        (or level 3 without one), or (when called) a budget below the least feasible.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> def loss(w, x):
      ...     h = jax.nn.gelu(x @ w)
      ...     return jnp.mean(jax.nn.logsumexp(h, axis=-1))
      >>> w, x = jnp.ones((4, 3)) / 4, jnp.ones((2, 4))
      >>> fast = cannjax.optimize(loss)
      >>> bool(jnp.allclose(jax.grad(fast)(w, x), jax.grad(loss)(w, x)))
      True
      >>> [r.op for r in cannjax.inspect.optimize(loss, w, x).replaced]
      ['linear', 'gelu', 'logsumexp']
    """
    if not callable(fun):
        raise TypeError(f"{_FN}: fun must be callable, got {type(fun).__name__} {fun!r}")
    _check_level(level, memory_budget)
    entry = PerSignature(is_dynamic, lambda *sig: _make_entry(fun, *sig, level, memory_budget))

    @functools.wraps(fun)
    def optimized(*args, **kwargs):
        if level == 0:
            return fun(*args, **kwargs)
        e, dyn_leaves = entry(args, kwargs)
        return jax.tree_util.tree_unflatten(e.out_tree, e.run(dyn_leaves))

    def plan_for(*args, **kwargs) -> Entry:
        return entry(args, kwargs)[0]

    optimized.optimize_entry = plan_for
    optimized.optimize_options = {"level": level, "memory_budget": memory_budget}
    return optimized


def _describe(leaf) -> str:
    return f"{type(leaf).__name__} {leaf!r}"[:80]


def _check_output(path, leaf) -> None:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        where = jax.tree_util.keystr(path) or "(the output itself)"
        raise TypeError(
            f"{_FN}: fun must return arrays (a pytree of them); output {where} is {_describe(leaf)}"
        )


def _make_entry(fun, in_tree, dyn, statics, avals, level, memory_budget) -> Entry:
    try:
        t = trace_signature(fun, in_tree, dyn, statics, avals, _check_output)
    except NeedsConcreteValues as err:
        raise TypeError(
            f"{_FN}: fun cannot be traced with abstract inputs (it needs concrete values: "
            f"{err}); pass values that steer Python control flow as Python numbers (they "
            f"are static), or write the branch with jnp.where / lax.cond"
        ) from None
    jaxpr, consts = t.jaxpr, t.consts
    sub = None
    placed = unrolled = 0
    if level >= 2:
        jaxpr, consts = without_repeats(jaxpr, consts)
        sub = plan_substitution(jaxpr, consts)
        if sub.replacements or sub.bodies:
            jaxpr, consts2 = R.retrace(jaxpr, sub.steps())
            consts = (*consts2, *consts)
        jaxpr, consts, placed = carries_placed_like_init(jaxpr, consts)
        jaxpr, consts, unrolled = half_loops_unrolled(jaxpr, consts)
    choice = None
    if level == 3:
        jaxpr, consts, choice = B.fit(jaxpr, consts, memory_budget, fn=_FN)
    fusion = plan_jaxpr(jaxpr, "derivative", 2)
    return Entry(sub, fusion, choice, tuple(consts), t.out_tree, placed, unrolled)
