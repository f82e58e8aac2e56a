"""Scaling out with JAX's own machinery: meshes, sharded batches, FSDP, reduced gradients.

jaxamp adds nothing to ``jax.sharding`` and ``jax.distributed``; these helpers
only remove the boilerplate that mixed precision makes easy to get wrong:

* :func:`shard_batch` puts a batch on a data-parallel mesh (in a multi-process
  run, each process passes its own part) and says clearly when the batch does
  not divide over the devices;
* :func:`fsdp_shardings` shards every parameter (and, applied to it, every
  optimizer-state leaf) along the largest dimension the mesh axis divides;
* :func:`reduce_gradients` all-reduces gradients inside ``shard_map`` in the
  policy's :attr:`~jaxamp.Policy.grad_reduce_dtype` (float32 under mixed
  policies), so bfloat16 gradients are never summed in bfloat16.

Under ``jax.jit`` with sharded inputs, :func:`jaxamp.loss_scaled`'s finiteness
check is a global reduction, so every device (and every process) skips the
same steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxamp._src.autocast_interpreter import FLOAT32_SCOPE
from jaxamp._src.policy import Policy, get_policy, is_floating_array


def data_parallel_mesh(devices: Sequence[Any] | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh over ``devices`` (default: every device of every process).

    Example:
      >>> mesh = data_parallel_mesh()
      >>> mesh.axis_names
      ('data',)
    """
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (axis,))


def shard_batch(batch: Any, mesh: Mesh, axis: str = "data") -> Any:
    """Places a batch (a pytree of arrays, batch dimension first) along ``axis`` of ``mesh``.

    In a single-process run ``batch`` is the global batch. In a multi-process run each
    process passes its own part (``global batch / process count`` examples) and gets
    back global arrays (``jax.make_array_from_process_local_data``).

    Args:
      batch: arrays with the batch as their first dimension.
      mesh: the mesh.
      axis: the mesh axis to split the batch over.

    Returns:
      The batch as global ``jax.Array``s sharded along ``axis``.

    Raises:
      ValueError: if the batch does not divide over the devices of ``axis``.
    """
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    devices = mesh.shape[axis]
    local_devices = devices // jax.process_count()

    def place(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        if x.ndim == 0:
            raise ValueError("shard_batch takes arrays with a batch dimension, got a scalar.")
        if jax.process_count() == 1:
            if x.shape[0] % devices:
                raise ValueError(
                    f"A batch of {x.shape[0]} examples does not divide over the {devices} "
                    f"devices of mesh axis {axis!r}; use a batch size that is a multiple "
                    f"of {devices}."
                )
            return jax.device_put(x, sharding)
        if x.shape[0] % local_devices:
            raise ValueError(
                f"This process's batch of {x.shape[0]} examples does not divide over its "
                f"{local_devices} devices on mesh axis {axis!r}."
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(place, batch)


def fsdp_shardings(tree: Any, mesh: Mesh, axis: str = "data", min_size: int = 2**14) -> Any:
    """``NamedSharding``s that split each leaf along its largest dimension ``axis`` divides.

    Leaves smaller than ``min_size`` elements, scalars and leaves with no divisible
    dimension are replicated. Apply it to the params and to the optimizer state (whose
    moments have the params' shapes) to shard both, FSDP-style.

    Args:
      tree: a pytree of arrays or ``jax.ShapeDtypeStruct``s.
      mesh: the mesh.
      axis: the mesh axis to shard over.
      min_size: leaves below this many elements stay replicated.

    Returns:
      A pytree of ``NamedSharding`` with the structure of ``tree``.
    """
    devices = mesh.shape[axis]

    def sharding(x):
        shape = tuple(getattr(x, "shape", ()))
        spec = [None] * len(shape)
        if int(np.prod(shape, dtype=np.int64)) >= min_size:
            for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
                if shape[dim] % devices == 0:
                    spec[dim] = axis
                    break
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(sharding, tree)


def reduce_gradients(
    grads: Any, axis_name: str, policy: str | Policy = "mixed_bfloat16", mean: bool = True
) -> Any:
    """All-reduces gradients over a mapped axis in the policy's reduction dtype.

    For use inside ``jax.shard_map`` (or ``pmap``), where each device holds the
    gradients of its own examples. Floating leaves are cast to
    ``policy.grad_reduce_dtype`` (float32 under mixed policies unless the policy's
    ``reduce_dtype`` says otherwise), summed (or averaged) across ``axis_name``, and
    returned in that dtype; under :func:`jaxamp.autocast` too (the reduction runs as
    traced there, so ``reduce=bf16`` is kept rather than widened to float32).

    Args:
      grads: the per-device gradients.
      axis_name: the mapped axis.
      policy: the policy (or spec) that gives the reduction dtype.
      mean: average instead of sum.

    Returns:
      The reduced gradients, identical on every device.
    """
    policy = get_policy(policy)
    dtype = policy.grad_reduce_dtype
    reduce = lax.pmean if mean else lax.psum

    def one(g):
        if not is_floating_array(g):
            return g
        with jax.named_scope(FLOAT32_SCOPE):  # as traced under autocast: the dtype asked for
            return reduce(g.astype(dtype), axis_name)

    return jax.tree.map(one, grads)


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())
