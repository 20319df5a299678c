"""Lets a function transform ``t(fun, *, options)`` also be written as a decorator.

``jax.checkpoint`` and ``jax.jit`` take their options as keywords after the function.
cannjax's transforms do the same, and :func:`keyword_decorator` adds the two decorator
spellings on top, so that these are equivalent::

    g = t(f, level="recompute")

    @t(level="recompute")
    def g(...): ...

and ``@t`` alone is ``t(f)``. Options are validated when the function is wrapped, as for
the direct call.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=Callable[..., Any])


def keyword_decorator(transform: T) -> T:
    """Returns ``transform``, also usable as ``@transform(**options)``.

    Called with no positional argument and without its first parameter (the function to
    transform) as a keyword, the result is a decorator that applies ``transform`` with
    those options; any other call goes to ``transform`` unchanged. The wrapper keeps
    ``transform``'s name, docstring and signature (``functools.wraps``).

    Args:
      transform: ``transform(fun, ..., **options)``; its first parameter is the function.

    Returns:
      The wrapper.

    Example:
      >>> @keyword_decorator
      ... def twice(fun, *, times=2):
      ...     return lambda x: [fun(x) for _ in range(times)]
      >>> @twice(times=3)
      ... def one(x):
      ...     return x
      >>> one(1), twice(one, times=1)(1)
      ([1, 1, 1], [[1, 1, 1]])
    """
    first = next(iter(inspect.signature(transform).parameters))

    @functools.wraps(transform)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if args or first in kwargs:
            return transform(*args, **kwargs)

        def decorate(fun: Callable[..., Any]) -> Any:
            return transform(fun, **kwargs)

        return decorate

    return wrapper  # type: ignore[return-value]
