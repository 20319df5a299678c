"""Parameter shardings beyond data parallelism: FSDP and tensor parallelism.

A rule maps each array of a parameter pytree (a dict, a NamedTuple, flax.nnx state, an
equinox module) to a :class:`jax.sharding.NamedSharding` over a mesh; ``jax.jit`` and
``jax.device_put`` take the result, and the GSPMD/Shardy partitioner makes the
collectives:

* **tensor parallel** over axis ``tensor``: the spec of the first ``rules`` entry whose
  pattern matches the parameter's path, else the last dimension of every array with two or
  more dimensions (column-parallel), when the axis divides it;
* **FSDP** over axis ``fsdp`` (ZeRO-3): then the largest dimension not yet sharded that
  the axis divides (the first of equal ones). Each device keeps ``1/size`` of the
  parameter; the partitioner gathers it where it is used and reduce-scatters its gradient.

Arrays that no dimension fits stay replicated; leaves that are not arrays (an equinox
module's activation function) get ``None``, as ``equinox.filter_shard`` expects.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cannjax._src.parallel.mesh import _check_axis

_FN = "cannjax.parallel"

Rule = tuple[str, Any]  # (regular expression searched in the path, PartitionSpec)


def model_mesh(
    data: int,
    model: int,
    devices: Sequence[jax.Device] | None = None,
    axis_names: tuple[str, str] = ("data", "model"),
) -> Mesh:
    """A ``data x model`` mesh: the batch (and FSDP) over ``data``, layers over ``model``.

    Args:
      data: size of the data axis.
      model: size of the model (tensor-parallel) axis; devices next to each other in
        ``devices`` share a data row, so the model axis is the faster-connected one.
      devices: ``data * model`` devices; default ``jax.devices()``, all of them.
      axis_names: the two axis names.

    Raises:
      ValueError: sizes that are not positive or do not multiply to the device count.

    Example:
      >>> import cannjax
      >>> mesh = cannjax.parallel.model_mesh(4, 2)  # 8 devices
      >>> dict(mesh.shape)
      {'data': 4, 'model': 2}
    """
    fn = f"{_FN}.model_mesh"
    devices = list(jax.devices() if devices is None else devices)
    for name, size in (("data", data), ("model", model)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{fn}: {name} must be an int >= 1, got {size!r}")
    if data * model != len(devices):
        raise ValueError(
            f"{fn}: data * model = {data} * {model} = {data * model} must equal the number "
            f"of devices, {len(devices)}"
        )
    return Mesh(np.array(devices).reshape(data, model), tuple(axis_names))


def param_shardings(
    params: Any,
    mesh: Mesh,
    *,
    fsdp: str | None = None,
    tensor: str | None = None,
    rules: Sequence[Rule] = (),
) -> Any:
    """The ``NamedSharding`` of every array of ``params``: tensor parallel, FSDP or both.

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct``).
      mesh: the mesh.
      fsdp: the mesh axis to shard every parameter over (its largest free dimension), or
        ``None``.
      tensor: the mesh axis of tensor parallelism, or ``None``.
      rules: ``(pattern, spec)`` pairs for tensor parallelism: the first pattern that
        ``re.search`` finds in a parameter's path (``"blocks/w_o"``: keys joined by
        ``/``) gives its ``PartitionSpec``; ``()`` for none. Parameters no rule matches
        are column-parallel over ``tensor``.

    Returns:
      a pytree like ``params``: a ``NamedSharding`` per array leaf, ``None`` for others.

    Raises:
      TypeError: ``mesh`` not a ``Mesh``, a rule not a ``(str, PartitionSpec)`` pair.
      ValueError: an axis not in the mesh, neither ``fsdp`` nor ``tensor`` given, or a
        rule's spec that does not fit its parameter (more entries than dimensions, an
        unknown axis, a dimension the axes do not divide), naming the path and shape.

    Example:
      >>> import jax, jax.numpy as jnp, cannjax
      >>> mesh = cannjax.parallel.model_mesh(4, 2)
      >>> params = {"w": jnp.zeros((16, 6)), "b": jnp.zeros(6)}
      >>> s = cannjax.parallel.param_shardings(params, mesh, fsdp="data", tensor="model")
      >>> s["w"].spec, s["b"].spec
      (P('data', 'model'), P())
    """
    return _shardings("param_shardings", params, mesh, fsdp, tensor, rules)


def fsdp(params: Any, mesh: Mesh, axis: str = "data") -> Any:
    """FSDP (ZeRO-3) shardings: :func:`param_shardings` with ``fsdp=axis`` only.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> mesh = cannjax.parallel.model_mesh(8, 1)
      >>> cannjax.parallel.fsdp({"w": jnp.zeros((3, 16))}, mesh)["w"].spec
      P(None, 'data')
    """
    return _shardings("fsdp", params, mesh, axis, None, ())


def tensor_parallel(
    params: Any, mesh: Mesh, axis: str = "model", rules: Sequence[Rule] = ()
) -> Any:
    """Tensor-parallel shardings: :func:`param_shardings` with ``tensor=axis`` only.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = cannjax.parallel.model_mesh(4, 2)
      >>> params = {"w_in": jnp.zeros((8, 32)), "w_out": jnp.zeros((32, 8))}
      >>> s = cannjax.parallel.tensor_parallel(params, mesh, rules=[("w_out", P("model"))])
      >>> s["w_in"].spec, s["w_out"].spec  # Megatron's column- then row-parallel pair
      (P(None, 'model'), P('model',))
    """
    return _shardings("tensor_parallel", params, mesh, None, axis, rules)


def _shardings(name, params, mesh, fsdp_axis, tensor_axis, rules):
    fn = f"{_FN}.{name}"
    axes = [a for a in (fsdp_axis, tensor_axis) if a is not None]
    if not axes:
        raise ValueError(f"{fn}: give fsdp=AXIS, tensor=AXIS or both; got neither")
    for axis in axes:
        _check_axis(fn, mesh, axis)
    rules = _check_rules(fn, rules)

    def one(path, leaf):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return None
        where = jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"
        shape = tuple(leaf.shape)
        spec = [None] * len(shape)
        if tensor_axis is not None:
            spec = _tensor_spec(fn, where, shape, mesh, tensor_axis, rules)
        if fsdp_axis is not None:
            size = mesh.shape[fsdp_axis]
            free = [d for d in range(len(shape)) if spec[d] is None and shape[d] % size == 0]
            if free and fsdp_axis not in spec:
                spec[max(free, key=lambda d: (shape[d], -d))] = fsdp_axis
        while spec and spec[-1] is None:  # P('data') rather than P('data', None)
            spec.pop()
        return NamedSharding(mesh, P(*spec))

    return jax.tree_util.tree_map_with_path(one, params)


def _tensor_spec(fn, where, shape, mesh, axis, rules):
    for pattern, spec in rules:
        if re.search(pattern, where):
            return _fit(fn, where, shape, mesh, pattern, spec)
    spec = [None] * len(shape)
    if len(shape) >= 2 and shape[-1] % mesh.shape[axis] == 0:
        spec[-1] = axis
    return spec


def _fit(fn, where, shape, mesh, pattern, spec):
    """The rule's spec as a list of ``len(shape)`` entries, or a ValueError saying why not."""
    entries = list(spec)
    said = f"{fn}: rule {pattern!r} gives parameter {where} (shape {shape}) the spec {spec}"
    if len(entries) > len(shape):
        raise ValueError(f"{said}, which has more entries than the parameter has dimensions")
    for d, entry in enumerate(entries):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in names if a not in mesh.axis_names]
        if unknown:
            raise ValueError(f"{said}; {unknown[0]!r} is not a mesh axis ({mesh.axis_names})")
        size = math.prod(mesh.shape[a] for a in names)
        if shape[d] % size:
            raise ValueError(
                f"{said}; dimension {d} (size {shape[d]}) is not divisible by the "
                f"{size} devices of {'x'.join(names)}"
            )
    return entries + [None] * (len(shape) - len(entries))


def _check_rules(fn, rules):
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(f"{fn}: rules must be a sequence of (pattern, spec) pairs, got {rules!r}")
    out = []
    for rule in rules:
        ok = isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)
        if not ok or not isinstance(rule[1], (P, tuple, list)):
            raise TypeError(
                f"{fn}: each rule must be a (str pattern, PartitionSpec) pair, got {rule!r}"
            )
        try:
            re.compile(rule[0])
        except re.error as e:
            raise ValueError(
                f"{fn}: rule pattern {rule[0]!r} is not a regular expression: {e}"
            ) from None
        out.append((rule[0], rule[1]))
    return out
