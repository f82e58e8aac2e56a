"""Tests for jaxamp/_src/deprecated.py: the moved 0.1 names and sharding helpers warn."""

import importlib
import pathlib
import pickle
import re
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import jaxamp
from jaxamp._src.deprecated import MOVED_MODULES

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_private_module_imports_as_its_new_home(old):
    new = importlib.import_module(f"jaxamp._src.{MOVED_MODULES[old]}")
    sys.modules.pop(f"jaxamp._src.{old}", None)  # imported before: import it afresh
    with pytest.warns(DeprecationWarning, match=rf"jaxamp\._src\.{old} moved to"):
        module = importlib.import_module(f"jaxamp._src.{old}")
    assert module is new and sys.modules[f"jaxamp._src.{old}"] is new


def _as_written_by_0_1(data: bytes, new: str, old: str) -> bytes:
    """A protocol-2 pickle of today's objects, their module path as jaxamp 0.1 wrote it
    (protocol 2 names a class as ``c<module>\\n<name>\\n``, with no frame lengths)."""
    new_path, old_path = f"jaxamp._src.{new}\n".encode(), f"jaxamp._src.{old}\n".encode()
    assert new_path in data
    return data.replace(new_path, old_path)


def test_an_optimizer_state_pickled_by_0_1_loads():
    params = {"w": jnp.ones((4,), jnp.bfloat16), "b": jnp.zeros((2,))}
    state = jaxamp.loss_scaled(optax.adam(1e-3)).init(params)
    data = _as_written_by_0_1(pickle.dumps(state, protocol=2), "optim.loss_scaled", "loss_scaled")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loaded = pickle.loads(data)
    assert type(loaded) is jaxamp.optim.LossScaledState
    assert jax.tree.structure(loaded) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(state), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_docs_and_docstrings_use_no_deprecated_top_level_name():
    """Examples a user copies must not warn: only the migration note names old names."""
    root = pathlib.Path(__file__).parent.parent
    names = "|".join(sorted(jaxamp._MOVED, key=len, reverse=True))
    pattern = re.compile(rf"\bjaxamp\.({names})\b")
    files = [root / "README.md", *(root / "docs").rglob("*.md")]
    files += [*(root / "jaxamp").rglob("*.py"), *(root / "examples").rglob("*.py")]
    found = [
        f"{path.relative_to(root)}:{i}: {line.strip()}"
        for path in files
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and " is now " not in line  # docs/index.md's migration note
    ]
    assert files and not found, found


@pytest.mark.parametrize("name", sorted(jaxamp._MOVED))
def test_a_moved_top_level_name_warns_and_is_the_same_object(name):
    home, _, attr = jaxamp._MOVED[name].partition(":")
    with pytest.warns(DeprecationWarning, match=rf"jaxamp\.{name} is deprecated.*jaxamp 0\.3"):
        old = getattr(jaxamp, name)
    assert old is getattr(importlib.import_module(home), attr)
    assert name not in jaxamp.__all__


def test_moved_names_cover_every_top_level_name_of_0_1():
    # jaxamp 0.1's __all__, less the namespaces it had: each name is still reachable
    names_0_1 = [
        "AUTOCAST_RULES",
        "MASTER_WEIGHTS",
        "MATMUL_FORMS",
        "OPTIMIZER_RECIPES",
        "PRESETS",
        "AutocastRules",
        "DynamicLossScale",
        "LayerDiff",
        "LayerRange",
        "LossScaleState",
        "LossScaleStuckError",
        "LossScaledState",
        "MatmulForm",
        "MatmulOp",
        "NoOpLossScale",
        "NonFinite",
        "NumericsDiff",
        "Policy",
        "PrecisionError",
        "PrecisionReport",
        "Problem",
        "RangeReport",
        "Recommendation",
        "SensitiveOp",
        "StateDtypeState",
        "StaticLossScale",
        "ValueRange",
        "activation_bytes",
        "all_finite",
        "auto_policy",
        "autocast",
        "autocast_float32",
        "cast_floating",
        "checkpoint_residuals",
        "data_parallel_mesh",
        "dot_algorithm",
        "dot_product_attention",
        "find_loss_scaled_state",
        "find_nonfinite",
        "fsdp_shardings",
        "get_loss_scale",
        "get_policy",
        "linen",
        "loss_scale_metrics",
        "loss_scaled",
        "matmul_form",
        "nnx",
        "nonfinite_gradients",
        "numerics_diff",
        "optimizer_recipe",
        "precision_report",
        "raise_if_stuck",
        "range_report",
        "reduce_gradients",
        "replicated",
        "saved_residuals",
        "scale_history",
        "scale_loss",
        "shard_batch",
        "softmax_float32",
        "stochastic_round",
        "underflow_fraction",
        "use_matmul_form",
        "value_and_grad",
        "with_state_dtype",
    ]
    missing = [n for n in names_0_1 if n not in jaxamp.__all__ and n not in jaxamp._MOVED]
    assert not missing


def test_an_unknown_name_is_an_attribute_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
            jaxamp.no_such_name
        assert not hasattr(jaxamp, "also_missing")


@needs_8
def test_the_deprecated_sharding_helpers_still_work_and_warn():
    with pytest.warns(DeprecationWarning, match=r"jaxamp.data_parallel_mesh is deprecated"):
        mesh = jaxamp.data_parallel_mesh()
    assert mesh.axis_names == ("data",) and mesh.size == jax.device_count()
    with pytest.warns(DeprecationWarning, match="examples/distributed_train.py"):
        shard_batch = jaxamp.shard_batch
    x = shard_batch(np.zeros((16, 3), np.float32), mesh)
    assert x.sharding.spec == PartitionSpec("data") and len(x.addressable_shards) == 8
    with pytest.raises(ValueError, match="A batch of 10 examples does not divide over the 8"):
        shard_batch(np.zeros((10, 3)), mesh)
    with pytest.raises(ValueError, match="scalar"):
        shard_batch(np.float32(1.0), mesh)
    with pytest.warns(DeprecationWarning):
        assert jaxamp.replicated(mesh).spec == PartitionSpec()
    with pytest.warns(DeprecationWarning):
        specs = jaxamp.fsdp_shardings({"k": jnp.zeros((64, 512))}, mesh, min_size=256)
    assert specs["k"].spec == PartitionSpec(None, "data")
