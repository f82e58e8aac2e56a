"""Names that left jaxamp's top level, kept for one release (removed in jaxamp 0.3).

The sharding helpers below only wrapped ``jax.sharding``; ``examples/distributed_train.py``
now shows the same in plain JAX. The record and state types moved to ``jaxamp.debug`` and
``jaxamp.optim``; ``deprecation_getattr`` serves their old top-level names with a warning.
The private modules of 0.1 that a pickle may name (an optimizer state pickles as
``jaxamp._src.loss_scaled.LossScaledState``) import as their new homes
(``MOVED_MODULES``), so that pickles written with 0.1 still load.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REMOVED_IN = "0.3"


def deprecation_getattr(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves each old name of ``moved`` from its new home.

    Args:
      module: the module's ``__name__``.
      moved: old name -> the new home as ``"package.module:name"``.

    Returns:
      The ``__getattr__``; it warns with a ``DeprecationWarning`` that names the new home.
    """

    def __getattr__(name: str) -> Any:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, attr = moved[name].partition(":")
        if home == __name__:
            instead = "it only wraps jax.sharding: see examples/distributed_train.py"
        else:
            instead = f"use {home}.{attr}"
        warnings.warn(
            f"{module}.{name} is deprecated and will be removed in jaxamp {REMOVED_IN}; {instead}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), attr)

    return __getattr__


def data_parallel_mesh(devices: Sequence[Any] | None = None, axis: str = "data") -> Mesh:
    """A one-axis mesh over ``devices`` (default: every device of every process).

    Examples:
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


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that keeps a full copy on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


# 0.1's private modules (under jaxamp._src) whose contents moved as a whole: a pickle
# written with 0.1 names its classes and functions by these paths.
MOVED_MODULES = {
    "attention": "ops.attention",
    "autocast_interpreter": "autocast.interpreter",
    "autocast_rules": "autocast.rules",
    "cli": "compare.cli",
    "compare_stats": "compare.choice",
    "data": "compare.data",
    "diagnostics": "optim.diagnostics",
    "environment": "compare.environment",
    "layers": "flax_policy.plan",
    "linen_policy": "flax_policy.linen",
    "loss_scale": "optim.scales",
    "loss_scaled": "optim.loss_scaled",
    "master_weights": "optim.master_weights",
    "matmul": "ops.matmul",
    "matmul_forms": "ops.forms",
    "models": "compare.models",
    "models.bert": "compare.models.bert",
    "models.gpt2": "compare.models.gpt2",
    "models.resnet": "compare.models.resnet",
    "nnx_policy": "flax_policy.nnx",
    "numerics.in_compare": "compare.numerics_checks",
    "numerics.walk": "numerics.evaluator",
    "precision_report": "audit.report",
    "program_walk": "audit.stablehlo",
    "report": "compare.report",
    "residuals": "ops.residuals",
    "rounding": "ops.rounding",
    "scale_loss": "optim.gradients",
    "state_dtype": "optim.state_dtype",
    "variants": "compare.variants",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``jaxamp._src.<old>`` as the module it moved to (the same module object),
    with a ``DeprecationWarning``."""

    prefix = "jaxamp._src."

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix(self.prefix)
        if not fullname.startswith(self.prefix) or old not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = self.prefix + MOVED_MODULES[spec.name.removeprefix(self.prefix)]
        warnings.warn(
            f"{spec.name} moved to {new}; its old path is kept for pickles written with "
            f"jaxamp 0.1 and will be removed in jaxamp {REMOVED_IN}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the module it moved to is already executed


def install_moved_modules() -> None:
    """Puts the finder for ``MOVED_MODULES`` on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())  # before the path finder: one module
