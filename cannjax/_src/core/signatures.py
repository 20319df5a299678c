"""The front end of ``fuse`` and ``optimize``: a pytree function traced once per signature.

A call's signature is its tree structure, the avals of its *dynamic* leaves and the
values of its other leaves (static). One rule decides which is which for both transforms
(:func:`is_dynamic`). :class:`PerSignature` keeps what a transform built for each
signature; :func:`trace_signature` traces the function of the dynamic leaves alone
(:func:`flat_function`) and normalizes it for the rewriting layer (``core.rewrite``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src import core as jcore

from cannjax._src.core import jaxpr as J
from cannjax._src.core.rewrite import normalize

_STATIC = object()  # stands for a dynamic leaf in the tuple of static values


def is_dynamic(leaf: Any) -> bool:
    """Whether a leaf is traced: arrays (jax, numpy, numpy scalars) are; every other leaf
    (Python numbers and bools, strings, None) is static, part of the signature, as under
    ``eqx.filter_jit``: code may branch on it (an equinox ``Dropout``'s rate and flag),
    and a new value traces again."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


@dataclasses.dataclass(frozen=True)
class Traced:
    """A function traced at one signature: its normalized jaxpr, the constants that lead
    the jaxpr's inputs, and the tree structure of its outputs."""

    jaxpr: jcore.Jaxpr
    consts: tuple
    out_tree: Any


class NeedsConcreteValues(Exception):
    """The function cannot be traced with abstract inputs (Python control flow on an
    array's value); the message is the first line of JAX's."""


class PerSignature:
    """Builds and caches one entry per input signature.

    ``build(in_tree, dynamic, statics, avals)`` makes the entry; an entry whose
    ``consts`` hold tracers (built under an outer trace) is not cached.
    """

    def __init__(self, is_dynamic: Callable[[Any], bool], build: Callable[..., Any]):
        self._is_dynamic = is_dynamic
        self._build = build
        self._cache: dict[Any, Any] = {}

    def __call__(self, args: tuple, kwargs: dict) -> tuple[Any, list]:
        """The entry for this call and its dynamic leaves."""
        leaves, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        dyn = [self._is_dynamic(x) for x in leaves]
        avals = [jax.typeof(x) for x, d in zip(leaves, dyn) if d]
        statics = tuple(x if not d else _STATIC for x, d in zip(leaves, dyn))
        dyn_leaves = [x for x, d in zip(leaves, dyn) if d]
        try:
            key = (in_tree, tuple(avals), statics)
            hash(key)
        except TypeError:  # an unhashable static leaf: build every time
            key = None
        if key is not None and key in self._cache:
            return self._cache[key], dyn_leaves
        entry = self._build(in_tree, dyn, statics, avals)
        consts = getattr(entry, "consts", ())
        if key is not None and not any(isinstance(c, jcore.Tracer) for c in consts):
            self._cache[key] = entry
        return entry, dyn_leaves


def flat_function(
    fun: Callable[..., Any],
    in_tree: Any,
    dynamic: list[bool],
    statics: tuple,
    out_trees: list,
    check_output: Callable[[Any, Any], None] | None = None,
) -> Callable[..., list]:
    """``fun`` as a function of its dynamic leaves returning its output leaves.

    Each call appends the output tree structure to ``out_trees``; ``check_output(path,
    leaf)`` may refuse an output leaf.
    """

    def flat(*dyn_leaves):
        it = iter(dyn_leaves)
        leaves = [next(it) if d else s for d, s in zip(dynamic, statics)]
        args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        paths, out_tree = jax.tree_util.tree_flatten_with_path(fun(*args, **kwargs))
        if check_output is not None:
            for path, leaf in paths:
                check_output(path, leaf)
        out_trees.append(out_tree)
        return [leaf for _, leaf in paths]

    return flat


def trace_signature(
    fun: Callable[..., Any],
    in_tree: Any,
    dynamic: list[bool],
    statics: tuple,
    avals: list,
    check_output: Callable[[Any, Any], None] | None = None,
) -> Traced:
    """``fun`` traced at one signature (the arguments :class:`PerSignature` builds with).

    Raises:
      NeedsConcreteValues: tracing needs concrete values; each transform says what it does
        then (``fuse`` runs ``fun`` as written, ``optimize`` raises a TypeError).
    """
    out_trees: list = []
    flat = flat_function(fun, in_tree, dynamic, statics, out_trees, check_output)
    try:
        closed = J.trace(flat, avals)
    except jax.errors.ConcretizationTypeError as err:
        raise NeedsConcreteValues(str(err).strip().splitlines()[0]) from None
    jaxpr, consts = normalize(closed)
    return Traced(jaxpr, consts, out_trees[-1])
