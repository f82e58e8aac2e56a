"""Tests for jaxamp/_src/state_dtype.py: any optax state stored in 16 bits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _params():
    return {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros(32)}


def _grads(step):
    return jax.tree.map(
        lambda p: jax.random.normal(jax.random.fold_in(jax.random.key(1), step), p.shape), _params()
    )


def _dtypes(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_adam_moments_in_dtype_counts_untouched_and_stable(dtype, rounding):
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), dtype, rounding=rounding)
    params = _params()
    state = tx.init(params)
    adam = state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {np.dtype(dtype)}
    assert adam.count.dtype == jnp.int32
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    first = _dtypes(state)
    for i in range(4):
        params, state = step(params, state, _grads(i))
        assert _dtypes(state) == first  # dtypes (and structure) stable across steps
    assert len(traces) == 1  # one trace
    assert int(state.count) == 4 and int(state.inner_state[0].count) == 4


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_updates_follow_float32_adam(dtype):
    tx = jaxamp.with_state_dtype(optax.adam(1e-2), {"mu": dtype, "nu": dtype})
    ref = optax.adam(1e-2)
    params = ours = _params()
    state, ref_state = tx.init(params), ref.init(params)
    for i in range(20):
        u, state = jax.jit(tx.update)(_grads(i), state, ours)
        ours = optax.apply_updates(ours, u)
        r, ref_state = ref.update(_grads(i), ref_state, params)
        params = optax.apply_updates(params, r)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-3)  # 20 steps of 1e-2: within 10% of a step


def test_per_field_dtypes_and_errors():
    tx = jaxamp.with_state_dtype(optax.adam(1e-3), {"mu": jnp.bfloat16})
    adam = tx.init(_params()).inner_state[0]
    assert adam.mu["w"].dtype == jnp.bfloat16 and adam.nu["w"].dtype == jnp.float32
    momentum = jaxamp.with_state_dtype(optax.sgd(1e-2, momentum=0.9), {"trace": "bf16"})
    assert momentum.init(_params()).inner_state[0].trace["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"'nu_dtype'.*Valid choices: 'mu', 'nu'"):
        jaxamp.with_state_dtype(optax.adam(1e-3), {"nu_dtype": jnp.bfloat16}).init(_params())
    with pytest.raises(ValueError, match="Unknown rounding 'floor'"):
        jaxamp.with_state_dtype(optax.adam(1e-3), jnp.bfloat16, rounding="floor")
    with pytest.raises(ValueError, match="int8"):
        jaxamp.with_state_dtype(optax.adam(1e-3), "int8")
    with pytest.raises(TypeError, match="got str: 'adam'"):
        jaxamp.with_state_dtype("adam", jnp.bfloat16)


def test_stochastic_state_rounding_is_reproducible_and_unbiased():
    """An EMA whose per-step change is below half a bfloat16 ulp: to nearest it stalls,
    stochastically it follows float32 on average."""
    decay, steps = 0.9999, 3000
    params = {"w": jnp.zeros(4096)}
    grads = {"w": jnp.ones(4096)}
    ema32 = optax.ema(decay, debias=False)

    def run(tx):
        step = lambda _, state: tx.update(grads, state, params)[1]
        return jax.jit(lambda s: jax.lax.fori_loop(0, steps, step, s))(tx.init(params))

    expected = 1 - decay**steps  # about 0.26; to nearest, bfloat16 stalls near 0.03
    nearest = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16)).inner_state.ema["w"]
    stochastic = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16, rounding="stochastic"))
    again = run(jaxamp.with_state_dtype(ema32, jnp.bfloat16, rounding="stochastic"))
    s = stochastic.inner_state.ema["w"].astype(jnp.float32)
    np.testing.assert_array_equal(s, again.inner_state.ema["w"].astype(jnp.float32))
    assert abs(float(s.mean()) - expected) < 0.01
    assert abs(float(nearest.astype(jnp.float32).mean()) - expected) > 0.05  # it stalls


@pytest.mark.parametrize("name", list(jaxamp.OPTIMIZER_RECIPES))
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
