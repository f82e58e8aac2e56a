"""Tests for jaxamp/_src/optim/rounding.py: stochastic rounding is unbiased and reproducible."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp._src.optim.rounding import (
    round_in_float32,
    round_to,
    stochastic_round,
    validate_rounding,
)

SIXTEEN = [jnp.bfloat16, jnp.float16]
# Each property test draws this many float32 values per example and rounds them under one
# jit per dtype (the shapes never change, so each dtype compiles once).
BATCH = 64
_round = jax.jit(stochastic_round, static_argnums=1)


def _bits(x):
    """The raw bits of an array (so -0.0 != 0.0 and NaN payloads count)."""
    x = np.asarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def _out_of_range(dtype):
    """float32 values at and beyond ``dtype``'s finite range, both signs: its max, values
    that round to nearest onto the max, and values that round to nearest to inf."""
    big = float(jnp.finfo(dtype).max)
    ulp_at_max = big - float(np.nextafter(np.asarray(big, dtype), np.asarray(0, dtype)))
    values = [
        big,
        big + 0.25 * ulp_at_max,  # rounds to nearest down onto the max
        big + 0.49 * ulp_at_max,
        big + 0.51 * ulp_at_max,  # rounds to nearest up to inf
        big * 1.01,
        1e10 if dtype == jnp.float16 else 3.4e38,
        float(jnp.finfo(jnp.float32).max),
    ]
    values = np.minimum(values, float(jnp.finfo(jnp.float32).max))  # bfloat16's max * 1.01
    return np.concatenate([values, -values]).astype(np.float32)


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
def test_exact_non_finite_and_out_of_range_values_round_to_nearest(dtype):
    """Exact values (zeros of both signs, the max, the smallest subnormal and normal),
    infinities, NaN, and every value beyond the finite range: exactly ``x.astype(dtype)``,
    for any key, symmetric by sign."""
    info = jnp.finfo(dtype)
    exact = [1.0, 0.0, -0.0, -2.0, float(info.max), float(info.smallest_normal)]
    exact += [float(info.smallest_subnormal), 3 * float(info.smallest_subnormal)]
    exact = np.asarray(exact + [-v for v in exact], np.float32)
    x = np.concatenate([exact, [np.inf, -np.inf, np.nan, -np.nan], _out_of_range(dtype)])
    x = jnp.asarray(x, jnp.float32)
    nearest = x.astype(dtype)
    assert bool(jnp.any(jnp.isinf(nearest) & jnp.isfinite(x)))  # some overflow to nearest
    assert bool(jnp.any((jnp.abs(nearest) == info.max) & (jnp.abs(x) > info.max)))
    for seed in range(8):
        y = _round(x, dtype, jax.random.key(seed))
        assert y.dtype == dtype
        np.testing.assert_array_equal(_bits(y), _bits(nearest))
    np.testing.assert_array_equal(_bits(y[: len(exact)].astype(jnp.float32)), _bits(exact))


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_subnormals_round_between_their_neighbours_without_bias(dtype):
    """Between the subnormals of ``dtype`` (and between 0 and the smallest one) the
    roundings land on the two neighbours, with the mean at the value."""
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    x = jnp.asarray([0.25 * tiny, 0.5 * tiny, 5.75 * tiny, -2.5 * tiny], jnp.float32)
    lo = jnp.asarray([0.0, 0.0, 5 * tiny, -3 * tiny], jnp.float32)
    draws = jax.jit(jax.vmap(lambda k: stochastic_round(x, dtype, k)))(
        jax.random.split(jax.random.key(5), 20_000)
    )
    # read on the host: XLA:CPU flushes float32 subnormals (bfloat16's) to zero in arithmetic
    draws, lo = np.asarray(draws).astype(np.float64), np.asarray(lo, np.float64)
    assert np.all((draws == lo) | (draws == lo + tiny))
    np.testing.assert_allclose((draws.mean(axis=0) - lo) / tiny, [0.25, 0.5, 0.75, 0.5], atol=0.015)


def test_same_key_same_roundings():
    x = jax.random.normal(jax.random.key(2), (1000,))
    a = stochastic_round(x, jnp.bfloat16, jax.random.key(3))
    b = stochastic_round(x, jnp.bfloat16, jax.random.key(3))
    c = stochastic_round(x, jnp.bfloat16, jax.random.key(4))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_nearest_and_bad_rounding(dtype):
    x = jnp.asarray([1.0 + 2.0**-10, 1e10, -1e10, 3.4e38], jnp.float32)
    near = jax.jit(round_to, static_argnums=(1, 2))(x, dtype, "nearest", None)
    np.testing.assert_array_equal(_bits(near), _bits(x.astype(dtype)))
    assert float(near[0]) == (1.0 if dtype == jnp.bfloat16 else float(x[0].astype(dtype)))
    # stochastic rounding to float32 of float32 values is the identity (nothing to round)
    same = jax.jit(round_to, static_argnums=(1, 2))(x, jnp.float32, "stochastic", jax.random.key(0))
    np.testing.assert_array_equal(_bits(same), _bits(x))
    with pytest.raises(ValueError, match=r"Unknown rounding 'up'\. Valid choices: 'nearest'"):
        validate_rounding("up")


# Property tests. Values are drawn from the float32 range of each 16-bit dtype (plus
# beyond it), keys from a seed; every check runs through the jitted ``_round``.

_finite32 = st.floats(
    min_value=-3.3999999521443642e38,
    max_value=3.3999999521443642e38,
    allow_nan=False,
    allow_infinity=False,
    width=32,
)
_seeds = st.integers(min_value=0, max_value=2**31 - 1)
_dtypes = st.sampled_from(SIXTEEN)


def _batch(values):
    return jnp.asarray(np.resize(np.asarray(values, np.float32), BATCH))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draws(x, dtype, n, key):
    """``n`` stochastic roundings of each element of ``x``."""
    return jax.vmap(lambda k: stochastic_round(x, dtype, k))(jax.random.split(key, n))


def _bracket(x, dtype):
    """The neighbours ``lo <= x <= hi`` of each float32 ``x`` in ``dtype``, from NumPy."""
    near = x.astype(dtype)
    down = np.nextafter(near, np.asarray(-np.inf, dtype))
    up = np.nextafter(near, np.asarray(np.inf, dtype))
    lo = np.where(near.astype(np.float32) > x, down, near).astype(np.float64)
    hi = np.where(near.astype(np.float32) < x, up, near).astype(np.float64)
    return lo, hi


@settings(max_examples=25, deadline=None)
@given(dtype=_dtypes, values=st.lists(_finite32, min_size=1, max_size=BATCH), seed=_seeds)
def test_property_unbiased(dtype, values, seed):
    """Each rounding is one of the two neighbours that bracket the value, the upper one
    in a fraction of 4096 draws within 5 standard errors of ``(x - lo) / (hi - lo)``
    (values beyond the finite range round to nearest: the last property test). Read on
    the host, in float64 (XLA:CPU flushes float32 subnormals in arithmetic)."""
    x = np.resize(np.asarray(values, np.float32), BATCH)
    x = np.where(np.abs(x) <= float(jnp.finfo(dtype).max), x, np.float32(1.0 + 2.0**-12))
    n = 4096
    draws = np.asarray(_draws(jnp.asarray(x), dtype, n, jax.random.key(seed))).astype(np.float64)
    lo, hi = _bracket(x, dtype)
    assert np.all((draws == lo) | (draws == hi))
    inexact = hi > lo
    p = np.where(inexact, (x.astype(np.float64) - lo) / np.where(inexact, hi - lo, 1.0), 0.0)
    error = np.abs(np.mean(draws == np.where(inexact, hi, np.inf), axis=0) - p)
    bound = 5 * np.sqrt(p * (1 - p) / n) + 2 / n
    worst = int(np.argmax(error - bound))
    assert np.all(error <= bound), (float(x[worst]), p[worst], error[worst])


@settings(max_examples=50, deadline=None)
@given(dtype=_dtypes, values=st.lists(_finite32, min_size=1, max_size=BATCH), seed=_seeds)
def test_property_exact_values_are_unchanged(dtype, values, seed):
    exact = _batch(values).astype(dtype)  # values representable in dtype (and inf)
    y = _round(exact.astype(jnp.float32), dtype, jax.random.key(seed))
    np.testing.assert_array_equal(_bits(y), _bits(exact))


@settings(max_examples=50, deadline=None)
@given(dtype=_dtypes, values=st.lists(_finite32, min_size=1, max_size=BATCH), seed=_seeds)
def test_property_symmetric_by_sign(dtype, values, seed):
    """With the same bits, round(-x) == -round(x): the magnitude is what is rounded."""
    x = np.resize(np.asarray(values, np.float32), BATCH)
    key = jax.random.key(seed)
    negated = np.asarray(_round(jnp.asarray(-x), dtype, key))  # negated on the host, exactly
    np.testing.assert_array_equal(
        _bits(negated), _bits(-np.asarray(_round(jnp.asarray(x), dtype, key)))
    )


@settings(max_examples=50, deadline=None)
@given(
    dtype=_dtypes,
    magnitudes=st.lists(
        st.floats(min_value=1.0, max_value=2.0**100, width=32), min_size=1, max_size=BATCH
    ),
    signs=st.lists(st.booleans(), min_size=BATCH, max_size=BATCH),
    seed=_seeds,
)
def test_property_non_finite_and_out_of_range_as_round_to_nearest(dtype, magnitudes, signs, seed):
    """Beyond the finite range (past the max, to inf), at inf and at NaN: exactly
    ``x.astype(dtype)``."""
    big = float(jnp.finfo(dtype).max)
    scale = _batch(magnitudes)  # >= 1: |x| >= the max
    x = jnp.where(jnp.asarray(signs), -1.0, 1.0) * jnp.minimum(big * scale, 3.4e38)
    x = x.at[:3].set(jnp.asarray([jnp.inf, -jnp.inf, jnp.nan]))
    y = _round(x, dtype, jax.random.key(seed))
    np.testing.assert_array_equal(_bits(y), _bits(x.astype(dtype)))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8])
def test_unsupported_dtypes_are_a_clear_error(dtype):
    """float8 dtypes (some without an inf) and non-floating dtypes are refused, listing the
    dtypes that are supported (float8 raised jax's TypePromotionError)."""
    x = jnp.ones(4, jnp.float32)
    with pytest.raises(ValueError, match=r"Valid choices: bfloat16, float16, float32"):
        stochastic_round(x, dtype, jax.random.key(0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_rounding_is_in_the_compiled_program(dtype):
    """x.astype(16 bits).astype(float32) may be folded to x by a compiler allowed excess
    precision (XLA's default on GPU and TPU): stochastic rounding's exactness test and
    Kahan's compensation rely on that rounding, so it is lax.reduce_precision, which
    survives compilation. XLA:CPU keeps both forms; the compiled text shows which."""
    text = (
        jax.jit(lambda x, key: stochastic_round(x, dtype, key))
        .lower(jnp.ones(8), jax.random.key(0))
        .compile()
        .as_text()
    )
    assert text.count("reduce-precision") >= 1
    params = {"w": jnp.ones(16, dtype)}
    for recipe in ("kahan", "float32"):
        tx = jaxamp.loss_scaled(optax.sgd(1e-3), jaxamp.NoOpLossScale(), master_weights=recipe)
        text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
        assert text.count("reduce-precision") >= 1, recipe


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-7e4, 7e4, allow_nan=False, width=32), min_size=1, max_size=16),
    dtype=st.sampled_from([jnp.bfloat16, jnp.float16]),
)
def test_round_in_float32_is_the_convert_pair(values, dtype):
    """The same values as x.astype(dtype).astype(float32), subnormals and overflow
    included, where XLA keeps the pair (on a CPU)."""
    x = jnp.asarray([*values, 1e-6, 3e-7, 65519.0, 65520.0, -1e-45], jnp.float32)
    got = jax.jit(functools.partial(round_in_float32, dtype=dtype))(x)
    np.testing.assert_array_equal(got, x.astype(dtype).astype(jnp.float32))
