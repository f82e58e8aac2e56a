"""Layer settings a policy makes: what it leaves alone (complex layers, complex inputs)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from tests.helpers.promotion import FLAX

X = jax.lax.complex(jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3)))  # complex64


class LinenComplex(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4, param_dtype=jnp.complex64, name="complex")(x)
        return nn.Dense(2, name="real")(h)  # float32 params, complex input


class NNXComplex(nnx.Module):
    def __init__(self, rngs):
        self.complex = nnx.Linear(3, 4, param_dtype=jnp.complex64, rngs=rngs)
        self.real = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.real(self.complex(x))


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_complex_layers_and_inputs_are_not_cast_to_real(policy):
    reference = LinenComplex()
    variables = reference.init(jax.random.key(0), X)
    expected = reference.apply(variables, X)
    model = jaxamp.linen.apply_policy(LinenComplex(), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards ..."
        ours = jax.jit(model.apply)(variables, X)
        created = model.init(jax.random.key(0), X)
    assert ours.dtype == jnp.complex64
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert created["params"]["complex"]["kernel"].dtype == jnp.complex64
    assert created["params"]["real"]["kernel"].dtype == jnp.float32


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_nnx_complex_layers_are_not_cast_to_real(policy):
    expected = NNXComplex(nnx.Rngs(0))(X)
    model = jaxamp.nnx.apply_policy(NNXComplex(nnx.Rngs(0)), policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = nnx.jit(lambda m, x: m(x))(model, X)
    assert ours.dtype == jnp.complex64
    np.testing.assert_allclose(ours, expected, rtol=1e-6)
    assert model.complex.kernel[...].dtype == jnp.complex64
    assert model.complex.dtype is None  # left alone


def test_real_layers_beside_them_still_take_the_policy():
    model = jaxamp.nnx.apply_policy(NNXComplex(nnx.Rngs(0)), "mixed_bfloat16")
    assert model.real.dtype == jnp.bfloat16
    x = jnp.ones((2, 4))
    assert model.real(x).dtype == jnp.bfloat16


class _CustomLoopLinen(nn.Module):
    """A hand-written recurrence whose carry starts in float32 (``jnp.zeros``)."""

    @nn.compact
    def __call__(self, xs):
        dense = nn.Dense(xs.shape[-1])
        step = lambda c, x: (dense(c) + x, c)
        return jax.lax.scan(step, jnp.zeros(xs.shape[1:]), xs)[0]


class _CustomLoopNNX(nnx.Module):
    def __init__(self):
        self.dense = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, xs):
        step = lambda c, x: (self.dense(c) + x, c)
        return jax.lax.scan(step, jnp.zeros(xs.shape[1:]), xs)[0]


@pytest.mark.parametrize("path", ["linen", "nnx"])
def test_a_loop_carry_that_changes_dtype_is_explained(path):
    """A carry a 16-bit layer changes inside a hand-written loop cannot be kept by the
    policy (Flax's own cells' can): the error says why and how to start the carry."""
    xs = jnp.ones((4, 2, 3))
    with pytest.raises(TypeError, match=r"jnp.zeros\(shape, x.dtype\)") as error:
        if path == "linen":
            model = jaxamp.linen.apply_policy(_CustomLoopLinen(), "mixed_bfloat16")
            model.init(jax.random.key(0), xs)
        else:
            jaxamp.nnx.apply_policy(_CustomLoopNNX(), "mixed_bfloat16")(xs)
    assert "bfloat16 here" in str(error.value)
    assert str(error.value).count("jaxamp:") == 1


@pytest.mark.parametrize("lift", ["none", "remat", "remat_twice"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "float32"])
def test_a_float32_carry_of_an_nn_scan_over_a_lifted_body_keeps_its_dtype(lift, policy):
    """A float32 carry (jnp.zeros) through nn.scan(nn.remat(Cell)), whose Dense runs in 16
    bits: the body's new carry comes back float32 as with nn.scan(Cell) (the scan failed
    with a carry TypeError: the body behind nn.remat's class was not seen as the loop's)."""

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, h, x):
            h = jnp.tanh(nn.Dense(8)(h) + x)
            return h, h

    lifts = {"none": Cell, "remat": nn.remat(Cell), "remat_twice": nn.remat(nn.remat(Cell))}

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, xs):
            scan = nn.scan(lifts[lift], variable_broadcast="params", split_rngs={"params": False})
            return scan(name="cell")(jnp.zeros(xs.shape[1:]), xs)[0]

    xs = jax.random.normal(jax.random.key(0), (4, 3, 8))
    model = Looped()
    variables = model.init(jax.random.key(1), xs)
    policed = jaxamp.linen.apply_policy(model, policy)
    out = jax.jit(policed.apply)(variables, xs)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, model.apply(variables, xs), rtol=2e-2, atol=2e-2)
    grads = jax.grad(lambda v: jnp.sum(policed.apply(v, xs)))(variables)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("key", ["blocks", "blocks/Dense_0"])
def test_an_override_on_an_nn_scan_body_keeps_the_carry_dtype(key):
    """The model's input (cast to bfloat16) is the carry of an nn.scan whose block an
    override runs in float32: the loop failed with a carry TypeError. The body now
    returns its carry in the dtype it was given, its matmuls in float32."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dense(c.shape[-1])(c), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            return scan(name="blocks")(x, None)[0]

    x = jnp.ones((2, 8))
    model = Net()
    variables = model.init(jax.random.key(0), x)
    policed = jaxamp.linen.apply_policy(model, "mixed_bfloat16", overrides={key: "float32"})
    out = jax.jit(policed.apply)(variables, x)
    report = jaxamp.precision_report(policed.apply)(variables, x)
    assert {op.lhs_dtype for op in report.ops} == {"float32"}
    np.testing.assert_allclose(out, model.apply(variables, x), rtol=2e-2, atol=2e-2)
