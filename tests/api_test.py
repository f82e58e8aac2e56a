"""The public API: every exported name imports (ruff keeps ``__all__`` sorted), the
names of jaxamp 0.1 that moved still work with a warning, and the core imports without
the ``compare`` extra."""

import importlib
import subprocess
import sys
import warnings

import pytest

import jaxamp

MODULES = [
    "jaxamp",
    "jaxamp.linen",
    "jaxamp.nnx",
    "jaxamp.optim",
    "jaxamp.debug",
    "jaxamp.ops",
    "jaxamp.models",
]


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_imports(module):
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


@pytest.mark.parametrize("module", MODULES)
def test_all_has_no_duplicates_or_private_names(module):
    names = list(importlib.import_module(module).__all__)
    assert len(names) == len(set(names))
    assert not any(name.startswith("_") for name in names)


def test_version():
    assert isinstance(jaxamp.__version__, str) and jaxamp.__version__.count(".") == 2


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


BLOCK_COMPARE_EXTRA = (
    "import sys\n"
    "for m in ('tqdm', 'matplotlib', 'tensorflow_datasets', 'sklearn', 'PIL'):\n"
    "    sys.modules[m] = None\n"
)


def test_the_core_imports_without_the_compare_extra():
    code = BLOCK_COMPARE_EXTRA + (
        "import jaxamp, jaxamp.models, jaxamp.optim, jaxamp.debug, jaxamp.ops\n"
        "assert not any(m in sys.modules and sys.modules[m] for m in ('tqdm', 'matplotlib'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_jaxamp_compare_without_the_extra_names_the_extra_to_install():
    code = BLOCK_COMPARE_EXTRA + (
        "from jaxamp._src.compare import cli\nsys.exit(cli.main(['compare', '--steps', '1']))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs the 'compare' extra" in result.stderr
    assert "pip install 'jaxamp[compare]'" in result.stderr
