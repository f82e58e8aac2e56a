"""Tests for jaxamp/_src/checkpoint/state.py: params and optimizer state moved between recipes.

References: the weight each saved state stands for, computed here in float64 numpy (the
master, or the 16-bit param plus its Kahan compensation, or the param); float32 optax,
which a float32 master follows bit for bit; Orbax's own save and restore."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp.checkpoint import LossyConversionError, convert_state
from tests.helpers.promotion import OPTAX

MASTERS = ("float32", "kahan", "stochastic", "none")
DTYPES = [jnp.bfloat16, jnp.float16]


def _params(dtype=jnp.float32):
    w = jax.random.normal(jax.random.key(0), (6, 5))
    return {"w": w.astype(dtype), "b": jnp.linspace(-1.0, 1.0, 5).astype(dtype)}


def _grads(params, i):
    return jax.tree.map(lambda x: jnp.full(x.shape, 0.01 * (i + 1), jnp.float32), params)


def _recipe(dtype, master):
    """A loss_scaled Adam over params of ``dtype`` (float32: plain params, no master)."""
    return jaxamp.loss_scaled(optax.adam(1e-2), master_weights=master)


def _trained(dtype, master, steps=3):
    tx = _recipe(dtype, master)
    params = _params(dtype)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(steps):
        updates, state = step(_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _weight(params, state):
    """What the saved state stands for, per leaf, in float64 (the reference)."""
    p = jax.tree.map(lambda x: np.asarray(x.astype(jnp.float32), np.float64), params)
    if state.master_params is not None:
        return jax.tree.map(lambda m: np.asarray(m, np.float64), state.master_params)
    if state.compensation is not None:
        c = jax.tree.map(
            lambda x: np.asarray(x.astype(jnp.float32), np.float64), state.compensation
        )
        return jax.tree.map(np.add, p, c)
    return p


def _like(params, dtype):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype), params)


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(
        np.asarray(x).dtype == np.asarray(y).dtype
        and np.asarray(x).tobytes() == np.asarray(y).tobytes()
        for x, y in zip(la, lb, strict=True)
    )


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("master", MASTERS)
def test_the_same_recipe_is_the_identity_bit_for_bit(dtype, master):
    params, state = _trained(dtype, master)
    out = convert_state(params, state, _like(params, dtype), _recipe(dtype, master))
    assert out.report.rows == () and out.report.lossless
    assert _leaves_equal(out.params, params) and _leaves_equal(out.opt_state, state)
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(state)


@pytest.mark.parametrize("name", list(jaxamp.optim.OPTIMIZER_RECIPES))
@pytest.mark.standard_promotion(OPTAX)
def test_each_named_recipe_converts_to_itself_bit_for_bit(name):
    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-2))
    params = _params(policy.param_dtype)
    state = tx.init(params)
    step = jax.jit(tx.update)
    for i in range(2):
        updates, state = step(_grads(params, i), state, params)
        params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
    out = convert_state(params, state, _like(params, policy.param_dtype), tx)
    assert out.report.rows == ()
    assert _leaves_equal(out.params, params) and _leaves_equal(out.opt_state, state)


def _fits(w, saved_param, dtype, saved, target):
    """Whether the target recipe can hold the float64 weight ``w`` exactly: whole in a
    float32 master; as a 16-bit param and the 16-bit rest (Kahan: the saved param kept
    where it was Kahan's already, else ``w`` rounded to nearest); as a 16-bit param."""
    low = np.dtype(dtype)
    fits = lambda x, d: np.array_equal(x.astype(d).astype(np.float64), x)
    if target == "float32":
        return fits(w, np.float32)
    if target == "kahan":
        p = np.asarray(saved_param) if saved == "kahan" else w.astype(np.float32).astype(low)
        return fits(w - p.astype(np.float64), low)
    return fits(w, low)


def _holds(params, state):
    """The weight the converted state holds, in float64."""
    return _weight(params, state)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("saved", "target"), list(itertools.product(MASTERS, MASTERS)))
def test_every_pair_keeps_the_weight_or_is_refused_naming_the_error(dtype, saved, target):
    """Lossless exactly where the target can hold the saved weight (the reference: the
    weight computed here in float64); refused otherwise, and with allow_lossy the error
    the report names is the difference from that weight, at most half a 16-bit ulp."""
    params, state = _trained(dtype, saved)
    want = _weight(params, state)
    tx = _recipe(dtype, target)
    try:
        out = convert_state(params, state, _like(params, dtype), tx)
        lossless = True
    except LossyConversionError as e:
        lossless = False
        out = convert_state(params, state, _like(params, dtype), tx, allow_lossy=True)
        assert e.report.lossy() == out.report.lossy()
    got = _holds(out.params, out.opt_state)
    for (path, w), g in zip(
        jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got), strict=True
    ):
        error = float(np.max(np.abs(w - g)))
        row = [r for r in out.report.rows if r.path == f"params{jax.tree_util.keystr(path)}"]
        assert error == (row[0].max_abs_error if row else 0.0), (path, row)
        if not lossless:
            ulp = np.abs(np.spacing(w.astype(np.dtype(dtype))).astype(np.float64))
            assert np.all(np.abs(w - g) <= ulp / 2 + 1e-30)
    # lossless exactly where the target can hold the weight (derived here in numpy)
    assert lossless == all(
        _fits(w, params_leaf, dtype, saved, target)
        for w, params_leaf in zip(jax.tree.leaves(want), jax.tree.leaves(params), strict=True)
    )
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(tx.init(out.params))


@pytest.mark.standard_promotion(OPTAX)
def test_a_float32_run_continued_with_a_float32_master_follows_float32_optax():
    """Convert float32 params and Adam state to bfloat16 params with a float32 master
    mid-run: the conversion is exact, and the master goes on as float32 optax alone does
    (the reference), to float32 rounding (the two programs fuse Adam's arithmetic apart)."""
    ref_tx = optax.adam(1e-2)
    params = _params()
    state = ref_tx.init(params)
    ref_step = jax.jit(ref_tx.update)
    for i in range(3):
        updates, state = ref_step(_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
    tx = jaxamp.loss_scaled(optax.adam(1e-2), loss_scale=jaxamp.NoOpLossScale())
    out = convert_state(params, state, _like(params, jnp.bfloat16), tx)
    assert out.report.lossless and {r.action for r in out.report.rows} == {"cast", "created"}
    low, low_state = out.params, out.opt_state
    assert _leaves_equal(low_state.master_params, params)
    assert _leaves_equal(low_state.inner_state, state)
    step = jax.jit(tx.update)
    for i in range(3, 6):
        updates, state = ref_step(_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
        updates, low_state = step(_grads(low, i), low_state, low)
        low = optax.apply_updates(low, updates)
    for m, p in zip(jax.tree.leaves(low_state.master_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(m, p, rtol=1e-6, atol=1e-7)
    assert _leaves_equal(
        low, jax.tree.map(lambda m: m.astype(jnp.bfloat16), low_state.master_params)
    )


@pytest.mark.standard_promotion(OPTAX)
def test_statistics_rounded_to_16_bits_are_refused_and_measured():
    params, state = _trained(jnp.bfloat16, "float32")
    tx = jaxamp.loss_scaled(jaxamp.with_state_dtype(optax.adam(1e-2), jnp.bfloat16))
    with pytest.raises(LossyConversionError, match="allow_lossy=True") as e:
        convert_state(params, state, _like(params, jnp.bfloat16), tx)
    rows = {r.path: r for r in e.value.report.lossy()}
    mu = state.inner_state[0].mu["w"]
    path = "opt_state.inner_state.inner_state[0].mu['w']"
    want = np.max(
        np.abs(
            np.asarray(mu, np.float64)
            - np.asarray(mu.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
        )
    )
    assert rows[path].max_abs_error == want > 0
    out = convert_state(params, state, _like(params, jnp.bfloat16), tx, allow_lossy=True)
    assert out.opt_state.inner_state.inner_state[0].mu["w"].dtype == jnp.bfloat16
    # the count of updates the saved state applied is what the new rounding key folds in
    assert int(out.opt_state.inner_state.count) == 3


@pytest.mark.standard_promotion(OPTAX)
def test_the_loss_scale_is_kept_clipped_or_started_fresh():
    params, state = _trained(jnp.float16, "float32")
    like = _like(params, jnp.float16)
    saved = float(state.loss_scale.scale)
    kept = convert_state(params, state, like, _recipe(jnp.float16, "float32"))
    assert float(kept.opt_state.loss_scale.scale) == saved
    small = jaxamp.loss_scaled(
        optax.adam(1e-2), jaxamp.DynamicLossScale(init_scale=512.0, max_scale=1024.0)
    )
    clipped = convert_state(params, state, like, small)
    assert float(clipped.opt_state.loss_scale.scale) == 1024.0
    assert any("clipped to 1024" in r.detail for r in clipped.report.rows)
    for tx, choice in [
        (jaxamp.loss_scaled(optax.adam(1e-2), jaxamp.NoOpLossScale()), "saved"),
        (_recipe(jnp.float16, "float32"), "fresh"),
    ]:
        fresh = convert_state(params, state, like, tx, loss_scale=choice)
        assert _leaves_equal(fresh.opt_state.loss_scale, tx.init(params).loss_scale)
    with pytest.raises(ValueError, match="'saved', 'fresh'"):
        convert_state(params, state, like, small, loss_scale="keep")


@pytest.mark.standard_promotion(OPTAX)
def test_another_inner_optimizer_or_other_params_are_refused_by_name():
    params, state = _trained(jnp.bfloat16, "float32")
    with pytest.raises(ValueError, match="not one optax optimizer into another"):
        convert_state(
            params, state, _like(params, jnp.bfloat16), jaxamp.loss_scaled(optax.sgd(0.1))
        )
    other = {"w": params["w"]}
    with pytest.raises(ValueError, match=r"only saved \[\"\['b'\]\"\]"):
        convert_state(params, state, _like(other, jnp.bfloat16), _recipe(jnp.bfloat16, "float32"))


@pytest.mark.standard_promotion(OPTAX)
def test_a_converted_state_restored_through_orbax_steps_under_jit(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, state = _trained(jnp.bfloat16, "kahan")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    template = {"params": params, "opt_state": state}
    like = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", like)
    tx = _recipe(jnp.float32, "float32")
    out = convert_state(restored["params"], restored["opt_state"], _like(params, jnp.float32), tx)
    assert out.report.lossless
    np.testing.assert_array_equal(
        np.asarray(out.params["w"], np.float64), _weight(params, state)["w"].astype(np.float32)
    )
    fresh = tx.init(out.params)
    assert jax.tree.structure(out.opt_state) == jax.tree.structure(fresh)
    assert [x.dtype for x in jax.tree.leaves(out.opt_state)] == [
        x.dtype for x in jax.tree.leaves(fresh)
    ]
    updates, _ = jax.jit(tx.update)(_grads(params, 0), out.opt_state, out.params)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_the_guides_examples_run():
    """docs/guides/checkpoints.md's three moves, as written (under strict promotion)."""
    import doctest
    import pathlib

    guide = pathlib.Path(__file__).parents[2] / "docs" / "guides" / "checkpoints.md"
    result = doctest.testfile(str(guide), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15 and result.failed == 0


@pytest.mark.standard_promotion(OPTAX)
def test_an_nnx_optimizer_moves_to_a_float32_master_and_trains_as_float32():
    """nnx.Optimizer's state (its leaves wrapped in Variables) converted, written back
    into the target's optimizer, and stepped: the master follows the float32 optimizer
    going on alone on the same gradients (the reference), to float32 rounding."""
    from flax import nnx

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    loss = lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2)
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    train_step = nnx.jit(lambda opt, model: opt.update(model, nnx.grad(loss)(model)))
    for _ in range(2):
        train_step(opt, model)
    _, tx = jaxamp.optimizer_recipe("bf16_float32_master", optax.adam(1e-2))
    low = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    low_opt = nnx.Optimizer(low, tx, wrt=nnx.Param)
    out = convert_state(nnx.state(model, nnx.Param), opt.opt_state, nnx.state(low, nnx.Param), tx)
    assert out.report.lossless
    nnx.update(low, out.params)
    is_var = lambda v: hasattr(v, "set_value")
    jax.tree.map(lambda v, new: v.set_value(new), low_opt.opt_state, out.opt_state, is_leaf=is_var)
    assert low.kernel.get_value().dtype == jnp.bfloat16
    update = nnx.jit(lambda opt, model, grads: opt.update(model, grads))
    for i in range(3):  # the same gradients for both: float32 Adam's reference steps
        grads = jax.tree.map(lambda p, i=i: jnp.full(p.shape, 0.01 * (i + 1)), nnx.state(model))
        update(opt, model, grads)
        scale = jaxamp.optim.get_loss_scale(low_opt.opt_state)
        update(low_opt, low, jax.tree.map(lambda g, s=scale: g * s, grads))
    master = low_opt.opt_state.master_params
    np.testing.assert_allclose(
        master["kernel"].get_value(), model.kernel.get_value(), rtol=1e-5, atol=1e-6
    )


def _sgd(name):
    return jaxamp.optimizer_recipe(name, optax.sgd(1.0), loss_scale=jaxamp.NoOpLossScale())[1]


@pytest.mark.standard_promotion(OPTAX)
def test_a_kahan_weight_halfway_between_bfloat16_values_moves_to_a_master_unchanged():
    """A Kahan step leaves p = 1 + 2**-7 and c = -2**-8: the weight 1 + 2**-8 lies halfway
    between two bfloat16 values, and the master's param must be the master rounded to
    nearest (1.0, even), else the next step takes the param for a change made outside
    update. Reference: the weight by hand, and the Kahan state stepped unconverted."""
    kahan = _sgd("bf16_kahan")
    p = {"w": jnp.array([1.0], jnp.bfloat16)}
    state = kahan.init(p)
    updates, state = jax.jit(kahan.update)({"w": jnp.array([-(2.0**-8 + 2.0**-20)])}, state, p)
    p = optax.apply_updates(p, updates)
    assert float(p["w"][0]) + float(state.compensation["w"][0]) == 1 + 2.0**-8
    master = _sgd("bf16_float32_master")
    out = convert_state(p, state, _like(p, jnp.bfloat16), master)
    assert out.report.lossless
    zero = {"w": jnp.zeros((1,))}
    _, after = jax.jit(master.update)(zero, out.opt_state, out.params)
    assert float(after.master_params["w"][0]) == 1 + 2.0**-8


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("master", MASTERS)
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan])
def test_the_identity_keeps_non_finite_params_and_their_companions_bit_for_bit(master, value):
    params, state = _trained(jnp.bfloat16, master)
    params = {**params, "b": params["b"].at[1].set(value)}
    out = convert_state(params, state, _like(params, jnp.bfloat16), _recipe(jnp.bfloat16, master))
    assert out.report.rows == ()
    assert _leaves_equal(out.params, params) and _leaves_equal(out.opt_state, state)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("master", MASTERS)
def test_a_nan_payload_survives_a_change_of_recipe_that_keeps_the_param(master):
    """bfloat16 NaNs with payloads (0x7FC1, 0x7FA0) stay those bits where the param is
    kept (here: a master recipe to any other, whose weight for them is the param's NaN)."""
    params, state = _trained(jnp.bfloat16, "none")
    bits = np.array([0x7FC1, 0x7FA0, 0x3F80, 0x0000, 0x7FC0], np.uint16)
    params = {**params, "b": jnp.asarray(bits.view(jnp.bfloat16))}
    out = convert_state(params, state, _like(params, jnp.bfloat16), _recipe(jnp.bfloat16, master))
    assert np.asarray(out.params["b"]).view(np.uint16).tolist() == bits.tolist()
    assert out.report.lossless


@pytest.mark.standard_promotion(OPTAX)
def test_params_and_masters_keep_the_targets_sharding():
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    params = _params()
    state = optax.adam(1e-2).init(params)
    like = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sharding), params
    )
    out = convert_state(params, state, like, _recipe(jnp.bfloat16, "float32"))
    for leaf in jax.tree.leaves((out.params, out.opt_state.master_params)):
        assert leaf.sharding == sharding


@pytest.mark.standard_promotion(OPTAX)
def test_a_state_restored_without_a_template_is_refused_with_the_way_round(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    params, state = _trained(jnp.bfloat16, "float32")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    with ocp.StandardCheckpointer() as ckpt:
        plain = ckpt.restore(tmp_path / "ckpt")
    tx = _recipe(jnp.bfloat16, "kahan")
    with pytest.raises(ValueError, match=r"without a template.*saved_tx\.init"):
        convert_state(plain["params"], plain["opt_state"], _like(params, jnp.bfloat16), tx)
    adam = optax.adam(1e-2)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "plain", {"opt_state": adam.init(params)})
        bare = ckpt.restore(tmp_path / "plain")["opt_state"]
    with pytest.raises(ValueError, match="without a template"):
        convert_state(params, bare, _like(params, jnp.bfloat16), adam)


@pytest.mark.standard_promotion(OPTAX)
def test_a_master_above_float16s_range_is_refused_where_its_param_would_be_inf():
    """A bfloat16 weight of 1e5 with a float32 master, moved to float16 params: the master
    holds it, but its float16 param is inf (float16's max is 65504), and the next step
    makes it NaN. Reference: float16's range, by hand."""
    adam = optax.adam(1e-3)
    _, tx = jaxamp.optimizer_recipe("bf16_float32_master", adam)
    params = {"w": jnp.asarray([1e5, 1.0], jnp.bfloat16)}
    target = jaxamp.loss_scaled(adam, master_weights="float32")
    with pytest.raises(LossyConversionError, match=r"params\['w'\]") as e:
        convert_state(params, tx.init(params), _like(params, jnp.float16), target)
    assert e.value.report.worst().max_abs_error == np.inf


@pytest.mark.standard_promotion(OPTAX)
def test_a_scale_that_never_moved_starts_fresh_under_a_dynamic_target():
    """A no-op (or static) scale's 1.0 is not dynamic scaling's state: under a dynamic
    target it starts at the target's initial scale (kept only when asked)."""
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    saved = jaxamp.loss_scaled(optax.adam(1e-3), jaxamp.NoOpLossScale())
    state = saved.init(params)
    for i in range(2):
        _, state = saved.update(_grads(params, i), state, params)
    target = jaxamp.loss_scaled(optax.adam(1e-3))
    like = _like(params, jnp.float16)
    out = convert_state(params, state, like, target)
    assert float(out.opt_state.loss_scale.scale) == 2.0**16
    assert any("never moved" in r.detail for r in out.report.rows)
    kept = convert_state(params, state, like, target, loss_scale="saved")
    assert float(kept.opt_state.loss_scale.scale) == 1.0


@pytest.mark.standard_promotion(OPTAX)
def test_with_state_dtypes_count_is_the_inner_optimizers_without_loss_scaled():
    params = _params()
    adam = optax.adam(1e-3)
    state = adam.init(params)
    for i in range(5):
        _, state = adam.update(_grads(params, i), state, params)
    _, tx = jaxamp.optimizer_recipe("bf16_stochastic", adam)
    out = convert_state(params, state, _like(params, jnp.bfloat16), tx, allow_lossy=True)
    assert int(out.opt_state.inner_state.count) == 5 == int(state[0].count)


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices")
def test_a_restore_onto_another_mesh_equals_the_unsharded_restore(tmp_path):
    """bfloat16 params with Kahan compensation, saved by Orbax unsharded, restored onto a
    2x2 mesh and moved to a float32 master there: the same bits as the unsharded restore
    and move, each param and master on the target's sharding, and the next step the same."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    ocp = pytest.importorskip("orbax.checkpoint")
    params, state = _trained(jnp.bfloat16, "kahan")
    saved = {"params": params, "opt_state": state}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", saved)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))

    def sharding(x):
        rows = np.ndim(x) and np.shape(x)[0] % 2 == 0
        return NamedSharding(mesh, PartitionSpec("a") if rows else PartitionSpec())

    def restore(place):
        like = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place(x)), saved
        )
        with ocp.StandardCheckpointer() as ckpt:
            return ckpt.restore(tmp_path / "ckpt", like)

    tx = _recipe(jnp.bfloat16, "float32")
    one = jax.devices()[0]
    alone = restore(lambda _: jax.sharding.SingleDeviceSharding(one))
    plain = convert_state(alone["params"], alone["opt_state"], _like(params, jnp.bfloat16), tx)
    spread = restore(sharding)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sharding(x)), params
    )
    out = convert_state(spread["params"], spread["opt_state"], target, tx)
    assert out.report.rows == plain.report.rows and out.report.lossless
    assert _leaves_equal(out.params, plain.params)
    assert _leaves_equal(out.opt_state, plain.opt_state)
    for tree in (out.params, out.opt_state.master_params):
        for leaf, like in zip(jax.tree.leaves(tree), jax.tree.leaves(target), strict=True):
            assert leaf.sharding == like.sharding
    step = jax.jit(tx.update)
    grads = _grads(params, 5)
    sharded_grads = jax.tree.map(lambda g: jax.device_put(g, sharding(g)), grads)
    assert _leaves_equal(
        step(sharded_grads, out.opt_state, out.params), step(grads, plain.opt_state, plain.params)
    )


@pytest.mark.standard_promotion(OPTAX)
def test_a_fine_tune_from_a_converted_checkpoint_trains_as_one_from_the_original():
    """An MLP pretrained on scikit-learn's digits in float32, then fine-tuned with bfloat16
    params and a float32 master from the converted checkpoint: its losses, step by step on
    the same batches, follow the float32 run continued from the original checkpoint (the
    reference), far closer than the same fine-tune moved by hand (params cast, a fresh
    optimizer state), whose Adam restarts."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = jnp.asarray(x / 16.0, jnp.float32), jnp.asarray(y)
    keys = jax.random.split(jax.random.key(0), 2)
    params = {
        "w1": jax.random.normal(keys[0], (64, 64)) / 8,
        "b1": jnp.zeros((64,)),
        "w2": jax.random.normal(keys[1], (64, 10)) / 8,
        "b2": jnp.zeros((10,)),
    }

    def loss(params, xb, yb):
        p = jax.tree.map(lambda v: v.astype(jnp.float32), params)
        logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def train(tx, params, state, first, steps):
        @jax.jit
        def step(params, state, xb, yb):
            value, grads = jax.value_and_grad(loss)(params, xb, yb)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value

        losses = []
        for i in range(first, first + steps):
            rows = (np.arange(64) + 64 * i) % x.shape[0]
            params, state, value = step(params, state, x[rows], y[rows])
            losses.append(float(value))
        return params, state, np.array(losses)

    adam = optax.adam(3e-3)
    params, state, _ = train(adam, params, adam.init(params), 0, 40)  # the checkpoint
    _, _, reference = train(adam, params, state, 40, 40)
    tx = jaxamp.loss_scaled(optax.adam(3e-3), loss_scale=jaxamp.NoOpLossScale())
    out = convert_state(params, state, _like(params, jnp.bfloat16), tx)
    _, _, converted = train(tx, out.params, out.opt_state, 40, 40)
    low = jax.tree.map(lambda v: v.astype(jnp.bfloat16), params)
    _, _, by_hand = train(tx, low, tx.init(low), 40, 40)
    off, off_by_hand = np.abs(converted - reference), np.abs(by_hand - reference)
    assert off.mean() < off_by_hand.mean() / 3, (off.mean(), off_by_hand.mean())
    assert off.max() < 0.02 * reference.max(), (off.max(), reference.max())
