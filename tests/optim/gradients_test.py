"""Tests for jaxamp/_src/optim/gradients.py: scale_loss, get_loss_scale and value_and_grad."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp import DynamicLossScale
from tests.train_steps import loss_scaled_step

PARAMS = {"w": jnp.array([1.0, 2.0])}


def loss_fn(params):
    return jnp.sum(params["w"] ** 2)


def _train_through_an_overflow(tx, steps=6, k=2):
    """Steps of a loss-scaled float32 sgd with every_k=2 accumulation; the second
    micro-batch overflows. Returns the params and the loss scale after ``steps``."""
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    step = loss_scaled_step(tx, loss_fn)
    for i in range(steps):
        params, state = step(params, state, jnp.asarray(i == 1))
    return params, jaxamp.optim.get_loss_scale(state)


def test_multisteps_inside_loss_scaled_trains_through_an_overflow():
    tx = jaxamp.loss_scaled(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    params, scale = _train_through_an_overflow(tx)
    # the overflowing micro-batch is skipped; the 5 others make two full steps and a half
    expected = jnp.array([1.0, 2.0]) * (1 - 0.1 * 2) ** 2
    np.testing.assert_allclose(params["w"], expected, rtol=1e-6)
    assert float(scale) == 2.0**15


def test_nnx_optimizer():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(
        model, jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(64.0)), wrt=nnx.Param
    )
    assert float(jaxamp.optim.get_loss_scale(optimizer)) == 64.0
    assert float(jaxamp.optim.get_loss_scale(optimizer.opt_state)) == 64.0
    x = jnp.ones((3, 2))

    @nnx.jit
    def step(model, optimizer):
        loss = lambda m: jaxamp.scale_loss(jnp.mean(m(x) ** 2), optimizer)
        grads = nnx.grad(loss)(model)
        optimizer.update(model, grads)

    kernel, bias = model.kernel[...], model.bias[...]
    step(model, optimizer)
    expected = kernel - 0.1 * jax.grad(lambda k: jnp.mean((x @ k + bias) ** 2))(kernel)
    np.testing.assert_allclose(model.kernel[...], expected, rtol=1e-5)
    assert jaxamp.optim.loss_scale_metrics(optimizer)["skipped_steps"] == 0


def test_equinox_filter_grad():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    state = tx.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((3, 2))

    @eqx.filter_grad
    def grads_of(model):
        return jaxamp.scale_loss(jnp.mean(jax.vmap(model)(x) ** 2), state)

    grads = grads_of(model)
    updates, _ = tx.update(grads, state, eqx.filter(model, eqx.is_array))
    plain = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    np.testing.assert_allclose(updates.weight, -0.1 * plain.weight, rtol=1e-5)


def test_scale_loss_upcasts_16_bit_losses():
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(PARAMS)
    scaled = jaxamp.scale_loss(jnp.float16(2.0), state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 2.0 * 65536  # would overflow in f16


@pytest.mark.parametrize("has_aux", [False, True])
def test_value_and_grad(has_aux):
    tx = jaxamp.loss_scaled(optax.sgd(0.1), DynamicLossScale(1024.0))
    state = tx.init(PARAMS)
    fun = (lambda p, k: (loss_fn(p) * k, {"k": k})) if has_aux else (lambda p, k: loss_fn(p) * k)
    value, grads = jax.jit(jaxamp.value_and_grad(fun, has_aux=has_aux))(
        PARAMS, 3.0, opt_state=state
    )
    loss = value[0] if has_aux else value
    assert float(loss) == 15.0  # unscaled
    np.testing.assert_allclose(grads["w"], 1024.0 * 6.0 * PARAMS["w"])  # scaled
    if has_aux:
        assert float(value[1]["k"]) == 3.0
    updates, _ = tx.update(grads, state, PARAMS)
    np.testing.assert_allclose(updates["w"], -0.1 * 6.0 * PARAMS["w"], rtol=1e-6)


def test_readme_linen_train_state():
    """The README's Linen example: three changed lines make a float16 loss-scaled step."""
    import flax.linen as nn
    from flax.training import train_state

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(16)(x)))

    x, y = jax.random.normal(jax.random.key(0), (32, 8)), jnp.arange(32) % 3
    model = jaxamp.linen.apply_policy(MLP(), "mixed_float16")
    params = model.init(jax.random.key(1), x)["params"]
    tx = jaxamp.loss_scaled(optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jaxamp.value_and_grad(loss_fn)(state.params, opt_state=state.opt_state)
        return state.apply_gradients(grads=grads), loss

    losses = []
    for _ in range(30):
        state, loss = train_step(state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert jaxamp.optim.loss_scale_metrics(state.opt_state)["consecutive_skips"] == 0


def test_readme_nnx_optimizer():
    """The README's NNX example."""

    class MLP(nnx.Module):  # with BatchNorm and Dropout: their state is not differentiable
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return self.down(self.dropout(nnx.relu(self.norm(self.up(x)))))

    x, y = jax.random.normal(jax.random.key(0), (32, 8)), jnp.arange(32) % 3
    model = MLP(nnx.Rngs(0))
    jaxamp.nnx.apply_policy(model, "mixed_float16")
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaled(optax.adam(1e-2)), wrt=nnx.Param)

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = jaxamp.value_and_grad(loss_fn, transform=nnx.value_and_grad)(
            model, x, y, opt_state=optimizer
        )
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, x, y)) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0]
    assert model.up.kernel[...].dtype == jnp.float32
    assert not np.allclose(model.norm.mean[...], 0.0)  # BatchNorm's statistics moved
    assert int(model.dropout.rngs.count[...]) == 30


def test_nnx_transform_is_used_on_a_model_with_batch_norm_and_dropout():
    """``transform=nnx.value_and_grad`` differentiates Params only, not RNG or BatchStat state."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 16, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.down = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.down(self.drop(nnx.relu(self.norm(self.up(x)))))

    x, y = jax.random.normal(jax.random.key(0), (32, 8)), jnp.arange(32) % 3
    model = jaxamp.nnx.apply_policy(Net(nnx.Rngs(0)), "mixed_float16")
    optimizer = nnx.Optimizer(model, jaxamp.loss_scaled(optax.adam(1e-2)), wrt=nnx.Param)

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        loss, grads = jaxamp.value_and_grad(loss_fn, transform=nnx.value_and_grad)(
            model, x, y, opt_state=optimizer
        )
        optimizer.update(model, grads)
        return loss, grads

    _, grads = train_step(model, optimizer, x, y)
    assert isinstance(grads, nnx.State)
    assert all(jnp.issubdtype(g.dtype, jnp.floating) for g in jax.tree.leaves(grads))
    losses = [float(train_step(model, optimizer, x, y)[0]) for _ in range(20)]
    assert losses[-1] < losses[0]
