"""Tests for jaxamp/_src/numerics/sources.py: a custom_vjp fault names its bwd rule."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.helpers.promotion import FLAX
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


@pytest.mark.standard_promotion(FLAX)
def test_a_fault_in_a_jaxamp_model_points_at_the_models_line():
    """jaxamp.models' code counted as library code (the path named the module before it
    moved), so a fault in it was reported at the user's loss line."""
    import jaxamp.models

    cfg = jaxamp.models.GPT2Config(
        vocab_size=64, max_position=16, hidden_size=32, num_layers=1, num_heads=2, dropout_rate=0.0
    )
    block = jaxamp.models.GPT2Block(cfg)
    x = jnp.full((1, 8, 32), 300.0) * jnp.linspace(-1, 1, 32)
    mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
    params = block.init(jax.random.key(0), x, mask)["params"]
    params = jax.tree.map(lambda p: p * 40.0, params)  # float16 overflows inside the block

    def loss(p, x):
        return jnp.sum(block.apply({"params": p}, x, mask).astype(jnp.float32) ** 2)

    fault = jaxamp.find_nonfinite(loss, policy="mixed_float16")(params, x)
    assert "jaxamp/_src/compare/models/gpt2.py:" in fault.source, fault.source
