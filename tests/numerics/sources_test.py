"""Tests for jaxamp/_src/numerics/sources.py: a custom_vjp fault names its bwd rule."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.numerics.nets import DTYPES


def _bad_bwd(x, g):
    return (g / (x * 0.0),)  # the fault: the rule divides by zero


@jax.custom_vjp
def _custom(x):
    return x * 2.0


_custom.defvjp(lambda x: (_custom(x), x), _bad_bwd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit_inside", [False, True])
def test_a_custom_vjp_backward_fault_points_at_the_bwd_rule(dtype, jit_inside):
    def loss(x):
        with jax.named_scope("custom"):
            y = _custom(x.astype(dtype))
        return jnp.sum(y.astype(jnp.float32))

    fault = jaxamp.find_nonfinite(jax.jit(loss) if jit_inside else loss)(jnp.ones(3))
    assert (fault.phase, fault.primitive) == ("backward", "div"), fault
    line = _bad_bwd.__code__.co_firstlineno
    assert fault.source.endswith(f"sources_test.py:{line} (_bad_bwd)"), fault.source
