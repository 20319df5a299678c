"""Declaring an operator: forward, tangent rule and hand-written backward.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from cannjax.core import defop
  >>> def forward(x):
  ...     y = jnp.exp(x)
  ...     return y, {"out": y}          # keep exp(x): d exp(x) = exp(x) dx
  >>> my_exp = defop(
  ...     "my_exp",
  ...     forward=forward,
  ...     tangent=lambda res, t: res["out"] * t,
  ...     backward=lambda res, g: (res["out"] * g,),
  ... )
  >>> float(jax.grad(my_exp)(0.0)), float(jax.jvp(my_exp, (0.0,), (1.0,))[1])
  (1.0, 1.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from cannjax._src.core import dots, kernels
from cannjax._src.core.primitives import Rule, bind
from cannjax._src.core.registry import Level, OpSpec, register


class Operator:
    """A differentiable operator built from hand-written rules.

    Rules (``**static`` are the keyword arguments the operator was called with; they must
    be hashable):

    * ``forward(*args, **static) -> (out, residuals)``: ``out`` is an array (or a tuple of
      ``num_outputs`` arrays); ``residuals`` a dict of the arrays the backward needs.
    * ``tangent(residuals, *tangents, **static) -> out_tangent``: forward mode, one
      tangent per differentiable argument; must be linear in the tangents.
    * ``backward(residuals, g, **static) -> tuple``: reverse mode, one cotangent per
      differentiable argument. This function *is* the transpose of ``tangent`` that
      reverse mode runs; it is never derived.

    Calling the operator binds it as a JAX primitive pair, so it composes with jit, grad,
    vjp, jvp, linearize, jacfwd, jacrev, hessian, vmap, scan, checkpoint and shard_map.

    ``forward`` and ``backward`` may be replaced per platform (a vendor kernel on Ascend,
    say) with :func:`cannjax.core.register_kernel`; the choice is made at lowering time.
    """

    def __init__(
        self,
        name: str,
        *,
        forward: Callable[..., tuple[Any, dict]],
        tangent: Callable[..., Any],
        backward: Callable[..., Sequence[jax.Array]],
        nondiff_argnums: Sequence[int] = (),
        num_outputs: int = 1,
        residuals: Mapping[str, str] | None = None,
        level: Level = Level.RECOMPUTE,
        reuse: Sequence[int] = (),
    ):
        for what, f in (("forward", forward), ("tangent", tangent), ("backward", backward)):
            if not callable(f):
                raise TypeError(f"cannjax.defop: {what} must be callable, got {f!r}")
        if not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"cannjax.defop: num_outputs must be an int >= 1, got {num_outputs!r}")
        self.name = name
        self.forward = forward
        self.tangent = tangent
        self.backward = backward
        self.nondiff_argnums = tuple(nondiff_argnums)
        self.num_outputs = num_outputs
        self.residuals = dict(residuals or {})
        self.level = Level(level)
        self.reuse = tuple(reuse)
        functools.update_wrapper(self, forward, assigned=("__module__",), updated=())

    def __repr__(self) -> str:
        return f"<cannjax operator {self.name}>"

    def __call__(self, *args: Any, **static: Any) -> Any:
        args = tuple(a if isinstance(a, jax.Array) else jnp.asarray(a) for a in args)
        outs = bind(self.rule(len(args), **static), *args)
        return outs[0] if self.num_outputs == 1 else tuple(outs)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 -- operators live as long as the program
    def _rule(self, nargs: int, static: tuple, table_generation: Any = 0) -> Rule:
        # table_generation: bumped when this op's kernel table or the dot-form table
        # changes, so a changed table gives new primitive parameters (and no stale
        # compiled executable).
        kw = dict(static)
        single = self.num_outputs == 1
        diff = tuple(i not in self.nondiff_argnums for i in range(nargs))
        name = self.name

        def forward(*args):
            # kernels.dispatch calls self.forward directly when no kernel is registered.
            out, res = kernels.dispatch(name, "forward", self.forward, args, kw)
            return ([out] if single else list(out)), res

        def tangent(res, ts):
            out = self.tangent(res, *ts, **kw)
            return [out] if single else list(out)

        def backward(res, cts):
            g = cts[0] if single else tuple(cts)
            cts = kernels.dispatch(name, "backward", self.backward, (res, g), kw)
            if not isinstance(cts, (tuple, list)):
                raise TypeError(
                    f"cannjax operator {self.name}: backward must return a tuple of "
                    f"cotangents, one per differentiable argument, got {type(cts).__name__}"
                )
            return list(cts)

        return Rule(self.name, forward, tangent, backward, diff)

    def rule(self, nargs: int, **static: Any) -> Rule:
        """The primitive-level :class:`Rule` for ``nargs`` arguments and ``static``."""
        try:
            key = tuple(sorted(static.items()))
            hash(key)
        except TypeError as e:
            raise TypeError(
                f"cannjax.{self.name}: keyword arguments must be hashable, got {static!r}"
            ) from e
        # The dot-form table shapes every rule that multiplies matrices.
        return self._rule(nargs, key, (kernels.generation(self.name), dots.generation()))


def defop(name: str, **rules: Any) -> Operator:
    """Declares an operator from its forward, tangent (JVP) and hand-written backward.

    Args:
      name: an identifier; residuals are named ``cannjax.<name>.<key>``.
      **rules: the keyword arguments of :class:`Operator`: ``forward``, ``tangent`` and
        ``backward`` (the rules), ``nondiff_argnums``, ``num_outputs``, and what the
        forward keeps: ``residuals`` (key -> what it holds), ``level``
        (:class:`cannjax.core.Level`) and ``reuse`` (inputs the backward never reads).

    Decorate the public function built on the operator with
    :func:`cannjax.core.registered` so the test harness and tools find it.

    Raises:
      ValueError: ``name`` is not an identifier, or ``num_outputs`` is not an int >= 1.
      TypeError: a rule is not callable, or an unknown keyword is given.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"cannjax.defop: name must be an identifier string, got {name!r}")
    try:
        return Operator(name, **rules)
    except TypeError as e:
        if "unexpected keyword" not in str(e) and "missing" not in str(e):
            raise
        raise TypeError(
            f"cannjax.defop: expected forward=, tangent=, backward= and optionally "
            f"nondiff_argnums=, num_outputs=, residuals=, level=, reuse=; got {sorted(rules)}"
        ) from None


def registered(op: Operator, **metadata: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: registers the decorated public function as the face of ``op``.

    ``metadata`` gives the :class:`cannjax.core.OpSpec` fields that describe the public
    function (``reference``, ``sample``, ``edges``, ``configs``, ``doc``); the fields that
    describe the rule (``residuals``, ``level``, ``reuse``, ``nondiff_argnums``) come from
    ``op`` unless given. The name is ``op.name``.

    Example (an operator ``cube`` declared and registered in one place)::

        _cube = defop(
            "cube",
            forward=lambda x: (x**3, {"x": x}),
            tangent=lambda res, t: 3 * res["x"] ** 2 * t,
            backward=lambda res, g: (3 * res["x"] ** 2 * g,),
            residuals={"x": "the input x"},
        )

        @registered(_cube, reference=lambda x: x**3, sample=lambda key: (jnp.ones(3),))
        def cube(x):
            "x cubed."
            return _cube(x)
    """
    if not isinstance(op, Operator):
        raise TypeError(f"cannjax.core.registered: op must be an Operator from defop, got {op!r}")

    def register_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        fields = dict(
            name=op.name,
            fn=fn,
            residuals=op.residuals,
            level=op.level,
            reuse=op.reuse,
            nondiff_argnums=op.nondiff_argnums,
        )
        fields.update(metadata)
        register(OpSpec(**fields))
        return fn

    return register_fn
