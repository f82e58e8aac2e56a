"""Tests for jaxamp/_src/optim/opt_state.py: the loss-scaled state, never-cast fields."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import DynamicLossScale
from tests.helpers.expected_warnings import FLOAT16_STATISTICS, NO_STATISTIC
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import sample_params, traced_steps

PARAMS = {"w": jnp.array([1.0, 2.0])}


def test_finds_the_state_of_the_whole_optimizer():
    tx = jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(256.0))
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


TWO = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([3.0, 4.0])}


def _ls(inner=None):
    return jaxamp.loss_scaled(optax.sgd(1.0) if inner is None else inner)


# Every order in which loss_scaled is not the whole optimizer, each silently wrong before:
# the transformations outside it saw the scaled gradients or changed its updates.
WRONG_ORDERS = {
    "clip_ahead": lambda: optax.chain(optax.clip(1.0), _ls()),
    "clip_by_global_norm_ahead": lambda: optax.chain(optax.clip_by_global_norm(2.0), _ls()),
    "add_decayed_weights_ahead": lambda: optax.chain(optax.add_decayed_weights(0.1), _ls()),
    "apply_every_ahead": lambda: optax.chain(optax.apply_every(2), _ls()),
    "scale_by_adam_ahead": lambda: optax.chain(optax.scale_by_adam(), _ls()),
    "named_chain": lambda: optax.named_chain(("adam", optax.scale_by_adam()), ("ls", _ls())),
    "multi_transform": lambda: optax.multi_transform(
        {"amp": _ls(optax.sgd(0.1)), "plain": optax.sgd(0.1)}, {"a": "amp", "b": "plain"}
    ),
    "scale_after": lambda: optax.chain(_ls(), optax.scale(0.5)),
    "apply_every_after": lambda: optax.chain(_ls(), optax.apply_every(2)),
    "apply_if_finite": lambda: optax.apply_if_finite(_ls(), 3),
    "masked": lambda: optax.masked(_ls(), {"a": True, "b": False}),
    "chain_of_one": lambda: optax.chain(_ls()),
    # its count, and so a schedule, advanced on the steps loss_scaled skipped
    "inject_hyperparams": lambda: optax.inject_hyperparams(
        lambda learning_rate: _ls(optax.sgd(learning_rate))
    )(learning_rate=optax.piecewise_constant_schedule(1.0, {2: 0.0})),
}


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("order", sorted(WRONG_ORDERS))
def test_loss_scaled_inside_another_transformation_is_refused(order, dtype):
    """At the first step, with a message that names the order that works."""
    tx = WRONG_ORDERS[order]()
    params = jax.tree.map(lambda p: p.astype(dtype), TWO)
    state = tx.init(params)
    value_and_grad = jaxamp.value_and_grad(lambda p: sum(jnp.sum(x**2) for x in p.values()))
    with pytest.raises(ValueError, match=r"is inside .* jaxamp\.loss_scaled\("):
        jax.jit(lambda p, s: value_and_grad(p, opt_state=s))(params, state)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_orders_that_work_give_float32_optaxs_updates(dtype):
    """The refused orders written the way that works: loss_scaled around everything."""
    params = jax.tree.map(lambda p: p.astype(dtype), TWO)
    loss = lambda p: sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in p.values())
    for inner in (
        optax.chain(optax.clip_by_global_norm(2.0), optax.sgd(1.0)),
        optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.5)),
        optax.multi_transform({"x": optax.sgd(0.1), "y": optax.sgd(0.2)}, {"a": "x", "b": "y"}),
        optax.named_chain(("clip", optax.clip(1.0)), ("sgd", optax.sgd(0.5))),
    ):
        tx = jaxamp.loss_scaled(inner, DynamicLossScale(2.0**10))
        state = tx.init(params)
        _, grads = jax.jit(lambda p, s: jaxamp.value_and_grad(loss)(p, opt_state=s))(params, state)
        updates, _ = jax.jit(tx.update)(grads, state, params)
        want, _ = inner.update(jax.grad(loss)(TWO), inner.init(TWO), TWO)
        landed = optax.apply_updates(params, updates)
        expected = jax.tree.map(lambda p, u: (p + u).astype(dtype), TWO, want)
        for got, exp in zip(jax.tree.leaves(landed), jax.tree.leaves(expected), strict=True):
            # one rounding apart at most (jit and eager may round the norm differently)
            eps = float(jnp.finfo(dtype).eps)
            np.testing.assert_allclose(got.astype(np.float32), exp.astype(np.float32), rtol=eps)


@pytest.mark.standard_promotion(OPTAX)
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


# float16 statistics on purpose beside bfloat16
@pytest.mark.standard_promotion(OPTAX)
@FLOAT16_STATISTICS
@NO_STATISTIC
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_hyperparameters_weight_sums_and_counters_are_never_cast(dtype, rounding):
    """inject_hyperparams' b2 = 0.999 is 1.0 in bfloat16 (Adam's update is then NaN);
    schedule_free's weight_sum, b1 and max_lr are scalars too: all stay float32, and
    only the per-parameter statistics (mu, nu) take ``dtype``; z, a copy of the params,
    stays float32."""
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
    assert {x.dtype for x in jax.tree.leaves(sf.z)} == {np.dtype(jnp.float32)}
    assert float(sf.weight_sum) > 0 and dtypes[1:] == dtypes[:1] * 5 and traces == 1


@pytest.mark.standard_promotion(OPTAX)
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
    assert sf.z.dtype == jnp.float32  # a copy of the params
    plateau = optax.chain(optax.adam(1e-3), optax.contrib.reduce_on_plateau())
    chained = jaxamp.with_state_dtype(plateau, jnp.bfloat16).init(params).inner_state
    assert chained[0][0].mu.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(chained[1])} <= {np.dtype(jnp.float32)} | {
        np.dtype(jnp.int32)
    }


@pytest.mark.standard_promotion(OPTAX)
def test_flatten_around_loss_scaled_with_mixed_dtypes_is_refused():
    """optax.flatten joins float32 and bfloat16 params into one float32 vector, so
    loss_scaled saw no 16-bit param, kept no master, and the bfloat16 params stalled
    at 1.0 (100 steps of 2**-10). jaxamp.value_and_grad sees both sides and refuses."""
    params = {"a": jnp.ones(2, jnp.float32), "b": jnp.ones(2, jnp.bfloat16)}
    loss = lambda p: -(p["a"].sum() + p["b"].astype(jnp.float32).sum())
    wrong = optax.flatten(jaxamp.loss_scaled(optax.sgd(2.0**-10)))
    step = jax.jit(lambda p, s: jaxamp.value_and_grad(loss)(p, opt_state=s))
    with pytest.raises(ValueError, match=r"jaxamp\.loss_scaled\(optax\.flatten\(inner\)\)"):
        step(params, wrong.init(params))
    right = jaxamp.loss_scaled(optax.flatten(optax.sgd(2.0**-10)))
    p, s = params, right.init(params)
    for _ in range(100):
        _, g = step(p, s)
        u, s = right.update(g, s, p)
        p = optax.apply_updates(p, u)
    assert float(p["b"][0]) == float(jnp.bfloat16(1 + 100 * 2.0**-10))
