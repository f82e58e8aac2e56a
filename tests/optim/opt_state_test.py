"""Tests for jaxamp/_src/optim/opt_state.py: the loss-scaled state, never-cast fields."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import DynamicLossScale
from tests.optim.steps import sample_params, traced_steps

PARAMS = {"w": jnp.array([1.0, 2.0])}


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: tx,
        lambda tx: optax.chain(optax.identity(), tx),
        lambda tx: optax.inject_hyperparams(
            lambda learning_rate: jaxamp.loss_scaled(
                optax.sgd(learning_rate), DynamicLossScale(256.0)
            )
        )(learning_rate=0.1),
        lambda tx: optax.multi_transform({"a": tx}, {"w": "a"}),
    ],
    ids=["plain", "chain", "inject_hyperparams", "multi_transform"],
)
def test_finds_the_state_anywhere(wrap):
    tx = wrap(jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(256.0)))
    state = tx.init(PARAMS)
    assert float(jaxamp.optim.get_loss_scale(state)) == 256.0
    assert float(jax.jit(jaxamp.scale_loss)(jnp.float32(2.0), state)) == 512.0


def test_errors():
    with pytest.raises(ValueError, match=r"jaxamp\.loss_scaled"):
        jaxamp.optim.get_loss_scale(optax.adam(1e-3).init(PARAMS))
    both = optax.chain(jaxamp.loss_scaled(optax.sgd(0.1)), jaxamp.loss_scaled(optax.sgd(0.1)))
    with pytest.raises(ValueError, match="Found 2"):
        jaxamp.optim.get_loss_scale(both.init(PARAMS))


@pytest.mark.parametrize("skip", [None, optax.skip_not_finite], ids=["plain", "skip_not_finite"])
def test_loss_scaled_inside_multisteps_is_a_clear_error(skip):
    """MultiSteps around loss_scaled accumulates the scaled gradients and never trains
    again after an overflow (its reset multiplies the inf by 0); the state says so."""
    kwargs = {} if skip is None else {"should_skip_update_fn": skip}
    tx = optax.MultiSteps(jaxamp.loss_scaled(optax.sgd(0.1)), every_k_schedule=2, **kwargs)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"inside optax.MultiSteps.*jaxamp.loss_scaled\(optax"):
        jaxamp.optim.get_loss_scale(state)
    with pytest.raises(ValueError, match=r"inside optax\.MultiSteps"):
        jaxamp.scale_loss(jnp.float32(1.0), state)


@pytest.mark.parametrize(
    "build",
    [
        lambda ls: optax.chain(optax.apply_every(2), ls),
        lambda ls: optax.chain(optax.chain(optax.apply_every(2)), optax.chain(ls)),
        lambda ls: optax.chain(optax.scale_by_adam(), ls),
    ],
    ids=["apply_every", "nested_apply_every", "scale_by_adam"],
)
def test_loss_scaled_after_gradient_statistics_is_a_clear_error(build):
    """A transformation ahead of loss_scaled in a chain that keeps statistics of the
    gradients (optax.apply_every's accumulator, Adam's moments) sees them scaled and,
    after one overflow, keeps a NaN for good while the scale halves forever: refused,
    naming the order that works."""
    tx = build(jaxamp.loss_scaled(optax.sgd(0.1)))
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"ahead of jaxamp\.loss_scaled.*jaxamp\.loss_scaled\("):
        jax.jit(jaxamp.scale_loss)(jnp.float32(1.0), state)


def test_stateless_or_later_transformations_beside_loss_scaled_are_fine():
    ls = jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(256.0))
    for tx in (
        optax.chain(optax.clip(1.0), optax.identity(), ls),
        optax.chain(ls, optax.apply_every(2)),
        optax.chain(optax.inject_hyperparams(optax.scale)(step_size=1.0), ls),
    ):
        assert float(jaxamp.optim.get_loss_scale(tx.init(PARAMS))) == 256.0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_loss_scaled_records_which_leaves_were_non_finite(dtype):
    params = {"a": jnp.ones(3, dtype), "b": {"c": jnp.ones(2, dtype)}}
    tx = jaxamp.loss_scaled(optax.adam(1e-3), record_nonfinite=True)
    state = tx.init(params)
    update = jax.jit(tx.update)
    assert jaxamp.optim.nonfinite_gradients(state) == []
    bad = {"a": jnp.ones(3, dtype), "b": {"c": jnp.array([1.0, jnp.nan], dtype)}}
    _, state = update(bad, state, params)
    assert int(state.skipped_steps) == 1
    assert jaxamp.optim.nonfinite_gradients(state) == ["['b']['c']"]
    good = jax.tree.map(jnp.ones_like, params)
    _, state2 = update(good, state, params)  # a finite step keeps the last skip's record
    assert jaxamp.optim.nonfinite_gradients(state2) == ["['b']['c']"]
    assert jax.tree.structure(state2) == jax.tree.structure(state)
    with pytest.raises(ValueError, match="record_nonfinite=True"):
        jaxamp.optim.nonfinite_gradients(jaxamp.loss_scaled(optax.sgd(1.0)).init(params))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_hyperparameters_weight_sums_and_counters_are_never_cast(dtype, rounding):
    """inject_hyperparams' b2 = 0.999 is 1.0 in bfloat16 (Adam's update is then NaN);
    schedule_free's weight_sum, b1 and max_lr are scalars too: all stay float32, and
    only the per-parameter statistics (mu, nu, z) take ``dtype``."""
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b2=0.999)
    tx = jaxamp.with_state_dtype(adam, dtype, rounding=rounding)
    params, state, dtypes, traces = traced_steps(tx, sample_params(), 5)
    hyper = state.inner_state.hyperparams
    assert {x.dtype for x in jax.tree.leaves(hyper)} == {np.dtype(jnp.float32)}
    assert float(hyper["b2"]) == np.float32(0.999)
    moments = state.inner_state.inner_state[0]
    assert {x.dtype for x in jax.tree.leaves((moments.mu, moments.nu))} == {np.dtype(dtype)}
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
    assert dtypes[1:] == dtypes[:1] * 5 and traces == 1
    free = jaxamp.with_state_dtype(
        optax.contrib.schedule_free(optax.sgd(1.0), 1e-2), dtype, rounding=rounding
    )
    params, state, dtypes, traces = traced_steps(free, sample_params(), 5)
    sf = state.inner_state
    assert {sf.b1.dtype, sf.weight_sum.dtype, sf.max_lr.dtype} == {np.dtype(jnp.float32)}
    assert sf.step_count.dtype == jnp.int32
    assert {x.dtype for x in jax.tree.leaves(sf.z)} == {np.dtype(dtype)}
    assert float(sf.weight_sum) > 0 and dtypes[1:] == dtypes[:1] * 5 and traces == 1


@pytest.mark.parametrize("params", [jnp.float32(1.0), jnp.ones(1)], ids=["scalar", "one"])
def test_scalar_params_never_cast_hyperparameters(params):
    """With one scalar param every scalar state leaf has the param's shape and
    structure: inject_hyperparams' hyperparameters, schedule-free's b1/weight_sum/max_lr
    and reduce_on_plateau's scale are still never cast (b2 = 0.999 became 1.0 in
    bfloat16 and Adam's update NaN)."""
    adam = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = jaxamp.with_state_dtype(adam, jnp.bfloat16)
    state = tx.init(params)
    hyper = state.inner_state.hyperparams
    assert {x.dtype for x in jax.tree.leaves(hyper)} == {np.dtype(jnp.float32)}
    assert state.inner_state.inner_state[0].mu.dtype == jnp.bfloat16
    updates, state = jax.jit(tx.update)(jnp.full_like(params, 0.5), state, params)
    np.testing.assert_allclose(updates, jnp.full_like(params, -1e-3), rtol=1e-6)
    assert float(state.inner_state.hyperparams["b2"]) == np.float32(0.999)
    free = jaxamp.with_state_dtype(optax.contrib.schedule_free_adamw(1e-3), jnp.bfloat16)
    sf = free.init(params).inner_state
    assert {sf.b1.dtype, sf.weight_sum.dtype, sf.max_lr.dtype} == {np.dtype(jnp.float32)}
    assert sf.z.dtype == jnp.bfloat16
    plateau = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    chained = jaxamp.with_state_dtype(plateau, jnp.bfloat16).init(params).inner_state
    assert chained[0][0].mu.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(chained[1])} <= {np.dtype(jnp.float32)} | {
        np.dtype(jnp.int32)
    }
