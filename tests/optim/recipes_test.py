"""Tests for jaxamp/_src/optim/recipes.py: optimizer_recipe and OPTIMIZER_RECIPES."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers.promotion import OPTAX


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("name", list(jaxamp.optim.OPTIMIZER_RECIPES))
def test_named_recipes_give_a_policy_and_an_optimizer(name):
    import flax.linen as nn

    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-2))
    model = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    x = jnp.ones((4, 5))
    params = model.init(jax.random.key(0), x)["params"]
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean(model.apply({"params": p}, x) ** 2)
        value, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(5):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    expected = jnp.float32 if name == "float32_params" else jnp.bfloat16
    assert {p.dtype for p in jax.tree.leaves(params)} == {np.dtype(expected)}
    with pytest.raises(ValueError, match=r"Unknown optimizer recipe 'sr'\. Valid choices"):
        jaxamp.optimizer_recipe("sr", optax.adam(1e-2))


@pytest.mark.standard_promotion(OPTAX)
def test_bf16_stochastic_recipe_trains_inject_hyperparams_adam():
    """The 6-bytes recipe with an injected learning rate: the loss goes down and the
    params stay finite (with b2 rounded to 1.0 they went NaN at the first step)."""
    import flax.linen as nn

    policy, tx = jaxamp.optimizer_recipe(
        "bf16_stochastic", optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
    )
    model = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    x = jax.random.normal(jax.random.key(3), (16, 5))
    params = model.init(jax.random.key(0), x)["params"]
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean((model.apply({"params": p}, x) - 1.0) ** 2)
        value, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(10):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    hyper = state.inner_state.inner_state.hyperparams
    assert float(hyper["b2"]) == np.float32(0.999) and hyper["b2"].dtype == jnp.float32


@pytest.mark.standard_promotion(OPTAX)
def test_bf16_stochastic_recipe_rounds_params_and_state_with_independent_bits():
    """optimizer_recipe("bf16_stochastic"): the param and its optimizer state, both at the
    same value halfway between two bfloat16 neighbours, round up or down independently
    (agree in about half the elements; with the same bits they agreed in all)."""
    n = 1 << 14
    x = (
        1.0 + (2 * jnp.arange(n, dtype=jnp.float32) % 128 + 1) * 2.0**-8
    )  # halfway between bfloat16 neighbours
    _, tx = jaxamp.optimizer_recipe(
        "bf16_stochastic", optax.trace(decay=0.9), loss_scale=jaxamp.StaticLossScale(1.0)
    )
    params = {"w": jnp.zeros(n, jnp.bfloat16)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": x}, state, params)  # trace = g; update = g
    new = optax.apply_updates(params, updates)["w"].astype(jnp.float32)
    trace = state.inner_state.inner_state.trace["w"].astype(jnp.float32)
    assert bool(jnp.all(new != x)) and bool(jnp.all(trace != x))  # every one was rounded
    agree = float(jnp.mean((new > x) == (trace > x)))
    assert abs(agree - 0.5) < 0.05, agree  # 0.5 +- 0.004 (1 SE) for independent bits
    assert abs(float(jnp.mean(new > x)) - 0.5) < 0.05  # each unbiased on its own
