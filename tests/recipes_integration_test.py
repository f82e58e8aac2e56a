"""Integration tests of the named optimizer recipes (``jaxamp.optimizer_recipe``).

tests/master_weights_test.py tests the recipes on raw pytrees; this file tests
them where users meet them, every step under ``jax.jit`` or ``nnx.jit``:

* Flax Linen with ``flax.training.train_state.TrainState``, per recipe: an
  unmodified MLP under the recipe's policy trains (the loss goes down), the
  params keep the policy's dtype, the optimizer state keeps its structure and
  dtypes (one trace), and a step with an infinite gradient element leaves the
  params and every optimizer-state leaf but the loss-scale counters bit for
  bit as they were.
* Flax NNX with ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, per recipe: the
  same checks through ``nnx.jit`` and ``jaxamp.scale_loss(loss, optimizer)``.
* FSDP over 8 (fake CPU) devices for ``bf16_kahan`` and ``bf16_stochastic``:
  params and optimizer state placed as examples/distributed_train.py places them (FSDP); the Kahan
  compensation and the Adam moments come out of the jitted step sharded like
  their params, the rounding keys replicated, and on the same gradients the sharded
  steps' params and state are bit-identical to the same steps on one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, PartitionSpec

import jaxamp
from examples import distributed_train
from jaxamp._src.optim.loss_scaled import LossScaledState
from jaxamp._src.optim.state_dtype import StateDtypeState
from tests.helpers.promotion import OPTAX
from tests.helpers.train_steps import apply_step

RECIPES = list(jaxamp.optim.OPTIMIZER_RECIPES)
# The fields of LossScaledState that a skipped step must leave exactly as they were
# (the loss scale and the step and skip counters move; see _check_skip).
KEPT = ("inner_state", "master_params", "compensation", "rounding_key")
STEPS = 12

X = jax.random.normal(jax.random.key(0), (64, 8), jnp.float32)
Y = jnp.sin(X[:, :1] * 1.5) + 0.5 * X[:, 1:2] * X[:, 2:3]


def _param_dtype(name):
    return np.dtype(jnp.float32 if name == "float32_params" else jnp.bfloat16)


def _bits(x):
    """The raw bits of an array (so -0.0 != 0.0 and NaN payloads count)."""
    x = np.asarray(jax.device_get(x))
    return x.view(f"u{x.dtype.itemsize}") if jnp.issubdtype(x.dtype, jnp.floating) else x


def _assert_bits_equal(a, b, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=f"{what}, leaf {i}")


def _moved(a, b):
    """Whether some leaf of ``a`` differs from its counterpart in ``b``."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return any(not np.array_equal(_bits(x), _bits(y)) for x, y in pairs)


def _spec(tree):
    return jax.tree.map(lambda x: (x.shape, np.dtype(x.dtype)), tree)


def _poison(grads, poison):
    """``grads`` with its first element of its first leaf set to inf where ``poison``."""
    leaves, treedef = jax.tree.flatten(grads)
    g = leaves[0]
    idx = (0,) * g.ndim
    leaves[0] = g.at[idx].set(jnp.where(poison, jnp.asarray(jnp.inf, g.dtype), g[idx]))
    return jax.tree.unflatten(treedef, leaves)


def _check_recipe_state(name, ls):
    """The LossScaledState of recipe ``name`` holds what that recipe keeps, in its dtypes."""
    assert isinstance(ls, LossScaledState)
    has = {
        "master_params": ls.master_params is not None,
        "compensation": ls.compensation is not None,
        "rounding_key": ls.rounding_key is not None,
    }
    assert has == {
        "master_params": name == "bf16_float32_master",
        "compensation": name == "bf16_kahan",
        "rounding_key": name == "bf16_stochastic",
    }
    if name == "bf16_float32_master":
        assert {x.dtype for x in jax.tree.leaves(ls.master_params)} == {np.dtype("float32")}
    if name == "bf16_kahan":
        assert {x.dtype for x in jax.tree.leaves(ls.compensation)} == {np.dtype("bfloat16")}
    if name == "bf16_stochastic":
        assert ls.rounding_key.dtype == jnp.uint32
        assert isinstance(ls.inner_state, StateDtypeState)
        moments = [x for x in jax.tree.leaves(ls.inner_state.inner_state) if x.ndim > 0]
        assert moments and {x.dtype for x in moments} == {np.dtype("bfloat16")}
    else:
        moments = [
            x
            for x in jax.tree.leaves(ls.inner_state)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0
        ]
        assert moments and {x.dtype for x in moments} == {np.dtype("float32")}


def _check_skip(before, after):
    """``after`` is ``before`` after one skipped step: the kept fields bit for bit, the
    counters moved."""
    for field in KEPT:
        _assert_bits_equal(getattr(after, field), getattr(before, field), field)
    assert not bool(after.last_finite)
    assert float(after.loss_scale.scale) == float(before.loss_scale.scale) / 2
    assert int(after.skipped_steps) == int(before.skipped_steps) + 1
    assert int(after.consecutive_skips) == int(before.consecutive_skips) + 1
    assert int(after.step) == int(before.step) + 1


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.relu(nn.Dense(32)(x)))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("name", RECIPES)
def test_linen_train_state(name):
    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-2))
    assert policy.param_dtype == _param_dtype(name)
    model = jaxamp.linen.apply_policy(MLP(), policy)
    params = model.init(jax.random.key(1), X)["params"]
    assert {p.dtype for p in jax.tree.leaves(params)} == {_param_dtype(name)}
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    _check_recipe_state(name, state.opt_state)
    opt_spec = _spec(state.opt_state)
    opt_treedef = jax.tree.structure(state.opt_state)
    traces = []

    @jax.jit
    def train_step(state, x, y, poison):
        traces.append(1)

        def loss_fn(params):
            pred = state.apply_fn({"params": params}, x)
            return jnp.mean((pred.astype(jnp.float32) - y) ** 2)

        loss, grads = jaxamp.value_and_grad(loss_fn)(state.params, opt_state=state.opt_state)
        return state.apply_gradients(grads=_poison(grads, poison)), loss

    losses = []
    for _ in range(STEPS):
        state, loss = train_step(state, X, Y, False)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(traces) == 1  # the state kept its structure and dtypes: no retrace
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {_param_dtype(name)}
    assert jax.tree.structure(state.opt_state) == opt_treedef
    assert _spec(state.opt_state) == opt_spec
    assert int(state.opt_state.skipped_steps) == 0

    # The same state, one clean step and one with an infinite gradient element.
    clean, _ = train_step(state, X, Y, False)
    skipped, _ = train_step(state, X, Y, True)
    assert len(traces) == 1
    # A clean step from this state moves the params and Adam's moments, so the skip
    # below is not vacuous.
    assert _moved(clean.params, state.params)
    assert _moved(clean.opt_state.inner_state, state.opt_state.inner_state)
    _assert_bits_equal(skipped.params, state.params, "params")
    _check_skip(state.opt_state, skipped.opt_state)
    assert int(skipped.step) == int(state.step) + 1  # TrainState's own counter moves
    # training goes on from the skipped step, at half the scale
    after, loss = train_step(skipped, X, Y, False)
    assert bool(after.opt_state.last_finite) and int(after.opt_state.consecutive_skips) == 0
    assert float(loss) < losses[0]


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.relu(self.up(x)))


def _nnx_params(model):
    return jax.device_get(jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("name", RECIPES)
def test_nnx_optimizer(name):
    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-2))
    assert policy.param_dtype == _param_dtype(name)
    model = jaxamp.nnx.apply_policy(NNXMLP(nnx.Rngs(1)), policy)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {_param_dtype(name)}
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    _check_recipe_state(name, jaxamp.optim.find_loss_scaled_state(optimizer))
    opt_spec = _spec(nnx.state(optimizer))
    traces = []

    @nnx.jit
    def train_step(model, optimizer, x, y, poison):
        traces.append(1)

        def loss_fn(model):
            loss = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
            return jaxamp.scale_loss(loss, optimizer), loss

        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, _poison(grads, poison))
        return loss

    losses = [float(train_step(model, optimizer, X, Y, False)) for _ in range(STEPS)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert len(traces) == 1
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {_param_dtype(name)}
    assert _spec(nnx.state(optimizer)) == opt_spec
    assert int(jaxamp.optim.find_loss_scaled_state(optimizer).skipped_steps) == 0

    params_before = _nnx_params(model)
    state_before = jax.device_get(jaxamp.optim.find_loss_scaled_state(optimizer))
    train_step(model, optimizer, X, Y, True)
    assert len(traces) == 1
    _assert_bits_equal(_nnx_params(model), params_before, "params")
    _check_skip(state_before, jax.device_get(jaxamp.optim.find_loss_scaled_state(optimizer)))
    # the next clean step trains on: it moves the params and Adam's moments
    loss = float(train_step(model, optimizer, X, Y, False))
    assert loss < losses[0]
    assert _moved(_nnx_params(model), params_before)
    state_after = jax.device_get(jaxamp.optim.find_loss_scaled_state(optimizer))
    assert _moved(state_after.inner_state, state_before.inner_state)


def _ordinal(x):
    """Each float's position on the number line of its dtype (adjacent values differ by 1)."""
    bits = _bits(x).astype(np.int64)
    sign = np.int64(1) << (8 * np.asarray(x).dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & ~sign), bits)


def _fsdp_setup(name, seed=0):
    """A Dense(512) on 256 features under recipe ``name``: model, optimizer, params, state."""
    policy, tx = jaxamp.optimizer_recipe(name, optax.adam(1e-3), seed=seed)
    model = jaxamp.linen.apply_policy(nn.Dense(512), policy)
    params = model.init(jax.random.key(5), jnp.zeros((1, 256)))["params"]
    return model, tx, params, tx.init(params)


def _fsdp_gradients(name, steps=4):
    """The (loss-scaled) gradients of ``steps`` one-device training steps under ``name``.

    Both runs of the FSDP test apply these same gradients. A gradient computed on a
    sharded batch sums its examples in another order than on one device, which XLA
    does not promise to round alike: on a Xeon with AMX, one element of the 256x512
    bfloat16 kernel gradient came out one bfloat16 ulp apart.
    """
    model, tx, params, state = _fsdp_setup(name)
    x = jax.random.normal(jax.random.key(3), (16, 256))
    y = jax.random.normal(jax.random.key(4), (16, 512))

    @jax.jit
    def step(params, state):
        loss = lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        _, grads = jaxamp.value_and_grad(loss)(params, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grads

    gradients = []
    for _ in range(steps):
        params, state, grads = step(params, state)
        gradients.append(grads)
    return gradients


def _fsdp_run(name, gradients, *, sharded, seed=0):
    """The jitted optimizer steps of recipe ``name`` on ``gradients``, FSDP-sharded over
    every device as examples/distributed_train.py shards them, or on one device."""
    _, tx, params, state = _fsdp_setup(name, seed)
    if sharded:
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        params = jax.device_put(params, distributed_train.fsdp_shardings(params, mesh))
        state = jax.device_put(state, distributed_train.fsdp_shardings(state, mesh))
        shardings = distributed_train.fsdp_shardings(params, mesh)
        gradients = [jax.device_put(g, shardings) for g in gradients]

    step = apply_step(tx)
    for grads in gradients:
        params, state = step(params, state, grads)
    return params, state


def _adam_state(name, state):
    return (state.inner_state.inner_state if name == "bf16_stochastic" else state.inner_state)[0]


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("name", ["bf16_kahan", "bf16_stochastic"])
def test_fsdp_matches_one_device(name):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    gradients = _fsdp_gradients(name)
    params, state = _fsdp_run(name, gradients, sharded=True)
    kernel = params["kernel"]
    assert kernel.dtype == jnp.bfloat16 and kernel.sharding.spec == PartitionSpec(None, "data")
    assert {s.data.shape for s in kernel.addressable_shards} == {(256, 64)}
    assert params["bias"].sharding.is_fully_replicated  # 512 elements: below min_size
    # The state that has the params' shapes comes out of the jitted step sharded like them.
    adam = _adam_state(name, state)
    like_params = [adam.mu, adam.nu] + ([state.compensation] if name == "bf16_kahan" else [])
    for tree in like_params:
        for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(tree), strict=True):
            assert s.shape == p.shape and s.sharding.is_equivalent_to(p.sharding, p.ndim)
    moment_dtype = np.dtype(jnp.bfloat16 if name == "bf16_stochastic" else jnp.float32)
    assert adam.mu["kernel"].dtype == adam.nu["kernel"].dtype == moment_dtype
    if name == "bf16_kahan":
        assert state.compensation["kernel"].dtype == jnp.bfloat16
        assert state.rounding_key is None
    else:
        assert state.compensation is None
        keys = [state.rounding_key, state.inner_state.rounding_key]
        assert all(k.dtype == jnp.uint32 and k.sharding.is_fully_replicated for k in keys)

    ref_params, ref_state = _fsdp_run(name, gradients, sharded=False)
    assert all(len(x.devices()) == 1 for x in jax.tree.leaves((ref_params, ref_state)))
    if name == "bf16_kahan":
        _assert_bits_equal(params, ref_params, "params")
        _assert_bits_equal(state, ref_state, "state")
        return
    # bf16_stochastic: XLA:CPU fuses the sharded and the one-device programs differently
    # and contracts the moment update b1 * mu + (1 - b1) * g into an FMA in one of them,
    # so a float32 moment can differ by one float32 ulp before it is stochastically
    # rounded to bfloat16 (seen: one element of mu, whose noise u fell between the two
    # rounding probabilities). Such an element rounds to the other bfloat16 neighbour;
    # the difference is then at most one bfloat16 ulp, in a handful of elements. The
    # noise itself is the same: a wrong key (another seed) changes most rounded elements.
    other_seed, _ = _fsdp_run(name, gradients, sharded=False, seed=1)
    for what, a, b in [("params", params, ref_params), ("state", state, ref_state)]:
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype
            if not jnp.issubdtype(x.dtype, jnp.floating):
                np.testing.assert_array_equal(x, y, err_msg=what)
                continue
            distance = np.abs(_ordinal(x) - _ordinal(y))
            assert distance.max() <= 1, what  # at most one ulp apart
            assert np.count_nonzero(distance) <= max(2, x.size // 10_000), what
    differs = np.asarray(other_seed["kernel"]) != np.asarray(ref_params["kernel"])
    assert differs.mean() > 0.1
