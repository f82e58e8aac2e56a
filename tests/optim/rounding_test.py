"""Tests for jaxamp/_src/optim/rounding.py: stochastic rounding is unbiased and reproducible."""

import functools
import re
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.extend import core as jex

import jaxamp
from jaxamp._src.dtypes import JMP_DTYPE_NAMES
from jaxamp._src.optim.rounding import (
    round_in_float32,
    round_to,
    stochastic_round,
    validate_rounding,
)
from tests.helpers.expected_warnings import FLOAT16_STATISTICS
from tests.helpers.promotion import OPTAX, SUBJECT

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


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
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


@pytest.mark.standard_promotion(SUBJECT)
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


# A compiler allowed excess precision (XLA's default on GPU and TPU) simplifies a chain of
# float converts to one convert (XLA's SimplifyFPConversions): x.astype(float16).astype(float32)
# becomes x. XLA:CPU never does, even with --xla_allow_excess_precision=true (on by default), so
# the tests do it on purpose: they run the jaxpr with every such chain folded.

_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")


class _FoldingCompiler:
    """Evaluates a jaxpr (nested calls inlined) as a compiler allowed excess precision would
    run it: a float convert of the result of a float convert is one convert from the first
    operand, so a float32 -> 16 bits -> float32 pair is the identity. ``folded`` counts the
    pairs that returned a value to its own dtype."""

    def __init__(self):
        self.sources = {}  # id(result of a float convert) -> (that result, the chain's operand)
        self.folded = 0

    def convert(self, eqn, x):
        new_dtype = eqn.params["new_dtype"]
        floats = jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(new_dtype, jnp.floating)
        entry = self.sources.get(id(x))
        if floats and entry is not None and entry[0] is x:
            source = entry[1]
            if source.dtype == new_dtype:
                self.folded += 1
                return source
            out = lax.convert_element_type(source, new_dtype)
        else:
            source = x
            out = eqn.primitive.bind(x, **eqn.params)
        if floats and out is not source:
            self.sources[id(out)] = (out, source)
        return out

    def run(self, jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v):
            return v.val if isinstance(v, jex.Literal) else env[v]

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if eqn.primitive.name in _CALLS and isinstance(inner, jex.ClosedJaxpr):
                outs = self.run(inner.jaxpr, inner.consts, invals)
            elif eqn.primitive.name == "convert_element_type":
                outs = [self.convert(eqn, invals[0])]
            else:
                params = eqn.primitive.get_bind_params(eqn.params)  # (subfuns, params) in older jax
                subfuns, params = params if isinstance(params, tuple) else ((), params)
                outs = eqn.primitive.bind(*subfuns, *invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for v, out in zip(eqn.outvars, outs, strict=True):
                if not isinstance(v, jex.DropVar):
                    env[v] = out
        return [read(v) for v in jaxpr.outvars]


def _folded(fn, compiler=None):
    """``fn`` run with every float convert chain folded (see ``_FoldingCompiler``)."""

    def run(*args):
        closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = (compiler or _FoldingCompiler()).run(
            closed.jaxpr, closed.consts, jax.tree.leaves(args)
        )
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return run


def _pairs_folded(fn, *args):
    """How many float32 -> narrower -> float32 convert pairs a folding compiler removes from
    ``fn``'s program (traced for ``args``)."""
    compiler = _FoldingCompiler()
    jax.eval_shape(_folded(fn, compiler), *args)
    return compiler.folded


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
def test_the_folding_compiler_folds_a_convert_pair():
    """The simulated compiler does what the GPU one may: the pair, inside a nested jit,
    returns x unrounded (a quarter of a float16 ulp above 1)."""
    x = jnp.float32(1 + 2.0**-12)
    fn = jax.jit(lambda x: jax.jit(lambda y: y.astype(jnp.float16))(x).astype(jnp.float32) * 2)
    assert float(fn(x)) == 2.0
    assert float(jax.jit(_folded(fn))(x)) == 2 * (1 + 2.0**-12)
    assert _pairs_folded(fn, x) == 1
    assert _pairs_folded(lambda x: x.astype(jnp.float16), x) == 0


# Each 16-bit grid case: float32 values x = lo + f * (hi - lo) for the neighbours lo < hi of
# dtype and f in FRACTIONS, both signs, built in float64 (exactly) from numpy and ml_dtypes.
FRACTIONS = np.arange(8) / 8  # 0, 1/8, ..., 7/8 of a unit in the last place
GRID_DRAWS = 1024


def _planted_bases(dtype):
    """Lower neighbours every grid case holds: 0, subnormals, 1 (1 + 3/4 ulp is the issue's
    value), and the value just below the max (rounding up lands on the max)."""
    info = jnp.finfo(dtype)
    tiny, big = float(info.smallest_subnormal), np.asarray(info.max, dtype)
    below_max = float(np.nextafter(big, np.asarray(0, dtype)))
    largest_subnormal = float(info.smallest_normal) - tiny
    return [0.0, tiny, 5 * tiny, largest_subnormal, 1.0, 3.0, below_max]


def _grid_case(dtype, bases):
    """``(x, lo, hi, p)``: float32 inputs and, in float64, the two values each may round to and
    the probability of ``hi`` (``lo == hi``, ``p == 0`` where the rounding is determined). Past
    the max, at inf and at NaN the result is numpy's (ml_dtypes') round to nearest."""
    dtype = np.dtype(dtype)
    big = np.asarray(jnp.finfo(dtype).max, dtype)
    lo = np.asarray(bases, np.float32).astype(dtype)
    hi = np.nextafter(lo, np.asarray(np.inf, dtype))
    f = np.tile(FRACTIONS, len(lo))
    lo, hi = np.repeat(lo.astype(np.float64), 8), np.repeat(hi.astype(np.float64), 8)
    x = lo + f * (hi - lo)  # exact: three bits more than dtype's significand
    big64 = float(big)
    ulp_at_max = big64 - float(np.nextafter(big, np.asarray(0, dtype)))
    beyond = np.concatenate([big64 + FRACTIONS * ulp_at_max, [2 * big64]])
    beyond = np.minimum(beyond, float(np.finfo(np.float32).max))
    x = np.concatenate([x, beyond])
    p = np.concatenate([f, np.zeros(len(beyond))])
    determined = p == 0
    x = np.concatenate([x, -x, [np.inf, -np.inf, np.nan]])
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(x32.astype(np.float64), x)  # the grid is exact in float32
    with np.errstate(over="ignore"):  # past the max, to inf
        near = x32.astype(dtype).astype(np.float64)
    lo, hi = np.concatenate([lo, beyond, -lo, -beyond]), np.concatenate([hi, beyond, -hi, -beyond])
    determined = np.concatenate([determined, determined, [True] * 3])
    lo = np.where(determined, near, np.concatenate([lo, [np.nan] * 3]))
    hi = np.where(determined, near, np.concatenate([hi, [np.nan] * 3]))
    return x32, lo, hi, np.concatenate([p, p, [0.0] * 3])


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _grid_draws(x, dtype, n, fold, key):
    """``n`` stochastic roundings of each element of ``x``, the convert pairs folded if ``fold``."""

    def round_once(x, k):
        return stochastic_round(x, dtype, k)

    fn = _folded(round_once) if fold else round_once
    return jax.vmap(lambda k: fn(x, k))(jax.random.split(key, n))


def _bits_of(values, dtype):
    return _bits(np.asarray(values, np.float64).astype(dtype))


# Drawn lower neighbours: a float32 (rounded to the dtype, kept below its max), or an int k
# for the k-th subnormal of the dtype (modulo their count).
_bases = st.lists(
    st.one_of(
        st.floats(min_value=0.0, max_value=float(np.float32(3.3e38)), width=32),
        st.integers(0, 1023),
    ),
    min_size=3,
    max_size=3,
)


def _lower_neighbours(dtype, drawn):
    """The planted lower neighbours and the drawn ones (see ``_bases``), values of ``dtype``."""
    info = jnp.finfo(dtype)
    planted = _planted_bases(dtype)
    out = []
    for b in drawn:
        if isinstance(b, int):
            b = b % 2 ** int(info.nmant) * float(info.smallest_subnormal)
        with np.errstate(over="ignore"):
            b = float(np.asarray(b, np.float32).astype(dtype))
        out.append(min(b, planted[-1]))  # below the max (inf included)
    return planted + out


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("fold", [False, True], ids=["as_compiled_on_cpu", "pair_folded"])
@pytest.mark.parametrize("dtype", SIXTEEN)
@settings(max_examples=6, deadline=None)
@given(bases=_bases, seed=_seeds)
@example(bases=[1.0, 1.0, 1.0], seed=0)  # issue 46: float16 1 + 3/4 ulp, folded, always up
def test_grid_of_fractions_unbiased_with_the_convert_pair_folded(dtype, fold, bases, seed):
    """Over a grid of fractions of a unit in the last place (0, 1/8, ..., 7/8) above drawn and
    planted values (0, subnormals, 1, below the max), both signs, each rounding is one of the two
    neighbours and the upper one comes in a share of the draws within 5 standard errors of the
    fraction; values that are exact, past the max (to the max or inf), inf and NaN give numpy's
    round to nearest, bit for bit. The same when a compiler folds every float32 -> 16 bits ->
    float32 convert pair (the issue: float16 1 + 3/4 ulp then always rounded up). Compared, in
    float64, with values built from numpy alone."""
    _check_grid(dtype, fold, bases, seed)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", SIXTEEN)
@settings(max_examples=100, deadline=None)
@given(bases=_bases, seed=_seeds)
def test_grid_of_fractions_with_the_convert_pair_folded_larger_budget(dtype, bases, seed):
    """The grid test above, folded, with a larger budget of drawn values and keys."""
    _check_grid(dtype, True, bases, seed)


def _check_grid(dtype, fold, bases, seed):
    """The grid test's checks for one draw of lower neighbours and one key."""
    x, lo, hi, p = _grid_case(dtype, _lower_neighbours(dtype, bases))
    draws = np.asarray(_grid_draws(jnp.asarray(x), dtype, GRID_DRAWS, fold, jax.random.key(seed)))
    assert draws.dtype == np.dtype(dtype)
    determined = p == 0
    nan = np.isnan(x)
    np.testing.assert_array_equal(np.isnan(draws), np.broadcast_to(nan, draws.shape))
    exact = determined & ~nan
    np.testing.assert_array_equal(
        _bits(draws[:, exact]), np.broadcast_to(_bits_of(lo[exact], dtype), draws[:, exact].shape)
    )
    d = draws[:, ~determined].astype(np.float64)
    lo, hi, p, x = lo[~determined], hi[~determined], p[~determined], x[~determined]
    outside = ~((d == lo) | (d == hi))
    assert not outside.any(), x[outside.any(axis=0)][:4]
    share = np.mean(d == hi, axis=0)
    bound = 5 * np.sqrt(p * (1 - p) / GRID_DRAWS) + 2 / GRID_DRAWS
    worst = int(np.argmax(np.abs(share - p) - bound))
    mean = d.mean(axis=0)  # float64, from the two neighbours
    assert np.all(np.abs(share - p) <= bound), (
        f"{float(x[worst])!r}: fraction {p[worst]}, mean {mean[worst]!r} "
        f"(lo {lo[worst]!r}, hi {hi[worst]!r}), share up {share[worst]}"
    )


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("dtype", SIXTEEN)
@settings(max_examples=10, deadline=None)
@given(bases=_bases)
def test_round_in_float32_with_the_convert_pair_folded(dtype, bases):
    """Kahan's rounding (``round_in_float32``) is numpy's round to nearest over the grid,
    subnormals included, also when a compiler folds convert pairs (its subnormal branch was a
    pair: folded, it returned x unrounded)."""
    tiny = np.float32(jnp.finfo(dtype).smallest_subnormal)
    x = _grid_case(dtype, _lower_neighbours(dtype, bases))[0]
    x = np.concatenate([x, x + tiny / 2]).astype(np.float32)  # subnormal ties among them
    with np.errstate(over="ignore"):
        want = x.astype(dtype).astype(np.float32)
    fn = functools.partial(round_in_float32, dtype=dtype)
    for run in (jax.jit(fn), jax.jit(_folded(fn))):
        got = np.asarray(run(jnp.asarray(x)))
        np.testing.assert_array_equal(_bits(got), _bits(want))


_WIDENING = re.compile(
    r"stablehlo\.convert [^\n]*\(tensor<(?:[\d?]+x)*(?:bf16|f16)>\) -> tensor<(?:[\d?]+x)*f32>"
)


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_the_rounding_is_in_the_compiled_program(dtype):
    """x.astype(16 bits).astype(float32) may be folded to x by a compiler allowed excess
    precision (XLA's default on GPU and TPU). Stochastic rounding takes no such pair: its
    program converts nothing from 16 bits back to float32, and it rounds on the bits
    (integer and, add). Kahan's and the float32 master's roundings are lax.reduce_precision,
    which survives compilation, with no pair a compiler could fold."""
    fn = jax.jit(lambda x, key: stochastic_round(x, dtype, key))
    args = (jnp.ones(8), jax.random.key(0))
    text = fn.lower(*args).as_text()
    assert not _WIDENING.findall(text), _WIDENING.findall(text)
    assert _pairs_folded(fn, *args) == 0
    assert re.search(r"stablehlo\.and [^\n]*: tensor<8xui32>", text)
    assert re.search(r"stablehlo\.add [^\n]*: tensor<8xui32>", text)
    assert _pairs_folded(functools.partial(round_in_float32, dtype=dtype), jnp.ones(8)) == 0
    params = {"w": jnp.ones(16, dtype)}
    for recipe in ("kahan", "float32", "stochastic"):
        tx = jaxamp.loss_scaled(optax.sgd(1e-3), jaxamp.NoOpLossScale(), master_weights=recipe)
        args = (params, tx.init(params), params)
        assert _pairs_folded(tx.update, *args) == 0, recipe
        if recipe != "stochastic":
            text = jax.jit(tx.update).lower(*args).compile().as_text()
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


# One dtype vocabulary: stochastic_round takes the names cast_floating and with_state_dtype take.
_NAMED = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "half": jmp.half_dtype(),  # jmp's: float16, or bfloat16 on TPU
    "f64": None,  # stochastic_round rounds float32 values: nothing wider
    "float64": None,
}


# the float16 names too, on purpose
@pytest.mark.standard_promotion(OPTAX)
@FLOAT16_STATISTICS
@pytest.mark.parametrize("name", [*JMP_DTYPE_NAMES, " BF16 ", "Float16"])
def test_the_dtype_names_policies_accept(name):
    """Every dtype name of the library's vocabulary (jmp's grammar, which cast_floating and
    with_state_dtype accept) names the same dtype for stochastic_round, through jax.jit, and
    rounds as that dtype does; float64 is refused by name."""
    wanted = _NAMED[name.strip().lower()]
    x = jax.random.normal(jax.random.key(1), (256,)) * 1e3
    key = jax.random.key(2)
    if wanted is None:
        with pytest.raises(ValueError, match=rf"{re.escape(repr(name))}.*Valid choices: .*bf16"):
            stochastic_round(x, name, key)
        return
    assert jaxamp.cast_floating(x, name).dtype == wanted
    got = _round(x, name, key)
    assert got.dtype == wanted
    np.testing.assert_array_equal(_bits(got), _bits(_round(x, wanted, key)))
    tx = jaxamp.with_state_dtype(optax.adam(1e-3), name, rounding="stochastic")
    assert tx.init({"w": x}).inner_state[0].mu["w"].dtype == wanted


@pytest.mark.parametrize("bad", ["bfloat", "fp16", "f8", "int8", None, jnp.float64, jnp.int8])
def test_a_bad_dtype_name_names_itself_and_the_choices(bad):
    """A name or dtype stochastic_round cannot round to: a ValueError naming it and listing
    every choice, the names included."""
    with pytest.raises(ValueError) as info:
        stochastic_round(jnp.ones(4), bad, jax.random.key(0))
    message = str(info.value)
    shown = repr(bad) if bad is None or isinstance(bad, str) else np.dtype(bad).name
    assert shown in message, message
    choices = message.split("Valid choices: ")[1]
    for name in ("bfloat16", "float16", "float32", "bf16", "f16", "half", "f32", "full"):
        assert re.search(rf"\b{name}\b", choices), (name, message)


@pytest.mark.standard_promotion(OPTAX)
def test_the_device_check_runs_on_cpu_at_tiny_size(tmp_path, monkeypatch):
    """benchmarks/rounding_on_device.py (a GPU check) runs its grid of fractions on the CPU."""
    from benchmarks import rounding_on_device

    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["rounding_on_device", "--draws", "256", "--out", str(out)])
    rounding_on_device.main()
    text = (out / "rounding_on_device.md").read_text()
    for fraction in ("0.125", "0.875"):
        assert fraction in text
    assert "unbiased" in text and "BIASED" not in text
