"""Tests for jaxamp/_src/optim/diagnostics.py: underflow fraction, metrics, stuck runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import DynamicLossScale
from tests.helpers.promotion import OPTAX


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_underflow_fraction(dtype):
    grads = {
        "a": jnp.array([1.0, 1e-9, 0.0, -2e-8], dtype=jnp.float32),  # 2 at most 2**-25: flush
        "b": jnp.array([6e-8, 1.0], dtype=jnp.float32),  # 6e-8 > 2**-24 ~ 5.96e-8
        "step": jnp.array(3),  # not floating: ignored
    }
    grads = jax.tree.map(lambda x: x.astype(dtype) if x.dtype == jnp.float32 else x, grads)
    fraction = jax.jit(jaxamp.optim.underflow_fraction)(grads)
    # the reference: numpy's float16 cast of each value (bfloat16 widens to float32 exactly)
    values = np.concatenate([np.asarray(grads[k], np.float32) for k in ("a", "b")])
    flushed = (values != 0) & (values.astype(np.float16) == 0)
    assert float(fraction) == pytest.approx(flushed.sum() / values.size)
    assert float(fraction) == pytest.approx(2 / 6)  # bfloat16 rounding moves none across
    assert fraction.dtype == jnp.float32
    # bfloat16 has float32's range: 1e-9 does not flush there
    assert float(jaxamp.optim.underflow_fraction(jnp.array([1e-9, 1.0]), dtype=jnp.bfloat16)) == 0.0


def test_underflow_fraction_of_empty_tree():
    assert float(jaxamp.optim.underflow_fraction({})) == 0.0
    # arrays with no elements: nothing flushes (it was 0 / 0, NaN)
    assert float(jax.jit(jaxamp.optim.underflow_fraction)({"w": jnp.zeros((0,))})) == 0.0


def make_state(skips, init_scale=1024.0):
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(init_scale), history_length=8)
    state = tx.init(params)
    for skip in skips:
        grads = {"w": jnp.full(3, jnp.inf if skip else 1.0)}
        _, state = tx.update(grads, state, params)
    return state


def test_metrics_under_jit():
    state = make_state([False, True, True])
    metrics = jax.jit(jaxamp.optim.loss_scale_metrics)(state)
    assert float(metrics["loss_scale"]) == 256.0
    assert int(metrics["skipped_steps"]) == 2 and int(metrics["consecutive_skips"]) == 2
    assert not bool(metrics["last_finite"])


def test_raise_if_stuck_shows_the_scale_history():
    state = make_state([False] + [True] * 5)
    jaxamp.optim.raise_if_stuck(state, max_consecutive_skips=6)  # not yet
    with pytest.raises(jaxamp.optim.LossScaleStuckError) as e:
        jaxamp.optim.raise_if_stuck(state, max_consecutive_skips=5)
    message = str(e.value)
    assert "The last 5 steps were skipped" in message
    assert "[1024, 512, 256, 128, 64, 32]" in message
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        jaxamp.optim.raise_if_stuck(state, 0)


def test_scale_history_wraps_around():
    state = make_state([True] * 10)  # more steps than history_length=8
    np.testing.assert_array_equal(
        jaxamp.optim.scale_history(state), [1024.0 / 2**k for k in range(3, 11)]
    )


def test_underflow_fraction_follows_float16_rounding():
    """float16 rounds (2**-25, 2**-24) up to its smallest subnormal; 2**-25 and below flush."""
    tiny = 2.0**-24
    kept = jnp.array([0.75 * tiny, 0.51 * tiny, tiny], jnp.float32)
    flushed = jnp.array([0.5 * tiny, 0.3 * tiny], jnp.float32)
    assert float(jax.jit(jaxamp.optim.underflow_fraction)(kept)) == 0.0
    assert float(jax.jit(jaxamp.optim.underflow_fraction)(flushed)) == 1.0


def test_raise_if_stuck_points_to_the_leaves_and_to_find_nonfinite():
    params = {"w": jnp.ones(2)}
    for record in (True, False):
        tx = jaxamp.loss_scaled(optax.sgd(0.1), record_nonfinite=record)
        state = tx.init(params)
        for _ in range(3):
            _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state, params)
        with pytest.raises(jaxamp.optim.LossScaleStuckError) as error:
            jaxamp.optim.raise_if_stuck(state, max_consecutive_skips=3)
        message = str(error.value)
        assert "jaxamp.find_nonfinite" in message
        assert ("['w']" in message) == record


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("holder", ["train_state", "nnx"])
def test_applied_steps_count_as_the_inner_optimizer_does(holder):
    """A TrainState and an nnx.Optimizer count every call; the inner optax state (the
    reference: optax's own count) and ``applied_steps`` count the applied updates."""
    from flax import nnx
    from flax.training import train_state

    skips = [False, True, False, True, True, False]
    tx = jaxamp.loss_scaled(optax.adam(1e-2))
    grads_of = lambda skip: {"w": jnp.full(3, jnp.inf if skip else 1.0)}
    if holder == "train_state":
        state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(3)}, tx=tx)
        step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
        for skip in skips:
            state = step(state, grads_of(skip))
        calls, opt_state = state.step, state.opt_state
    else:
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        for skip in skips:
            grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 3)))))(model)
            if skip:
                grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), grads)
            optimizer.update(model, grads)
        calls, opt_state, inner = optimizer.step[...], optimizer, optimizer.opt_state
    if holder == "train_state":
        inner = opt_state
    (inner_count,) = {
        int(leaf.count[...])
        for leaf in jax.tree.leaves(inner, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(leaf, optax.ScaleByAdamState)
    }
    metrics = jax.jit(jaxamp.optim.loss_scale_metrics)(opt_state)
    assert int(calls) == len(skips)
    assert int(metrics["applied_steps"]) == inner_count == skips.count(False)
    assert int(metrics["skipped_steps"]) == skips.count(True)
