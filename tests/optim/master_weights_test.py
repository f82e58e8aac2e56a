"""Tests for jaxamp/_src/optim/master_weights.py through loss_scaled(master_weights=...)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp import StaticLossScale
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import apply_step

RECIPES = ["float32", "kahan", "stochastic", "none"]
SIXTEEN = [jnp.bfloat16, jnp.float16]


def _train(tx, params, grads_of, steps):
    """``steps`` updates under jit, in a loop on device; returns params and state."""

    def body(i, carry):
        params, state = carry
        updates, state = tx.update(grads_of(params, i), state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(lambda p: jax.lax.fori_loop(0, steps, body, (p, tx.init(p))))(params)


@pytest.mark.standard_promotion(OPTAX)
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


@pytest.mark.standard_promotion(OPTAX)
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


def _bits(x):
    """The raw bits of an array (so -0.0 != 0.0 and NaN payloads count)."""
    x = np.asarray(jax.device_get(x))
    return x.view(f"u{x.dtype.itemsize}") if jnp.issubdtype(x.dtype, jnp.floating) else x


def _assert_bits_equal(a, b, what):
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for i, (x, y) in enumerate(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)):
        assert np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype, what
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"{what}, leaf {i}")


# The fields each recipe keeps besides the inner state (the other fields are None).
KEEPS = {
    "float32": ("master_params",),
    "kahan": ("compensation",),
    "stochastic": ("rounding_key",),
    "none": (),
}


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_a_non_finite_step_is_skipped_bit_for_bit(recipe, dtype):
    """After a good step (so every state field holds something that moved), a step with
    a NaN gradient returns ``-0.0`` updates (zeros that keep a ``-0.0`` param's sign) and
    leaves the params and every state leaf but
    the step and skip counters bit for bit as they were: the inner state, the master,
    the compensation and the rounding key, whichever the recipe keeps."""
    params = {"w": jnp.linspace(-1, 1, 64).astype(dtype), "b": jnp.linspace(0, 1, 8)}
    tx = jaxamp.loss_scaled(optax.adam(1e-2), StaticLossScale(4.0), master_weights=recipe)
    state = tx.init(params)
    update = jax.jit(tx.update)
    good = {"w": jnp.full((64,), 4e-3), "b": jnp.full((8,), 4e-3)}
    updates, state = update(good, state, params)
    params = optax.apply_updates(params, updates)
    fields = ("inner_state", "master_params", "compensation", "rounding_key")
    for name in fields:  # the recipe's own fields exist and have leaves; the others are None
        value = getattr(state, name)
        if name == "inner_state" or name in KEEPS[recipe]:
            assert jax.tree.leaves(value), name
        else:
            assert value is None, name
    bad = {"w": good["w"].at[3].set(jnp.nan), "b": good["b"]}
    updates, after = update(bad, state, params)
    assert not bool(after.last_finite) and int(after.skipped_steps) == 1
    assert int(after.step) == int(state.step) + 1
    _assert_bits_equal(updates, jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates), "updates")
    _assert_bits_equal(optax.apply_updates(params, updates), params, "params")
    for name in fields:
        _assert_bits_equal(getattr(after, name), getattr(state, name), name)
    _assert_bits_equal(after.loss_scale, state.loss_scale, "loss_scale")  # static scale


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_mixed_dtype_params_donate_and_float32_leaves_follow_plain_optax(recipe, dtype):
    """Params with a 16-bit and a float32 leaf: the state shares no buffer with the
    params (the float32 master aliased the float32 leaf, so donating both failed with
    "donate the same buffer twice"), and the float32 leaf takes exactly plain optax's
    update (through the master it landed on p + (m' - p), which with Adam under jit was
    an ulp off the master m' it stored in about 0.6% of elements).

    sgd with a power-of-two learning rate: every product is exact, so how XLA:CPU
    contracts multiplies and adds into FMAs (which depends on what surrounds them: plain
    optax's own jitted Adam step and its jitted update applied outside jit differ in
    about 2% of elements) cannot change a bit, and the comparison is of the algebra."""
    n = 4096
    params = {
        "w": jnp.linspace(-1, 1, n).astype(dtype),
        "b": jax.random.normal(jax.random.key(0), (n,)),
    }
    inner = optax.sgd(2.0**-4)
    tx = jaxamp.loss_scaled(inner, StaticLossScale(1.0), master_weights=recipe)

    def grads(i):
        key = jax.random.fold_in(jax.random.key(1), i)
        return {"w": jax.random.normal(key, (n,)), "b": 8 * jax.random.normal(key, (n,))}

    plain = apply_step(inner)
    b, plain_state = {"b": params["b"]}, inner.init({"b": params["b"]})
    expected = []
    for i in range(3):
        b, plain_state = plain(b, plain_state, {"b": grads(i)["b"]})
        expected.append(_bits(b["b"]))
    state = tx.init(params)
    param_buffers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
    assert not param_buffers & {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for i in range(3):
        params, state = step(params, state, grads(i))
        np.testing.assert_array_equal(_bits(params["b"]), expected[i])
        assert params["w"].dtype == dtype and params["b"].dtype == jnp.float32
    if recipe == "float32":  # no float32 copy of the float32 leaf: a scalar placeholder
        assert state.master_params["b"].shape == () and state.master_params["w"].shape == (n,)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", SIXTEEN)
def test_kahan_discards_the_compensation_of_a_param_set_outside_update(dtype):
    """Weights zeroed (pruned) or clipped between steps: the compensation built up for
    their old values is dropped, so a zero update leaves a zeroed weight at exactly 0
    (it became the stale compensation) and a clipped one at exactly its clipped value.
    Elsewhere the compensation is kept; the next step starts each edited weight afresh
    from its edited value."""
    n = 1024
    params = {"w": jnp.linspace(0.5, 2.0, n).astype(dtype)}
    sgd = jaxamp.loss_scaled(optax.sgd(1.0), StaticLossScale(1.0), master_weights="kahan")

    def grads_of(p, i):  # sub-ulp steps: the compensation fills up
        key = jax.random.fold_in(jax.random.key(2), i)
        return {"w": 1e-3 * jax.random.uniform(key, (n,))}

    params, state = _train(sgd, params, grads_of, 20)
    c = state.compensation["w"]
    assert float(jnp.mean(c != 0)) > 0.9
    pruned = jnp.arange(n) % 4 == 0
    clipped = jnp.arange(n) % 4 == 1
    edited = jnp.where(pruned, 0, params["w"])
    edited = jnp.where(clipped, jnp.asarray(1e-3, dtype), edited)
    update = jax.jit(sgd.update)
    zero = {"w": jnp.zeros(n)}
    updates, after = update(zero, state, {"w": edited})
    new = optax.apply_updates({"w": edited}, updates)["w"]
    np.testing.assert_array_equal(_bits(new), _bits(edited))  # zero update: nothing moves
    c_after = after.compensation["w"]
    assert bool(jnp.all(c_after[pruned | clipped] == 0))
    untouched = ~(pruned | clipped)
    np.testing.assert_array_equal(_bits(c_after[untouched]), _bits(c[untouched]))
    # the next real step starts the edited weights afresh from their edited values
    g = grads_of(None, 99)
    updates, _ = update(g, after, {"w": new})
    stepped = optax.apply_updates({"w": new}, updates)["w"].astype(jnp.float32)
    fresh = (new.astype(jnp.float32) - g["w"]).astype(dtype).astype(jnp.float32)
    np.testing.assert_array_equal(stepped[pruned | clipped], fresh[pruned | clipped])


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("recipe", RECIPES)
def test_state_is_arrays_stable_and_traced_once(recipe):
    params = {"w": jnp.ones((8, 4), jnp.bfloat16), "b": jnp.zeros(4)}  # a float32 leaf too
    tx = jaxamp.loss_scaled(optax.adam(1e-3), master_weights=recipe)
    state = tx.init(params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(state))
    traces = []
    step = apply_step(tx, count_traces=traces)
    grads = jax.tree.map(lambda p: jnp.ones(p.shape, jnp.float32), params)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(3):
        params, state = step(params, state, grads)
    assert len(traces) == 1
    assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
    assert params["w"].dtype == jnp.bfloat16 and params["b"].dtype == jnp.float32
    has = {k: getattr(state, k) is not None for k in ("master_params", "compensation")}
    assert has == {"master_params": recipe == "float32", "compensation": recipe == "kahan"}
    assert (state.rounding_key is not None) == (recipe == "stochastic")


@pytest.mark.standard_promotion(OPTAX)
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
        grads = jax.tree.map(lambda g: g * jaxamp.optim.get_loss_scale(state), grads)
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


@pytest.mark.standard_promotion(OPTAX)
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


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("recipe", RECIPES)
def test_complex_params_take_the_inner_update_as_it_is(recipe):
    """A complex param beside a 16-bit one takes the inner update unchanged in every
    recipe (with a float32 master it was frozen: its update was zeros)."""
    params = {"z": jnp.array([1 + 1j, -2j], jnp.complex64), "w": jnp.ones(2, jnp.bfloat16)}
    grads = {"z": jnp.array([0.5 + 0.5j, 1 - 1j], jnp.complex64), "w": jnp.ones(2, jnp.bfloat16)}
    tx = jaxamp.loss_scaled(optax.sgd(1.0), StaticLossScale(1.0), master_weights=recipe)

    @jax.jit
    def step(params, state):
        updates, state = tx.update(grads, state, params)
        return updates, optax.apply_updates(params, updates), state

    updates, new, _ = step(params, tx.init(params))
    assert updates["z"].dtype == jnp.complex64
    np.testing.assert_array_equal(updates["z"], -grads["z"])
    np.testing.assert_array_equal(new["z"], params["z"] - grads["z"])
    assert new["w"].dtype == jnp.bfloat16
