"""Tests for jaxamp/_src/numerics: find_nonfinite, range_report and numerics_diff, each
with the fault at a known layer, on Linen, NNX and autocast paths, under jit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from tests.gated_net import gated_setup

X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)


class Root(nn.Module):
    """sqrt of a ReLU: finite forward, infinite derivative where the ReLU is 0."""

    @nn.compact
    def __call__(self, x):
        return jnp.sqrt(nn.relu(x))


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="embed")(x))
        x = nn.Dense(8, name="amplify")(x)
        x = Root(name="root")(x)
        return nn.Dense(3, name="head")(x)


def linen_setup(dtype_policy=None, scale_amplify=1.0):
    model = LinenNet()
    params = model.init(jax.random.key(0), X)
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: p * scale_amplify if "amplify" in jax.tree_util.keystr(path) else p,
        params,
    )
    if dtype_policy is not None:
        model = jaxamp.linen.apply_policy(model, dtype_policy)

    @jax.jit
    def loss(params, x):
        return jnp.mean(model.apply(params, x).astype(jnp.float32) ** 2)

    return loss, params


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
    assert "tools_test.py" in fault.source
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


class NnxRoot(nnx.Module):
    def __call__(self, x):
        return jnp.sqrt(nnx.relu(x))


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(6, 8, rngs=rngs)
        self.amplify = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.root = NnxRoot()
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        x = self.norm(self.amplify(nnx.relu(self.embed(x))))
        return self.head(self.root(x))


def nnx_loss(model, x):
    return jnp.mean(model(x).astype(jnp.float32) ** 2)


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


def model_output(params, x):
    return LinenNet().apply(params, x)


def test_forward_only_with_grad_false():
    fault = jaxamp.find_nonfinite(lambda x: jnp.log(x), grad=False)(jnp.zeros(3))
    assert fault.primitive == "log" and fault.phase == "forward"


# --- faults fed by non-finite constants, loss scaling, phases in loops ---------------------

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
MASK = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]])


def _mask_scores(s, mask):
    return s - 1e30 * (1 - mask)  # DistilBERT's mask: 1e30 is inf in float16


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
    assert "(_mask_scores)" in fault.source and "tools_test.py" in fault.source
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


def _layer_norm(h):
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-12)


def _norm_loss(wrap):
    def loss(w, x):
        def step(h):
            with jax.named_scope("norm"):
                return _layer_norm(h @ w)

        h = wrap(step, x)
        return jnp.mean(h[:, :2] ** 3)

    return loss


def _unrolled(step, x):
    return step(step(x))


def _scanned(step, x):
    return jax.lax.scan(lambda h, _: (step(h), None), x, None, length=2)[0]


def _remat(step, x):
    return jax.checkpoint(step)(jax.checkpoint(step)(x))


def _cond(step, x):
    both = lambda h: step(step(h))
    return jax.lax.cond(jnp.sum(x) > -1e9, both, lambda h: h * 2.0, x)


def _norm_inputs():
    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jnp.full((8, 8), 1e-3) + 1e-5 * jax.random.normal(jax.random.key(1), (8, 8))
    return w, x


@pytest.mark.parametrize("wrap", [_scanned, _remat, _cond], ids=["scan", "remat", "cond"])
def test_range_report_phases_inside_loops_match_the_unrolled_program(wrap):
    """A near-constant row's LayerNorm has a derivative of ~1e13: a value of the
    gradient, not an activation, inside a scan, remat or cond as outside it."""
    w, x = _norm_inputs()
    plain = jaxamp.range_report(jax.jit(_norm_loss(_unrolled)))(w, x)
    looped = jaxamp.range_report(jax.jit(_norm_loss(wrap)))(w, x)
    fwd = lambda r: next(row for row in r.layers if row.layer == "norm" and row.phase == "forward")
    assert fwd(plain).max_abs < 65504, plain.table()  # the activations fit float16
    assert fwd(looped).max_abs == pytest.approx(fwd(plain).max_abs, rel=1e-5), looped.table()
    assert ("norm", "forward") not in {(r.layer, r.phase) for r in looped.overflows()}
    assert ("norm", "backward") in {(r.layer, r.phase) for r in looped.overflows()}
    assert looped.recommend().reason.startswith("Use bfloat16: gradients")


def test_a_derivative_computed_inside_a_scan_is_a_backward_fault():
    def loss(w, x):
        def body(h, _):
            with jax.named_scope("root"):
                return jnp.sqrt(h * w), None

        return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])

    fault = jaxamp.find_nonfinite(jax.jit(loss))(jnp.float32(1.0), jnp.array([1.0, 0.0]))
    # 0.5 / sqrt(0), which the forward scan computes for the backward one
    assert (fault.phase, fault.primitive, fault.layer) == ("backward", "div", "root"), fault
    assert fault.iteration == (0,)


def test_a_while_loop_of_the_forward_pass_counts_as_forward():
    def loss(w, x):
        with jax.named_scope("loop"):
            n = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 3.0), (0, x))
        return jnp.sum(jax.lax.stop_gradient(n[1]) * w)

    report = jaxamp.range_report(jax.jit(loss))(jnp.ones(3), jnp.full(3, 1e4))
    loop = [r for r in report.layers if r.layer == "loop"]
    assert [r.phase for r in loop] == ["forward"] and loop[0].max_abs == 2.7e5


def _bad_bwd(x, g):
    return (g / (x * 0.0),)  # the fault: the rule divides by zero


@jax.custom_vjp
def _custom(x):
    return x * 2.0


_custom.defvjp(lambda x: (_custom(x), x), _bad_bwd)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jit_inside", [False, True])
def test_a_custom_vjp_backward_fault_points_at_the_bwd_rule(dtype, jit_inside):
    def loss(x):
        with jax.named_scope("custom"):
            y = _custom(x.astype(dtype))
        return jnp.sum(y.astype(jnp.float32))

    fault = jaxamp.find_nonfinite(jax.jit(loss) if jit_inside else loss)(jnp.ones(3))
    assert (fault.phase, fault.primitive) == ("backward", "div"), fault
    line = _bad_bwd.__code__.co_firstlineno
    assert fault.source.endswith(f"tools_test.py:{line} (_bad_bwd)"), fault.source


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_function_returning_activations_is_checked_forward_only(dtype):
    loss, params = linen_setup()
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    apply = jax.jit(lambda p, x: LinenNet().apply(p, x))
    with pytest.warns(UserWarning, match="forward only"):
        assert jaxamp.find_nonfinite(apply)(params, X.astype(dtype)) is None
    with pytest.warns(UserWarning, match="forward only"):
        fault = jaxamp.find_nonfinite(lambda x: jnp.log(x) * 2.0)(jnp.zeros(3, dtype))
    assert fault.forward_only and fault.primitive == "log" and fault.phase == "forward"
    assert "forward only: the function returns a non-scalar, so no gradient was taken" in str(fault)
    with pytest.warns(UserWarning, match="forward only"):
        report = jaxamp.range_report(apply)(params, X.astype(dtype))
    assert report.forward_only and {r.phase for r in report.layers} == {"forward"}
    assert "forward only" in report.table() and "forward only" in report.recommend().reason
    assert any(r.layer.endswith("amplify") for r in report.layers)
    full = jaxamp.range_report(loss)(params, X.astype(dtype))
    assert not full.forward_only and "forward only" not in full.table()


# --- range_report ---------------------------------------------------------------------------


def test_range_report_flags_a_model_beyond_float16_and_passes_one_that_fits():
    loss, params = linen_setup(None, scale_amplify=1e5)
    big = jaxamp.range_report(loss)(jax.tree.map(jnp.abs, params), jnp.abs(X) + 1.0)
    flagged = {(r.layer.split("/")[-1], r.phase) for r in big.overflows("float16")}
    assert ("amplify", "forward") in flagged, big.table()
    assert ("embed", "forward") not in flagged  # before the large layer
    assert ("embed", "backward") in flagged  # its gradient flows back through amplify
    advice = big.recommend()
    assert advice.dtype == "bfloat16" and "amplify" in advice.reason
    assert big.overflows("bfloat16") == []

    small = jaxamp.range_report(loss)(*_fitting(linen_setup()[1]))
    assert small.overflows("float16") == []
    assert small.recommend().dtype == "float16"
    amplify = next(r for r in small.layers if r.layer.endswith("amplify") and r.phase == "forward")
    assert 0 < amplify.max_abs < 100 and amplify.headroom() > 600
    assert "max |act|" in small.table()


def _fitting(params):
    return jax.tree.map(jnp.abs, params), jnp.abs(X) + 0.1


def test_range_report_sees_gradients_that_flush_to_zero_in_float16():
    def loss(w, x):
        with jax.named_scope("tiny"):
            return jnp.sum(x @ w) * 1e-9

    report = jaxamp.range_report(loss)(jnp.ones((6, 2)), X)
    tiny = next(r for r in report.layers if r.layer == "tiny" and r.phase == "backward")
    assert tiny.below_subnormal > 0.5 and tiny.below_normal >= tiny.below_subnormal
    advice = report.recommend()
    assert advice.dtype == "float16" and advice.loss_scaling
    scaled = jaxamp.range_report(loss, loss_scale=2.0**24)(jnp.ones((6, 2)), X)
    tiny = next(r for r in scaled.layers if r.layer == "tiny" and r.phase == "backward")
    assert tiny.below_subnormal == 0.0  # the loss scale lifts them into range


def test_range_report_dtype_errors():
    report = jaxamp.range_report(lambda w: jnp.sum(w))(jnp.ones(2))
    with pytest.raises(ValueError, match="dtype must be one of float16, bfloat16"):
        report.overflows("int8")


def _dense_loss(dtype):
    def loss(w, x):
        with jax.named_scope("dense"):
            h = x.astype(dtype) @ w.astype(dtype)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_report_does_not_count_the_loss_scale_multiply(dtype):
    """The loss times 65536 is not a value of the model: at jaxamp's default scale
    every model would otherwise be told to use bfloat16."""
    w, x = jnp.full((4, 4), 0.5), jnp.abs(X[:2, :4]) + 0.5
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(w)  # loss scale 65536
    plain = jaxamp.range_report(jax.jit(_dense_loss(dtype)))(w, x)
    scaled = jaxamp.range_report(jax.jit(_dense_loss(dtype)), loss_scale=state)(w, x)
    assert scaled.loss_scale == 65536.0
    forward = lambda r: {(row.layer, row.max_abs) for row in r.layers if row.phase == "forward"}
    assert forward(scaled) == forward(plain)  # the scaled loss (1e5) is not among them
    assert [r for r in scaled.overflows() if r.phase == "forward"] == []
    advice = scaled.recommend()
    assert advice.dtype == "float16" and "activations" not in advice.reason, advice


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_recommend_names_a_loss_scale_that_fits_when_the_scale_overflows(dtype, policy):
    """Gradients that fit float16 unscaled but overflow at 2**24: float16 with a smaller
    loss scale, not bfloat16."""
    if policy and dtype != jnp.float32:
        pytest.skip("a policy applies to the float32 function")
    w, x = jnp.full((4, 4), 0.5), jnp.abs(X[:2, :4]) + 0.5
    loss = jax.jit(_dense_loss(dtype))
    report = jaxamp.range_report(loss, loss_scale=2.0**24, policy=policy)(w, x)
    assert any(r.phase == "backward" for r in report.overflows()), report.table()
    advice = report.recommend()
    assert advice.dtype == "float16" and advice.loss_scaling, advice
    assert advice.loss_scale is not None and 1 <= advice.loss_scale < 2.0**24
    assert f"{advice.loss_scale:g}" in advice.reason and "smaller loss scale" in advice.reason
    assert np.log2(advice.loss_scale).is_integer()
    # the scale it names does fit, and twice... the largest power of two that does
    fits = jaxamp.range_report(loss, loss_scale=advice.loss_scale, policy=policy)(w, x)
    assert fits.overflows() == [], fits.table()
    assert fits.recommend().dtype == "float16" and fits.recommend().loss_scale is None
    # gradients float16 cannot hold even unscaled still need bfloat16
    big = jaxamp.range_report(loss, loss_scale=2.0**24, policy=policy)(w * 300.0, x * 300.0)
    assert big.recommend().dtype == "bfloat16"


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_report_leaves_out_a_mask_fill_of_the_dtype_s_lowest(dtype):
    def loss(w, keep):
        with jax.named_scope("attn"):
            s = jnp.where(keep, w.astype(dtype) * 2, jnp.finfo(dtype).min)
        return jnp.sum(jax.nn.softmax(s).astype(jnp.float32))

    report = jaxamp.range_report(jax.jit(loss))(jnp.arange(4.0), jnp.arange(4) < 2)
    attn = next(r for r in report.layers if r.layer == "attn" and r.phase == "forward")
    assert attn.max_abs == 6.0, attn  # 2w, not the fill: finfo(dtype).min is a sentinel


def test_range_report_flush_to_zero_boundary_is_float16_rounding():
    """float16 rounds 2**-25 (half its smallest subnormal, a tie) to 0, and a value just
    below its smallest normal up to that normal."""
    c = jnp.array([2.0**-25, 2.0**-25 * (1 + 2.0**-20), 2.0**-26, 2.0**-14 - 2.0**-26])
    assert list(np.asarray(c.astype(jnp.float16), np.float64) == 0) == [1, 0, 1, 0]

    def loss(w):
        with jax.named_scope("tiny"):
            return jnp.sum(w * c)

    report = jaxamp.range_report(jax.jit(loss))(jnp.ones(4))
    tiny = next(r for r in report.layers if r.layer == "tiny" and r.phase == "backward")
    # its gradient values: the cotangent ones (4) and c (4)
    assert tiny.below_subnormal == 2 / 8, tiny  # 2**-25 and 2**-26
    assert tiny.below_normal == 3 / 8, tiny  # and 2**-25 (1 + 2**-20); 2**-14 - 2**-26 rounds up


@pytest.mark.parametrize(
    ("value", "dtype", "overflows"),
    [
        (65504.0, "float16", False),
        (65519.0, "float16", False),  # rounds to 65504
        (65520.0, "float16", True),  # rounds to inf
        (3.3895e38, "bfloat16", False),
        (3.395e38, "bfloat16", False),  # above bfloat16's largest, rounds down to it
        (3.4e38, "bfloat16", True),
    ],
)
def test_range_report_overflow_boundary_is_the_dtype_rounding(value, dtype, overflows):
    def loss(w):
        with jax.named_scope("big"):
            h = w * 1.0
        return jnp.sum(h) * 0.0

    report = jaxamp.range_report(jax.jit(loss))(jnp.array([value, 1.0], jnp.float32))
    big = next(r for r in report.layers if r.layer == "big" and r.phase == "forward")
    assert big.max_abs == float(np.float32(value))
    assert (big in report.overflows(dtype)) == overflows


# --- numerics_diff --------------------------------------------------------------------------


def test_numerics_diff_per_layer_under_autocast():
    """Each row is the relative error one computes by hand: the layer's output captured
    under autocast against float32, and the layer's parameter gradients."""
    model = LinenNet()
    params = jax.tree.map(jnp.abs, model.init(jax.random.key(0), X))
    x = jnp.abs(X) + 0.1

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    same = jaxamp.numerics_diff(loss, policy="float32")(params, x)
    assert all(r.relative_error == 0.0 for r in same.layers if r.relative_error is not None)
    assert same.loss[0] == same.loss[1]
    bf16 = jaxamp.numerics_diff(jax.jit(loss), policy="mixed_bfloat16")(params, x)
    rows = {(r.layer, r.phase): r.relative_error for r in bf16.layers}

    def relative(a, r):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        return np.linalg.norm(a - r) / np.linalg.norm(r)

    inter = lambda p, x: model.apply(p, x, capture_intermediates=True)[1]["intermediates"]
    ref, amp = inter(params, x), jaxamp.autocast(inter, "mixed_bfloat16")(params, x)
    g_ref = jax.grad(loss)(params, x)["params"]
    g_amp = jax.grad(jaxamp.autocast(loss, "mixed_bfloat16"))(params, x)["params"]
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(tree)])
    for name in ("embed", "amplify", "root", "head"):
        expected = relative(amp[name]["__call__"][0], ref[name]["__call__"][0])
        assert 1e-4 < expected < 0.05
        assert rows[(f"LinenNet/{name}", "forward")] == pytest.approx(expected, rel=1e-6)
    for name in ("embed", "amplify", "head"):
        expected = relative(flat(g_amp[name]), flat(g_ref[name]))
        assert rows[(f"LinenNet/{name}", "backward")] == pytest.approx(expected, rel=1e-6)
    # worst: every comparable row, largest error first, and by phase
    errors = sorted((e for e in rows.values() if e is not None), reverse=True)
    assert [r.relative_error for r in bf16.worst(len(rows))] == errors
    assert [r.relative_error for r in bf16.worst(2)] == errors[:2]
    backward = bf16.worst(10, "backward")
    assert {r.layer for r in backward} == {f"LinenNet/{n}" for n in ("embed", "amplify", "head")}
    assert "activation rel. error" in bf16.table()
    f16 = jaxamp.numerics_diff(loss, policy="mixed_float16")(params, x)
    # float16 keeps 3 more mantissa bits than bfloat16: smaller errors, layer for layer
    for (layer, phase), error in {(r.layer, r.phase): r.relative_error for r in f16.layers}.items():
        if layer.startswith("LinenNet/"):
            assert error < rows[(layer, phase)], (layer, phase)


def test_numerics_diff_joins_nnx_gradients_to_their_layer():
    model = NnxNet(nnx.Rngs(0))
    diff = jaxamp.numerics_diff(nnx_loss, policy="mixed_bfloat16")(model, jnp.abs(X) + 0.1)
    backward = {r.layer for r in diff.layers if r.phase == "backward"}
    forward = {r.layer for r in diff.layers if r.phase == "forward"}
    assert backward == {f"NnxNet/{n}" for n in ("embed", "amplify", "norm", "head")}, backward
    assert backward <= forward  # one row of the table per layer, both columns filled
    table = diff.table()
    amplify = next(line for line in table.splitlines() if line.startswith("NnxNet/amplify "))
    assert "-" not in amplify.split()[1:], table
    assert dict(diff.gradients)["[0]['amplify']['kernel'].value"] > 0  # leaves keep their paths


def test_numerics_diff_with_a_policy_applied_to_the_model():
    model = LinenNet()
    params = jax.tree.map(jnp.abs, model.init(jax.random.key(0), X))
    amp = jaxamp.linen.apply_policy(model, "mixed_bfloat16")
    ref = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    mixed = lambda p, x: jnp.mean(amp.apply(p, x).astype(jnp.float32) ** 2)
    diff = jaxamp.numerics_diff(ref, policy=mixed)(params, jnp.abs(X) + 0.1)
    paths = dict(diff.gradients)
    assert "[0]['params']['amplify']['kernel']" in paths
    assert all(0 < e < 0.1 for e in paths.values())


def test_numerics_diff_marks_rows_whose_float32_value_is_near_zero():
    """A zero gate: the gate's output and the branch's gradients are exactly 0 in both
    runs (identical: error 0, marked near zero). A gate of 1e-6: float16 flushes the
    branch's gradients (a raw relative error of tens of %), but they are a millionth of
    the typical gradient, so their scale error is small and the rows are marked."""
    loss, params = gated_setup(0.0)
    diff = jaxamp.numerics_diff(loss, policy="mixed_bfloat16")(params, X)
    rows = {(r.layer, r.phase): r for r in diff.layers}
    for key in (("GatedNet/gate", "forward"), ("GatedNet/branch", "backward")):
        assert rows[key].near_zero and rows[key].scale_error == 0.0, rows[key]
        assert rows[key].relative_error == 0.0 and rows[key].cosine is None
    for key in (("GatedNet/embed", "forward"), ("GatedNet/head", "backward")):
        r = rows[key]
        assert not r.near_zero and 1e-4 < r.scale_error < 0.05, r
        assert r.scale_error == pytest.approx(r.relative_error)  # normal rows: the same number
        assert 0.99 < r.cosine <= 1.0, r
    same = jaxamp.numerics_diff(loss, policy="float32")(params, X)
    assert all(r.scale_error == 0.0 for r in same.layers), same.layers

    loss, params = gated_setup(1e-6)
    diff = jaxamp.numerics_diff(loss, policy="mixed_float16")(params, X)
    rows = {(r.layer, r.phase): r for r in diff.layers}
    for key in (("GatedNet/gate", "forward"), ("GatedNet/branch", "backward")):
        assert rows[key].near_zero and 0 < rows[key].scale_error < 1e-3, rows[key]
    # float16 flushes most of the branch's gradients (1e-6 times the usual) to zero: the
    # raw relative error, kept as it was, reads 46%
    assert rows[("GatedNet/branch", "backward")].relative_error > 0.1
    assert not rows[("GatedNet/gate", "backward")].near_zero  # the gate's own gradient


# --- loss_scaled's record of non-finite gradients -------------------------------------------


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


def test_the_float16_walk_through_example(tmp_path):
    """examples/float16_overflow.py at a small size: the walk-through of the numerics guide."""
    import io

    from examples import float16_overflow

    out = io.StringIO()
    result = float16_overflow.main(["--steps", "4", "--out", str(tmp_path / "t.txt")], out=out)
    f16, bf16 = result["float16"], result["bfloat16"]
    assert f16["skipped"] == len(f16["losses"]) == 4 and "find_nonfinite" in f16["stuck"]
    assert result["fault"].phase == "forward"
    assert result["fault"].layer == "GPT2LMHeadModel/h_1/c_fc"
    assert result["fault"].output.dtype == "float16"
    assert result["advice"].dtype == "bfloat16"
    assert bf16["skipped"] == 0 and bf16["losses"][-1] < bf16["losses"][0]
    assert (tmp_path / "t.txt").read_text() == out.getvalue()


def test_range_report_under_a_policy_counts_only_its_16_bit_values():
    """A LayerNorm's statistics have huge derivatives for near-constant rows; a policy
    computes them in float32, so they are no reason to avoid float16."""

    def loss(w, x):
        with jax.named_scope("proj"):
            h = x @ w
        with jax.named_scope("norm"):
            mu = jnp.mean(h, -1, keepdims=True)
            var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
            y = (h - mu) * jax.lax.rsqrt(var + 1e-12)
        return jnp.mean(y[:, :2] ** 3)

    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jnp.full((8, 8), 1e-3) + 1e-5 * jax.random.normal(jax.random.key(1), (8, 8))
    plain = jaxamp.range_report(loss)(w, x)
    assert ("norm", "backward") in {(r.layer, r.phase) for r in plain.overflows()}
    assert plain.policy is None
    mixed = jaxamp.range_report(loss, policy="mixed_float16")(w, x)
    assert mixed.overflows() == [] and mixed.recommend().dtype == "float16"
    assert mixed.policy == str(jaxamp.get_policy("mixed_float16"))
    # a value the policy does hold in 16 bits is measured at its float32 size, not inf
    big = jaxamp.range_report(loss, policy="mixed_float16")(w * 1e8, x)
    proj = next(r for r in big.layers if r.layer == "proj" and r.phase == "forward")
    assert proj.nonfinite == 0 and proj.max_abs > 65504
    assert ("proj", "forward") in {(r.layer, r.phase) for r in big.overflows()}
    with pytest.raises(TypeError, match="policy must be"):
        jaxamp.range_report(loss, policy=3)


def test_the_three_tools_share_one_signature():
    import inspect

    def shape(tool):
        return [(p.name, p.kind, p.default) for p in inspect.signature(tool).parameters.values()]

    tools = (jaxamp.find_nonfinite, jaxamp.range_report, jaxamp.numerics_diff)
    assert shape(tools[0]) == shape(tools[1]) == shape(tools[2])
    assert [name for name, *_ in shape(tools[0])] == [
        "fun", "argnums", "policy", "has_aux", "loss_scale", "grad"
    ]  # fmt: skip


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


def test_range_report_forward_only_with_grad_false():
    w, x = jnp.full((4,), 300.0), jnp.ones((2, 4))
    report = jaxamp.range_report(lambda w, x: (x * w) ** 2, grad=False)(w, x)
    assert report.forward_only == "grad=False"
    assert report.layers and {r.phase for r in report.layers} == {"forward"}


def test_numerics_diff_takes_the_policy_by_keyword_and_says_when_it_is_missing():
    params, x = {"w": jnp.full((4,), 0.3)}, jnp.ones((2, 4))
    loss = lambda p, x: jnp.mean(jnp.tanh(x * p["w"]))
    by_keyword = jaxamp.numerics_diff(loss, policy="mixed_bfloat16")(params, x)
    with pytest.warns(DeprecationWarning, match=r"numerics_diff\(fun, policy=\.\.\.\)"):
        positional = jaxamp.numerics_diff(loss, "mixed_bfloat16")(params, x)
    assert positional == by_keyword
    with pytest.raises(ValueError, match="numerics_diff needs the policy"):
        jaxamp.numerics_diff(loss)


def test_numerics_diff_forward_only_with_grad_false():
    x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
    out = lambda w, x: jnp.tanh(x * w)  # not a scalar: activations only
    diff = jaxamp.numerics_diff(out, policy="mixed_bfloat16", grad=False)(jnp.ones(4), x)
    assert diff.gradients == () and diff.loss is None
    assert diff.layers and {r.phase for r in diff.layers} == {"forward"}
    assert all(r.relative_error is not None and r.relative_error < 1e-2 for r in diff.layers)
