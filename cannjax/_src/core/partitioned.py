"""Row loops (and attention) that run on each device's own rows, whatever sharding the
program gives them.

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

Attention's kernel runs the same way on each device's batch rows and heads
(:class:`HeadsLayout`): it keeps the axes the batch and the heads are split over and
moves the axes that split its operands elsewhere (a head's features) to the heads or the
batch, so no device runs another's sequences.

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
from jax._src.sharding import IndivisibleError
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
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
      heads: the axes attention heads are split over (:class:`HeadsLayout`).
    """

    rows: tuple[str, ...] = ()
    vocab: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()

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

    def heads_sum(self, v: jax.Array) -> jax.Array:
        return jax.lax.psum(v, self.heads) if self.heads else v


@dataclasses.dataclass(frozen=True)
class Layout:
    """The axes of a local function's operands and results, one string of letters per
    array: ``n`` rows, ``v`` vocabulary, any other letter an axis kept whole.
    ``rows_of`` and ``vocab_of`` name the operands whose sharding decides the split."""

    ins: tuple[str, ...]
    outs: tuple[str, ...]
    rows_of: int = 0
    vocab_of: int | None = None

    def rule(self, axis_sizes: tuple[int, ...] = ()) -> str:
        """The Shardy sharding rule (``"n d, d v -> n d"``)."""
        side = lambda specs: ", ".join(" ".join(s) for s in specs)  # noqa: E731
        return f"{side(self.ins)} -> {side(self.outs)}"

    def split(self, mesh, arg_shapes) -> tuple[Shards, list[P], list[P]]:
        """The axes the rows and vocabulary are split over, given the operands' shardings,
        and the operands' and results' specs for that split."""
        ref = arg_shapes[self.rows_of]
        dim = self.ins[self.rows_of].index("n")
        rows = _split(mesh, _dim_axes(mesh, ref, dim), ref.shape[dim])
        vocab: tuple[str, ...] = ()
        if self.vocab_of is not None:
            ref = arg_shapes[self.vocab_of]
            dim = self.ins[self.vocab_of].index("v")
            free = tuple(a for a in _dim_axes(mesh, ref, dim) if a not in rows)
            vocab = _split(mesh, free, ref.shape[dim])
        pick = {"n": rows or None, "v": vocab or None}
        spec = lambda letters: P(*(pick.get(c) for c in letters))  # noqa: E731
        return Shards(rows, vocab), [spec(s) for s in self.ins], [spec(s) for s in self.outs]


@dataclasses.dataclass(frozen=True)
class HeadsLayout:
    """Attention's axes, one string of letters per operand and result: ``b`` batch,
    ``q`` the query heads and their features as one axis (``N H``), ``k`` the key/value
    heads and features (``K H``), ``n`` the query heads alone (``N``), ``1`` a broadcast
    axis of size one, any other letter an axis kept whole (``t`` queries, ``s`` keys).
    ``heads`` is ``K``: a split of the heads divides it (each device's query heads then
    read its own key/value heads); ``query_heads`` is ``N``, ``head_dim`` ``H``. The
    first operand (the queries) decides the split.

    The batch keeps the axes it is split over; so do the heads, where those axes split
    whole heads. Every other mesh axis that splits an operand (a head's features, the
    sequence) is moved to the heads where it divides them, else to the batch, and
    gathered where it divides neither; when nothing splits the operands (every device
    holds them whole), every axis is. Each device then runs the kernel on its own batch
    rows and heads."""

    ins: tuple[str, ...]
    outs: tuple[str, ...]
    heads: int
    query_heads: int
    head_dim: int

    def rule(self, axis_sizes: tuple[int, ...] = ()) -> SdyShardingRule:
        """The Shardy sharding rule: batch and heads shared (``q`` the compound of the
        heads ``n`` and their features, ``k`` of the key/value heads and theirs), every
        other axis a factor of its own (the partition callback decides them).

        The heads of ``lse``, the mask and the bias are tied to those of ``q`` only when
        every mesh axis (of ``axis_sizes``) divides the heads: a larger axis splitting
        ``q``'s heads and features would have propagation split them over part of the
        axis, which the kernel's own placement (the batch over that axis) can reach only
        by gathering the value whole and splitting it again."""
        tied = all(self.heads % n == 0 for n in axis_sizes if n > 1)

        def merged(heads, features, size):  # a compound factor cannot hold a size-1 one
            parts = [f for f, n in ((heads, size), (features, self.head_dim)) if n > 1]
            return CompoundFactor(*parts) if len(parts) == 2 else (parts or [heads])[0]

        names = {"b": "b", "q": merged("n", "hq", self.query_heads),
                 "k": merged("kh", "hk", self.heads)}  # fmt: skip
        if tied:
            names["n"] = "n"

        def side(specs, base):
            return tuple(
                ArrayMapping(*(names.get(c, f"u{base + i}x{j}") for j, c in enumerate(s)))
                for i, s in enumerate(specs)
            )

        sizes = {"kh": self.heads, "hq": self.head_dim, "hk": self.head_dim}
        if not tied:
            sizes["n"] = self.query_heads
        compound = {f for m in names.values() if isinstance(m, CompoundFactor) for f in m}
        return SdyShardingRule(side(self.ins, 0), side(self.outs, len(self.ins)),
                               **{f: n for f, n in sizes.items() if f in compound})  # fmt: skip

    def split(self, mesh, arg_shapes) -> tuple[Shards, list[P], list[P]]:
        placed = [_placement(mesh, arg) for arg in arg_shapes]
        letters, dims = self.ins[0], placed[0]
        B = arg_shapes[0].shape[letters.index("b")]
        rows = _split(mesh, dims[letters.index("b")], B)
        heads = _split(
            mesh, tuple(a for a in dims[letters.index("q")] if a not in rows), self.heads
        )
        used = {a for arg in placed for axes in arg for a in axes}
        for axis in mesh.axis_names:
            if axis in rows + heads or mesh.shape[axis] == 1 or (used and axis not in used):
                continue
            if self.heads % (_size(mesh, heads) * mesh.shape[axis]) == 0:
                heads += (axis,)
            elif B % (_size(mesh, rows) * mesh.shape[axis]) == 0:
                rows += (axis,)
        pick = {"b": rows or None, **dict.fromkeys("nqk", heads or None)}
        spec = lambda letters: P(*(pick.get(c) for c in letters))  # noqa: E731
        return Shards(rows, heads=heads), [spec(s) for s in self.ins], [spec(s) for s in self.outs]


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _placement(mesh, arg) -> list[tuple[str, ...]]:
    """Per dimension of the operand ``arg`` (a shape with its sharding), the mesh axes
    that split it, in order. The partitioner may split a dimension over part of an axis
    (4 heads over an axis of 8, the other half splitting the features), which no
    ``PartitionSpec`` says: the operand then reads as split over no axis."""
    sharding = arg.sharding
    try:
        if isinstance(sharding, NamedSharding):
            spec = sharding.spec
        else:
            spec = sharding_impls.parse_flatten_op_sharding(sharding._hlo_sharding, mesh)[0]
    except IndivisibleError:
        spec = P()
    return [_axes(spec[d]) if d < len(spec) else () for d in range(len(arg.shape))]


def _dim_axes(mesh, arg, dim: int) -> tuple[str, ...]:
    return _placement(mesh, arg)[dim]


def _size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _split(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """``axes`` if they divide ``size`` evenly, else none (the dimension is gathered)."""
    return axes if axes and size % _size(mesh, axes) == 0 else ()


@functools.cache
def _partitioned(
    local: Callable, layout: Layout | HeadsLayout, axis_sizes: tuple[int, ...]
) -> custom_partitioning:
    """``local`` as a ``custom_partitioning`` function that splits as ``layout`` says."""

    # Jitted: custom_partitioning refuses a function whose trace has constants (the
    # attention kernel's lists of block pairs); a jit keeps them inside its own jaxpr.
    whole = jax.jit(functools.partial(_whole, local))

    def partition(mesh, arg_shapes, result_shape):
        shards, ins, outs = layout.split(mesh, arg_shapes)
        ins = tuple(NamedSharding(mesh, spec) for spec in ins)
        outs = [NamedSharding(mesh, spec) for spec in outs]
        return mesh, functools.partial(local, shards=shards), outs, ins

    fn = custom_partitioning(whole)
    # Undecoded: the operands' shardings may split a dimension over part of an axis,
    # which a NamedSharding cannot say (_placement reads them).
    fn.def_partition(
        partition=partition, sharding_rule=layout.rule(axis_sizes), decode_shardings=False
    )
    return fn


row_local_p = Primitive("cannjax_row_local")
row_local_p.multiple_results = True


def row_local(local: Callable, layout: Layout | HeadsLayout, *args: jax.Array) -> list[jax.Array]:
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
        sizes = tuple(ctx.module_context.axis_context.abstract_mesh.axis_sizes)
        fn = lambda *a: list(_partitioned(local, layout, sizes)(*a))  # noqa: E731
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
