"""Row loops that run on each device's own rows, whatever sharding the program gives them.

A fused loss walks its rows in chunks (``lax.scan``) and sums ``x^T G`` over them into a
weight gradient. Under a sharded program the partitioner cannot keep such a loop local:
a loop over contiguous chunks has its chunk axis sharded, so the rows are all-gathered
into the loop and every device computes every row; over strided chunks the rows stay,
but the weight-gradient carry is all-reduced at every chunk (XLA:CPU has no pass that
sinks it out of the loop). Both cost more than plain JAX, which materializes the logits
and reduces the weight gradient once.

:func:`row_local` makes the loop a primitive that the partitioner hands its operands'
shardings (``jax.experimental.custom_partitioning``) and that then runs the same loop on
each device's rows, with the collectives written out:

* the rows (letter ``n``) keep the sharding of the first operand's rows;
* the vocabulary (letter ``v``) keeps the sharding of its operand's vocabulary axis over
  the mesh axes the rows do not use (vocabulary-parallel, as Megatron-LM's
  cross-entropy): the local function gets those axes and reduces its per-row statistics
  over them;
* every other axis is gathered (an FSDP-sharded weight, as plain JAX gathers it).

The local function receives a :class:`Shards` naming the axes; it sums its weight
gradient over ``shards.rows`` once, after its loop. Unsharded (one device, inside
``shard_map``, or a program whose mesh is not known) the primitive is the local function
with no axes, the loop as written; differentiating or batching it differentiates or
batches that same function.

The partitioner's callback needs the program's devices when it is lowered, which JAX
gives only to programs that ask (:func:`needs_devices`, called by the operators that
use :func:`row_local`). So ``jax.export`` serializes the unsharded form only: a program
exported for several devices meets the callback, which cannot be serialized, and one
lowered against an ``AbstractMesh`` alone is refused by JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
from jax._src import api_util, dispatch, sharding_impls
from jax._src.interpreters import partial_eval as pe
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.shard_alike import shard_alike
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Shards:
    """Mesh axes a local function's operands are split over (empty: not split).

    Attributes:
      rows: the axes the rows are split over; a sum over rows is ``psum`` over them.
      vocab: the axes the vocabulary is split over (never one of ``rows``).
    """

    rows: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()

    def vocab_offset(self, local_size: int) -> jax.Array | int:
        """The index of this device's first vocabulary entry."""
        return jax.lax.axis_index(self.vocab) * local_size if self.vocab else 0

    def vocab_size(self) -> int:
        """How many devices split the vocabulary."""
        return jax.lax.psum(1, self.vocab) if self.vocab else 1

    def vocab_max(self, v: jax.Array) -> jax.Array:
        return jax.lax.pmax(v, self.vocab) if self.vocab else v

    def vocab_sum(self, v: jax.Array) -> jax.Array:
        return jax.lax.psum(v, self.vocab) if self.vocab else v

    def rows_sum(self, v: jax.Array) -> jax.Array:
        return jax.lax.psum(v, self.rows) if self.rows else v


@dataclasses.dataclass(frozen=True)
class Layout:
    """The axes of a local function's operands and results, one string of letters per
    array: ``n`` rows, ``v`` vocabulary, any other letter an axis kept whole.
    ``rows_of`` and ``vocab_of`` name the operands whose sharding decides the split."""

    ins: tuple[str, ...]
    outs: tuple[str, ...]
    rows_of: int = 0
    vocab_of: int | None = None

    def rule(self) -> str:
        """The Shardy sharding rule (``"n d, d v -> n d"``)."""
        side = lambda specs: ", ".join(" ".join(s) for s in specs)  # noqa: E731
        return f"{side(self.ins)} -> {side(self.outs)}"


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _dim_axes(sharding, dim: int) -> tuple[str, ...]:
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec):
        return ()
    return _axes(spec[dim])


def _split(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """``axes`` if they divide ``size`` evenly, else none (the dimension is gathered)."""
    return axes if axes and size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _spec(letters: str, shards: Shards) -> P:
    pick = {"n": shards.rows or None, "v": shards.vocab or None}
    return P(*(pick.get(c) for c in letters))


@functools.cache
def _partitioned(local: Callable, layout: Layout) -> custom_partitioning:
    """``local`` as a ``custom_partitioning`` function that splits as ``layout`` says."""

    def whole(*args):
        return local(*args, shards=Shards())

    def partition(mesh, arg_shapes, result_shape):
        ref = arg_shapes[layout.rows_of]
        rows = _split(mesh, _dim_axes(ref.sharding, layout.ins[layout.rows_of].index("n")),
                      ref.shape[layout.ins[layout.rows_of].index("n")])  # fmt: skip
        vocab: tuple[str, ...] = ()
        if layout.vocab_of is not None:
            ref = arg_shapes[layout.vocab_of]
            dim = layout.ins[layout.vocab_of].index("v")
            free = tuple(a for a in _dim_axes(ref.sharding, dim) if a not in rows)
            vocab = _split(mesh, free, ref.shape[dim])
        shards = Shards(rows, vocab)
        ins = tuple(NamedSharding(mesh, _spec(s, shards)) for s in layout.ins)
        outs = [NamedSharding(mesh, _spec(s, shards)) for s in layout.outs]
        return mesh, functools.partial(local, shards=shards), outs, ins

    fn = custom_partitioning(whole)
    fn.def_partition(partition=partition, sharding_rule=layout.rule())
    return fn


row_local_p = Primitive("cannjax_row_local")
row_local_p.multiple_results = True


def row_local(local: Callable, layout: Layout, *args: jax.Array) -> list[jax.Array]:
    """``local(*args, shards=...)`` run on each device's rows (module docstring).

    ``local`` must be hashable and equal to itself from call to call (a module-level
    function, or :func:`bound` of one: the primitive's parameters are compared) and
    return a list of arrays shaped as ``layout.outs`` says.
    """
    return row_local_p.bind(*args, local=local, layout=layout)


@functools.cache
def bound(fn: Callable, **static) -> Callable:
    """``fn`` with its static keywords bound: one object per ``(fn, static)``, as
    :func:`row_local` needs (its primitive compares the local function)."""
    return functools.partial(fn, **static)


def _whole(local, *args):
    return list(local(*args, shards=Shards()))


def _abstract(*avals, local, layout):
    # Traced with the avals themselves: shard_map's varying-axis types stay on the outputs.
    fn = functools.partial(_whole, local)
    return pe.abstract_eval_fun(
        fn, *avals, debug_info=api_util.debug_info("cannjax", fn, avals, {})
    )


row_local_p.def_impl(functools.partial(dispatch.apply_primitive, row_local_p))
row_local_p.def_abstract_eval(_abstract)


def _jvp(primals, tangents, *, local, layout):
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(functools.partial(_whole, local), tuple(primals), tuple(tangents))


def _batch(args, dims, *, local, layout):
    args = [a if d is None else jax.numpy.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    axes = [None if d is None else 0 for d in dims]
    outs = jax.vmap(functools.partial(_whole, local), in_axes=axes)(*args)
    return outs, [0] * len(outs)


def _typed_placement(x: jax.Array) -> bool:
    """Whether ``x`` lives on a mesh with explicit (or manual) axes, where its type fixes
    its placement and a constraint is neither needed nor allowed."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    return any(t != jax.sharding.AxisType.Auto for t in getattr(mesh, "axis_types", ()))


def _sharded_context(ctx) -> bool:
    """Whether the program is partitioned over a known mesh of known devices (not one
    device, not the manual body of a ``shard_map``, not an ``AbstractMesh`` alone)."""
    axis = ctx.module_context.axis_context
    return (
        isinstance(axis, sharding_impls.ShardingContext)
        and axis.num_devices > 1
        and axis.device_assignment is not None
        and axis.abstract_mesh is not None
        and not axis.abstract_mesh.empty
    )


def _lowering(ctx, *args, local, layout):
    if _sharded_context(ctx):
        fn = lambda *a: list(_partitioned(local, layout)(*a))  # noqa: E731
    else:
        fn = functools.partial(_whole, local)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


ad.primitive_jvps[row_local_p] = _jvp
batching.primitive_batchers[row_local_p] = _batch
mlir.register_lowering(row_local_p, _lowering)


# JAX hands a program's devices to its lowering only when its jaxpr holds a primitive
# that asks for them. An operator's forward is traced when the program is lowered, so
# the row_local_p in it comes too late to ask: the operator's public function passes
# its result through needs_devices (an identity) for it (not an input: the forward saves
# its inputs, and a residual should stay the value the user passed).
needs_devices_p = Primitive("cannjax_needs_devices")
needs_devices_p.def_impl(lambda x: x)
needs_devices_p.def_abstract_eval(lambda x: x)
# Linear, and its tangent and cotangent pass through it too: under jax.grad the
# forward's result is dead code, and the mark must survive in the backward.
ad.deflinear2(needs_devices_p, lambda ct, x: [needs_devices_p.bind(ct)])
batching.defvectorized(needs_devices_p)
mlir.register_lowering(needs_devices_p, lambda ctx, x: [x])
dispatch.prim_requires_devices_during_lowering.update((row_local_p, needs_devices_p))


def needs_devices(x: jax.Array) -> jax.Array:
    """``x``, marked so that a program holding it is lowered with its devices (which
    :func:`row_local` needs under a sharded program). Such a program cannot be lowered
    against an ``AbstractMesh`` alone (``jax.export`` with abstract shardings)."""
    return needs_devices_p.bind(x)


# ---------------------------------------------------------- an axis kept whole
# Attention's logits q k^T contract the head dim H. Where a program splits H over devices
# (more devices on the model axis than heads), every logit block is a partial sum, and
# the blockwise kernel all-reduces it in the forward and again in the backward's
# recomputation. Gathering q and k over H once makes the logits local.
last_axis_whole_p = Primitive("cannjax_last_axis_whole")
last_axis_whole_p.def_impl(lambda x: x)
last_axis_whole_p.def_abstract_eval(lambda x: x)
# Linear: its tangent and cotangent are kept whole too.
ad.deflinear2(last_axis_whole_p, lambda ct, x: [last_axis_whole_p.bind(ct)])


def _last_whole_batch(args, dims):
    (x,), (d,) = args, dims
    if d is not None and d == x.ndim - 1:  # the batch axis is never the one kept whole
        x, d = jax.numpy.moveaxis(x, d, 0), 0
    return last_axis_whole_p.bind(x), d


def _last_whole_lowering(ctx, x):
    if not _sharded_context(ctx):
        return [x]
    mesh = ctx.module_context.axis_context.abstract_mesh
    free = [P.UNCONSTRAINED] * (len(ctx.avals_in[0].shape) - 1)
    whole = NamedSharding(mesh, P(*free, None))
    fn = lambda a: jax.lax.with_sharding_constraint(a, whole)  # noqa: E731
    return mlir.lower_fun(fn, multiple_results=False)(ctx, x)


batching.primitive_batchers[last_axis_whole_p] = _last_whole_batch
mlir.register_lowering(last_axis_whole_p, _last_whole_lowering)
dispatch.prim_requires_devices_during_lowering.add(last_axis_whole_p)


def last_axis_whole(x: jax.Array) -> jax.Array:
    """``x`` with its last axis whole on every device (gathered where a sharded program
    splits it), its other axes placed by the partitioner. The identity on one device,
    inside ``shard_map`` and where the mesh has explicit axes (the types say where each
    axis is). A program holding it is lowered with its devices, as :func:`needs_devices`
    asks: it cannot be lowered against an ``AbstractMesh`` alone."""
    if _typed_placement(x):
        return x
    return last_axis_whole_p.bind(x)


# ------------------------------------------------------- placed as another value is
# A layer loop's carry should stay placed as the activations that enter it are (its
# rows over the data axis); the partitioner may place it as the loop body's weights are
# instead. Grouping the loop's result with its initial value gives both one placement.
placed_like_p = Primitive("cannjax_placed_like")
placed_like_p.def_impl(lambda y, ref: y)
placed_like_p.def_abstract_eval(lambda y, ref: y)


def _placed_like_jvp(primals, tangents):
    # The tangent passes through: grouping the forward's carry alone places the
    # backward's loop too (measured), and a tangent grouped with ref would save ref.
    (y, ref), (dy, _) = primals, tangents
    return placed_like_p.bind(y, ref), dy


def _placed_like_batch(args, dims):
    (y, ref), (dy, dr) = args, dims
    if dy is None:  # ref batched, y not: no one placement for two shapes
        return y, None
    y = jax.numpy.moveaxis(y, dy, 0)
    ref = jax.numpy.broadcast_to(ref, y.shape) if dr is None else jax.numpy.moveaxis(ref, dr, 0)
    return placed_like_p.bind(y, ref), 0


def _placed_like_lowering(ctx, y, ref):
    axis = ctx.module_context.axis_context
    if not (isinstance(axis, sharding_impls.ShardingContext) and axis.num_devices > 1):
        return [y]  # one device, or the manual body of a shard_map: nothing to place

    def group(y, ref):
        return shard_alike(ref, y)[1]

    return mlir.lower_fun(group, multiple_results=False)(ctx, y, ref)


ad.primitive_jvps[placed_like_p] = _placed_like_jvp
batching.primitive_batchers[placed_like_p] = _placed_like_batch
mlir.register_lowering(placed_like_p, _placed_like_lowering)


def placed_like(y: jax.Array, ref: jax.Array) -> jax.Array:
    """``y``, which the partitioner places (shards) as it places ``ref`` (same shape).

    ``jax.experimental.shard_alike`` with ``ref`` a guide only: no gradient flows to it,
    the tangent of ``y`` passes through, and the partitioner chooses the one placement
    (it is not ``ref``'s forced on ``y``). For a layer loop's result and its initial
    value, ``y = placed_like(lax.scan(body, x, layers)[0], x)``, the loop's carry stays
    placed as its input (``docs/parallel.md``). The identity on one device, inside
    ``shard_map`` and on a mesh with explicit axes (where the types fix placements).

    Raises:
      TypeError: if ``y`` or ``ref`` is not an array.
      ValueError: if their shapes differ.
    """
    for name, v in (("y", y), ("ref", ref)):
        if not hasattr(v, "shape") or not hasattr(v, "dtype"):
            raise TypeError(
                f"cannjax.parallel.placed_like: {name} must be an array, got {type(v).__name__}"
            )
    if tuple(y.shape) != tuple(ref.shape):
        raise ValueError(
            f"cannjax.parallel.placed_like: y and ref must have one shape, got y "
            f"{tuple(y.shape)} and ref {tuple(ref.shape)}"
        )
    if _typed_placement(y):
        return y
    return placed_like_p.bind(y, ref)
