"""Tests for jaxamp/_src/rounding.py: stochastic rounding is unbiased and reproducible."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.rounding import round_to, stochastic_round, validate_rounding

SIXTEEN = [jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_unbiased_mean_over_many_draws(dtype):
    """Values between two 16-bit neighbours: the mean of the roundings is the value."""
    base = jnp.asarray([1.0, -3.0, 1e-3, 200.0], jnp.float32).astype(dtype).astype(jnp.float32)
    ulp = (jnp.nextafter(base.astype(dtype), jnp.asarray(jnp.inf, dtype)).astype(jnp.float32)
           - base.astype(dtype).astype(jnp.float32))  # fmt: skip
    for fraction in (0.1, 0.25, 0.5, 0.9):
        x = base + fraction * ulp
        draws = jax.jit(jax.vmap(lambda k, x=x: stochastic_round(x, dtype, k)))(
            jax.random.split(jax.random.key(0), 20_000)
        ).astype(jnp.float32)
        lo, hi = base, base + ulp
        assert bool(jnp.all((draws == lo) | (draws == hi)))  # only the two neighbours
        mean = draws.mean(axis=0)
        # standard error of a Bernoulli mean over 20k draws <= 0.0036 ulp; allow 4 SE
        np.testing.assert_allclose((mean - lo) / ulp, fraction, atol=0.015)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_exact_and_non_finite_values_are_kept(dtype):
    x = jnp.asarray([1.0, 0.0, -2.0, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    y = jax.jit(stochastic_round, static_argnums=1)(x, dtype, jax.random.key(1))
    np.testing.assert_array_equal(y.astype(jnp.float32), x)
    assert y.dtype == dtype


def test_same_key_same_roundings():
    x = jax.random.normal(jax.random.key(2), (1000,))
    a = stochastic_round(x, jnp.bfloat16, jax.random.key(3))
    b = stochastic_round(x, jnp.bfloat16, jax.random.key(3))
    c = stochastic_round(x, jnp.bfloat16, jax.random.key(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_nearest_and_bad_rounding():
    x = jnp.asarray([1.0 + 2.0**-10], jnp.float32)
    assert float(round_to(x, jnp.bfloat16, "nearest", None)[0]) == 1.0
    with pytest.raises(ValueError, match=r"Unknown rounding 'up'\. Valid choices: 'nearest'"):
        validate_rounding("up")
