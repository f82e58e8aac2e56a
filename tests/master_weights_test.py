"""Tests for jaxamp/_src/master_weights.py through loss_scaled(master_weights=...)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import StaticLossScale

RECIPES = ["float32", "kahan", "stochastic", "none"]
SIXTEEN = [jnp.bfloat16, jnp.float16]


def _train(tx, params, grads_of, steps):
    """``steps`` updates under jit, in a loop on device; returns params and state."""

    def body(i, carry):
        params, state = carry
        updates, state = tx.update(grads_of(params, i), state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(lambda p: jax.lax.fori_loop(0, steps, body, (p, tx.init(p))))(params)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_the_stall_updates_below_half_an_ulp(dtype):
    """sgd steps of 2**-13 on weights at 1 (the spacing just below 1 is 2**-8 in bfloat16,
    2**-11 in float16): to nearest the weights never move; a float32 master, Kahan and
    stochastic rounding move them by 400 * 2**-13 as float32 arithmetic does (stochastic
    rounding on average)."""
    steps, lr = 400, 2.0**-13
    params = {"w": jnp.ones(8192, dtype)}
    grads_of = lambda p, i: {"w": jnp.full(p["w"].shape, 8.0, jnp.float32)}  # scale 8: g=1
    target = 1.0 - steps * lr  # 0.951171875
    finals = {}
    for recipe in RECIPES:
        tx = jaxamp.loss_scaled(optax.sgd(lr), StaticLossScale(8.0), master_weights=recipe)
        finals[recipe], _ = _train(tx, params, grads_of, steps)
        finals[recipe] = finals[recipe]["w"].astype(jnp.float32)
    assert bool(jnp.all(finals["none"] == 1.0))  # stalled: every update was rounded away
    ulp = float(jnp.finfo(dtype).eps) / 2  # spacing just below 1
    np.testing.assert_allclose(finals["float32"], target, atol=ulp)
    np.testing.assert_allclose(finals["kahan"], target, atol=ulp)
    assert abs(float(finals["stochastic"].mean()) - target) < 0.2 * ulp  # about 5 SE


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_kahan_tracks_the_float32_sum(dtype):
    """Random small updates: Kahan stays within a 16-bit ulp of the float32 sum."""
    params = {"w": jnp.linspace(0.5, 2.0, 1024).astype(dtype)}
    exact = params["w"].astype(jnp.float32)

    def grads_of(p, i):
        return {"w": jax.random.uniform(jax.random.fold_in(jax.random.key(0), i), (1024,))}

    lr = 1e-3
    tx = jaxamp.loss_scaled(optax.sgd(lr), StaticLossScale(1.0), master_weights="kahan")
    ours, state = _train(tx, params, grads_of, 300)
    for i in range(300):
        exact = exact - lr * grads_of(None, i)["w"]
    w = ours["w"]
    spacing = jnp.nextafter(w, jnp.asarray(jnp.inf, dtype)).astype(jnp.float32) - w.astype(
        jnp.float32
    )  # the larger of the two gaps around each weight
    kahan_error = jnp.abs(w.astype(jnp.float32) - exact)
    assert bool(jnp.all(kahan_error <= spacing))  # within one 16-bit ulp of the float32 sum
    compensated = w.astype(jnp.float32) + state.compensation["w"].astype(jnp.float32)
    # p + c holds the sum to within the 16-bit compensation's own roundings
    assert bool(jnp.all(jnp.abs(compensated - exact) <= 0.25 * spacing))
    none = jaxamp.loss_scaled(optax.sgd(lr), StaticLossScale(1.0), master_weights="none")
    naive, _ = _train(none, params, grads_of, 300)
    naive_error = jnp.abs(naive["w"].astype(jnp.float32) - exact)
    assert float(naive_error.max()) > 4 * float(kahan_error.max())
    assert state.compensation["w"].dtype == dtype


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_a_non_finite_step_is_skipped_bit_for_bit(recipe, dtype):
    params = {"w": jnp.linspace(-1, 1, 64).astype(dtype)}
    tx = jaxamp.loss_scaled(optax.adam(1e-2), StaticLossScale(4.0), master_weights=recipe)
    state = tx.init(params)
    update = jax.jit(tx.update)
    good = {"w": jnp.full((64,), 4e-3)}
    updates, state = update(good, state, params)
    params = optax.apply_updates(params, updates)
    before = (params, state)
    bad = {"w": good["w"].at[3].set(jnp.nan)}
    updates, after = update(bad, state, params)
    assert not bool(after.last_finite)
    assert all(not bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates))
    for name in ("inner_state", "master_params", "compensation", "rounding_key"):
        for a, b in zip(
            jax.tree.leaves(getattr(after, name)),
            jax.tree.leaves(getattr(before[1], name)),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_is_arrays_stable_and_traced_once(recipe):
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.zeros(4)}  # a float32 leaf too
    tx = jaxamp.loss_scaled(optax.adam(1e-3), master_weights=recipe)
    state = tx.init(params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    traces = []

    @jax.jit
    def step(params, state):
        traces.append(1)
        grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(3):
        params, state = step(params, state)
    assert len(traces) == 1
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
    assert params["w"].dtype == jnp.bfloat16 and params["b"].dtype == jnp.float32
    has = {k: getattr(state, k) is not None for k in ("master_params", "compensation")}
    assert has == {"master_params": recipe == "float32", "compensation": recipe == "kahan"}
    assert (state.rounding_key is not None) == (recipe == "stochastic")


def test_stochastic_resume_through_orbax_is_bit_identical(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = {"w": jnp.linspace(-1, 1, 256).astype(jnp.bfloat16)}
    tx = jaxamp.loss_scaled(
        jaxamp.with_state_dtype(optax.adam(1e-3), jnp.bfloat16, rounding="stochastic"),
        master_weights="stochastic",
        seed=7,
    )

    @jax.jit
    def step(params, state, i):
        grads = {"w": jax.random.normal(jax.random.fold_in(jax.random.key(1), i), (256,))}
        grads = jax.tree.map(lambda g: g * jaxamp.get_loss_scale(state), grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def run(params, state, start, stop):
        for i in range(start, stop):
            params, state = step(params, state, i)
        return params, state

    straight = run(params, tx.init(params), 0, 6)
    half = run(params, tx.init(params), 0, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", half)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", half)
    resumed = run(*restored, 3, 6)
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bytes_per_parameter_of_each_recipe():
    """Params + master/compensation + Adam state, read from the state pytree."""
    n = 1 << 16
    params = {"w": jnp.zeros(n, jnp.bfloat16)}

    def bytes_per_param(tx):
        state = tx.init(params)
        total = sum(x.nbytes for x in jax.tree.leaves(state)) + params["w"].nbytes
        return total / n

    adam = optax.adam(1e-3)
    bf16_adam = jaxamp.with_state_dtype(adam, jnp.bfloat16, rounding="stochastic")
    assert round(bytes_per_param(jaxamp.loss_scaled(adam)), 2) == 14.0
    assert round(bytes_per_param(jaxamp.loss_scaled(adam, master_weights="kahan")), 2) == 12.0
    sr = jaxamp.loss_scaled(bf16_adam, master_weights="stochastic")
    assert round(bytes_per_param(sr), 2) == 6.0


def test_bad_master_weights():
    with pytest.raises(ValueError, match=r"Unknown master_weights 'fp32'\. Valid choices"):
        jaxamp.loss_scaled(optax.adam(1e-3), master_weights="fp32")
    tx = jaxamp.loss_scaled(optax.adam(1e-3), master_weights="kahan")
    state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update({"w": jnp.ones(2)}, state)
