"""Tests for jaxamp/_src/numerics/find_nonfinite.py: the first non-finite operation, named."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from tests.helpers.expected_warnings import FLOAT16_LOSS, FLOAT16_OVERFLOW
from tests.helpers.promotion import FLAX
from tests.numerics.nets import (
    DTYPES,
    LinenNet,
    NnxNet,
    NnxRoot,
    X,
    linen_setup,
    model_output,
    nnx_loss,
)


def test_a_finite_step_reports_none():
    loss, params = linen_setup()
    # positive inputs and a positive first layer keep every ReLU above 0 at sqrt
    params = jax.tree.map(jnp.abs, params)
    assert jaxamp.find_nonfinite(loss)(params, jnp.abs(X) + 0.1) is None


@pytest.mark.parametrize("policy", ["mixed_float16", "p=f16,c=f16,o=f32"])
def test_forward_float16_overflow_in_a_named_linen_layer(policy):
    loss, params = linen_setup(policy, scale_amplify=1e6)
    fault = jaxamp.find_nonfinite(loss)(params, X)
    assert fault is not None
    assert fault.phase == "forward" and fault.layer.endswith("amplify"), fault
    # the rule casts the x1e6 float32 weight to float16 (inf) inside its GEMM: inf - inf
    assert fault.output.infs + fault.output.nans > 0 and fault.output.dtype == "float16"
    assert all(r.nans == 0 and r.infs == 0 for r in fault.inputs)
    assert max(r.max_abs for r in fault.inputs) > float(jnp.finfo(jnp.float16).max)
    assert "nets.py" in fault.source
    # the same model in float32 does not overflow there
    loss32, params32 = linen_setup(None, scale_amplify=1e6)
    fault32 = jaxamp.find_nonfinite(loss32)(params32, X)
    assert fault32 is None or not fault32.layer.endswith("amplify")


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16", "mixed_float16"])
def test_backward_only_fault_is_reported_at_the_submodule(policy):
    loss, params = linen_setup(policy)
    # the forward pass is finite: the loss is a number
    assert np.isfinite(float(loss(params, X)))
    fault = jaxamp.find_nonfinite(loss)(params, X)
    assert fault is not None and fault.phase == "backward", fault
    assert fault.layer.endswith("root"), fault
    assert fault.output.infs > 0


def test_log_of_zero_in_the_loss():
    model = LinenNet()
    params = model.init(jax.random.key(0), X)

    def loss(params, x):
        probs = jax.nn.softmax(model.apply(params, x))
        return -jnp.mean(jnp.log(probs * 0.0))  # log(0): -inf

    fault = jaxamp.find_nonfinite(jax.jit(loss))(params, X)
    assert fault.phase == "forward" and fault.primitive == "log" and fault.layer == ""
    assert fault.output.infs > 0 and fault.inputs[0].max_abs == 0.0


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_nnx_backward_fault_named_by_module_path_and_model_untouched(policy):
    model = NnxNet(nnx.Rngs(0))
    if policy:
        jaxamp.nnx.apply_policy(model, policy)
    before = jax.tree.map(np.asarray, nnx.state(model))
    fault = jaxamp.find_nonfinite(nnx.jit(nnx_loss))(model, X)
    assert fault.phase == "backward" and fault.layer == "NnxNet/root", fault
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # BatchNorm stats too
    assert type(model.root) is NnxRoot


@pytest.mark.standard_promotion(FLAX)
def test_nnx_forward_float16_overflow():
    model = NnxNet(nnx.Rngs(0))
    model.amplify.kernel[...] = model.amplify.kernel[...] * 1e6
    jaxamp.nnx.apply_policy(model, "mixed_float16")
    fault = jaxamp.find_nonfinite(nnx_loss)(model, X)
    assert fault.phase == "forward" and fault.layer == "NnxNet/amplify", fault


def test_autocast_path_under_jit():
    def loss(w, x):
        with jax.named_scope("proj"):
            h = x @ w
        with jax.named_scope("act"):
            return jnp.mean(jnp.exp(h))

    f = jax.jit(jaxamp.autocast(loss, "mixed_float16"))
    w = jnp.full((6, 6), 1e5)
    fault = jaxamp.find_nonfinite(f)(w, jnp.abs(X))
    assert fault.phase == "forward" and fault.layer == "proj", fault  # 16-bit matmul
    assert fault.output.dtype == "float16"
    fault = jaxamp.find_nonfinite(f)(jnp.full((6, 6), 30.0), X)
    assert fault.layer == "act" and fault.primitive == "exp"  # exp(180) in float32


def test_loss_scale_reproduces_a_backward_overflow():
    def loss(w, x):
        with jax.named_scope("dense"):
            return jnp.mean((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

    w, x = jnp.ones((6, 6)), jnp.abs(X) + 0.5
    assert jaxamp.find_nonfinite(loss)(w, x) is None
    fault = jaxamp.find_nonfinite(loss, loss_scale=2.0**20)(w, x)
    assert fault.phase == "backward" and fault.layer == "dense", fault
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(2.0**20))
    fault = jaxamp.find_nonfinite(loss, loss_scale=tx.init(w))(w, x)
    assert fault.phase == "backward"


def test_fault_inside_a_scan_names_the_iteration():
    def loss(w, x):
        def body(h, i):
            h = jax.lax.cond(i == 3, lambda h: jnp.log(h * 0.0), lambda h: h * w, h)
            return h, None

        h, _ = jax.lax.scan(body, x, jnp.arange(5))
        return jnp.sum(h)

    fault = jaxamp.find_nonfinite(jax.jit(loss))(jnp.float32(0.5), X)
    assert fault.primitive == "log" and fault.iteration == (3,), fault


def test_non_finite_argument_and_bad_arguments():
    loss, params = linen_setup()
    x = X.at[1, 2].set(jnp.nan)
    fault = jaxamp.find_nonfinite(loss)(params, x)
    assert fault.phase == "input" and fault.layer == "[1]" and fault.output.nans == 1
    # a function of activations, not a loss: its forward pass alone, and it says so
    with pytest.warns(UserWarning, match=r"forward only: fun returns float32\[4, 3\]"):
        assert jaxamp.find_nonfinite(lambda p, x: model_output(p, x))(params, X) is None
    with pytest.raises(TypeError, match="floating scalar"):  # numerics_diff compares gradients
        jaxamp.numerics_diff(model_output, policy="mixed_bfloat16")(params, X)
    with pytest.raises(ValueError, match="argnums 5"):
        jaxamp.find_nonfinite(loss, argnums=5)(params, X)
    with pytest.raises(ValueError, match="loss_scale must be a positive"):
        jaxamp.find_nonfinite(loss, loss_scale=-1.0)


def test_forward_only_with_grad_false():
    fault = jaxamp.find_nonfinite(lambda x: jnp.log(x), grad=False)(jnp.zeros(3))
    assert fault.primitive == "log" and fault.phase == "forward"


MASK = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])


def _mask_scores(s, mask):
    return s - 1e30 * (1 - mask)  # DistilBERT's mask: 1e30 is inf in float16


# the fault under test: JAX's cast of 1e30 to float16 warns
@FLOAT16_OVERFLOW
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mask_constant_that_float16_cannot_hold_is_named(dtype):
    def loss(w, x, mask):
        s = (x @ w).astype(dtype)
        with jax.named_scope("attn"):
            p = jax.nn.softmax(_mask_scores(s, mask.astype(dtype)), axis=-1)
        return jnp.sum(p.astype(jnp.float32) * x)

    w, x = jnp.eye(4), jnp.abs(X[:2, :4])
    fault = jaxamp.find_nonfinite(jax.jit(loss))(w, x, MASK)
    if dtype != jnp.float16:  # 1e30 fits float32 and bfloat16
        assert fault is None and np.isfinite(float(loss(w, x, MASK)))
        return
    assert not np.isfinite(float(loss(w, x, MASK)))
    assert fault is not None, "a float16 mask of 1e30 (inf) makes the loss NaN"
    assert (fault.phase, fault.primitive, fault.layer) == ("forward", "mul", "attn"), fault
    assert "(_mask_scores)" in fault.source and "find_nonfinite_test.py" in fault.source
    assert fault.inputs[0].infs == 1  # the constant, already inf in float16
    assert fault.output.nans > 0  # inf * 0 where the mask keeps a score


def _fill_masked(s, mask):
    return jnp.where(mask > 0, s, -jnp.inf)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fully_masked_softmax_row_is_named_and_a_partly_masked_one_is_not(dtype):
    def loss(w, x, mask):
        s = (x @ w).astype(dtype)
        with jax.named_scope("attn"):
            p = jax.nn.softmax(_fill_masked(s, mask), axis=-1)
        return jnp.sum(p.astype(jnp.float32) * x)

    w, x = jnp.eye(4), jnp.abs(X[:2, :4])
    # -inf fills are fine while every row keeps a score: not a fault
    assert np.isfinite(float(loss(w, x, MASK)))
    assert jaxamp.find_nonfinite(jax.jit(loss))(w, x, MASK) is None
    masked = MASK.at[1].set(0.0)  # the second row keeps nothing: 0/0
    assert not np.isfinite(float(loss(w, x, masked)))
    fault = jaxamp.find_nonfinite(jax.jit(loss))(w, x, masked)
    assert fault is not None, "a fully masked row makes the loss NaN"
    assert (fault.phase, fault.primitive, fault.layer) == ("forward", "select_n", "attn"), fault
    assert "(_fill_masked)" in fault.source
    assert fault.output.infs == 6 and fault.output.dtype == jnp.dtype(dtype).name  # the fills


# a float16 loss on purpose (its warning has its own test in optim/)
@FLOAT16_LOSS
@pytest.mark.parametrize("scale", [2.0**10, 2.0**16])
def test_a_float16_loss_is_scaled_as_scale_loss_scales_it(scale):
    """scale_loss casts a 16-bit loss to float32 before multiplying: the scale (65536 by
    default, inf in float16) never is a float16 value, but the loss's cotangent is."""

    def loss(w, x):
        with jax.named_scope("dense"):
            return jnp.mean(x.astype(jnp.float16) @ w.astype(jnp.float16))

    w, x = jnp.ones((4, 4)), jnp.abs(X[:2, :4]) + 0.5
    tx = jaxamp.loss_scaled(optax.sgd(0.1), jaxamp.StaticLossScale(scale))
    state = tx.init(w)
    grads = jax.jit(jax.grad(lambda w, x: jaxamp.scale_loss(loss(w, x), state)))(w, x)
    step_overflows = not bool(jnp.all(jnp.isfinite(grads)))
    assert step_overflows == (scale > 65504)  # the float16 cotangent of the loss
    fault = jaxamp.find_nonfinite(jax.jit(loss), loss_scale=state)(w, x)
    assert (fault is not None) == step_overflows, fault
    if step_overflows:
        assert (fault.phase, fault.primitive) == ("backward", "convert_element_type"), fault
        assert fault.output.dtype == "float16" and fault.inputs[0].max_abs == scale
        assert "loss scale" in str(fault)

    # a loss averaged in float32 at the same scale is finite, as its step is
    def loss32(w, x):
        with jax.named_scope("dense"):
            return jnp.mean((x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32))

    grads = jax.grad(lambda w, x: jaxamp.scale_loss(loss32(w, x), state))(w, x)
    assert bool(jnp.all(jnp.isfinite(grads)))
    assert jaxamp.find_nonfinite(loss32, loss_scale=state)(w, x) is None


def _overflowing_in_float16(w, x):
    with jax.named_scope("dense"):
        h = x @ w  # 4 * 3e4 = 1.2e5: beyond float16's 65504
    return jnp.mean(h) * 1e-4


def test_find_nonfinite_under_a_policy_finds_the_16_bit_overflow():
    w, x = jnp.full((4, 4), 3e4), jnp.ones((2, 4))
    assert jaxamp.find_nonfinite(_overflowing_in_float16)(w, x) is None  # float32 holds it
    fault = jaxamp.find_nonfinite(_overflowing_in_float16, policy="mixed_float16")(w, x)
    assert fault is not None and fault.phase == "forward" and fault.layer == "dense"
    assert fault.primitive == "amp_dot_general"  # the matmul rule's GEMM
    bf16 = jaxamp.find_nonfinite(_overflowing_in_float16, policy="mixed_bfloat16")(w, x)
    assert bf16 is None


def test_a_zero_scale_in_an_optimizer_state_is_named_by_its_value():
    """The message printed the whole optimizer state (2,222 characters) and never the
    value: it now gives the value and says where it came from, for each tool."""
    params = {"w": jnp.ones((64, 64))}
    state = jaxamp.loss_scaled(optax.adam(1e-3)).init(params)
    zero = state._replace(loss_scale=state.loss_scale._replace(scale=jnp.float32(0.0)))
    loss = lambda p, x: jnp.sum(x @ p["w"])
    for tool in (
        lambda: jaxamp.find_nonfinite(loss, loss_scale=zero),
        lambda: jaxamp.range_report(loss, loss_scale=zero),
        lambda: jaxamp.numerics_diff(loss, policy="mixed_float16", loss_scale=zero),
    ):
        with pytest.raises(ValueError, match=r"got 0\.0 \(the scale of") as info:
            tool()(params, jnp.ones((2, 64)))
        assert len(str(info.value)) < 200
