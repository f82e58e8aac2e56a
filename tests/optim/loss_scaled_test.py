"""Tests for jaxamp/_src/optim/loss_scaled.py: the optax wrapper, its state and its skips."""

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxamp
from jaxamp._src.optim import loss_scaled as loss_scaled_module
from jaxamp.optim import DynamicLossScale, LossScaledState, NoOpLossScale, StaticLossScale
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import loss_scaled_step

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def params_of(dtype):
    return {"w": jnp.linspace(-1.0, 1.0, 12, dtype=dtype).reshape(3, 4), "b": jnp.ones(4, dtype)}


def quadratic(params):
    return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(params))


def scaled_grads(params, state, loss=quadratic, poison=False):
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
    if poison:
        grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.inf), grads)
    return grads


def test_float16_gradient_that_flushes_to_zero_survives_scaling():
    w = jnp.ones(4, jnp.float32)

    def loss(w):  # the backward pass runs in float16, as under a mixed_float16 policy
        y = w.astype(jnp.float16) * jnp.float16(1e-4)
        return jnp.sum(y.astype(jnp.float32)) * 1e-4

    true_grad = 1e-8  # below float16's smallest subnormal, 2**-24 ~ 6e-8
    assert float(jax.grad(loss)(w)[0]) == 0.0  # flushed without scaling

    tx = jaxamp.loss_scaled(optax.sgd(1.0))
    state = tx.init(w)
    updates, state = jax.jit(tx.update)(scaled_grads(w, state, loss), state, w)
    np.testing.assert_allclose(-updates, true_grad, rtol=1e-2)
    assert bool(state.last_finite)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("skip_with", ["select", "cond"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_overflow_skips_with_params_and_inner_state_bit_for_bit_unchanged(dtype, skip_with):
    params = params_of(dtype)
    tx = jaxamp.loss_scaled(
        optax.adam(1e-2), DynamicLossScale(init_scale=1024.0), skip_with=skip_with
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    for _ in range(2):  # move the inner state away from its initial value
        updates, state = update(scaled_grads(params, state), state, params)
        params = optax.apply_updates(params, updates)
    before = state
    updates, state = update(scaled_grads(params, state, poison=True), state, params)
    new_params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(
        jax.tree.leaves(before.inner_state), jax.tree.leaves(state.inner_state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    assert float(state.loss_scale.scale) == 512.0
    assert int(state.skipped_steps) == 1 and int(state.consecutive_skips) == 1
    assert not bool(state.last_finite)
    # the next finite step continues
    updates, state = update(scaled_grads(new_params, state), state, new_params)
    assert int(state.consecutive_skips) == 0 and int(state.skipped_steps) == 1


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("skip_with", ["select", "cond"])
@pytest.mark.parametrize("master_weights", ["float32", "kahan", "stochastic", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_skipped_step_keeps_every_bit_of_the_params_signed_zeros_too(
    dtype, master_weights, skip_with
):
    """``optax.apply_updates(params, updates)`` after a skipped step is ``params`` bit for
    bit: a zero update turned ``-0.0`` into ``+0.0`` (``-0.0 + 0.0``); the skip's updates
    are ``-0.0``, which leaves every value as it is. Compared by bit pattern."""
    params = {"w": jnp.array([-0.0, 0.0, -1.5, 2.0], dtype)}
    tx = jaxamp.loss_scaled(optax.adam(1e-2), master_weights=master_weights, skip_with=skip_with)
    state = tx.init(params)
    grads = {"w": jnp.array([jnp.inf, 1.0, 1.0, 1.0], dtype)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.last_finite)
    new = optax.apply_updates(params, updates)
    bits = lambda x: np.asarray(x).view(f"u{np.dtype(x.dtype).itemsize}")
    np.testing.assert_array_equal(bits(new["w"]), bits(params["w"]))


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_any_non_finite_value_skips(bad):
    params = params_of(jnp.float32)
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    grads["b"] = grads["b"].at[2].set(bad)
    _, state = jax.jit(tx.update)(grads, state, params)
    assert int(state.skipped_steps) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", [0, 1, 4095])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_a_non_finite_element_anywhere_in_a_large_leaf_skips(dtype, position, bad):
    params = {"w": jnp.zeros((64, 64), dtype)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), NoOpLossScale())
    grads = {"w": jnp.full((64, 64), -2.0, dtype).reshape(-1).at[position].set(bad).reshape(64, 64)}
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert int(state.skipped_steps) == 1


@pytest.mark.parametrize(
    "values, scale, skipped",
    [
        ([3e38, -3e38, 1.0], 1.0, False),  # large, finite, cancelling: not a skip
        ([3e38, 3e38, 1.0], 1.0, False),  # finite even though their sum overflows
        ([3e38, 1.0, 1.0], 0.5, True),  # finite scaled, but unscaling (x2) overflows
        ([-3e38, 1.0, 1.0], 0.5, True),
        ([1e38, 1.0, 1.0], 0.5, False),
        ([jnp.inf, -jnp.inf, 1.0], 1.0, True),
    ],
)
def test_finiteness_is_that_of_the_unscaled_gradients(values, scale, skipped):
    params = {"w": jnp.zeros(3)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), StaticLossScale(scale))
    _, state = jax.jit(tx.update)({"w": jnp.array(values, jnp.float32)}, tx.init(params), params)
    assert int(state.skipped_steps) == int(skipped)


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize(
    "options", [{"xla_cpu_enable_fast_math": True}, {"xla_cpu_enable_fast_min_max": True}]
)
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_a_non_finite_step_is_skipped_under_xla_fast_math(options, bad):
    """Compiled with fast math (here through the jit's compiler options, which no check of
    XLA_FLAGS sees), XLA folded the check ``sum(u - u)`` to 0 and let the inf into the
    params. optax.apply_if_finite skips the same step under the same options."""
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), StaticLossScale(2.0**15))
    step = jax.jit(tx.update, compiler_options=options)
    grads = {"w": jnp.array([1.0, bad, 2.0])}
    updates, state = step(grads, tx.init(params), params)
    assert not bool(state.last_finite) and int(state.skipped_steps) == 1
    np.testing.assert_array_equal(updates["w"], jnp.zeros(3))
    reference = optax.apply_if_finite(optax.sgd(0.1), 10)
    _, ref_state = jax.jit(reference.update, compiler_options=options)(
        grads, reference.init(params), params
    )
    assert int(ref_state.notfinite_count) == 1


@pytest.mark.parametrize("skip_with", ["select", "cond"])
def test_an_inf_gradient_is_skipped_quietly_under_debug_nans(skip_with):
    """The check made a NaN of an inf gradient (``u - u``), which jax_debug_nans raised on,
    eagerly, on the very step loss scaling exists to skip."""
    params = {"w": jnp.ones(3)}
    tx = jaxamp.loss_scaled(optax.sgd(0.1), skip_with=skip_with)
    with jax.debug_nans(True):
        updates, state = tx.update({"w": jnp.array([1.0, jnp.inf, 2.0])}, tx.init(params), params)
    assert int(state.skipped_steps) == 1
    np.testing.assert_array_equal(updates["w"], jnp.zeros(3))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_narrow_gradients_under_strict_promotion_and_float8_leaves(dtype):
    """``jnp.promote_types(g.dtype, float32)`` was refused under strict dtype promotion
    (every 16-bit gradient) and for float8 leaves; the updates are optax's on the
    unscaled gradients, in float32."""
    params = {"w": jnp.ones(4, jnp.float32), "q": jnp.ones(4, dtype)}
    grads = {"w": jnp.full(4, 2.0, jnp.float32), "q": jnp.full(4, 2.0, dtype)}
    tx = jaxamp.loss_scaled(optax.sgd(0.5), StaticLossScale(2.0), master_weights="none")
    with jax.numpy_dtype_promotion("strict"):
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert bool(state.last_finite)
    np.testing.assert_array_equal(updates["w"], jnp.full(4, -0.5))
    np.testing.assert_array_equal(np.asarray(updates["q"], np.float32), np.full(4, -0.5))


def test_all_finite_checks_python_float_leaves():
    """A Python float leaf was skipped (``all_finite({"w": inf})`` was True)."""
    assert not bool(jaxamp.optim.all_finite({"w": float("inf"), "b": jnp.ones(2)}))
    assert not bool(jax.jit(jaxamp.optim.all_finite)({"w": complex(0.0, float("nan"))}))
    assert bool(jaxamp.optim.all_finite({"w": 1.5, "n": 3, "b": jnp.ones(2)}))


def _bytes_accessed(fn, *args) -> float:
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])


@pytest.mark.standard_promotion(OPTAX)
def test_the_check_reads_each_gradient_once_more_than_plain_optax():
    """The compiled loss-scaled Adam update reads and writes at most 2.5 gradient sizes
    more than plain optax's (the check's one read and its booleans, and the update that
    cannot read the new moments it selects); the check of three reductions per leaf read
    each gradient three times (four more in all)."""
    params = {"w": jnp.ones((256, 256)), "b": jnp.ones((256, 256))}
    grads = jax.tree.map(lambda p: p * 1e-3, params)
    size = sum(g.nbytes for g in grads.values())

    def update(tx):
        def step(params, grads, state):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        return step

    plain, scaled = optax.adam(1e-3), jaxamp.loss_scaled(optax.adam(1e-3))
    plain_bytes = _bytes_accessed(update(plain), params, grads, plain.init(params))
    scaled_bytes = _bytes_accessed(update(scaled), params, grads, scaled.init(params))
    assert scaled_bytes <= plain_bytes + 2.6 * size, (plain_bytes / size, scaled_bytes / size)


def test_clipping_sees_unscaled_gradients():
    params = {"w": jnp.array([0.3, 0.4])}  # gradient 2w, norm 1.0
    inner = optax.chain(optax.clip_by_global_norm(2.0), optax.sgd(1.0))
    tx = jaxamp.loss_scaled(inner)
    state = tx.init(params)
    updates, _ = jax.jit(tx.update)(scaled_grads(params, state), state, params)
    np.testing.assert_allclose(updates["w"], [-0.6, -0.8], rtol=1e-6)  # not clipped
    clip = jaxamp.loss_scaled(optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1.0)))
    state = clip.init(params)
    updates, _ = jax.jit(clip.update)(scaled_grads(params, state), state, params)
    np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)  # clipped to 0.5


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("master_weights", ["float32", "kahan", "stochastic", "none"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_weakly_typed_float32_param_beside_16_bit_ones_keeps_one_state_type(
    dtype, master_weights
):
    """A param made with jnp.asarray(1.0) is weakly typed: the inner state built from it
    is not, so the jitted update keeps one signature and compiles once."""
    params = {"w": jnp.ones((4,), dtype), "s": jnp.asarray(1.0)}
    assert params["s"].weak_type
    tx = jaxamp.loss_scaled(optax.adam(1e-3), master_weights=master_weights)
    state = tx.init(params)
    weak = [x for x in jax.tree.leaves(state) if getattr(x, "weak_type", False)]
    assert not weak, weak
    traces = []

    def counted(grads, state, params):  # a Python side effect: runs once per trace
        traces.append(jax.tree.map(lambda x: (x.dtype, x.weak_type), state))
        return tx.update(grads, state, params)

    update = jax.jit(counted)
    grads = jax.tree.map(jnp.ones_like, params)
    for _ in range(2):
        _, state = update(grads, state, params)
    assert len(traces) == 1, traces


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_params_keep_a_float32_master(dtype):
    params = {"w": jnp.full(4, 1.0, dtype)}
    tx = jaxamp.loss_scaled(optax.sgd(1e-4), StaticLossScale(8.0))
    state = tx.init(params)
    assert state.master_params["w"].dtype == jnp.float32
    update = jax.jit(tx.update)
    for _ in range(20):
        updates, state = update(scaled_grads(params, state), state, params)
        params = optax.apply_updates(params, updates)
        assert params["w"].dtype == dtype
        np.testing.assert_array_equal(params["w"], state.master_params["w"].astype(dtype))
    # 20 steps of w -= 2e-4 w: the master moved, as float32 arithmetic says
    np.testing.assert_allclose(state.master_params["w"], (1 - 2e-4) ** 20, rtol=1e-6)
    # ...and the params are that master, rounded (bfloat16 spacing below 1 is 2**-8)
    assert float(params["w"][0]) == float(jnp.asarray((1 - 2e-4) ** 20, dtype))
    # without the master, bfloat16 params would not move at all: each update is too small
    plain = optax.sgd(1e-4)
    p = {"w": jnp.full(4, 1.0, jnp.bfloat16)}
    u, _ = plain.update(jax.grad(quadratic)(p), plain.init(p), p)
    assert float(optax.apply_updates(p, u)["w"][0]) == 1.0


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("skip_with", ["select", "cond"])
def test_master_adopts_changes_made_to_the_params_outside_update(dtype, skip_with):
    """Weight clipping between steps is kept: the master takes the clipped values."""
    params = params_of(dtype)
    tx = jaxamp.loss_scaled(optax.sgd(1e-2), StaticLossScale(8.0), skip_with=skip_with)
    state = tx.init(params)
    update = jax.jit(tx.update)
    updates, state = update(scaled_grads(params, state), state, params)
    params = optax.apply_updates(params, updates)
    clipped = jax.tree.map(lambda p: jnp.clip(p, -0.5, 0.5), params)  # outside update
    assert not np.array_equal(clipped["w"], params["w"]) and float(params["b"][0]) > 0.5
    master = state.master_params
    updates, state = update(scaled_grads(clipped, state), state, clipped)
    params = optax.apply_updates(clipped, updates)
    # sgd on sum(p**2): m <- m - 0.01 * 2p. The master starts from the clipped value where
    # clipping changed the param, and keeps its own float32 value where it did not.
    for ours, new_master, old_master, c in zip(
        jax.tree.leaves(params),
        jax.tree.leaves(state.master_params),
        jax.tree.leaves(master),
        jax.tree.leaves(clipped),
        strict=True,
    ):
        changed = old_master.astype(dtype) != c
        assert bool(jnp.any(changed))
        start = jnp.where(changed, c.astype(jnp.float32), old_master)
        expected = start - 0.01 * 2 * c.astype(jnp.float32)
        np.testing.assert_allclose(new_master, expected, rtol=1e-6)
        np.testing.assert_array_equal(ours, new_master.astype(dtype))
        assert float(jnp.max(jnp.abs(ours.astype(jnp.float32)))) <= 0.5
    # ...and a skipped step keeps the adopted master too
    clipped = jax.tree.map(lambda p: jnp.clip(p, -0.25, 0.25), params)
    updates, state = update(scaled_grads(clipped, state, poison=True), state, clipped)
    assert not bool(state.last_finite)
    for master, c in zip(
        jax.tree.leaves(state.master_params), jax.tree.leaves(clipped), strict=True
    ):
        np.testing.assert_array_equal(master.astype(dtype), c)


def test_master_needs_params():
    params = params_of(jnp.bfloat16)
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs the current params"):
        tx.update(scaled_grads(params, state), state)


def test_float32_params_have_no_master():
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(params_of(jnp.float32))
    assert state.master_params is None


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_training_resumed_from_a_flattened_state_is_bit_identical(dtype):
    """A state taken apart into its leaves (as a checkpoint stores it) and rebuilt trains
    on exactly as the original: every setting that is not a leaf is static config."""
    params = params_of(dtype)
    tx = jaxamp.loss_scaled(
        optax.adam(1e-3), DynamicLossScale(min_scale=2.0**14, hysteresis=2, growth_interval=2)
    )
    step = loss_scaled_step(tx, quadratic)

    def run(params, state, poisons, rebuild):
        for poison in poisons:
            if rebuild:
                leaves, treedef = jax.tree.flatten(state)
                state = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
            params, state = step(params, state, jnp.asarray(poison))
        return params, state

    poisons = [True, True, True, True, False, False, False, True]
    a = run(params, tx.init(params), poisons, rebuild=False)
    b = run(params, tx.init(params), poisons, rebuild=True)
    assert float(a[1].loss_scale.scale) == 2.0**15  # floored at 2**14, then grew once
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("skip_with", ["select", "cond"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_state_dtypes_and_structure_stable_and_one_compile(dtype, skip_with):
    params = params_of(dtype)
    # init_scale 1024: gradients of 2w * 65536 would overflow float16 itself
    tx = jaxamp.loss_scaled(
        optax.adamw(1e-3), DynamicLossScale(1024.0, growth_interval=2), skip_with=skip_with
    )
    state = tx.init(params)
    traces = []
    step = loss_scaled_step(tx, quadratic, count_traces=traces)
    structure = jax.tree.structure(state)
    dtypes = [x.dtype for x in jax.tree.leaves(state)]
    for poison in [False, True, False, False, True]:
        params, state = step(params, state, poison)
        assert jax.tree.structure(state) == structure
        assert [x.dtype for x in jax.tree.leaves(state)] == dtypes
        assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(dtype)}
    assert len(traces) == 1
    assert int(state.skipped_steps) == 2 and int(state.step) == 5


def test_scale_history_records_the_scale_after_each_step():
    params = params_of(jnp.float32)
    tx = jaxamp.loss_scaled(optax.sgd(0.0), DynamicLossScale(init_scale=64.0), history_length=4)
    state = tx.init(params)
    for _ in range(6):
        _, state = tx.update(scaled_grads(params, state, poison=True), state, params)
    np.testing.assert_array_equal(jaxamp.optim.scale_history(state), [8.0, 4.0, 2.0, 1.0])


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_noop_scale_with_16bit_params_lands_on_the_rounded_float32_step(dtype):
    params = params_of(dtype)
    tx = jaxamp.loss_scaled(optax.sgd(0.5), NoOpLossScale())
    state = tx.init(params)
    grads = jax.grad(quadratic)(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    landed = optax.apply_updates(params, updates)
    for name in ("w", "b"):
        p32 = params[name].astype(jnp.float32)
        want = p32 - 0.5 * grads[name].astype(jnp.float32)  # float32 sgd on the true grads
        np.testing.assert_array_equal(state.master_params[name], want)
        np.testing.assert_array_equal(landed[name], want.astype(dtype))
        assert landed[name].dtype == dtype


def rosenbrock(x):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)


def test_line_search_gets_the_unscaled_gradient():
    """optax.lbfgs's zoom line search takes the gradient again as ``grad=``: it was passed
    on scaled, and the run went elsewhere (2e-2 off after 8 steps). It now tracks optax."""
    x0 = jnp.array([-1.2, 1.0, 0.5])

    def run(tx, scaled):
        @jax.jit
        def step(x, state):
            if scaled:
                value, grad = jaxamp.value_and_grad(rosenbrock)(x, opt_state=state)
            else:
                value, grad = jax.value_and_grad(rosenbrock)(x)
            updates, state = tx.update(grad, state, x, value=value, grad=grad, value_fn=rosenbrock)
            return optax.apply_updates(x, updates), state

        x, state = x0, tx.init(x0)
        for _ in range(8):
            x, state = step(x, state)
        return x

    want = run(optax.lbfgs(), scaled=False)
    got = run(jaxamp.loss_scaled(optax.lbfgs(), StaticLossScale(1024.0)), scaled=True)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_extra_args_reach_the_inner_transformation():
    seen = {}

    def inner_update(updates, state, params=None, **extra):
        seen.update(extra)
        return updates, state

    inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), inner_update)
    tx = jaxamp.loss_scaled(inner)
    params = params_of(jnp.float32)
    state = tx.init(params)
    tx.update(scaled_grads(params, state), state, params, value=jnp.ones([]))
    assert "value" in seen


def test_all_finite_sees_complex_nan_and_inf():
    finite = jax.jit(jaxamp.optim.all_finite)
    assert bool(finite({"z": jnp.array([1 + 2j, 3j], jnp.complex64)}))
    assert not bool(finite({"z": jnp.array([1 + 2j, complex(0, float("nan"))], jnp.complex64)}))
    assert not bool(finite([jnp.ones(2), jnp.array([complex(float("inf"), 0)])]))


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"expects an optax.GradientTransformation .* got 'adam'"):
        jaxamp.loss_scaled("adam")
    with pytest.raises(TypeError, match=r"got .dynamic. \(str\)"):
        jaxamp.loss_scaled(optax.sgd(0.1), "dynamic")
    with pytest.raises(ValueError, match="history_length"):
        jaxamp.loss_scaled(optax.sgd(0.1), history_length=0)
    with pytest.raises(
        ValueError, match=r"Unknown skip_with 'if'\. Valid choices: 'select', 'cond'"
    ):
        jaxamp.loss_scaled(optax.sgd(0.1), skip_with="if")


@pytest.mark.standard_promotion(OPTAX)
def test_select_mode_has_no_conditional_and_no_host_callback():
    """Skipping is decided on device: nothing in the program waits for the host."""
    params = params_of(jnp.float32)
    tx = jaxamp.loss_scaled(optax.adam(1e-3))
    state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    text = jax.jit(tx.update).lower(grads, state, params).compile().as_text()
    assert "conditional(" not in text and "custom-call" not in text
    cond_tx = jaxamp.loss_scaled(optax.adam(1e-3), skip_with="cond")
    text = jax.jit(cond_tx.update).lower(grads, cond_tx.init(params), params).compile().as_text()
    assert "conditional(" in text


@pytest.mark.standard_promotion(OPTAX)
def test_orbax_checkpoint_resumes_bit_identically(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params = params_of(jnp.bfloat16)
    tx = jaxamp.loss_scaled(optax.adam(1e-2), DynamicLossScale(init_scale=256.0, growth_interval=2))
    poisons = [False, True, False, False, False, True, False]
    step = loss_scaled_step(tx, quadratic)

    def run(params, state, poisons):
        for poison in poisons:
            params, state = step(params, state, poison)
        return params, state

    reference = run(params, tx.init(params), poisons)

    half = run(params, tx.init(params), poisons[:3])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": half[0], "opt_state": half[1]})
    checkpointer.wait_until_finished()
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"params": half[0], "opt_state": half[1]}
    )
    restored = checkpointer.restore(tmp_path / "ckpt", target)
    assert type(restored["opt_state"]) is LossScaledState
    resumed = run(restored["params"], restored["opt_state"], poisons[3:])
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_non_finite_shard_skips_the_whole_data_parallel_step():
    devices = np.array(jax.devices()[:8])
    if len(devices) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(devices, ("data",))
    batch = NamedSharding(mesh, PartitionSpec("data"))
    replicated = NamedSharding(mesh, PartitionSpec())
    params = jax.device_put({"w": jnp.ones((4,))}, replicated)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(init_scale=8.0))
    state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, state, x):
        loss = lambda p: jnp.mean(jnp.sum(x * p["w"], axis=-1) ** 2)
        grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x = jnp.ones((16, 4)).at[13, 2].set(jnp.inf)  # example 13 lives on device 6
    x = jax.device_put(x, batch)
    assert x.addressable_shards[6].data[1, 2] == jnp.inf
    new_params, state = step(params, state, x)
    np.testing.assert_array_equal(new_params["w"], params["w"])
    assert int(state.skipped_steps) == 1 and float(state.loss_scale.scale) == 4.0

    # shard_map: per-device gradients, skipped everywhere through axis_name
    tx_mapped = jaxamp.loss_scaled(
        optax.sgd(0.1), DynamicLossScale(init_scale=8.0), axis_name="data"
    )
    state = tx_mapped.init({"w": jnp.ones((4,))})

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec("data")),
        out_specs=(PartitionSpec(), PartitionSpec()),
        check_vma=False,
    )
    def mapped_step(params, state, x):
        grads = jax.grad(lambda p: jaxamp.scale_loss(jnp.sum(x * p["w"]), state))(params)
        updates, state = tx_mapped.update(grads, state, params)  # no pmean: grads differ
        return optax.apply_updates(params, updates), state

    new_params, state = jax.jit(mapped_step)({"w": jnp.ones((4,))}, state, x)
    np.testing.assert_array_equal(new_params["w"], jnp.ones(4))
    assert int(state.skipped_steps) == 1


def test_nonfinite_record_is_the_same_on_every_device():
    """Under a named axis the record is taken from the global check: a device whose own
    gradients were finite records the leaf another device saw overflow."""
    tx = jaxamp.loss_scaled(optax.sgd(0.1), axis_name="d", record_nonfinite=True)
    params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    state = tx.init(params)
    grads = {"a": jnp.ones((2, 3)).at[0, 1].set(jnp.inf), "b": jnp.ones((2, 3))}

    @jax.jit
    @functools.partial(jax.vmap, in_axes=(0, None, None), out_axes=(0, 0), axis_name="d")
    def step(grads, state, params):
        return tx.update(grads, state, params)

    updates, new = step(grads, state, params)
    assert new.nonfinite_grads["a"].tolist() == [True, True]
    assert new.nonfinite_grads["b"].tolist() == [False, False]
    assert new.skipped_steps.tolist() == [1, 1]
    assert float(jnp.abs(updates["a"]).max()) == 0.0


_SPECIALS = [np.inf, -np.inf, np.nan]


@st.composite
def _gradient_trees(draw):
    """Trees of 1-3 leaves (float32/bfloat16/float16, 0-3 dims, up to 300 elements), values
    up to the dtype's max, with inf/-inf/NaN planted at random positions in some leaves."""
    leaves = {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
        shape = tuple(draw(st.lists(st.integers(1, 7), max_size=3)))
        size = int(np.prod(shape))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        magnitude = draw(st.sampled_from([1.0, 1e4, float(jnp.finfo(dtype).max)]))
        values = (rng.uniform(-1, 1, size) * magnitude).astype(np.float32)
        for _ in range(draw(st.integers(0, 2))):
            values[draw(st.integers(0, size - 1))] = draw(st.sampled_from(_SPECIALS))
        leaves[f"g{i}"] = jnp.asarray(values.reshape(shape), dtype)
    return leaves


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(grads=_gradient_trees(), inv_scale=st.sampled_from([2.0**-16, 1.0, 2.0**10]))
def test_finiteness_check_equals_isfinite_of_the_unscaled_gradients(grads, inv_scale):
    """The check against the elementwise definition, computed in numpy."""
    with np.errstate(over="ignore", invalid="ignore"):
        expected = all(
            bool(np.isfinite(np.asarray(g, np.float32) * np.float32(inv_scale)).all())
            for g in grads.values()
        )
    inv = jnp.float32(inv_scale)
    assert bool(jax.jit(loss_scaled_module._unscaled_finite)(grads, inv)) == expected
    per_leaf = jax.jit(loss_scaled_module._finite_leaves)(grads, inv)
    assert all(bool(ok) for ok in jax.tree.leaves(per_leaf)) == expected
    assert bool(jax.jit(jaxamp.optim.all_finite)(grads)) == all(
        bool(np.isfinite(np.asarray(g, np.float32)).all()) for g in grads.values()
    )


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("recipe", ["float32", "stochastic"])
def test_nonfinite_record_is_shaped_like_the_gradients_under_lookahead(dtype, recipe):
    """optax.lookahead's params are LookaheadParams(fast, slow) but its gradients are
    shaped like the fast params: the record is shaped like the gradients (init built it
    from the params, and update failed with "pytree structure error")."""
    fast = params_of(dtype)
    params = optax.LookaheadParams.init_synced(fast)
    inner = optax.lookahead(optax.adam(1e-2), 2, 0.5)
    tx = jaxamp.loss_scaled(inner, master_weights=recipe, record_nonfinite=True)
    state = tx.init(params)
    step = jax.jit(tx.update)
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 65536.0, x.dtype), fast)
    updates, state = step(grads, state, params)
    assert jax.tree.structure(state.nonfinite_grads) == jax.tree.structure(fast)
    params = optax.apply_updates(params, updates)
    assert bool(state.last_finite) and jaxamp.optim.nonfinite_gradients(state) == []
    _, state = step({**grads, "b": grads["b"].at[1].set(jnp.inf)}, state, params)
    assert not bool(state.last_finite)
    assert jaxamp.optim.nonfinite_gradients(state) == ["['b']"]


def test_nonfinite_record_of_other_gradients_is_a_clear_error():
    tx = jaxamp.loss_scaled(optax.sgd(0.1), record_nonfinite=True)
    params = params_of(jnp.float32)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"record_nonfinite=True.*shaped like the gradients"):
        jax.jit(tx.update)({"w": params["w"]}, state, None)


@pytest.mark.parametrize("master_weights", ["float32", "kahan", "stochastic", "none"])
def test_complex_gradients_are_unscaled(master_weights):
    """A complex param (beside a bfloat16 one) takes plain optax's update: its scaled
    gradient is unscaled in its complex dtype (it reached the inner optimizer still
    multiplied by the scale, 2**16)."""
    params = {"z": jnp.array([1 + 1j, -2 + 0.5j], jnp.complex64), "w": jnp.ones(2, jnp.bfloat16)}
    loss = lambda p: jnp.sum(jnp.abs(p["z"]) ** 2) + jnp.sum(p["w"].astype(jnp.float32) ** 2)
    tx = jaxamp.loss_scaled(optax.sgd(0.25), master_weights=master_weights)
    state = tx.init(params)
    grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    expected = -0.25 * jax.grad(loss)(params)["z"]
    assert updates["z"].dtype == jnp.complex64
    np.testing.assert_allclose(updates["z"], expected, rtol=1e-6)
    assert bool(state.last_finite)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("skip_with", ["select", "cond"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("make", [lambda: optax.adafactor(1e-2), lambda: optax.lamb(1e-2)])
def test_without_master_the_inner_optimizer_still_sees_float32_params(make, dtype, skip_with):
    """master_weights="none" gave the inner optimizer float32 params in init and the
    16-bit params in update: adafactor's float16 step was NaN, LAMB's -inf, and under
    skip_with="cond" the two branches' dtypes differed (a TypeError)."""
    params = {"h": jnp.full((1024,), 10.0, dtype)}  # sum of squares: inf in float16
    grads = {"h": jnp.full((1024,), 1e-4, jnp.float32)}  # squared: 0 in float16
    tx = jaxamp.loss_scaled(make(), NoOpLossScale(), master_weights="none", skip_with=skip_with)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(
        jax.tree.map(lambda g: g.astype(dtype), grads), state, params
    )
    landed = optax.apply_updates(params, updates)["h"]
    inner = make()  # float32 optax on the same (16-bit) params and gradients, rounded
    p32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    g32 = jax.tree.map(lambda g: g.astype(dtype).astype(jnp.float32), grads)
    want, _ = jax.jit(inner.update)(g32, jax.jit(inner.init)(p32), p32)
    np.testing.assert_array_equal(landed, (p32["h"] + want["h"]).astype(dtype))


def test_a_gradient_function_inside_the_optimizer_is_refused():
    """SAM's opaque mode calls grad_fn inside the optimizer: its gradients were used
    unscaled (params to -13368 where optax gives 0.796) and never checked."""
    tx = jaxamp.loss_scaled(
        optax.contrib.sam(optax.sgd(0.1), optax.sgd(0.01), sync_period=2, opaque_mode=True)
    )
    params = jnp.ones(2)
    state = tx.init(params)
    grad_fn = lambda p, i: jax.grad(lambda p: jnp.sum(p**2))(p)
    with pytest.raises(ValueError, match=r"grad_fn=.*opaque_mode=False"):
        tx.update(jnp.ones(2), state, params, grad_fn=grad_fn)


def test_float64_params_keep_float64_updates_and_range():
    """float64 gradients were unscaled in float32: the update lost its low bits, and a
    finite gradient of 1e300 counted as an overflow (skipped forever)."""
    with jax.enable_x64(True):
        params = {"w": jnp.array([1 + 1e-12])}
        tx = jaxamp.loss_scaled(optax.sgd(1.0), NoOpLossScale())
        state = tx.init(params)
        updates, state = jax.jit(tx.update)({"w": jnp.array([1 + 1e-12])}, state, params)
        assert updates["w"].dtype == jnp.float64
        assert float(updates["w"][0]) == -(1 + 1e-12)
        _, state = jax.jit(tx.update)({"w": jnp.array([1e300])}, state, params)
        assert bool(state.last_finite)


def test_settings_of_the_wrong_kind_are_refused():
    with pytest.raises(TypeError, match=r"instance of .* DynamicLossScale\(\)"):
        jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale)  # the class
    with pytest.raises(TypeError, match="record_nonfinite must be True or False, got 'no'"):
        jaxamp.loss_scaled(optax.sgd(0.1), record_nonfinite="no")
    with pytest.raises(ValueError, match="history_length must be an integer >= 1, got True"):
        jaxamp.loss_scaled(optax.sgd(0.1), history_length=True)
    with pytest.raises(TypeError, match="seed must be an integer"):
        jaxamp.loss_scaled(optax.sgd(0.1), master_weights="stochastic", seed=0.5)
    tx = jaxamp.loss_scaled(optax.sgd(0.1), history_length=np.int64(8))
    assert tx.init(jnp.ones(2)).scale_history.shape == (8,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_state_leaf_is_empty(dtype):
    """Orbax cannot save an array with no elements: the record of the 16-bit leaves init
    saw was one, for float32 params, and the sharded checkpoint example failed."""
    state = jaxamp.loss_scaled(optax.adam(1e-3)).init(params_of(dtype))
    assert all(np.size(x) > 0 for x in jax.tree.leaves(state))
