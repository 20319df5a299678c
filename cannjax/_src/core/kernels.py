"""Per-platform kernel tables: an operator's rules, replaced on one platform.

Every operator has an XLA implementation: its ``forward`` and ``backward`` rules, written
in ``jax.numpy``, which XLA compiles for any platform. A *kernel* replaces one of those
rules on one platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``, ``"ascend"``, or any
PJRT plugin's platform name), typically with a call into a vendor library through
``jax.ffi.ffi_call``. The choice is made when the program is *lowered*, with
``jax.lax.platform_dependent``: tracing stages out every alternative, lowering for one
platform keeps only that platform's branch, and a multi-platform ``jax.export`` keeps one
branch per platform, chosen when the module is compiled.

A kernel has the signature of the rule it replaces and must return the same structure,
shapes and dtypes (including the residual dict of a forward):

* ``forward(*args, **static) -> (out, residuals)``
* ``backward(residuals, g, **static) -> tuple of cotangents``

Operators without kernels are untouched: their rules are traced directly, with no
conditional and no extra equation in the program.

Derivatives of a kernel (needed at second order and above, e.g. ``jax.hessian``, or when
forward mode differentiates a backward) are those of the XLA rule it replaces: a vendor
kernel is a black box to autodiff, and the XLA rule computes the same function.

Register kernels before tracing the functions that use them: a function already compiled
by ``jax.jit`` keeps the kernels it was traced with until its cache is cleared
(``jax.clear_caches()``). Operators called outside ``jit`` pick up the change at once.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from cannjax.core import defop, register_kernel, unregister_kernel
  >>> cube = defop(
  ...     "doc_cube",
  ...     forward=lambda x: (x**3, {"x": x}),
  ...     tangent=lambda res, t: 3 * res["x"] ** 2 * t,
  ...     backward=lambda res, g: (3 * res["x"] ** 2 * g,),
  ... )
  >>> k = register_kernel("doc_cube", "cpu", forward=lambda x: (x * x * x, {"x": x}))
  >>> float(cube(2.0)), float(jax.grad(cube)(2.0))
  (8.0, 12.0)
  >>> "platform_index" in str(jax.make_jaxpr(jax.grad(cube))(2.0))  # chosen at lowering
  False
  >>> _ = unregister_kernel("doc_cube", "cpu")
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax import lax

_RULES = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One platform's implementation of an operator's forward and/or backward rule.

    Attributes:
      op: the operator's name (``Operator.name``, e.g. ``"gelu"``).
      platform: the lowering platform it is used on (``"cpu"``, ``"cuda"``, ``"ascend"``).
      forward: replaces the forward rule, or None to keep the XLA forward.
      backward: replaces the backward rule, or None to keep the XLA backward.
      source: free text saying where it comes from (``"CANN aclnnGeluV2"``), for reports.
    """

    op: str
    platform: str
    forward: Callable[..., Any] | None = None
    backward: Callable[..., Any] | None = None
    source: str = ""

    def rules(self) -> tuple[str, ...]:
        """The names of the rules this kernel replaces, e.g. ``("forward", "backward")``."""
        return tuple(r for r in _RULES if getattr(self, r) is not None)


# op name -> platform -> Kernel. Read on every trace of an operator; empty for most ops.
_TABLE: dict[str, dict[str, Kernel]] = {}
# op name -> number of changes to its entries: part of the operator's rule cache key, so
# a changed table makes new primitive parameters (and new compilations) for that op.
_GENERATION: dict[str, int] = {}


def _check_platform(fn: str, platform: Any) -> str:
    if not isinstance(platform, str) or not platform.isidentifier() or platform != platform.lower():
        raise ValueError(
            f"{fn}: platform must be a lower-case platform name such as 'cpu', 'cuda', "
            f"'rocm', 'tpu' or 'ascend', got {platform!r}"
        )
    if platform == "gpu":
        raise ValueError(f"{fn}: platform 'gpu' is ambiguous; use 'cuda' or 'rocm'")
    return platform


def _op_name(fn: str, op: Any) -> str:
    name = getattr(op, "name", op)  # an Operator or an OpSpec carries its name
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{fn}: op must be an operator name (an identifier), got {op!r}")
    return name


def register_kernel(
    op: Any,
    platform: str,
    *,
    forward: Callable[..., Any] | None = None,
    backward: Callable[..., Any] | None = None,
    source: str = "",
    overwrite: bool = False,
) -> Kernel:
    """Registers a platform implementation of an operator's forward and/or backward.

    ``forward`` and ``backward`` take and return exactly what the operator's own rules
    do (see :class:`cannjax.core.Operator`); each may be None to keep the XLA rule.

    Args:
      op: the operator, or its name (kernels may be registered before the op exists).
      platform: lowering platform name, e.g. ``"cpu"``, ``"cuda"``, ``"ascend"``.
      forward: ``(*args, **static) -> (out, residuals)``.
      backward: ``(residuals, g, **static) -> tuple of cotangents``.
      source: where the kernel comes from, shown by :func:`cannjax.backend.info`.
      overwrite: replace an existing entry for ``(op, platform)``.

    Returns:
      The registered :class:`Kernel`.

    Raises:
      ValueError: bad names, neither rule given, or an entry exists and not ``overwrite``.
      TypeError: a rule that is not callable.
    """
    fn = "cannjax.core.register_kernel"
    name = _op_name(fn, op)
    platform = _check_platform(fn, platform)
    if forward is None and backward is None:
        raise ValueError(f"{fn}: give forward=, backward= or both for {name!r} on {platform!r}")
    for what, f in (("forward", forward), ("backward", backward)):
        if f is not None and not callable(f):
            raise TypeError(f"{fn}: {what} must be callable or None, got {f!r}")
    entries = _TABLE.setdefault(name, {})
    if platform in entries and not overwrite:
        raise ValueError(
            f"{fn}: {name!r} already has a {platform!r} kernel ({entries[platform].source!r}); "
            "pass overwrite=True to replace it"
        )
    kernel = Kernel(name, platform, forward, backward, source)
    entries[platform] = kernel
    _GENERATION[name] = _GENERATION.get(name, 0) + 1
    return kernel


def unregister_kernel(op: Any, platform: str) -> Kernel | None:
    """Removes the ``platform`` kernel of ``op``; returns it (None if there was none)."""
    fn = "cannjax.core.unregister_kernel"
    name = _op_name(fn, op)
    platform = _check_platform(fn, platform)
    entries = _TABLE.get(name, {})
    kernel = entries.pop(platform, None)
    if not entries:
        _TABLE.pop(name, None)
    if kernel is not None:
        _GENERATION[name] = _GENERATION.get(name, 0) + 1
    return kernel


def kernel_table() -> Mapping[str, Mapping[str, Kernel]]:
    """A read-only snapshot: operator name -> platform -> :class:`Kernel`."""
    return types.MappingProxyType(
        {op: types.MappingProxyType(dict(p)) for op, p in sorted(_TABLE.items())}
    )


_DEFERRED: list[Callable[[], None]] = []


def defer_until_first_use(fn: Callable[[], None]) -> None:
    """Runs ``fn`` just before the first operator is traced, not at import.

    Table set-up that asks JAX which backends exist goes here: asking at import would
    start a backend, after which ``jax.distributed.initialize`` refuses to run.
    """
    _DEFERRED.append(fn)


def generation(op: str) -> int:
    """How many times the kernel entries of ``op`` changed (a cache key)."""
    while _DEFERRED:
        _DEFERRED.pop(0)()
    return _GENERATION.get(op, 0)


def dispatch(op: str, rule: str, default: Callable[..., Any], args: tuple, static: dict) -> Any:
    """Calls ``default(*args, **static)``, or its per-platform kernels if ``op`` has any.

    With kernels for ``rule`` (``"forward"`` or ``"backward"``), the call is staged out as
    ``lax.platform_dependent(*args, default=default, **kernels)`` inside a
    ``jax.custom_jvp`` whose derivative is that of ``default``.
    """
    entries = _TABLE.get(op)
    if not entries:
        return default(*args, **static)
    branches = {
        p: functools.partial(f, **static)
        for p, k in entries.items()
        if (f := getattr(k, rule)) is not None
    }
    if not branches:
        return default(*args, **static)
    xla = functools.partial(default, **static)

    @jax.custom_jvp
    def choose(*a):
        try:
            return lax.platform_dependent(*a, default=xla, **branches)
        except TypeError as e:
            raise TypeError(
                f"cannjax kernel table: a {rule} kernel of operator {op!r} "
                f"(platforms {sorted(branches)}) must return the same structure, shapes "
                f"and dtypes as the operator's own {rule} rule: {e}"
            ) from e

    @choose.defjvp
    def _choose_jvp(primals, tangents):
        # A vendor kernel is opaque to autodiff; the XLA rule is the same function.
        return choose(*primals), jax.jvp(xla, primals, tangents)[1]

    return choose(*args)
