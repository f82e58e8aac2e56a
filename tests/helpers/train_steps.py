"""Jitted optimizer steps, and params for them to train, shared by the tests."""

import jax
import jax.numpy as jnp
import optax

import jaxamp


def loss_scaled_step(tx, loss, *, count_traces=None):
    """A jitted ``step(params, state, poison=False) -> (params, state)``: the gradients of
    ``jaxamp.scale_loss(loss(params), state)``, every element made ``inf`` where ``poison``,
    applied through ``tx``. Each trace appends to the list ``count_traces`` if given."""

    @jax.jit
    def step(params, state, poison=False):
        if count_traces is not None:
            count_traces.append(1)
        grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
        grads = jax.tree.map(lambda g: jnp.where(poison, jnp.inf, g), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def apply_step(tx, *, count_traces=None):
    """A jitted ``step(params, state, grads) -> (params, state)``: ``grads`` applied
    through ``tx``. Each trace appends to the list ``count_traces`` if given."""

    @jax.jit
    def step(params, state, grads):
        if count_traces is not None:
            count_traces.append(1)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def sample_params():
    return {"w": jax.random.normal(jax.random.key(0), (64, 32)), "b": jnp.zeros(32)}


def dtypes_of(tree):
    return jax.tree.map(lambda x: jnp.asarray(x).dtype, tree)


def traced_steps(tx, params, steps, grads_dtype=jnp.float32):
    """``steps`` jitted updates of ``tx`` on random gradients: the params, the dtypes of
    the state after ``init`` and after each step, and how many times the step was traced."""
    traces = []
    step = apply_step(tx, count_traces=traces)
    state = tx.init(params)
    dtypes = [dtypes_of(state)]
    for i in range(steps):
        key = jax.random.fold_in(jax.random.key(1), i)
        grads = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape, grads_dtype), params)
        params, state = step(params, state, grads)
        dtypes.append(dtypes_of(state))
    return params, state, dtypes, len(traces)
