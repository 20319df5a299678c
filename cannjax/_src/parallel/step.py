"""The data-parallel training step: local loss-scaled gradients, all-reduce mean, update.

The step is ``jax.jit(jax.shard_map(...))`` over a :class:`jax.sharding.Mesh` axis
(``"data"`` by default): every device takes ``B / D`` examples of the batch (``B`` batch,
``D`` devices on the axis), computes the gradient of its local mean loss, and the
gradients are averaged with collectives,

.. math::  g = \\frac{1}{D} \\sum_{d=1}^{D} \\nabla_\\theta \\, \\frac{D}{B} \\sum_{i \\in d}
   \\ell_i(\\theta) = \\nabla_\\theta \\frac{1}{B} \\sum_{i=1}^{B} \\ell_i(\\theta),

which is the full-batch gradient whenever ``loss_fn`` is a mean over the examples. The same
code runs on one process (``jax_num_cpu_devices`` or several accelerators) and on many,
after :func:`cannjax.parallel.initialize`.

Loss scaling and the skipped step are ``cannjax.amp``'s, not a copy:
``amp.value_and_grad(..., axis_name=axis)`` runs the configured overflow check on the raw
local gradients and agrees the flag over the axis with ``pmin``, and
``amp.skip_nonfinite`` keeps params and optimizer state as they were when it is False.
So the check that catches a saturated float16 overflow on Ascend (``65504``, not
``inf``) guards data-parallel training as it guards one device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cannjax._src.amp import scaled_grad
from cannjax._src.amp.loss_scale import NoOpLossScale, OverflowCheck, default_overflow_check
from cannjax._src.core.decorators import keyword_decorator
from cannjax._src.core.vma import varying_axes
from cannjax._src.parallel.buckets import (
    DEFAULT_BUCKET_BYTES,
    _check_comm_dtype,
    all_reduce_mean,
    plan_buckets,
)
from cannjax._src.parallel.layerwise import gathered_per_layer
from cannjax._src.parallel.mesh import _check_axis, _leading_sizes, data_mesh

_FN = "cannjax.parallel"


class StepOutput(NamedTuple):
    """What a data-parallel step returns.

    Attributes:
      params: updated parameters (unchanged on a skipped non-finite step).
      opt_state: updated optimizer state (unchanged on a skipped step).
      loss_scale: the adjusted loss scale, or None when none was passed.
      metrics: dict of scalars, identical on every device: ``loss`` (unscaled mean over
        the global batch), ``grad_norm`` (global L2 norm of the averaged gradient; NaN on
        a step whose overflow check failed), ``grads_finite`` (bool, the overflow check's
        verdict agreed by every device), plus the averaged ``aux`` entries when
        ``has_aux``.
    """

    params: Any
    opt_state: Any
    loss_scale: Any
    metrics: dict


@dataclasses.dataclass(frozen=True)
class DataParallelStep:
    """A jitted data-parallel training step; build it with :func:`data_parallel`.

    Call ``step(params, opt_state, batch, loss_scale=None) -> StepOutput``. ``batch`` is
    the global batch (on several processes: global arrays from
    :func:`cannjax.parallel.shard_batch`).

    The loss scale is a ``cannjax.amp`` loss scale or any pytree with
    ``scale(loss) -> loss``, ``unscale(grads) -> grads`` and
    ``adjust(grads_finite) -> new loss scale`` (the jmp protocol); it goes to
    ``cannjax.amp.value_and_grad``. The finite flag passed to ``adjust`` and to the skip
    is ``overflow_check`` of the raw gradients reduced with ``pmin`` over the axis, so
    every device skips or applies the same step.
    """

    loss_fn: Callable
    optimizer: optax.GradientTransformation
    mesh: Mesh
    axis_name: str
    bucket_bytes: int | None
    comm_dtype: Any
    has_aux: bool
    skip_nonfinite: bool
    overflow_check: OverflowCheck
    param_shardings: Any = None
    reshard_after_forward: bool = False
    _jitted: Callable = dataclasses.field(repr=False, compare=False, default=None)

    def __call__(self, params: Any, opt_state: Any, batch: Any, loss_scale: Any = None):
        """Runs one step; see the class docstring."""
        self._validate(params, opt_state, batch, loss_scale)
        return self._jitted(params, opt_state, batch, loss_scale)

    def lower(self, params: Any, opt_state: Any, batch: Any, loss_scale: Any = None):
        """``jax.jit(...).lower`` of the step, for HLO inspection."""
        self._validate(params, opt_state, batch, loss_scale)
        return self._jitted.lower(params, opt_state, batch, loss_scale)

    def _validate(self, params, opt_state, batch, loss_scale):
        fn = f"{_FN}.data_parallel"
        sizes = _leading_sizes(fn, batch)
        if not sizes:
            raise ValueError(f"{fn}: batch has no array leaves")
        n = self.mesh.shape[self.axis_name]
        if sizes[0][1] % n:
            raise ValueError(
                f"{fn}: batch size {sizes[0][1]} is not divisible by the {n} devices on "
                f"mesh axis {self.axis_name!r}; pad or drop examples to a multiple of {n}"
            )
        if jax.process_count() > 1:
            for path, x in jax.tree_util.tree_leaves_with_path((params, opt_state, batch)):
                if not isinstance(x, jax.Array):
                    raise TypeError(
                        f"{fn}: with {jax.process_count()} processes every input must be a "
                        f"global jax.Array, got {type(x).__name__} at {jax.tree_util.keystr(path)}"
                        "; use cannjax.parallel.shard_batch / replicate"
                    )
        _check_opt_state(fn, self.optimizer, params, opt_state)
        if loss_scale is not None:
            missing = [m for m in ("scale", "unscale", "adjust") if not hasattr(loss_scale, m)]
            if missing:
                raise TypeError(
                    f"{fn}: loss_scale must provide scale(loss), unscale(grads) and "
                    f"adjust(grads_finite); {type(loss_scale).__name__} lacks {missing}"
                )


def _check_opt_state(fn: str, optimizer, params, opt_state) -> None:
    expected = jax.tree.structure(jax.eval_shape(optimizer.init, params))
    got = jax.tree.structure(opt_state)
    if expected != got:
        raise ValueError(
            f"{fn}: opt_state does not match optimizer.init(params) (the pytrees differ: "
            f"expected {expected}, got {got}); initialise it with optimizer.init(params) "
            "for these params"
        )


def _as_param_dtypes(grads: Any, params: Any, keep_float16: bool = False) -> Any:
    def one(g, p):
        dt = jnp.result_type(p)
        return g if keep_float16 and dt == jnp.float16 else g.astype(dt)

    return jax.tree.map(one, grads, params)


@keyword_decorator
def data_parallel(
    loss_fn: Callable,
    optimizer: optax.GradientTransformation,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "data",
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    comm_dtype: Any = None,
    has_aux: bool = False,
    skip_nonfinite: bool = False,
    overflow_check: OverflowCheck | None = None,
    donate: bool = False,
    param_shardings: Any = None,
    reshard_after_forward: bool = False,
) -> DataParallelStep:
    """Builds a data-parallel training step: shard, local grads, all-reduce mean, update.

    Per device (``shard_map`` over ``axis_name``; params and optimizer state replicated)::

        local = pcast(params, axis, to="varying")        # local gradients, no implicit psum
        loss, g, new_scale, finite = amp.value_and_grad(
            loss_fn, loss_scale or NoOpLossScale(), axis_name=axis,
            overflow_check=overflow_check)(local, local_batch)
        # finite = pmin(overflow_check(raw scaled g), axis): every device agrees;
        # g: unscaled (float32 with a loss scale), NaN on every device when not finite
        g = all_reduce_mean(g, axis)                     # bucketed
        if loss_scale or skip_nonfinite:                 # amp.skip_nonfinite's update
            params, opt_state = (update(params, opt_state, g) if finite
                                 else (params, opt_state))          # bit-identical
        else:
            params, opt_state = update(params, opt_state, g)
        metrics = pmean(loss, aux), grad_norm(g), finite

    ``loss_fn(params, batch)`` must return the *mean* loss over the examples in ``batch``
    (``(loss, aux)`` with ``has_aux``; ``aux`` a dict of float scalars, averaged over
    devices); then the averaged gradient equals the full-batch gradient.

    Gradient dtypes: with a loss scale the gradients are unscaled in float32 on each
    device and communicated so (or in ``comm_dtype``), as ``cannjax.amp`` hands them out.
    Without one each gradient is communicated and given to the optimizer in its
    parameter's dtype, except that float16 gradients are summed in float32 (a float16
    sum over devices can overflow where no device's gradient did).

    Also a decorator: ``@cannjax.parallel.data_parallel(optimizer=opt)`` above
    ``def loss_fn(params, batch)`` makes ``loss_fn`` the step.

    Args:
      loss_fn: ``(params, batch) -> loss`` (or ``(loss, aux)``).
      optimizer: an optax GradientTransformation.
      mesh: the mesh (default: :func:`cannjax.parallel.data_mesh` over all devices).
      axis_name: the mesh axis the batch is split over.
      bucket_bytes: all-reduce bucket capacity in bytes; None or 0 disables bucketing.
      comm_dtype: None or ``jnp.bfloat16`` (float32 accumulation; see
        :func:`cannjax.parallel.all_reduce_mean`).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      skip_nonfinite: skip the update of a step the overflow check flags even without a
        loss scale (with a loss scale the step always skips). Without either, a flagged
        step is applied with the NaN gradients ``amp.value_and_grad`` returns.
      overflow_check: ``tree -> bool scalar`` run on each device's raw (scaled)
        gradients, True when nothing overflowed; None means
        ``cannjax.amp.default_overflow_check()`` for the current platform (saturation
        detection on Ascend), resolved here.
      donate: donate params and optimizer state buffers to the step.
      param_shardings: None (parameters replicated), or a pytree of ``NamedSharding``
        matching ``params`` on one mesh (from :func:`cannjax.parallel.param_shardings`;
        ``NamedSharding(mesh, P())`` replicates a parameter). Each parameter then lives as
        those shardings say, and so does the optimizer state mirroring it
        (``optax.tree_map_params``): FSDP over ``axis_name`` (ZeRO-3: each device gathers a
        parameter sharded over the data axis for the forward and backward, ``all_gather``,
        and keeps its shard of the averaged gradient, ``psum_scatter``), tensor parallelism
        over the mesh's other axes (left to the partitioner: the ``shard_map`` is manual
        over ``axis_name`` only). The update runs outside the ``shard_map``, on the sharded
        gradients, so global-norm transforms (``optax.clip_by_global_norm``) see the whole
        gradient. ``comm_dtype`` and buckets apply to the all-reduced (not FSDP-sharded)
        leaves.
      reshard_after_forward: with FSDP ``param_shardings`` only. False (default): each
        FSDP parameter is gathered whole once and kept until the backward is done. True:
        a stacked parameter that a top-level ``lax.scan`` of ``loss_fn`` reads per layer
        is gathered one layer at a time inside the loop, and again in the backward
        (ZeRO-3; PyTorch FSDP's option of the same name): one layer's weights are held
        gathered rather than all, and each layer's gradient is reduce-scattered as it is
        made, for a second gather of those weights (``docs/parallel.md``).

    Returns:
      A :class:`DataParallelStep`.

    Raises:
      ValueError: ``axis_name`` not in the mesh, bad bucket size or comm dtype,
        ``param_shardings`` on another mesh, sharding a dimension over ``axis_name``
        together with another axis, or on a mesh whose ``axis_name`` has one device,
        ``reshard_after_forward`` without ``param_shardings``; at
        call time: batch not divisible by the devices, batch leaves of different sizes,
        optimizer state not built for these params.
      TypeError: ``loss_fn`` or ``overflow_check`` not callable, ``reshard_after_forward``
        not a bool, ``param_shardings``
        leaves that are not ``NamedSharding``, ``optimizer`` not a
        GradientTransformation, a loss scale without ``scale``/``unscale``/``adjust``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, cannjax
      >>> def loss_fn(w, batch):
      ...     x, y = batch
      ...     return jnp.mean((x @ w - y) ** 2)
      >>> opt = optax.sgd(0.1)
      >>> step = cannjax.parallel.data_parallel(loss_fn, opt)
      >>> w = jnp.zeros(3)
      >>> x = jnp.ones((8, 3)); y = jnp.ones(8)
      >>> out = step(w, opt.init(w), (x, y))
      >>> float(out.metrics["loss"]), bool(out.metrics["grads_finite"])
      (1.0, True)
    """
    fn = f"{_FN}.data_parallel"
    if not callable(loss_fn):
        raise TypeError(f"{fn}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"{fn}: optimizer must be an optax.GradientTransformation, got "
            f"{type(optimizer).__name__}"
        )
    if overflow_check is None:
        overflow_check = default_overflow_check()
    elif not callable(overflow_check):
        raise TypeError(
            f"{fn}: overflow_check must be a callable tree -> bool scalar (e.g. "
            f"cannjax.amp.saturation_check()), got {overflow_check!r}"
        )
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"{fn}: reshard_after_forward must be a bool, got {reshard_after_forward!r}"
        )
    if reshard_after_forward and param_shardings is None:
        raise ValueError(
            f"{fn}: reshard_after_forward=True applies to FSDP param_shardings, got "
            "param_shardings=None (parameters replicated)"
        )
    if mesh is None and param_shardings is not None:
        mesh = _mesh_of(fn, param_shardings)
    mesh = data_mesh(axis_name) if mesh is None else mesh
    _check_axis(fn, mesh, axis_name)
    plan_buckets([], bucket_bytes)  # validates bucket_bytes
    comm = _check_comm_dtype(fn, comm_dtype)
    sync = functools.partial(
        all_reduce_mean, axis_name=axis_name, bucket_bytes=bucket_bytes, comm_dtype=comm
    )
    # The skip is amp's; data_parallel has already unscaled (or never scaled) the
    # gradients, so float16 ones are genuine float16 training, not a forgotten unscale.
    guarded = scaled_grad.skip_nonfinite(optimizer, allow_float16_updates=True)

    def local_grads(params, batch, loss_scale, reduce, wrap=None):
        """Loss metrics, gradients reduced over the axis by ``reduce``, new scale, flag;
        ``wrap(loss_fn)``: the loss to differentiate in its place."""
        objective = loss_fn if wrap is None else wrap(loss_fn)

        def local_loss(p):
            out = objective(p, batch)
            if has_aux and not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(f"{fn}: with has_aux, loss_fn must return (loss, aux)")
            loss, aux = out if has_aux else (out, {})
            if not isinstance(aux, dict):
                raise TypeError(f"{fn}: with has_aux, aux must be a dict, got {type(aux).__name__}")
            if jnp.shape(loss) != () or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
                raise TypeError(
                    f"{fn}: loss_fn must return a floating scalar (the mean loss of the "
                    f"batch), got {jnp.result_type(loss)}{list(jnp.shape(loss))}"
                )
            return loss, aux

        # Varying copies: jax.grad then returns local gradients (no implicit psum per
        # leaf), and the reduction does the communication, bucketed.
        local = jax.tree.map(
            lambda p: (
                p if axis_name in varying_axes(p) else jax.lax.pcast(p, axis_name, to="varying")
            ),
            params,
        )
        scale = NoOpLossScale() if loss_scale is None else loss_scale
        (loss, aux), grads, new_scale, finite = scaled_grad.value_and_grad(
            local_loss, scale, has_aux=True, axis_name=axis_name, overflow_check=overflow_check
        )(local)
        if loss_scale is None:
            # amp widened the gradients to float32 (values unchanged: the scale is 1).
            # Back to each parameter's dtype, as jax.grad gives it; float16 only after
            # the sum over devices, which could overflow in float16.
            grads = _as_param_dtypes(reduce(_as_param_dtypes(grads, params, True)), params)
        else:
            grads = reduce(grads)
        for k in sorted(aux):
            if jnp.shape(aux[k]) != ():
                raise ValueError(
                    f"{fn}: aux[{k!r}] has shape {jnp.shape(aux[k])}; has_aux metrics must "
                    "be scalars (they are averaged over devices)"
                )
        # One collective for every scalar metric.
        names = ["loss", *sorted(aux)]
        vals = jnp.stack([jnp.asarray(loss, jnp.float32)] + [aux[k] for k in sorted(aux)])
        vals = jax.lax.pmean(vals.astype(jnp.float32), axis_name)
        return dict(zip(names, list(vals))), grads, new_scale, finite

    def apply(params, opt_state, grads, metrics, new_scale, finite, loss_scale):
        if loss_scale is not None or skip_nonfinite:
            # The user keeps optimizer.init(params) as opt_state: wrap it in a fresh skip
            # state for this step (the inner init that guarded.init makes is dead code).
            state = guarded.init(params)._replace(inner_state=opt_state)
            updates, state = guarded.update(grads, state, params, grads_finite=finite)
            new_opt = state.inner_state
        else:
            updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "grads_finite": finite}
        return StepOutput(new_params, new_opt, None if loss_scale is None else new_scale, metrics)

    if param_shardings is None:

        def local_step(params, opt_state, batch, loss_scale):
            metrics, grads, new_scale, finite = local_grads(params, batch, loss_scale, sync)
            return apply(params, opt_state, grads, metrics, new_scale, finite, loss_scale)

        def step(params, opt_state, batch, loss_scale):
            body = jax.shard_map(
                local_step,
                mesh=mesh,
                in_specs=(P(), P(), P(axis_name), P()),
                out_specs=P(),
            )
            return body(params, opt_state, batch, loss_scale)

    else:
        if mesh.shape[axis_name] == 1:
            # XLA's partitioner rejects the step's collectives over a one-device manual
            # axis beside automatic ones (a RET_CHECK: "Cross-partition allreduce must be
            # in (partial) manual partitioning mode").
            raise ValueError(
                f"{fn}: with param_shardings the data axis {axis_name!r} needs at least 2 "
                f"devices, got mesh {dict(mesh.shape)}; for tensor parallelism alone use "
                "jax.jit(..., in_shardings=param_shardings)"
            )
        shardings = _sharded_layout(fn, param_shardings, mesh, axis_name)
        step = _sharded_step(
            local_grads, apply, sync, optimizer, shardings, axis_name, reshard_after_forward
        )

    jitted = jax.jit(step, donate_argnums=(0, 1) if donate else ())
    return DataParallelStep(
        loss_fn=loss_fn,
        optimizer=optimizer,
        mesh=mesh,
        axis_name=axis_name,
        bucket_bytes=bucket_bytes,
        comm_dtype=comm,
        has_aux=has_aux,
        skip_nonfinite=skip_nonfinite,
        overflow_check=overflow_check,
        param_shardings=param_shardings,
        reshard_after_forward=reshard_after_forward,
        _jitted=jitted,
    )


# ------------------------------------------------------- sharded parameters (FSDP, TP)
class _Layout(NamedTuple):
    """Where each parameter lives: its ``NamedSharding``, the dimension it is sharded on
    over the data axis (None: not sharded over it) and the manual ``shard_map`` spec."""

    shardings: Any
    data_dims: Any
    manual_specs: Any


def _mesh_of(fn: str, param_shardings: Any) -> Mesh:
    named = [s for s in jax.tree.leaves(param_shardings) if isinstance(s, NamedSharding)]
    if not named:
        raise TypeError(
            f"{fn}: param_shardings must be a pytree of jax.sharding.NamedSharding (from "
            "cannjax.parallel.param_shardings), got no NamedSharding leaf"
        )
    return named[0].mesh


def _sharded_layout(fn: str, param_shardings: Any, mesh: Mesh, axis_name: str) -> _Layout:
    def one(path, s):
        where = jax.tree_util.keystr(path, simple=True, separator="/")
        if not isinstance(s, NamedSharding):
            raise TypeError(
                f"{fn}: param_shardings[{where!r}] must be a NamedSharding or None, got "
                f"{type(s).__name__}"
            )
        if s.mesh != mesh:
            raise ValueError(
                f"{fn}: param_shardings[{where!r}] is on mesh {dict(s.mesh.shape)}, not the "
                f"step's mesh {dict(mesh.shape)}"
            )
        dims = [i for i, e in enumerate(s.spec) if e == axis_name]
        mixed = [
            e for e in s.spec if isinstance(e, tuple) and len(e) > 1 and axis_name in e
        ]  # fmt: skip
        if mixed or len(dims) > 1:
            raise ValueError(
                f"{fn}: param_shardings[{where!r}] has spec {s.spec}: a parameter may be "
                f"sharded over the data axis {axis_name!r} on one dimension, alone"
            )
        dim = dims[0] if dims else None
        manual = P(*[axis_name if i == dim else None for i in range(len(s.spec))])
        return s, dim, manual

    # None (a parameter that is not there, as param_shardings maps it) is an empty
    # subtree, as in the parameters.
    flat, tree = jax.tree_util.tree_flatten_with_path(
        param_shardings, is_leaf=lambda s: isinstance(s, NamedSharding)
    )
    triples = [one(path, s) for path, s in flat]
    rebuild = functools.partial(jax.tree_util.tree_unflatten, tree)
    return _Layout(*(rebuild([t[i] for t in triples]) for i in range(3)))


def _sharded_step(
    local_grads, apply, sync, optimizer, layout: _Layout, axis_name: str, per_layer: bool
):
    """The step with parameters laid out by ``layout``: inside a ``shard_map`` manual over
    ``axis_name`` only, each device gathers its FSDP-sharded parameters, takes local
    gradients and keeps its shard of their mean (``psum_scatter``); the other leaves are
    all-reduced as in the replicated step. The update runs outside, on sharded arrays."""

    def dims_of(tree):
        """Each leaf's data dimension (None: not sharded over the data axis)."""
        return jax.tree.structure(tree).flatten_up_to(layout.data_dims)

    def gather(params):
        flat, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [
            p if d is None else jax.lax.all_gather(p, axis_name, axis=d, tiled=True)
            for p, d in zip(flat, dims_of(params))
        ])  # fmt: skip

    def reduce(grads, scattered: bool = False):
        """The mean over the axis: FSDP leaves reduce-scattered (``scattered``: summed
        and sharded already, by the transpose of each layer's gather), the others
        all-reduced in buckets."""
        flat, tree = jax.tree.flatten(grads)
        dims = dims_of(grads)
        summed = iter(sync([g for g, d in zip(flat, dims) if d is None]))
        n = jax.lax.axis_size(axis_name)

        def shard_sum(g, d):
            if scattered:
                return g
            return jax.lax.psum_scatter(g, axis_name, scatter_dimension=d, tiled=True)

        out = [next(summed) if d is None else shard_sum(g, d) / n for g, d in zip(flat, dims)]
        return jax.tree.unflatten(tree, out)

    def on_shards_of(loss_fn):
        def on_shards(params, batch):
            flat, tree = jax.tree.flatten(params)
            run = gathered_per_layer(
                lambda flat, batch: loss_fn(jax.tree.unflatten(tree, flat), batch),
                dims_of(params),
                axis_name,
            )
            return run(flat, batch)

        return on_shards

    def grads_on_shards(params, batch, loss_scale):
        if per_layer:
            scattered = functools.partial(reduce, scattered=True)
            return local_grads(params, batch, loss_scale, scattered, on_shards_of)
        return local_grads(gather(params), batch, loss_scale, reduce)

    def constrain(tree, shardings):
        return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)

    def step(params, opt_state, batch, loss_scale):
        params = constrain(params, layout.shardings)
        body = jax.shard_map(
            grads_on_shards,
            mesh=jax.tree.leaves(layout.shardings)[0].mesh,
            in_specs=(layout.manual_specs, P(axis_name), P()),
            out_specs=(P(), layout.manual_specs, P(), P()),
            axis_names={axis_name},
        )
        metrics, grads, new_scale, finite = body(params, batch, loss_scale)
        out = apply(params, opt_state, grads, metrics, new_scale, finite, loss_scale)
        # The optimizer state's copies of the parameter tree (Adam's moments) are laid
        # out as the parameters; its other leaves (step counts) are left to XLA.
        new_opt = optax.tree_map_params(
            optimizer, jax.lax.with_sharding_constraint, out.opt_state, layout.shardings
        )
        return out._replace(params=constrain(out.params, layout.shardings), opt_state=new_opt)

    return step
