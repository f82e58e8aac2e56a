"""Tests for jaxamp/_src/optim/gradients.py: scale_loss, get_loss_scale and value_and_grad."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp import DynamicLossScale
from tests.helpers.promotion import FLAX, OPTAX
from tests.helpers.train_steps import loss_scaled_step

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


@pytest.mark.standard_promotion(OPTAX)
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
    with pytest.warns(UserWarning, match="the loss is float16"):
        scaled = jaxamp.scale_loss(jnp.float16(2.0), state)
    assert scaled.dtype == jnp.float32 and float(scaled) == 2.0 * 65536  # would overflow in f16
    assert jaxamp.scale_loss(jnp.bfloat16(2.0), state).dtype == jnp.float32  # no warning


def test_a_float16_loss_warns_that_its_backward_pass_overflows_at_the_default_scale():
    """A float16 loss carries the scale in float16 through its backward pass: at 65536
    every gradient is inf (jax.grad of the same function times the scale, the reference,
    shows the overflow is float16's and not jaxamp's), so each such step is skipped.
    ``jaxamp.value_and_grad`` says so at trace time, naming the fix."""
    w = jnp.ones(4, jnp.float16)
    loss = lambda w: jnp.sum((w * jnp.float16(0.5) - 1) ** 2) * jnp.float16(1e-3)
    reference = jax.grad(lambda w: loss(w).astype(jnp.float32) * 65536.0)(w)
    assert not np.isfinite(np.asarray(reference, np.float32)).any()
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(w)
    with pytest.warns(UserWarning, match="compute the loss in float32|Compute the loss in float32"):
        _, grads = jax.jit(jaxamp.value_and_grad(loss))(w, opt_state=state)
    assert not np.isfinite(np.asarray(grads, np.float32)).any()
    # Computed in float32, the same loss scales: no warning, finite gradients.
    loss32 = lambda w: jnp.sum((w.astype(jnp.float32) * 0.5 - 1) ** 2) * 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, grads = jax.jit(jaxamp.value_and_grad(loss32))(w, opt_state=state)
    assert np.isfinite(np.asarray(grads, np.float32)).all()


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


@pytest.mark.standard_promotion(OPTAX)
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


@pytest.mark.standard_promotion(FLAX)
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


@pytest.mark.standard_promotion(FLAX)
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


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SCALE = 1024.0  # a power of two: the scaled gradients are the unscaled ones times it, exactly


def _weighted_loss(params, x):
    terms = [jnp.sum((p.astype(jnp.float32) * x.astype(jnp.float32)) ** 2) for p in params]
    return sum(terms) / 4.0


@pytest.mark.standard_promotion(OPTAX)
@settings(max_examples=15, deadline=None)
@given(
    param_dtypes=st.tuples(st.sampled_from(sorted(DTYPES)), st.sampled_from(sorted(DTYPES))),
    input_dtype=st.sampled_from(sorted(DTYPES)),
    params_first=st.booleans(),
    input_differentiated=st.booleans(),
    has_aux=st.booleans(),
)
# The case: float32 params and a differentiated bfloat16 input were refused,
# blaming an optax.flatten the user never wrote.
@example(("float32", "float32"), "bfloat16", True, True, False)
@example(("bfloat16", "float32"), "float16", False, True, True)
def test_value_and_grad_of_params_and_an_input_matches_jax(
    param_dtypes, input_dtype, params_first, input_differentiated, has_aux
):
    """jaxamp.value_and_grad with several argnums returns what jax.value_and_grad does, the
    gradients scaled: a differentiated 16-bit input beside the params is fine (it was
    counted with the params and refused). The params are argnums' first argument, in
    either position of the loss's arguments, and the optimizer unscales their gradients."""
    params = {
        "a": jnp.array([1.0, 2.0, -0.5], DTYPES[param_dtypes[0]]),
        "b": jnp.array([0.25, -1.5, 3.0], DTYPES[param_dtypes[1]]),
    }
    x = jnp.array([0.5, -1.0, 2.0], DTYPES[input_dtype])
    if params_first:
        loss = lambda p, x: _weighted_loss(p.values(), x)
    else:
        loss = lambda x, p: _weighted_loss(p.values(), x)
    fun = (lambda *a: (loss(*a), {"x": a[0]})) if has_aux else loss
    args = (params, x) if params_first else (x, params)
    at = 0 if params_first else 1
    argnums = (at, 1 - at) if input_differentiated else at
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(SCALE))
    state = tx.init(params)
    value, grads = jax.jit(jaxamp.value_and_grad(fun, argnums=argnums, has_aux=has_aux))(
        *args, opt_state=state
    )
    want_value, want = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(*args)
    for got, ref in zip(jax.tree.leaves(value), jax.tree.leaves(want_value), strict=True):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert got.dtype == ref.dtype
        np.testing.assert_array_equal(got, ref * jnp.asarray(SCALE, ref.dtype))
    param_grads = grads[0] if input_differentiated else grads
    updates, _ = jax.jit(tx.update)(param_grads, state, params)
    want_params = want[0] if input_differentiated else want
    for p, u, g in zip(*map(jax.tree.leaves, (params, updates, want_params)), strict=True):
        stepped = p.astype(jnp.float32) - 0.1 * g.astype(jnp.float32)
        np.testing.assert_array_equal(optax.apply_updates(p, u), stepped.astype(p.dtype))


@pytest.mark.standard_promotion(OPTAX)
def test_value_and_grad_refusal_names_what_was_written():
    """A transformation around loss_scaled that changes the params it sees is refused,
    naming the call the user wrote (its function and argnums) and the counts of each
    differentiated argument, not an optax.flatten the user never wrote."""
    params = {"a": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
    x = jnp.ones(3, jnp.float32)

    def my_loss(p, x):
        return jnp.sum(p["a"].astype(jnp.float32) * x) + jnp.sum(p["b"])

    flattened = optax.flatten(jaxamp.loss_scaled(optax.sgd(0.1)))  # sees one float32 vector
    state = flattened.init(params)
    call = jaxamp.value_and_grad(my_loss, argnums=(0, 1))
    wrote = r"jaxamp\.value_and_grad\(my_loss, argnums=\(0, 1\)\)"
    counts = r"with 0 16-bit leaves, and the params' gradients \(argument 0, .*\) have 1 "
    with pytest.raises(ValueError, match=wrote + ": .*" + counts):
        jax.jit(call)(params, x, opt_state=state)
    other = jaxamp.loss_scaled(optax.sgd(0.1)).init({"b": jnp.ones(2)})  # other params
    with pytest.raises(ValueError, match=wrote + r".*initialised on"):
        jax.jit(call)(params, x, opt_state=other)
