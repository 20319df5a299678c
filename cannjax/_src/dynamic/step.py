"""A training step compiled once per gear: pad the batch to its gear, weight it, dispatch.

``geared(step, gears)`` returns a :class:`GearedStep`. Each call finds the batch's length
``T``, picks the smallest gear ``S >= T``, pads the batch to ``S`` with
:func:`cannjax.dynamic.pad_to_gear` and calls the jitted step with the per-token weights
appended::

  S = gears.gear_for(T)                 (or a new gear on overflow, if asked)
  padded, weights = pad_to_gear(batch, S, axis=axis, lengths=lengths)
  return jitted_step(*args[:argnum], padded, *args[argnum + 1:], weights, **kwargs)

``jax.jit`` caches one executable per input signature, so a stream of batches of any
lengths compiles at most one program per gear (per signature of the other arguments),
and the step keeps count: ``compiled`` programs, and the padding it paid for.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.core.tables import number, render, render_html
from cannjax._src.dynamic.gears import Gears, _is_int
from cannjax._src.dynamic.padding import _pad, _sequences

_FN = "cannjax.dynamic.geared"
ON_OVERFLOW = ("error", "new_gear")


class GearedStep:
    """A step that pads each batch to its gear and runs that gear's compiled program.

    Build it with :func:`geared`; call it as the wrapped step without the weights,
    ``geared_step(*args, lengths=None, **kwargs)`` (``lengths``: optional real lengths
    per sequence, as for :func:`cannjax.dynamic.pad_to_gear`). What the wrapped step
    returns comes back unchanged.

    Attributes:
      gears: the gears given to :func:`geared` (a :class:`cannjax.dynamic.Gears` or the
        sizes).
      sizes: the gears now, increasing (grows on overflow with ``on_overflow="new_gear"``).
      compiled: how many programs have been compiled: distinct (gear, signature of the
        other arguments) seen, each one ``jax.jit`` compile.
      steps: calls so far.
      counts: calls per gear, a dict ``{gear: steps}``.
      tokens: sequence positions computed so far, padding included (the weights'
        entries).
      real_tokens: the real positions among them (the sum of the weights).

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.dynamic import geared
      >>> run = geared(lambda tokens, weights: jnp.sum(weights), [4, 8], argnum=0)
      >>> [float(run(jnp.ones((1, t)))) for t in (2, 3, 6)]
      [2.0, 3.0, 6.0]
      >>> run.compiled, run.counts, run.tokens, run.real_tokens, round(run.overhead, 4)
      (2, {4: 2, 8: 1}, 16, 11, 0.4545)
    """

    def __init__(self, step, gears, *, argnum, axis, value, on_overflow):
        self._jitted = step if hasattr(step, "lower") else jax.jit(step)
        self._argnum, self._axis, self._value = argnum, axis, value
        self._on_overflow = on_overflow
        self._multiple = gears.multiple if isinstance(gears, Gears) else 1
        self.gears = gears
        self.sizes: tuple[int, ...] = _sizes(gears)
        self.steps, self.tokens, self.real_tokens = 0, 0, 0
        self.counts: dict[int, int] = {}
        self._signatures: set = set()
        functools.update_wrapper(self, step)

    @property
    def compiled(self) -> int:
        """How many programs have been compiled so far."""
        return len(self._signatures)

    @property
    def overhead(self) -> float:
        """Padding positions over real positions so far (0: nothing padded)."""
        return (self.tokens - self.real_tokens) / self.real_tokens if self.real_tokens else 0.0

    def gear_for(self, length: int) -> int:
        """The gear a batch of ``length`` runs in, adding one on overflow if allowed.

        Args:
          length: the batch's sequence length ``T``, a positive int.

        Returns:
          The smallest gear ``>= length``.

        Raises:
          TypeError: if ``length`` is not an int.
          ValueError: if ``length < 1``, or if it exceeds the largest gear and
            ``on_overflow`` is ``"error"``.

        Warns:
          UserWarning: when a gear is added (``on_overflow="new_gear"``).
        """
        if not _is_int(length):
            raise TypeError(f"{_FN}: length must be an int, got {length!r}")
        if length < 1:
            raise ValueError(f"{_FN}: length must be >= 1, got {length}")
        return self._gear_for(int(length))

    def _gear_for(self, length: int) -> int:
        # Called by gear_for and __call__ alike: stacklevel 3 is the caller of either.
        i = int(np.searchsorted(self.sizes, length))
        if i < len(self.sizes):
            return self.sizes[i]
        new = -(-length // self._multiple) * self._multiple
        if self._on_overflow == "error":
            raise ValueError(
                f"{_FN}: a batch of length {length} exceeds the largest gear "
                f"{self.sizes[-1]}; plan the gears with max_length >= {length} "
                f"(cannjax.dynamic.plan_gears), or pass on_overflow='new_gear' to add a "
                f"gear of {new} (one more compile)"
            )
        warnings.warn(
            f"{_FN}: a batch of length {length} exceeds the largest gear "
            f"{self.sizes[-1]}: adding a gear of {new} (one more compile); plan the gears "
            f"with max_length >= {length} to compile it ahead",
            stacklevel=3,
        )
        self.sizes = (*self.sizes, new)
        return new

    def __call__(self, *args: Any, lengths: Any = None, **kwargs: Any) -> Any:
        """Pads ``args[argnum]`` to its gear and runs the step; see the class docstring."""
        if len(args) <= self._argnum:
            raise TypeError(
                f"{_FN}: the step takes its batch as positional argument {self._argnum} "
                f"(argnum), but was called with {len(args)} positional arguments"
            )
        seq = _sequences(_FN, args[self._argnum], self._axis)
        gear = self._gear_for(seq.length)
        padded, weights = _pad(_FN, seq, gear, self._value, lengths)
        args = (*args[: self._argnum], padded, *args[self._argnum + 1 :], weights)
        signature = (gear, _signature((args, kwargs)))
        out = self._jitted(*args, **kwargs)
        self._signatures.add(signature)  # counted once it compiled and ran
        rows = int(np.prod(seq.lead))
        self.steps += 1
        self.counts[gear] = self.counts.get(gear, 0) + 1
        self.tokens += rows * gear
        self.real_tokens += (
            rows * seq.length
            if lengths is None
            else int(np.sum(np.broadcast_to(np.asarray(lengths), seq.lead)))
        )
        return out

    def _table(self):
        rows = [[s, self.counts.get(s, 0)] for s in self.sizes]
        caption = (
            f"geared step: {self.steps} steps, {self.compiled} programs compiled, padding "
            f"overhead {number(self.overhead)}"
        )
        return ["gear", "steps"], rows, caption

    def __str__(self) -> str:
        headers, rows, caption = self._table()
        return caption + "\n" + render(headers, rows, right=(0, 1))

    def __repr__(self) -> str:
        """The table ``print`` shows: a REPL shows the report, not its fields."""
        return str(self)

    def _repr_html_(self) -> str:
        headers, rows, caption = self._table()
        return render_html(headers, rows, caption, right=(0, 1))


@keyword_decorator
def geared(
    step: Callable[..., Any],
    gears: Gears | Sequence[int],
    *,
    argnum: int = 1,
    axis: Any = 1,
    value: Any = 0,
    on_overflow: str = "error",
) -> GearedStep:
    """Wraps ``step`` to compile once per gear: each batch is padded to its gear.

    The wrapped step receives the padded batch in place of the batch and the per-token
    weights (``[B, S]`` float32, 1.0 real, 0.0 padded) as one more positional argument
    after the others: a ``step(state, batch, weights)`` is called as
    ``geared_step(state, batch)``. It must make the padded positions inert, e.g. by
    passing the weights to ``cannjax.models.gpt_loss(..., weights=weights)`` (see
    :func:`cannjax.dynamic.pad_to_gear`). The algorithm, per call::

      T = the batch's length along axis
      S = smallest gear >= T; if none: raise (on_overflow="error"), or
          warn and add the gear ceil(T / multiple) * multiple (on_overflow="new_gear")
      padded, weights = pad_to_gear(batch, S, axis=axis, value=value, lengths=lengths)
      out = jit(step)(*args with batch -> padded, weights, **kwargs)

    Gears that no batch needs are never compiled; batches of another size ``B``, or
    other arguments of another shape or dtype, compile another program (as ``jax.jit``
    would), and :attr:`GearedStep.compiled` counts them.

    Args:
      step: the step function, ``step(*args, weights, **kwargs)``; jitted here with
        ``jax.jit`` unless it is jitted already (it has ``.lower``: pass
        ``jax.jit(step, donate_argnums=...)`` for your own options).
      gears: a :class:`cannjax.dynamic.Gears` (from
        :func:`cannjax.dynamic.plan_gears`), or gear sizes, positive ints.
      argnum: which positional argument of the step is the batch.
      axis: the batch's sequence axis: an int, or a pytree prefix of the batch with an
        int or None per subtree (as for :func:`cannjax.dynamic.pad_to_gear`).
      value: the scalar padded positions are filled with.
      on_overflow: what a batch longer than the largest gear does: ``"error"`` (raise
        ValueError) or ``"new_gear"`` (warn and add a gear, rounded up to
        ``gears.multiple``).

    Returns:
      The :class:`cannjax.dynamic.GearedStep`, with ``compiled``, ``overhead`` and a
      table of steps per gear (``print(geared_step)``).

    Raises:
      TypeError: ``step`` not callable, ``gears`` neither Gears nor a sequence of ints,
        ``argnum`` not an int.
      ValueError: empty ``gears`` or a size that is not a positive int, ``argnum < 0``,
        or an unknown ``on_overflow``.

    Example:
      >>> import jax.numpy as jnp
      >>> from cannjax.dynamic import geared, plan_gears
      >>> def step(total, tokens, weights):  # a sum over the real tokens only
      ...     return total + jnp.sum(tokens * weights)
      >>> gears = plan_gears([3, 4, 7, 8], k=2)
      >>> run = geared(step, gears)
      >>> total = jnp.zeros(())
      >>> for t in (3, 4, 7, 8, 3):
      ...     total = run(total, jnp.ones((2, t)))
      >>> float(total), run.compiled, run.sizes
      (50.0, 2, (4, 8))
      >>> print(run)
      geared step: 5 steps, 2 programs compiled, padding overhead 0.1200
      gear  steps
      ----  -----
         4      3
         8      2
    """
    if not callable(step):
        raise TypeError(f"{_FN}: step must be callable, got {step!r}")
    _sizes(gears)
    if not _is_int(argnum):
        raise TypeError(f"{_FN}: argnum must be an int, got {argnum!r}")
    if argnum < 0:
        raise ValueError(f"{_FN}: argnum must be >= 0, got {argnum}")
    if on_overflow not in ON_OVERFLOW:
        raise ValueError(f"{_FN}: on_overflow must be one of {ON_OVERFLOW}, got {on_overflow!r}")
    return GearedStep(
        step, gears, argnum=int(argnum), axis=axis, value=value, on_overflow=on_overflow
    )


def _sizes(gears: Any) -> tuple[int, ...]:
    if isinstance(gears, Gears):
        return gears.sizes
    if isinstance(gears, np.ndarray):
        gears = gears.tolist()
    if isinstance(gears, (str, bytes)) or not isinstance(gears, Sequence):
        raise TypeError(
            f"{_FN}: gears must be a cannjax.dynamic.Gears (plan_gears) or a sequence of "
            f"sizes, got {type(gears).__name__}"
        )
    if not gears:
        raise ValueError(f"{_FN}: gears is empty; give at least one size")
    for s in gears:
        if not _is_int(s) or s < 1:
            raise ValueError(f"{_FN}: gear sizes must be positive ints, got {s!r}")
    return tuple(sorted({int(s) for s in gears}))


def _signature(tree: Any) -> tuple:
    """What ``jax.jit`` compiles anew for: the tree structure, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(
        (np.shape(x), str(x.dtype), bool(getattr(x, "weak_type", False)))
        if hasattr(x, "dtype")
        else type(x)
        for x in leaves
    )
