"""Params and jitted optimizer steps shared by the tests of jaxamp/_src/optim."""

import jax
import jax.numpy as jnp
import optax


def sample_params():
    return {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros(32)}


def dtypes_of(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


def traced_steps(tx, params, steps, grads_dtype=jnp.float32):
    """``steps`` jitted updates of ``tx``: the params, the dtypes of the state after
    ``init`` and after each step, and how many times the step was traced."""
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    dtypes = [dtypes_of(state)]
    for i in range(steps):
        key = jax.random.fold_in(jax.random.key(1), i)
        grads = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape, grads_dtype), params)
        params, state = step(params, state, grads)
        dtypes.append(dtypes_of(state))
    return params, state, dtypes, len(traces)
