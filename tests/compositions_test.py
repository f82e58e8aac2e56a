"""Loss scaling and 16-bit state under the optax compositions people write.

Every wrapper in ``WRAPPERS`` runs inside ``jaxamp.loss_scaled`` with 16-bit params,
under every ``master_weights`` recipe, with and without ``with_state_dtype``, through a
step whose gradients overflow. The run is compared with the same optimizer stepping
float32 params with plain optax on the gradients the 16-bit model gives (taken at the
params rounded to 16 bits), without the overflowing step. The skip must leave no trace;
with a float32 master the params must be the float32 run's rounded, bit for bit; with
the other recipes, or 16-bit optimizer state, within their rounding (``ULPS``).

The README's composition table is this matrix.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import loss_scaled_step

LR = 0.05
STEPS = 6
POISONED = 2  # the step whose gradients overflow (skipped: it never reaches the params)
PARAMS = {
    "a": jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(4, 6),
    "b": jnp.linspace(0.5, 1.5, 6, dtype=jnp.float32),
}
# far from the params: no gradient crosses zero, so sign-based updates (lion) are stable
TARGET = jax.tree.map(lambda p: p + 2.0, PARAMS)
LABELS = {"a": "adam", "b": "sgd"}

WRAPPERS = {
    "chain": lambda: optax.chain(optax.scale_by_adam(), optax.scale(-LR)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=LR),
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
    "multi_transform": lambda: optax.multi_transform(
        {"adam": optax.adam(LR), "sgd": optax.sgd(LR)}, LABELS
    ),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(LR), max_consecutive_errors=3),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(LR)),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(LR, warmup_steps=2),
    "lion": lambda: optax.lion(LR / 5),
    "adafactor": lambda: optax.adafactor(LR),
}
MASTER_WEIGHTS = ("float32", "kahan", "stochastic", "none")
# how far the 16-bit run may end from the float32 one, in units of the dtype's spacing at
# the value: none with a master; one rounding per step for the recipes that round the
# params every step (at most half a spacing to nearest, less than one stochastically);
# Kahan's compensation keeps the error within about one.
ULPS = {"float32": 0, "kahan": 2, "stochastic": STEPS, "none": STEPS}
# bfloat16 moments: a relative error of 2**-8 per step in each update, far below a spacing
STATE_ULPS = 1


def _loss(params):
    return sum(
        jnp.sum((p.astype(jnp.float32) - t) ** 2)
        for p, t in zip(*map(jax.tree.leaves, (params, TARGET)), strict=True)
    )


@functools.cache  # one float32 run per wrapper and dtype, shared by the recipes
def _reference(wrapper, dtype):
    """The float32 run: plain optax on float32 params starting from the 16-bit ones, with
    the gradients the 16-bit model gives (taken at the params rounded to ``dtype``), the
    poisoned step left out."""
    tx = WRAPPERS[wrapper]()
    params = jax.tree.map(lambda p: p.astype(dtype).astype(jnp.float32), PARAMS)  # as stored
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(_loss)(jax.tree.map(lambda p: p.astype(dtype), params))
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(STEPS - 1):
        params, state = step(params, state)
    return params


def _amp(wrapper, dtype, master_weights, state_dtype):
    inner = WRAPPERS[wrapper]()
    if state_dtype is not None:
        inner = jaxamp.with_state_dtype(inner, state_dtype)
    tx = jaxamp.loss_scaled(inner, jaxamp.DynamicLossScale(2.0**10), master_weights=master_weights)
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    state = tx.init(params)
    step = loss_scaled_step(tx, _loss)
    for i in range(STEPS):
        before = params, state
        params, state = step(params, state, jnp.asarray(i == POISONED))
        if i == POISONED:  # skipped: params and every inner state leaf exactly as they were
            for x, y in zip(jax.tree.leaves(before[0]), jax.tree.leaves(params), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
            old, new = before[1].inner_state, state.inner_state
            for x, y in zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(state.skipped_steps) == 1 and float(jaxamp.optim.get_loss_scale(state)) == 2.0**9
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    return params


def _cases():
    for wrapper in WRAPPERS:
        for master_weights in MASTER_WEIGHTS:
            name = f"{wrapper}-{master_weights}"
            yield pytest.param(wrapper, jnp.bfloat16, master_weights, None, id=name)
        for master_weights in ("float32", "stochastic"):  # bfloat16 state: bf16_stochastic's
            name = f"{wrapper}-{master_weights}-bf16 state"
            yield pytest.param(wrapper, jnp.bfloat16, master_weights, jnp.bfloat16, id=name)
        yield pytest.param(wrapper, jnp.float16, "float32", None, id=f"{wrapper}-float16 params")


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize(("wrapper", "dtype", "master_weights", "state_dtype"), list(_cases()))
def test_composes_through_an_overflow(wrapper, dtype, master_weights, state_dtype):
    ours = _amp(wrapper, dtype, master_weights, state_dtype)
    reference = _reference(wrapper, dtype)
    ulps = ULPS[master_weights] + (STATE_ULPS if state_dtype is not None else 0)
    leaves = jax.tree_util.tree_leaves_with_path(ours)
    for (path, x), y in zip(leaves, jax.tree.leaves(reference), strict=True):
        where = jax.tree_util.keystr(path)
        if ulps == 0:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(dtype)), where)
            continue
        spacing = jnp.finfo(dtype).eps * jnp.maximum(jnp.abs(y), 1.0)
        excess = jnp.abs(x.astype(jnp.float32) - y) / spacing
        assert float(excess.max()) <= ulps, (where, float(excess.max()), ulps)
