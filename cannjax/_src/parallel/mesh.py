"""Meshes and placement for data parallelism: a one-axis mesh, a sharded batch, replicas.

:func:`data_mesh` builds the ``(axis_name,)`` mesh the step runs over; :func:`shard_batch`
turns this process's rows into global arrays split over that axis and :func:`replicate`
places parameters and optimizer state on every device. The same calls serve one process
and many (after :func:`cannjax.parallel.initialize`): every array is built with
``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

_FN = "cannjax.parallel"


def data_mesh(axis_name: str = "data", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-dimensional mesh over ``devices`` (default: all global devices).

    Args:
      axis_name: the mesh axis name the batch is sharded over.
      devices: the devices, in order; default ``jax.devices()`` (every process's devices
        after :func:`cannjax.parallel.initialize`).

    Returns:
      ``jax.sharding.Mesh(devices, (axis_name,))``.

    Raises:
      ValueError: an empty ``axis_name`` or device list.

    Example:
      >>> import cannjax
      >>> mesh = cannjax.parallel.data_mesh("data")
      >>> mesh.axis_names
      ('data',)
    """
    if not isinstance(axis_name, str) or not axis_name:
        raise ValueError(f"{_FN}.data_mesh: axis_name must be a non-empty str, got {axis_name!r}")
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError(f"{_FN}.data_mesh: devices must not be empty")
    return Mesh(np.array(devices), (axis_name,))


def shard_batch(batch: Any, mesh: Mesh, axis_name: str = "data") -> Any:
    """Places this process's part of a batch as global arrays sharded over ``axis_name``.

    On one process ``batch`` is the whole batch. On ``N`` processes each passes its own
    ``B / N`` examples (process ``p`` holds rows ``p*B/N ... (p+1)*B/N - 1`` of the global
    batch when the mesh lists devices in process order, as :func:`data_mesh` does) and the
    result is a global array of leading size ``B``.

    Args:
      batch: a pytree of arrays with a common leading (batch) dimension.
      mesh: the mesh; ``axis_name`` must be one of its axes.
      axis_name: the axis the batch is split over.

    Returns:
      The batch as global ``jax.Array`` s sharded ``PartitionSpec(axis_name)``.

    Raises:
      ValueError: unknown axis, leaves with different leading sizes, or a local batch not
        divisible by this process's device count on the axis.

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> mesh = cannjax.parallel.data_mesh()
      >>> x = cannjax.parallel.shard_batch(jnp.ones((8, 3)), mesh)
      >>> x.shape, x.sharding.spec
      ((8, 3), P('data',))
    """
    _check_axis(f"{_FN}.shard_batch", mesh, axis_name)
    sizes = _leading_sizes(f"{_FN}.shard_batch", batch)
    local_devices = _local_device_count(mesh, axis_name)
    if sizes and sizes[0][1] % local_devices:
        raise ValueError(
            f"{_FN}.shard_batch: this process's batch has {sizes[0][1]} examples, not "
            f"divisible by its {local_devices} devices on mesh axis {axis_name!r}; "
            "pad or drop examples so each device gets the same number"
        )
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
    )


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Places a pytree (parameters, optimizer state) replicated on every device of ``mesh``.

    Every process must pass the same values (for example from the same seed).

    Example:
      >>> import jax.numpy as jnp, cannjax
      >>> w = cannjax.parallel.replicate({"w": jnp.ones(3)}, cannjax.parallel.data_mesh())
      >>> w["w"].sharding.is_fully_replicated
      True
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )


def _local_device_count(mesh: Mesh, axis_name: str) -> int:
    axis = mesh.axis_names.index(axis_name)
    devs = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.devices.shape[axis], -1)
    me = jax.process_index()
    return sum(any(d.process_index == me for d in row) for row in devs)


def _check_axis(fn: str, mesh: Any, axis_name: Any) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(
            f"{fn}: axis_name {axis_name!r} is not an axis of the mesh (axes "
            f"{mesh.axis_names}); pass one of them or build the mesh with "
            f"cannjax.parallel.data_mesh({axis_name!r})"
        )


def _leading_sizes(fn: str, batch: Any) -> list[tuple[str, int]]:
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    sizes = []
    for path, x in leaves:
        shape = np.shape(x)
        if len(shape) == 0:
            raise ValueError(
                f"{fn}: batch leaf {jax.tree_util.keystr(path) or '<root>'} is a scalar; "
                "every batch leaf needs a leading batch dimension"
            )
        sizes.append((jax.tree_util.keystr(path) or "<root>", shape[0]))
    if len({s for _, s in sizes}) > 1:
        raise ValueError(
            f"{fn}: batch leaves have different leading (batch) sizes "
            f"{dict(sizes)}; every leaf must hold the same examples"
        )
    return sizes
