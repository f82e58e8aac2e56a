"""Tests for jaxamp/_src/dtypes.py: the one dtype vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src import dtypes

FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", FLOATS)
def test_predicates_of_the_floating_dtypes(dtype):
    sixteen = np.dtype(dtype).itemsize == 2
    assert dtypes.is_floating(dtype) and dtypes.is_inexact(dtype)
    assert dtypes.is_16bit(dtype) == sixteen
    x = jnp.ones(3, dtype)
    assert dtypes.is_floating_array(x) and dtypes.is_narrow_array(x) == sixteen
    assert jax.jit(dtypes.upcast)(x).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_is_narrow_but_not_16_bit(dtype):
    """``is_16bit`` means 16 bits; ``is_narrow`` is any float narrower than float32 (what
    master weights and ``upcast`` act on)."""
    x = jnp.ones(3, dtype)
    assert not dtypes.is_16bit(dtype) and not dtypes.is_16bit(x.dtype)
    assert dtypes.is_narrow(dtype) and dtypes.is_narrow_array(x)
    assert dtypes.is_narrower(dtype, jnp.bfloat16) and not dtypes.is_narrower(jnp.float32, dtype)
    assert jax.jit(dtypes.upcast)(x).dtype == jnp.float32


@pytest.mark.parametrize(
    "value", [jnp.int16, jnp.int32, jnp.bool_, jnp.complex64, None, jax.random.key(0)]
)
def test_predicates_refuse_what_is_not_a_real_16_bit_float(value):
    dtype = getattr(value, "dtype", value)
    assert not dtypes.is_16bit(dtype)
    assert dtypes.is_inexact(dtype) == (value is jnp.complex64)
    assert not dtypes.is_floating_array(value)


def test_upcast_leaves_float64_ints_and_python_numbers_alone():
    tree = {"h": jnp.ones(2, jnp.float16), "i": jnp.arange(2), "n": 3.0}
    out = jax.tree.map(dtypes.upcast, tree)
    assert out["h"].dtype == jnp.float32 and out["i"].dtype == tree["i"].dtype
    assert out["n"] == 3.0
    x64 = np.ones(2, np.float64)
    assert dtypes.upcast(x64) is x64


@pytest.mark.parametrize(
    "value", [(0, 1), "not a dtype", 3, jax.lax.Precision.HIGHEST, jax.make_jaxpr(jnp.sin)(1.0)]
)
def test_predicates_answer_false_for_what_is_not_a_dtype(value):
    """An equation's parameters (axes, a precision, a jaxpr) are not dtypes: the numerics
    tools widen the 16-bit dtypes among them and leave the rest as they are."""
    assert not dtypes.is_floating(value) and not dtypes.is_inexact(value)
    assert not dtypes.is_16bit(value) and not dtypes.is_narrow(value)
    assert not dtypes.is_float16(value)


@pytest.mark.parametrize("dtype", [*FLOATS, jnp.float8_e4m3fn, jnp.int16])
def test_is_float16_means_float16_alone(dtype):
    """Not bfloat16, the other 16-bit float (of float32's range), nor int16."""
    assert dtypes.is_float16(dtype) == (dtype is jnp.float16)
    assert dtypes.is_float16(jnp.ones(2, dtype).dtype) == (dtype is jnp.float16)


@pytest.mark.parametrize("dtype", [*FLOATS, jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int16])
def test_upcast_16bit_widens_bfloat16_and_float16_alone(dtype):
    """float8, which ``upcast`` widens, is kept, as are float32 and ints."""
    x = jnp.ones(3, dtype)
    want = jnp.float32 if dtypes.is_16bit(dtype) else dtype
    assert jax.jit(dtypes.upcast_16bit)(x).dtype == want
    assert dtypes.upcast_16bit(np.asarray(x)).dtype == want
    assert dtypes.upcast_16bit(3.0) == 3.0


def test_upcast_16bit_widens_a_scalar_that_carries_a_16_bit_dtype():
    """A literal of a traced program is a Python scalar to which JAX gives a dtype."""

    class Typed(float):
        dtype = np.dtype(np.float16)

    out = dtypes.upcast_16bit(Typed(2.0))
    assert out.dtype == np.float32 and out == 2.0


@pytest.mark.parametrize(
    "name, expected",
    [("bf16", "bfloat16"), ("half", "float16"), ("full", "float32"), ("F32 ", "float32")],
)
def test_canonical_dtype_reads_jmps_names(name, expected):
    assert dtypes.canonical_dtype(name).name == expected


def test_canonical_dtype_names_the_bad_value_and_the_choices():
    with pytest.raises(ValueError, match=r"Unknown compute dtype 'bf61'\. Valid choices: f32, "):
        dtypes.canonical_dtype("bf61", "compute dtype")
    with pytest.raises(ValueError, match="must be a floating dtype, got 'int32'"):
        dtypes.canonical_dtype(jnp.int32)
