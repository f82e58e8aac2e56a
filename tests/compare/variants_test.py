"""Tests for jaxamp/_src/compare/variants.py: the four recipes, the optimizer-state and the
float8 ones."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from jaxamp._src.compare.variants import PRECISION_VARIANTS, VARIANTS, default_variants, get_variant
from tests.helpers.promotion import OPTAX


def test_the_four_recipes():
    assert PRECISION_VARIANTS == ("fp32", "tf32", "bf16", "fp16")
    assert list(VARIANTS)[:4] == list(PRECISION_VARIANTS)
    assert get_variant("FP32").matmul_precision == "highest"
    assert get_variant("tf32").matmul_precision is None
    assert get_variant("bf16").policy == jaxamp.get_policy("mixed_bfloat16")
    assert get_variant("fp16").policy == jaxamp.get_policy("mixed_float16")
    assert [VARIANTS[n].dynamic_loss_scaling for n in PRECISION_VARIANTS] == [0, 0, 0, 1]


@pytest.mark.standard_promotion(OPTAX)
def test_the_optimizer_state_recipes_are_variants_too():
    params = {"w": jnp.ones(2, jnp.bfloat16)}
    for name in jaxamp.optim.OPTIMIZER_RECIPES:
        if name == "float32_params":
            continue  # that recipe is the bf16 variant
        variant = get_variant(name)
        assert variant.optimizer_recipe == name and not variant.dynamic_loss_scaling
        assert variant.policy == jaxamp.get_policy(jaxamp.optim.OPTIMIZER_RECIPES[name][0])
        state = jaxamp.optim.find_loss_scaled_state(
            variant.optimizer(optax.adam(1e-3)).init(params)
        )
        assert (state.master_params is not None) == (name == "bf16_float32_master")
        assert (state.compensation is not None) == (name == "bf16_kahan")
        assert (state.rounding_key is not None) == (name == "bf16_stochastic")


def test_the_float8_recipes_are_variants_outside_the_benchmark_suites_defaults():
    fp8, delayed = get_variant("fp8"), get_variant("FP8-delayed")
    assert fp8.policy == jaxamp.get_policy("mixed_float8") and fp8.policy.fp8.scaling == "current"
    assert delayed.policy == jaxamp.get_policy("mixed_float8_delayed")
    assert delayed.policy.fp8.scaling == "delayed"
    for variant in (fp8, delayed):  # float8's own scales; no loss scaling, plain Adam
        assert not variant.dynamic_loss_scaling and variant.optimizer_recipe is None
        assert variant.matmul_precision is None
    assert "fp8" not in PRECISION_VARIANTS and "fp8" not in default_variants()


def test_optimizer_wraps_only_fp16():
    params = {"w": jnp.ones(2)}
    assert get_variant("bf16").optimizer(optax.sgd(0.1)).init(params) == optax.sgd(0.1).init(params)
    state = get_variant("fp16").optimizer(optax.sgd(0.1)).init(params)
    assert float(jaxamp.optim.get_loss_scale(state)) == 2.0**16


def test_fp32_traces_with_highest_precision():
    x = jnp.ones((4, 4))
    with get_variant("fp32").tracing():
        text = jax.jit(jnp.matmul).lower(x, x).as_text()
    assert "HIGHEST" in text
    with get_variant("tf32").tracing():
        assert "HIGHEST" not in jax.jit(lambda a: a @ a).lower(x).as_text()


def test_unknown_variant():
    with pytest.raises(ValueError, match=r"Unknown variant 'fp4'\. Valid choices: fp32, tf32"):
        get_variant("fp4")


def test_default_variants_on_this_machine():
    picked = jaxamp.auto_policy()
    expected = {
        str(jaxamp.PRESETS["mixed_bfloat16"]): ["fp32", "bf16"],
        str(jaxamp.PRESETS["mixed_float16"]): ["fp32", "fp16"],
        str(jaxamp.PRESETS["float32"]): ["fp32", "bf16", "fp16"],
    }[str(picked)]
    if jax.default_backend() == "cpu":  # float16 gains nothing on any CPU: left out
        expected = ["fp32", "bf16"]
    assert default_variants() == expected
