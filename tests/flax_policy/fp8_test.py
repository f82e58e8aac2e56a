"""FP8 policies on unmodified Linen and NNX models: Flax's fp8_ops as the reference for delayed
scaling, the state under reuse, nn.scan, Orbax and the optimizer."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp.ops import FP8_STATE_COLLECTION as STATE
from tests.helpers.fp8_models import REALISTIC_FEATURES, REALISTIC_INPUT, Mlp
from tests.helpers.promotion import FLAX, OPTAX, SUBJECT

assert STATE == fp8_ops.OVERWRITE_WITH_GRADIENT


def _flax_meta_as_jaxamp(tree):
    """Flax keeps a layer's state in a child (Dense_0/Fp8DirectDotGeneralOp_0/...);
    jaxamp keeps it in the layer's own scope (Dense_0/...), the model's own for a layer
    applied alone."""
    op = "Fp8DirectDotGeneralOp_0"
    if op in tree:
        return dict(tree[op])
    return {layer: dict(children[op]) for layer, children in tree.items()}


def _assert_steps_match_flax(model, ref, x0, run=jax.jit):
    """``model`` (unmodified, under 'p=f32,c=f32,o=f32,fp8=delayed') against ``ref`` (the
    same model written with Flax's Fp8DirectDotGeneralOp), trained with SGD for steps whose
    inputs change scale: outputs, the gradients of the params and of the input, amax
    histories and scales bit for bit. ``run``: ``jax.jit``, or op by op (eagerly)."""
    model = jaxamp.linen.apply_policy(model, "p=f32,c=f32,o=f32,fp8=delayed")
    ref_vars = ref.init(jax.random.key(1), x0)
    variables = model.init(jax.random.key(1), x0)
    np.testing.assert_equal(
        jax.tree.map(np.asarray, variables["params"]),
        jax.tree.map(np.asarray, ref_vars["params"]),
    )
    params, state = variables["params"], variables[STATE]
    ref_params, ref_state = ref_vars["params"], ref_vars[STATE]

    def loss(apply, params, state, x):
        y = apply({"params": params, STATE: state}, x)
        return jnp.mean((y - 1.0) ** 2), y

    grad = jax.grad(loss, argnums=(1, 2, 3), has_aux=True)
    step = jax.jit(grad, static_argnums=0) if run is jax.jit else grad
    for i, factor in enumerate([1.0, 4.0, 0.25, 30.0, 1.0, 0.01]):
        x = x0 * factor
        (g, new_state, dx), y = step(model.apply, params, state, x)
        (rg, ref_new, rdx), ry = step(ref.apply, ref_params, ref_state, x)
        np.testing.assert_array_equal(y, ry, err_msg=f"outputs, step {i}")
        np.testing.assert_array_equal(dx, rdx, err_msg=f"input gradient, step {i}")
        assert np.any(np.asarray(dx) != 0), i
        flat, ref_flat = jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(rg)
        for (path, a), b in zip(flat, ref_flat, strict=True):
            where = f"gradient {jax.tree_util.keystr(path)}, step {i}"
            np.testing.assert_array_equal(a, b, err_msg=where)
        np.testing.assert_equal(
            jax.tree.map(np.asarray, dict(new_state)),
            jax.tree.map(np.asarray, _flax_meta_as_jaxamp(ref_new)),
        )
        params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
        ref_params = jax.tree.map(lambda p, d: p - 0.1 * d, ref_params, rg)
        state, ref_state = new_state, ref_new
    scales = [
        float(v[0])
        for path, v in jax.tree_util.tree_flatten_with_path(state)[0]
        if jax.tree_util.keystr(path).endswith("['input_scale']")
    ]
    assert scales and all(s != 1.0 for s in scales)  # the scales moved


_DENSE_MODELS = {
    # a transformer's MLP block: 64 tokens, 256 -> 512 -> 128
    "mlp": (lambda op: Mlp(op, features=REALISTIC_FEATURES), REALISTIC_INPUT),
    # two contracting axes: the weight gradient's GEMM summed in another order than Flax's
    # (its operands swapped) and came out a last bit away in 1 to 3 of 1,512 elements
    "dense_general_2_axes": (
        lambda op: nn.DenseGeneral((4, 6), axis=(-2, -1), dot_general_cls=op),
        (32, 7, 9),
    ),
    # attention's head projections: 256 features to 4 heads of 64, on 8 x 32 tokens
    "dense_general_heads": (
        lambda op: nn.DenseGeneral((4, 64), dot_general_cls=op),
        (8, 32, 256),
    ),
}


@pytest.mark.default_compiler("the older emitters change the last bit of some float8 gradients")
@pytest.mark.parametrize("name", sorted(_DENSE_MODELS))
def test_linen_delayed_policy_matches_flax_fp8_ops_step_for_step(name):
    """Dense and DenseGeneral models of realistic widths against Flax's
    Fp8DirectDotGeneralOp under jit, bit for bit: outputs, params' and input's gradients,
    histories and scales (guides/fp8.md)."""
    make, shape = _DENSE_MODELS[name]
    x0 = jax.random.normal(jax.random.key(0), shape)
    _assert_steps_match_flax(make(None), make(fp8_ops.Fp8DirectDotGeneralOp), x0)


@pytest.mark.default_compiler("Flax's float8 numbers to the bit, as the step-for-step tests")
def test_linen_attention_under_float32_compute_matches_flax_fp8_ops():
    """MultiHeadDotProductAttention (4 heads of 16, 8 x 32 tokens), op by op: its four
    projections in float8, its two attention matmuls in the float32 compute dtype, as
    Flax's qkv/out_dot_general_cls put them (under a float32 compute dtype they ran in
    float8 too), bit for bit. Under jit the two programs' softmax and its gradient can
    fuse differently (a last bit, guides/fp8.md)."""
    x0 = jax.random.normal(jax.random.key(0), (8, 32, 64))
    op = fp8_ops.Fp8DirectDotGeneralOp
    model = nn.MultiHeadDotProductAttention(4, qkv_features=64)
    ref = nn.MultiHeadDotProductAttention(
        4, qkv_features=64, qkv_dot_general_cls=op, out_dot_general_cls=op
    )
    _assert_steps_match_flax(model, ref, x0, run=None)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_matmuls_without_a_hook_stay_out_of_float8_under_float32_compute(scaling):
    """Attention's two matmuls and Embed.attend (no hook) run in the compute dtype, as the
    guide says, under a float32 compute dtype too: only the layers' GEMMs are float8."""
    policy = f"p=f32,c=f32,fp8={scaling}"
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    attention = jaxamp.nnx.apply_policy(
        nnx.MultiHeadAttention(2, 8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)), policy
    )
    assert jaxamp.precision_report(lambda x: attention(x))(x).float8_gemms() == (4, 4)
    embed = jaxamp.linen.apply_policy(nn.Embed(10, 8), policy)
    variables = embed.init(jax.random.key(0), jnp.arange(3))
    attend = jax.jit(lambda v, x: embed.apply(v, x, method="attend"))
    assert jaxamp.precision_report(attend)(variables, x).float8_gemms() == (0, 0)
    np.testing.assert_array_equal(
        attend(variables, x), nn.Embed(10, 8).apply(variables, x, method="attend")
    )


def _train_linen(policy, steps=3, reuse=False):
    class Reused(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(8)
            return nn.Dense(2)(d(d(x)) if reuse else d(x))

    model = jaxamp.linen.apply_policy(Reused(), policy)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = model.init(jax.random.key(1), x)
    return model, x, variables


@pytest.mark.standard_promotion(SUBJECT)
def test_linen_layer_called_twice_records_the_larger_amax():
    model, x, variables = _train_linen("mixed_float8_delayed", reuse=True)
    d0 = variables["params"]["Dense_0"]

    def loss(state):
        return jnp.sum(model.apply({"params": variables["params"], STATE: state}, x))

    new = jax.jit(jax.grad(loss))(variables[STATE])
    first = jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32)))
    second_in = jnp.asarray(x.astype(jnp.bfloat16)) @ d0["kernel"].astype(jnp.bfloat16)
    second = jnp.max(jnp.abs((second_in + d0["bias"]).astype(jnp.bfloat16).astype(jnp.float32)))
    got = float(new["Dense_0"]["input_amax_history"][0])
    assert got == pytest.approx(max(float(first), float(second)), rel=0.1)
    assert got < float(first) + float(second) - 0.1  # not the sum


@pytest.mark.filterwarnings("ignore:Delayed float8 scaling")  # a one-step gradient check
@pytest.mark.parametrize("policy", ["mixed_float8", "mixed_float8_delayed"])
def test_linen_fp8_outputs_and_gradients_close_to_bf16(policy):
    model, x, variables = _train_linen(policy)
    bf16, _, _ = _train_linen("mixed_bfloat16")
    y, y16 = model.apply(variables, x), bf16.apply({"params": variables["params"]}, x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, y16, atol=0.15, rtol=0.1)

    # Gradients under the default residuals (the compute_dtype mode gave NaN around float8).
    def grads(m, v):
        return jax.grad(lambda p: jnp.mean((m.apply({**v, "params": p}, x) - 1.0) ** 2))(
            v["params"]
        )

    g, g16 = grads(model, variables), grads(bf16, {"params": variables["params"]})
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g16), strict=True):
        assert np.isfinite(np.asarray(a)).all()
        # e5m2 keeps 2 mantissa bits: single entries may be far off, the tensor is not
        assert np.linalg.norm(a - b) <= 0.2 * np.linalg.norm(b)
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    dtypes = {op.lhs_dtype for op in report.ops}
    assert dtypes == {"float8_e4m3fn"}, report


def test_linen_nn_scan_over_layers_keeps_a_state_per_layer():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return nn.relu(nn.Dense(8)(h)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scan = nn.scan(
                Block,
                variable_axes={"params": 0, STATE: 0},
                split_rngs={"params": True},
                length=3,
            )
            return scan()(x, None)[0]

    model = jaxamp.linen.apply_policy(Stack(), "mixed_float8_delayed")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = jax.jit(model.init)(jax.random.key(1), x)
    history = variables[STATE]["ScanBlock_0"]["Dense_0"]["input_amax_history"]
    assert history.shape == (3, 1024)

    def loss(state):
        return jnp.sum(model.apply({"params": variables["params"], STATE: state}, x))

    new = jax.jit(jax.grad(loss))(variables[STATE])
    amax = new["ScanBlock_0"]["Dense_0"]["input_amax_history"][:, 0]
    assert float(amax[0]) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=0.01)
    assert len(set(np.asarray(amax).tolist())) == 3  # each layer its own


def test_linen_state_survives_an_orbax_round_trip_bit_for_bit(tmp_path):
    import orbax.checkpoint as ocp

    model, x, variables = _train_linen("mixed_float8_delayed")

    def loss(state):
        return jnp.sum(model.apply({"params": variables["params"], STATE: state}, x))

    state = jax.jit(jax.grad(loss))(variables[STATE])
    saved = {"params": variables["params"], STATE: state}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", saved)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", saved)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_loss_scaled_refuses_the_state_instead_of_unscaling_it():
    model, x, variables = _train_linen("mixed_float8_delayed")
    tx = jaxamp.loss_scaled(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"FP8 state.*_overwrite_with_gradient"):
        tx.init(variables)
    state = tx.init(variables["params"])
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)
    with pytest.raises(ValueError, match="Its gradient is its next value"):
        tx.update(grads, state, variables["params"])


def _nnx_model(policy, overrides=None):
    model = nnx.Sequential(
        nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 2, rngs=nnx.Rngs(1))
    )
    return jaxamp.nnx.apply_policy(model, policy, overrides=overrides)


def _nnx_delayed_training(tx, scaled):
    """20 steps of the delayed float8 model with ``tx``; the loss multiplied by the loss
    scale (``jaxamp.scale_loss``) where ``scaled``. Returns the model and the losses."""
    model = _nnx_model("mixed_float8_delayed")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))

    @nnx.jit
    def step(model, optimizer, x):
        def loss(model):
            value = jnp.mean((model(x) - 1.0) ** 2)
            return (jaxamp.scale_loss(value, optimizer) if scaled else value), value

        (_, value), grads = nnx.value_and_grad(loss, argnums=wrt, has_aux=True)(model)
        grads = jaxamp.nnx.update_fp8_state(model, grads)
        optimizer.update(model, grads)
        return value

    losses = [float(step(model, optimizer, x)) for _ in range(20)]
    return model, x, losses


def test_nnx_delayed_state_updates_through_update_fp8_state_and_optimizer():
    """Through ``loss_scaled`` with a scaled loss, SGD (which, unlike Adam, a gradient
    left scaled or unscaled twice would not hide) follows plain optax's SGD on the
    unscaled loss, and the float8 state updates once per step."""
    model, x, losses = _nnx_delayed_training(jaxamp.loss_scaled(optax.sgd(0.05)), scaled=True)
    _, _, reference = _nnx_delayed_training(optax.sgd(0.05), scaled=False)
    np.testing.assert_allclose(losses, reference, rtol=0.02)
    first = model.layers[0]
    assert float(first.input_amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))), 0.01)
    assert int(jnp.sum(first.input_amax_history[...] > 0)) == 20  # one entry per step
    assert float(first.input_scale[0]) != 1.0
    assert losses[-1] < 0.5 * losses[0]


_F32_DELAYED = "p=f32,c=f32,fp8=delayed"


@pytest.mark.parametrize(
    "policy, override",
    [
        ("mixed_float8_delayed", None),
        # a layer kept wider than the root (a float32 compute dtype) with its own state
        ("mixed_float8_delayed", _F32_DELAYED),
        ("mixed_bfloat16", _F32_DELAYED),
        ("mixed_bfloat16", "mixed_float8_delayed"),
    ],
)
def test_nnx_matches_linen_under_the_same_policy(policy, override):
    """The same two-layer model and parameters under NNX and Linen, the second layer under
    an override: the same outputs and the same next state (NNX's paths hold the same six
    names). An NNX layer kept wider than the root policy had failed at its first call."""
    model = _nnx_model(policy, override and {"layers/2": override})
    x = jax.random.normal(jax.random.key(0), (4, 8))

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(16)(x))
            return nn.Dense(2)(h)

    linen = jaxamp.linen.apply_policy(Two(), policy, overrides=override and {"Dense_1": override})
    variables = linen.init(jax.random.key(1), x)
    params = {
        f"Dense_{i}": {
            "kernel": model.layers[j].kernel[...],
            "bias": model.layers[j].bias[...],
        }
        for i, j in ((0, 0), (1, 2))
    }
    state = variables.get(STATE, {})
    np.testing.assert_array_equal(model(x), linen.apply({"params": params, STATE: state}, x))
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)), argnums=wrt)(model)
    jaxamp.nnx.update_fp8_state(model, grads)
    new = jax.grad(lambda s: jnp.sum(linen.apply({"params": params, STATE: s}, x)))(state)
    for i, j in ((0, 0), (1, 2)):
        for name, value in new.get(f"Dense_{i}", {}).items():
            np.testing.assert_array_equal(getattr(model.layers[j], name)[...], value, name)
    assert ("Dense_1" in new) == (override is not None or "float8" in policy)


def test_float8_policy_grammar_and_errors():
    assert jaxamp.get_policy("mixed_float8") == jaxamp.get_policy("p=f32,c=bf16,o=f32,fp8=current")
    policy = jaxamp.get_policy("p=f32,c=f32,fp8=delayed")
    assert policy.fp8 == jaxamp.Fp8Recipe("delayed") and policy.is_mixed
    assert str(jaxamp.get_policy("mixed_float8_delayed")).endswith(",fp8=delayed")
    with pytest.raises(ValueError, match=r"fp8 scaling 'late'.*current.*delayed"):
        jaxamp.get_policy("p=f32,fp8=late")
    with pytest.raises(ValueError, match="amax_history_length"):
        jaxamp.Fp8Recipe("delayed", amax_history_length=0)
    with pytest.raises(ValueError, match=r"fp8_margin='-1' must be an integer >= 0"):
        jaxamp.get_policy("p=f32,fp8=delayed,fp8_margin=-1")
    with pytest.raises(ValueError, match=r"fp8_history='0' must be an integer >= 1"):
        jaxamp.get_policy("p=f32,fp8=delayed,fp8_history=0")
    assert jaxamp.Fp8Recipe("Delayed") == jaxamp.Policy("float32", fp8="Delayed").fp8


@pytest.mark.standard_promotion(OPTAX)
def test_accumulation_with_multisteps_advances_the_state_every_micro_step():
    """loss_scaled(MultiSteps(adam)): the optimizer averages gradients over micro-steps;
    the state never enters it, so each micro-batch's amax is pushed, none averaged."""
    model, x, variables = _train_linen("mixed_float8_delayed")
    tx = jaxamp.loss_scaled(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
    params, state = variables["params"], variables[STATE]
    opt = tx.init(params)

    @jax.jit
    def micro_step(params, state, opt, x):
        def loss(params, state):
            return jnp.mean(model.apply({"params": params, STATE: state}, x) ** 2)

        grads, new_state = jax.grad(loss, argnums=(0, 1))(params, state)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), new_state, opt

    scales = [1.0, 2.0, 4.0, 8.0]
    for s in scales:
        params, state, opt = micro_step(params, state, opt, x * s)
    history = np.asarray(state["Dense_0"]["input_amax_history"])
    amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32))))
    np.testing.assert_allclose(history[[-3, -2, -1, 0]], [amax * s for s in scales], rtol=1e-6)


def test_in_step_accumulation_over_a_scan_combines_by_max_with_max_combined():
    """Micro-batches accumulated in a lax.scan inside one differentiated step: converting
    the state with jaxamp.ops.max_combined first makes their uses combine by max."""
    model, x, variables = _train_linen("mixed_float8_delayed")
    xs = jnp.stack([x, 3 * x, 2 * x])

    def loss(state, combine):
        if combine:
            state = jaxamp.ops.max_combined(state)

        def body(total, xb):
            y = model.apply({"params": variables["params"], STATE: state}, xb)
            return total + jnp.sum(y), None

        return jax.lax.scan(body, 0.0, xs)[0]

    amax = float(jnp.max(jnp.abs((3 * x).astype(jnp.bfloat16).astype(jnp.float32))))
    new = jax.jit(jax.grad(loss), static_argnums=1)(variables[STATE], True)
    assert float(new["Dense_0"]["input_amax_history"][0]) == pytest.approx(amax, rel=1e-6)
    summed = jax.jit(jax.grad(loss), static_argnums=1)(variables[STATE], False)
    assert float(summed["Dense_0"]["input_amax_history"][0]) > 1.5 * amax  # why it is needed


_LINEN_LAYERS = {
    "Dense": lambda: nn.Dense(6),
    "DenseGeneral": lambda: nn.DenseGeneral((2, 3)),
    "Einsum": lambda: nn.Einsum((8, 6), "bi,io->bo"),
    "MultiHeadDotProductAttention": lambda: nn.MultiHeadDotProductAttention(2, qkv_features=8),
}


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("layer", sorted(_LINEN_LAYERS))
def test_linen_layers_run_in_float8_close_to_float32(layer, scaling):
    x = jax.random.normal(jax.random.key(0), (4, 8))
    x = x[:, None, :] * jnp.ones((1, 3, 1)) if layer.startswith("Multi") else x
    model = jaxamp.linen.apply_policy(_LINEN_LAYERS[layer](), f"p=f32,c=f32,fp8={scaling}")
    variables = model.init(jax.random.key(1), x)
    assert (STATE in variables) == (scaling == "delayed")
    plain = _LINEN_LAYERS[layer]()
    y, ref = model.apply(variables, x), plain.apply({"params": variables["params"]}, x)
    assert np.linalg.norm(y - ref) <= 0.1 * np.linalg.norm(ref)
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    gemms = [op for op in report.ops if op.contracts]
    # the layers' GEMMs in float8; attention's two matmuls (no hook) in the compute dtype
    unhooked = 2 if layer.startswith("Multi") else 0
    assert gemms and sum(op.float8 for op in gemms) == len(gemms) - unhooked, report
    assert all(op.float8 or op.lhs_dtype == "float32" for op in gemms), report


_NNX_LAYERS = {
    "Linear": lambda: nnx.Linear(8, 6, rngs=nnx.Rngs(0)),
    "LinearGeneral": lambda: nnx.LinearGeneral(8, (2, 3), rngs=nnx.Rngs(0)),
    "Einsum": lambda: nnx.Einsum("bi,io->bo", (8, 6), rngs=nnx.Rngs(0)),
}


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("layer", sorted(_NNX_LAYERS))
def test_nnx_layers_run_in_float8_close_to_float32(layer, scaling):
    x = jax.random.normal(jax.random.key(0), (4, 8))
    ref = _NNX_LAYERS[layer]()(x)
    model = jaxamp.nnx.apply_policy(_NNX_LAYERS[layer](), f"p=f32,c=f32,fp8={scaling}")
    assert hasattr(model, "input_scale") == (scaling == "delayed")
    y = model(x)
    assert np.linalg.norm(y - ref) <= 0.1 * np.linalg.norm(ref)
    if scaling == "delayed":
        wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
        grads = nnx.grad(lambda m: jnp.sum(m(x)), argnums=wrt)(model)
        jaxamp.nnx.update_fp8_state(model, grads)
        assert float(model.input_amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))))
    again = jaxamp.nnx.apply_policy(model, "float32")  # back to Flax's own, state removed
    assert not hasattr(again, "input_scale")
    np.testing.assert_array_equal(again(x), ref)


def test_a_state_left_out_of_the_gradient_is_warned_about():
    """grad with respect to params alone would leave the state at its first scale of 1
    forever: warned, for Linen and NNX; the documented steps and plain calls are not."""
    x = jnp.ones((2, 4))
    model = jaxamp.linen.apply_policy(nn.Dense(3), "mixed_float8_delayed")
    v = model.init(jax.random.key(0), x)
    with pytest.warns(UserWarning, match="FP8 state is not"):
        jax.grad(lambda p: jnp.sum(model.apply({**v, "params": p}, x)))(v["params"])
    nnx_model = jaxamp.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "mixed_float8_delayed")
    with pytest.warns(UserWarning, match="FP8 state is not"):
        nnx.grad(lambda m: jnp.sum(m(x)))(nnx_model)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        both = jax.grad(
            lambda p, s: jnp.sum(model.apply({"params": p, STATE: s}, x)), argnums=(0, 1)
        )
        both(v["params"], v[STATE])
        model.apply(v, x)
        wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
        nnx.grad(lambda m: jnp.sum(m(x)), argnums=wrt)(nnx_model)
        nnx_model(x)


# --- from the FP8 review: each a defect seen failing before its fix ----------------------


class _WithAux(nn.Module):
    @nn.compact
    def __call__(self, x):
        body = nn.Dense(8, name="body")(x)
        aux = nn.Dense(8, name="aux")(x)
        frozen = nn.Dense(8, name="frozen")(jax.lax.stop_gradient(x))
        return body, aux, jax.lax.stop_gradient(frozen)


def test_a_layer_left_out_of_the_loss_keeps_its_state_linen():
    """An auxiliary output or a stop_gradient branch gets a zero gradient; taken as the next
    state, its scale of 0 zeroed the layer's outputs for good."""
    model = jaxamp.linen.apply_policy(_WithAux(), "mixed_float8_delayed")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = model.init(jax.random.key(1), x)

    def loss(params, state):
        body, aux, _ = model.apply({"params": params, STATE: state}, x)
        return jnp.mean(body**2), jnp.mean(aux)

    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    state = variables[STATE]
    for _ in range(2):
        (_, state), _ = step(variables["params"], state)
    for name in ("aux", "frozen"):
        np.testing.assert_equal(
            jax.tree.map(np.asarray, dict(state[name])),
            jax.tree.map(np.asarray, dict(variables[STATE][name])),
        )
    assert float(state["body"]["input_scale"][0]) != 1.0
    _, aux, frozen = model.apply({"params": variables["params"], STATE: state}, x)
    assert float(jnp.abs(frozen).max()) > 0.1 and float(jnp.abs(aux).max()) > 0.1


def test_a_layer_left_out_of_the_loss_keeps_its_state_nnx():
    class Model(nnx.Module):
        def __init__(self):
            self.body = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
            self.aux = nnx.Linear(8, 8, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.body(x), self.aux(x)

    model = jaxamp.nnx.apply_policy(Model(), "mixed_float8_delayed")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    for _ in range(2):
        grads = nnx.grad(lambda m: jnp.mean(m(x)[0] ** 2), argnums=wrt)(model)
        jaxamp.nnx.update_fp8_state(model, grads)
    assert float(model.aux.input_scale[0]) == 1.0
    assert float(model.body.input_scale[0]) != 1.0
    assert float(jnp.abs(model(x)[1]).max()) > 0.1


def test_a_zeroed_state_starts_over_instead_of_zeroing_the_layer():
    """A state zeroed elsewhere (Flax's own step on an unused layer) recovers: a scale that
    is not positive counts as the initial 1."""
    from jaxamp.ops import fp8_dot_general, init_gemm_fp8_state

    gemm_state = init_gemm_fp8_state(4)._replace(
        input_scale=jnp.zeros((1,)), kernel_scale=jnp.zeros((1,))
    )
    y = jax.jit(
        lambda s: fp8_dot_general(
            jnp.ones((2, 3)), jnp.ones((3, 2)), (((1,), (0,)), ((), ())), fp8_state=s
        )
    )(gemm_state)
    np.testing.assert_allclose(y, 3.0)


def test_mutable_apply_still_combines_the_state_by_max():
    model, x, variables = _train_linen("mixed_float8_delayed", reuse=True)

    def loss(state, mutable):
        out = model.apply({"params": variables["params"], STATE: state}, x, mutable=mutable)
        return jnp.sum(out[0])

    expected = jax.grad(loss)(variables[STATE], False)
    got = jax.grad(loss)(variables[STATE], True)
    np.testing.assert_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, expected))
    _, updated = model.apply(variables, x, mutable=True)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(updated[STATE]))


def test_a_reused_layer_differentiates_without_jit():
    """Eager gradients add the max-combined cotangents outside jit (a KeyError before)."""
    model, x, variables = _train_linen("mixed_float8_delayed", reuse=True)

    def loss(state):
        return jnp.sum(model.apply({"params": variables["params"], STATE: state}, x))

    eager, jitted = jax.grad(loss)(variables[STATE]), jax.jit(jax.grad(loss))(variables[STATE])
    np.testing.assert_equal(jax.tree.map(np.asarray, eager), jax.tree.map(np.asarray, jitted))


def test_stacked_nnx_layers_run_by_nnx_scan_get_a_state_per_layer():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.lin(x))

    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(x, block):
                return block(x)

            return body(x, self.blocks)

    model = jaxamp.nnx.apply_policy(Stack(nnx.Rngs(0)), "mixed_float8_delayed")
    assert model.blocks.lin.input_amax_history.shape == (3, 1024)
    x = jax.random.normal(jax.random.key(0), (4, 8))
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    grads = nnx.grad(lambda m: jnp.sum(m(x)), argnums=wrt)(model)
    jaxamp.nnx.update_fp8_state(model, grads)
    first = model.blocks.lin.input_amax_history[:, 0]
    assert float(first[0]) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=0.01)
    assert len(set(np.asarray(first).tolist())) == 3


def test_a_recipe_policy_string_parses_back():
    recipe = jaxamp.Fp8Recipe("delayed", amax_history_length=np.int64(16), margin=1)
    policy = jaxamp.Policy("float32", "bfloat16", "float32", fp8=recipe)
    assert str(policy).endswith("fp8=delayed,fp8_history=16,fp8_margin=1")
    assert jaxamp.get_policy(str(policy)) == policy
    with pytest.raises(ValueError, match="need fp8="):
        jaxamp.get_policy("p=f32,fp8_history=16")


def test_a_missing_state_is_refused_with_what_to_pass():
    """nn.scan without the collection in variable_axes, and apply without the collection:
    each names the layer and what to add (Flax's own error named neither)."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.tanh(nn.Dense(8)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
            )
            return layers()(x, None)[0]

    x = jnp.ones((2, 8))
    stack = jaxamp.linen.apply_policy(Stack(), "mixed_float8_delayed")
    with pytest.raises(ValueError, match=r"ScanBlock_0/Dense_0.*'_overwrite_with_gradient': 0"):
        stack.init(jax.random.key(0), x)
    model, x, variables = _train_linen("mixed_float8_delayed")
    with pytest.raises(ValueError, match=r"Dense_0 found no '_overwrite_with_gradient'.*apply"):
        model.apply({"params": variables["params"]}, x)


@pytest.mark.parametrize("transform", ["jit", "grad_wrt_input", "vmap"])
def test_an_nnx_model_closed_over_by_a_jax_transformation_runs(transform):
    """jax.jit, jax.grad with respect to the input and jax.vmap of a function closing over
    an NNX model under delayed scaling (evaluation, saliency): the state is read, never
    written, so the model's variables of another trace are left alone (this failed with
    TraceContextError), and the outputs equal the model called directly."""
    model = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    jaxamp.nnx.apply_policy(model, "mixed_float8_delayed")
    x = jax.random.normal(jax.random.key(1), (4, 8))
    expected = {
        "jit": model(x),
        "grad_wrt_input": None,
        "vmap": jnp.stack([model(xi) for xi in x]),
    }[transform]
    if transform == "jit":
        got = jax.jit(lambda x: model(x))(x)
    elif transform == "grad_wrt_input":
        got = jax.grad(lambda x: jnp.sum(model(x)))(x)
        expected = jax.grad(lambda x: jnp.sum(nnx.merge(*nnx.split(model))(x)))(x)
    else:
        got = jax.vmap(lambda xi: model(xi))(x)
        expected = model(x)  # one amax over the whole batch, as the unbatched call
    np.testing.assert_array_equal(got, expected)
    assert model.input_amax_history[...].dtype == jnp.float32


def test_nnx_linear_general_with_batch_axis_keeps_one_state():
    """nnx.LinearGeneral's batch_axis dimensions lead its kernel: not a stack of layers."""
    layer = nnx.LinearGeneral(8, 5, axis=-1, batch_axis={0: 3}, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (3, 4, 8))
    call = nnx.jit(lambda m, x: m(x))
    expected = call(layer, x)
    jaxamp.nnx.apply_policy(layer, "mixed_float8_delayed")
    assert layer.input_amax_history[...].shape == (1024,)
    np.testing.assert_allclose(
        call(layer, x), expected, atol=0.1 * float(jnp.max(jnp.abs(expected)))
    )


def test_loss_scaled_refuses_nnx_state_at_init():
    """An NNX state's leaves sit under '.value': nnx.Optimizer with the state among wrt is
    refused at once (it was accepted, and the state stepped by the optimizer)."""
    model = _nnx_model("mixed_float8_delayed")
    both = nnx.Any(nnx.Param, jaxamp.nnx.OverwriteWithGradient)
    with pytest.raises(ValueError, match="FP8 state among the params"):
        nnx.Optimizer(model, jaxamp.loss_scaled(optax.sgd(0.1)), wrt=both)
    with pytest.raises(ValueError, match="FP8 state among the params"):
        jaxamp.loss_scaled(optax.sgd(0.1)).init(nnx.state(model))


def test_an_nnx_transform_inside_the_model_beside_a_plain_layer_keeps_its_state():
    """A layer run through nnx.remat inside __call__, beside a plain head: its next state is
    its own (the copy nnx.remat makes read the unconverted state, and old + new came back:
    the scale of an all-zero history went to 2)."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 8, rngs=rngs)
            self.b = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.remat(lambda mod, x: mod(x))(self.a, x))

    model = Model(nnx.Rngs(0))
    jaxamp.nnx.apply_policy(model, "p=f32,c=f32,fp8=delayed,fp8_history=4")
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    x = jnp.ones((4, 8))

    @nnx.jit
    def step(model, x):
        grads = nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=wrt)(model)
        jaxamp.nnx.update_fp8_state(model, grads)

    step(model, x)
    np.testing.assert_array_equal(model.a.input_scale[...], [1.0])
    np.testing.assert_array_equal(model.a.input_amax_history[...], [1.0, 0, 0, 0])
    step(model, x)
    np.testing.assert_allclose(model.a.input_scale[...], [1 / 448], rtol=1e-6)
    np.testing.assert_array_equal(model.a.input_amax_history[...], [1.0, 0, 0, 1.0])


_RAW_JAX = {
    "python": lambda layer, xs: sum(layer(x) for x in xs),
    "scan": lambda layer, xs: jax.lax.scan(
        lambda c, x: (c + layer(x), None), jnp.zeros((2, 4)), xs
    )[0],
    "fori_loop": lambda layer, xs: jax.lax.fori_loop(
        0, len(xs), lambda i, c: c + layer(xs[i]), jnp.zeros((2, 4))
    ),
    "checkpoint": lambda layer, xs: sum(jax.checkpoint(lambda x: layer(x))(x) for x in xs),
    "cond": lambda layer, xs: sum(jax.lax.cond(True, layer, lambda x: x[..., :4], x) for x in xs),
    "vmap": lambda layer, xs: jax.vmap(layer)(xs).sum(0),
}


@pytest.mark.parametrize("construct", sorted(set(_RAW_JAX) - {"python"}))
def test_an_nnx_layer_inside_jax_control_flow_in_the_model_matches_a_python_loop(construct):
    """A layer called inside jax.lax.scan, fori_loop, cond, jax.checkpoint or jax.vmap written
    in the model's __call__ (raised TraceContextError: the layer was written to during its
    call) has the outputs and next state of the same calls written as a Python loop."""

    class Model(nnx.Module):
        def __init__(self, run, rngs):
            self.run = run
            self.layer = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, xs):
            return self.run(self.layer, xs)

    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    xs = jax.random.normal(jax.random.key(0), (3, 2, 8)) * jnp.array([1.0, 9.0, 0.5])[:, None, None]
    results = []
    for run in (_RAW_JAX["python"], _RAW_JAX[construct]):
        model = jaxamp.nnx.apply_policy(Model(run, nnx.Rngs(0)), "p=f32,c=f32,fp8=delayed")

        @nnx.jit
        def step(model):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(xs) ** 2), argnums=wrt)(model)
            jaxamp.nnx.update_fp8_state(model, grads)
            return loss

        losses = [step(model) for _ in range(3)]
        results.append((losses, nnx.state(model, jaxamp.nnx.OverwriteWithGradient)))
    (ref_losses, ref_state), (losses, state) = results
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert float(state["layer"]["input_scale"][...][0]) != 1.0  # the scales moved


def test_a_model_returning_its_state_returns_float32():
    """A model that returns a layer's scale (to monitor it) returns float32, in Linen and
    NNX, eagerly and under jit: it returned the call's fp8_max32 values, on which no
    arithmetic works."""

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            dense = nn.Dense(8)
            return dense(x), dense.variables[STATE]["input_scale"]

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.layer = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return self.layer(x), self.layer.input_scale[...]

    x, policy = jnp.ones((2, 8)), "mixed_float8_delayed"
    linen = jaxamp.linen.apply_policy(Linen(), policy)
    variables = linen.init(jax.random.key(0), x)
    nnx_model = jaxamp.nnx.apply_policy(Nnx(nnx.Rngs(0)), policy)
    for call in (
        lambda x: linen.apply(variables, x),
        jax.jit(lambda x: linen.apply(variables, x)),
        lambda x: nnx_model(x),
        lambda x: nnx.jit(lambda m, x: m(x))(nnx_model, x),
    ):
        _, scale = call(x)
        assert scale.dtype == jnp.float32, scale.dtype
        np.testing.assert_array_equal(scale * 2, [2.0])
    # a loss that adds the returned scale (crashed: UndefinedPrimal) has the next state of
    # one that does not: the returned value is a reading, no gradient flows back through it
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    with_scale = lambda m, k: jnp.sum(m(x)[0]) + k * jnp.sum(m(x)[1])
    states = [nnx.grad(with_scale, argnums=wrt)(nnx_model, k) for k in (0.0, 1.0)]
    for a, b in zip(*(jax.tree.leaves(s) for s in states), strict=True):
        np.testing.assert_array_equal(a, b)
    loss = lambda s, k: (
        jnp.sum(linen.apply({**variables, STATE: s}, x)[0])
        + k * jnp.sum(linen.apply({**variables, STATE: s}, x)[1])
    )
    np.testing.assert_equal(
        *(jax.tree.map(np.asarray, jax.grad(loss)(variables[STATE], k)) for k in (0.0, 1.0))
    )


@pytest.mark.parametrize("shared_input", [True, False])
def test_an_nnx_ensemble_run_by_nnx_vmap_matches_its_members_run_one_by_one(shared_input):
    """Layers stacked by nnx.vmap and run by it (an ensemble) against the same layers as
    separate modules in a Python loop, members' weights far apart: losses and every
    member's state over 3 jitted steps (every member had recorded the largest one's amax)."""
    factors = [1.0, 50.0, 0.02]
    x = jax.random.normal(jax.random.key(1), (4, 8)) * 5
    xs = jnp.stack([x * f for f in factors[::-1]])
    in_axes = (0, None) if shared_input else (0, 0)

    class Ensemble(nnx.Module):
        def __init__(self, rngs):
            @nnx.split_rngs(splits=len(factors))
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return nnx.Linear(8, 8, rngs=rngs)

            self.layers = make(rngs)
            self.layers.kernel[...] *= jnp.array(factors)[:, None, None]

        def __call__(self, x):
            return nnx.vmap(lambda layer, x: layer(x), in_axes=in_axes)(self.layers, x)

    class Loop(nnx.Module):
        def __init__(self, ensemble):
            self.layers = nnx.List([nnx.Linear(8, 8, rngs=nnx.Rngs(0)) for _ in factors])
            for i, layer in enumerate(self.layers):
                layer.kernel[...] = ensemble.layers.kernel[i]
                layer.bias[...] = ensemble.layers.bias[i]

        def __call__(self, x):
            inputs = [x] * len(factors) if shared_input else list(x)
            return jnp.stack([layer(xi) for layer, xi in zip(self.layers, inputs, strict=True)])

    policy = "p=f32,c=f32,fp8=delayed,fp8_history=4"
    ensemble = jaxamp.nnx.apply_policy(Ensemble(nnx.Rngs(0)), policy)
    loop = jaxamp.nnx.apply_policy(Loop(ensemble), policy)
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))

    @nnx.jit
    def step(model, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2), argnums=wrt)(model)
        jaxamp.nnx.update_fp8_state(model, grads)
        return loss

    inputs = x if shared_input else xs
    for _ in range(3):
        np.testing.assert_allclose(step(ensemble, inputs), step(loop, inputs), rtol=1e-6)
    for i, layer in enumerate(loop.layers):
        for name in jaxamp.ops.Fp8State._fields:
            np.testing.assert_allclose(
                getattr(ensemble.layers, name)[...][i],
                getattr(layer, name)[...],
                rtol=1e-6,
                err_msg=f"member {i}, {name}",
            )


def test_a_linen_ensemble_run_by_nn_vmap_matches_its_members_run_one_by_one():
    """The same for Linen: nn.vmap over params and the state, against separate layers."""
    factors = [1.0, 50.0, 0.02]
    ensemble = nn.vmap(
        nn.Dense,
        variable_axes={"params": 0, STATE: 0},
        split_rngs={"params": True},
        in_axes=None,
        axis_size=len(factors),
    )(8)

    class Loop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.stack([nn.Dense(8, name=f"member_{i}")(x) for i in range(len(factors))])

    policy = "p=f32,c=f32,fp8=delayed,fp8_history=4"
    ensemble = jaxamp.linen.apply_policy(ensemble, policy)
    loop = jaxamp.linen.apply_policy(Loop(), policy)
    x = jax.random.normal(jax.random.key(1), (4, 8)) * 5
    variables = ensemble.init(jax.random.key(0), x)
    params = dict(variables["params"])
    params["kernel"] = params["kernel"] * jnp.array(factors)[:, None, None]
    state = variables[STATE]
    loop_params = {
        f"member_{i}": jax.tree.map(lambda v, i=i: v[i], params) for i in range(len(factors))
    }
    loop_state = loop.init(jax.random.key(0), x)[STATE]

    def loss(apply, params, state):
        return jnp.sum(apply({"params": params, STATE: state}, x) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(1, 2)), static_argnums=0)
    for _ in range(3):
        got, (_, state) = step(ensemble.apply, params, state)
        want, (_, loop_state) = step(loop.apply, loop_params, loop_state)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    for i in range(len(factors)):
        for name, value in loop_state[f"member_{i}"].items():
            np.testing.assert_allclose(state[name][i], value, rtol=1e-6, err_msg=f"{i} {name}")


def test_an_nnx_layer_of_ones_own_with_a_rank_3_kernel_keeps_one_state():
    """A layer of a class of one's own following Flax's hook convention, with a per-head
    kernel (heads, in, out), is one layer with one state (it had been read as a stack of
    layers made by nnx.vmap and failed at its call): its next state and gradient are the
    float8 GEMM's own, with the same state."""
    dims = (((2,), (1,)), ((0,), (0,)))

    class PerHead(nnx.Module):
        def __init__(self, rngs):
            self.kernel = nnx.Param(jax.random.normal(rngs.params(), (3, 4, 5)))
            self.dot_general = jax.lax.dot_general

        def __call__(self, x):
            return self.dot_general(x, self.kernel[...], dims)

    model = jaxamp.nnx.apply_policy(PerHead(nnx.Rngs(0)), "p=f32,c=f32,fp8=delayed,fp8_history=4")
    assert model.input_amax_history.shape == (4,)
    x = jax.random.normal(jax.random.key(1), (3, 2, 4))
    wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=wrt))(model)
    kernel = model.kernel[...]
    jaxamp.nnx.update_fp8_state(model, grads)

    def reference(kernel, gemm_state):
        return jnp.sum(jaxamp.ops.fp8_dot_general(x, kernel, dims, fp8_state=gemm_state) ** 2)

    want_kernel, want_gemm_state = jax.jit(jax.grad(reference, argnums=(0, 1)))(
        kernel, jaxamp.ops.init_gemm_fp8_state(4)
    )
    np.testing.assert_allclose(grads["kernel"][...], want_kernel, rtol=1e-6)
    for name in jaxamp.ops.Fp8State._fields:
        np.testing.assert_array_equal(
            getattr(model, name)[...], getattr(want_gemm_state, name), name
        )


def test_a_state_of_another_history_length_is_refused_naming_both():
    """A state made under another fp8_history (a checkpoint restored under a new policy)
    had run with its own length, the policy's ignored: Linen, NNX and autocast refuse it."""
    policy = "p=f32,c=f32,fp8=delayed,fp8_history=4"
    other = jaxamp.get_policy("p=f32,c=f32,fp8=delayed,fp8_history=2")
    x = jnp.ones((2, 8))
    match = "length 2, and the policy's fp8_history is 4"
    linen = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    params = linen.init(jax.random.key(0), x)["params"]
    old_state = jaxamp.linen.apply_policy(nn.Dense(3), other).init(jax.random.key(0), x)[STATE]
    with pytest.raises(ValueError, match=match):
        jax.jit(linen.apply)({"params": params, STATE: old_state}, x)

    model = jaxamp.nnx.apply_policy(nnx.Linear(8, 3, rngs=nnx.Rngs(0)), other)
    old_nnx = nnx.state(model, jaxamp.nnx.OverwriteWithGradient)
    jaxamp.nnx.apply_policy(model, policy)
    nnx.update(model, old_nnx)
    with pytest.raises(ValueError, match=match):
        model(x)

    f = jaxamp.autocast(lambda w, x: x @ w, policy)
    w = jnp.ones((8, 3))
    old_ac = jaxamp.init_fp8_state(jaxamp.autocast(lambda w, x: x @ w, other), w, x)
    with pytest.raises(ValueError, match=match):
        jax.jit(f)(w, x, fp8_state=old_ac)
    with pytest.raises(ValueError, match="amax_history_length must be an integer >= 1, got 0"):
        jaxamp.ops.init_gemm_fp8_state(0)


@pytest.mark.parametrize("override", ["mixed_float8", "mixed_float8_delayed"])
def test_a_float8_layer_under_a_16_bit_root_trains_as_without_checkpointing(override):
    """A float8 layer under a 16-bit root: the root's residual policy checkpoints the
    model, saving the layer's e4m3 operands, which JAX rounded to a format whose largest
    value is 240 (NaN above it): every gradient was NaN. Three steps equal those without
    checkpointing (residuals="all")."""

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="b")(nn.relu(nn.Dense(16, name="a")(x)))

    x = jax.random.normal(jax.random.key(1), (8, 12))

    def train(residuals):
        model = jaxamp.linen.apply_policy(
            Two(), "mixed_bfloat16", overrides={"a": override}, residuals=residuals
        )
        variables = model.init(jax.random.key(0), x)
        params, state = variables["params"], variables.get(STATE, {})

        def loss(params, state):
            y = model.apply({"params": params, STATE: state}, x)
            return jnp.sum(y.astype(jnp.float32) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        losses = []
        for _ in range(3):
            value, (grads, state) = step(params, state)
            params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
            losses.append(value)
        return losses, params

    (losses, params), (ref_losses, ref_params) = train("compute_dtype"), train("all")
    assert np.all(np.isfinite(losses))
    np.testing.assert_array_equal(losses, ref_losses)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_a_float32_override_keeps_a_layer_out_of_a_float32_compute_float8_root(scaling):
    """Under p=f32,c=f32,fp8=..., an override to "float32" keeps the layer out of float8
    (its matmul had run in float8 all the same, current scaling), in Linen and NNX: the
    model's output is the float8 body's, then the head in float32."""
    root = f"p=f32,c=f32,fp8={scaling}"
    x = jax.random.normal(jax.random.key(1), (8, 12)) * 3

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.Dense(16, name="body")(x))

    model = jaxamp.linen.apply_policy(Linen(), root, overrides={"head": "float32"})
    variables = model.init(jax.random.key(0), x)
    body = jaxamp.linen.apply_policy(nn.Dense(16), root)
    body_vars = {"params": variables["params"]["body"]}
    if scaling == "delayed":
        body_vars[STATE] = variables[STATE]["body"]
    head = variables["params"]["head"]
    want = body.apply(body_vars, x) @ head["kernel"] + head["bias"]
    np.testing.assert_allclose(model.apply(variables, x), want, rtol=1e-6)
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    assert report.float8_gemms() == (1, 1)

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.Linear(12, 16, rngs=rngs)
            self.head = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(self.body(x))

    model = jaxamp.nnx.apply_policy(Nnx(nnx.Rngs(0)), root, overrides={"head": "float32"})
    body = jaxamp.nnx.apply_policy(nnx.clone(model.body), root)
    want = body(x) @ model.head.kernel[...] + model.head.bias[...]
    np.testing.assert_allclose(model(x), want, rtol=1e-6)


_BAD_STATES = {
    # name: (how the layer's state is changed, what the error says)
    "a stack's state": (lambda v: jnp.stack([v] * 3), "has shape \\(3, "),
    "bfloat16": (lambda v: v.astype(jnp.bfloat16), "is bfloat16; the state is float32"),
    "float16": (lambda v: v.astype(jnp.float16), "is float16; the state is float32"),
}


@pytest.mark.parametrize("bad", sorted(_BAD_STATES))
def test_a_state_that_is_not_one_layers_float32_state_is_refused_by_name(bad):
    """A stack's state given to one layer crashed in a reshape naming neither; a 16-bit
    state ran with rounded scales and came back 16-bit. Refused in Linen, NNX and autocast."""
    change, match = _BAD_STATES[bad]
    policy = "p=f32,c=f32,fp8=delayed,fp8_history=4"
    x = jnp.ones((2, 8))
    linen = jaxamp.linen.apply_policy(nn.Dense(3), policy)
    variables = linen.init(jax.random.key(0), x)
    state = jax.tree.map(change, variables[STATE])
    with pytest.raises(ValueError, match=match):
        jax.jit(linen.apply)({"params": variables["params"], STATE: state}, x)

    model = jaxamp.nnx.apply_policy(nnx.Linear(8, 3, rngs=nnx.Rngs(0)), policy)
    for name in jaxamp.ops.Fp8State._fields:
        getattr(model, name).set_value(change(getattr(model, name).get_value()))
    with pytest.raises(ValueError, match=match):
        model(x)

    f = jaxamp.autocast(lambda w, x: x @ w, policy)
    w = jnp.ones((8, 3))
    state = jax.tree.map(change, jaxamp.init_fp8_state(f, w, x))
    with pytest.raises(ValueError, match=match):
        jax.jit(f)(w, x, fp8_state=state)
    with pytest.raises(ValueError, match=match):
        gemm_state = jax.tree.map(change, jaxamp.ops.init_gemm_fp8_state(4))
        jaxamp.ops.fp8_dot_general(x, w, (((1,), (0,)), ((), ())), fp8_state=gemm_state)


def test_amax_histories_of_different_lengths_are_not_one_state():
    gemm_state = jaxamp.ops.init_gemm_fp8_state(4)._replace(kernel_amax_history=jnp.zeros(16))
    with pytest.raises(ValueError, match=r"different lengths \[4, 16\]: not one GEMM's state"):
        jaxamp.ops.fp8_dot_general(
            jnp.ones((2, 8)), jnp.ones((8, 3)), (((1,), (0,)), ((), ())), fp8_state=gemm_state
        )


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("override", ["mixed_bfloat16", "mixed_float16", "float32"])
@pytest.mark.parametrize(
    "root", ["mixed_float8", "mixed_float8_delayed", "p=f32,c=f32,fp8=current"]
)
def test_an_override_out_of_float8_keeps_the_layers_own_matmuls_out(root, override):
    """A matmul a layer writes itself (x @ w) under an override that leaves float8 runs
    outside float8 too (under a 16-bit override it had run in float8 with current
    scaling), in Linen and NNX; a layer beside it, not overridden, stays in float8."""

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.normal(1.0), (8, 8))

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Inner(name="inner")(x) + Inner(name="other")(x)

    x = jax.random.normal(jax.random.key(1), (4, 8))
    model = jaxamp.linen.apply_policy(Linen(), root, overrides={"inner": override})
    variables = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    assert report.float8_gemms() == (1, 1)

    class NnxInner(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.random.normal(rngs.params(), (8, 8)))

        def __call__(self, x):
            return x @ self.w[...]

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.inner, self.other = NnxInner(rngs), NnxInner(rngs)

        def __call__(self, x):
            return self.inner(x) + self.other(x)

    model = jaxamp.nnx.apply_policy(Nnx(nnx.Rngs(0)), root, overrides={"inner": override})
    assert jaxamp.precision_report(lambda m: m(x))(model).float8_gemms() == (1, 1)


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float8", "mixed_float8_delayed"])
def test_a_models_own_variables_in_the_state_collection_are_left_alone(policy):
    """Variables a model keeps in '_overwrite_with_gradient' itself (by Flax's convention),
    or Flax's own float8 ops' state: every policy had converted the whole collection to
    jaxamp's max-combined dtype, and the model failed. Left alone now, their next value
    float32; Flax's ops beside a delayed float8 policy are refused, from init on."""

    class OwnVariable(nn.Module):
        @nn.compact
        def __call__(self, x):
            own = self.variable(STATE, "own", lambda: jnp.ones((8,), jnp.float32))
            return nn.Dense(4)(x * own.value)

    class WithFlaxFp8(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, dot_general_cls=nn.Fp8DirectDotGeneralOp)(x)

    x = jax.random.normal(jax.random.key(1), (2, 8))
    for cls in (OwnVariable, WithFlaxFp8):
        model = jaxamp.linen.apply_policy(cls(), policy)
        if cls is WithFlaxFp8 and policy == "mixed_float8_delayed":
            with pytest.raises(ValueError, match="Flax's own float8 op Fp8DirectDotGeneralOp"):
                model.init(jax.random.key(0), x)
            continue
        variables = model.init(jax.random.key(0), x)

        def loss(params, state, model=model):
            return jnp.sum(model.apply({"params": params, STATE: state}, x).astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        _, new = step(variables["params"], variables[STATE])
        assert jax.tree.structure(new) == jax.tree.structure(variables[STATE])
        assert all(v.dtype == jnp.float32 and np.all(np.isfinite(v)) for v in jax.tree.leaves(new))


class _NamedLikeFlaxOps(nn.Module):
    """Two plain Dense layers, named ``<prefix>Hidden`` and ``<prefix>Proj``."""

    prefix: str

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(16, name=f"{self.prefix}Hidden")(x))
        return nn.Dense(4, name=f"{self.prefix}Proj")(h)


def test_a_plain_layer_named_fp8_runs_like_any_dense_model():
    """``nn.Dense(name="Fp8Proj")`` is a Dense: under the delayed policy it inits and
    trains as the same model with other names, outputs, gradients and next state bit for
    bit. Its init passed and every apply was refused as Flax's own float8 op, by name."""
    x = jax.random.normal(jax.random.key(0), (8, 12))
    policy = "mixed_float8_delayed"
    named = jaxamp.linen.apply_policy(_NamedLikeFlaxOps("Fp8"), policy)
    plain = jaxamp.linen.apply_policy(_NamedLikeFlaxOps("My"), policy)
    variables = named.init(jax.random.key(1), x)
    assert sorted(variables[STATE]) == ["Fp8Hidden", "Fp8Proj"]
    plain_vars = plain.init(jax.random.key(1), x)

    def renamed(tree):
        return {k.replace("My", "Fp8"): v for k, v in tree.items()}

    def loss(apply, params, state):
        y = apply({"params": params, STATE: state}, x)
        return jnp.mean((y - 1.0) ** 2), y

    step = jax.jit(jax.grad(loss, argnums=(1, 2), has_aux=True), static_argnums=0)
    params, state = plain_vars["params"], plain_vars[STATE]
    for _ in range(2):  # the second step quantizes with the scales the first one set
        (g, new), y = step(plain.apply, params, state)
        (g_named, new_named), y_named = step(named.apply, renamed(params), renamed(state))
        np.testing.assert_array_equal(y_named, y)
        for got, want in ((g_named, g), (new_named, new)):
            np.testing.assert_equal(
                jax.tree.map(np.asarray, dict(got)), jax.tree.map(np.asarray, renamed(want))
            )
        params = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
        state = new
    assert float(state["MyProj"]["input_scale"][0]) != 1.0


class _FlaxOpNamedFreely(nn.Module):
    """Flax's own float8 ops under names of one's own: a Dense whose op is named
    ``scaler``, and an ``Fp8Einsum`` named ``mix``."""

    op: str

    @nn.compact
    def __call__(self, x):
        if self.op == "einsum":
            w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], 4))
            return fp8_ops.Fp8Einsum(name="mix")("bi,io->bo", x, w)
        cls = getattr(fp8_ops, self.op)
        return nn.Dense(4, dot_general_cls=functools.partial(cls, name="scaler"))(x)


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
@pytest.mark.parametrize(
    "policy, overrides",
    [
        ("mixed_float8_delayed", None),
        # a layer kept out of delayed scaling: the policy still converts the collection
        ("mixed_float8_delayed", {nn.Dense: "mixed_bfloat16", "mix": "mixed_bfloat16"}),
        ("mixed_bfloat16", {"Dense_0": "mixed_float8_delayed", "mix": "mixed_float8_delayed"}),
    ],
)
@pytest.mark.parametrize("op", ["Fp8DirectDotGeneralOp", "Fp8DotGeneralOp", "einsum"])
def test_flax_fp8_ops_are_refused_by_type_whatever_their_names(op, policy, overrides):
    """Flax's own float8 ops beside a delayed float8 policy anywhere in the model are
    told by their class, not their name: refused at init, and at apply with variables
    the bare model made (renamed, they passed init and failed at apply on a dtype)."""
    x = jax.random.normal(jax.random.key(0), (2, 8))
    bare = _FlaxOpNamedFreely(op)
    model = jaxamp.linen.apply_policy(bare, policy, overrides=overrides)
    cls = "Fp8Einsum" if op == "einsum" else op
    refused = f"Flax's own float8 op {cls} \\((Dense_0/scaler|mix)\\)"
    with pytest.raises(ValueError, match=refused):
        model.init(jax.random.key(1), x)
    variables = bare.init(jax.random.key(1), x)
    assert STATE in variables
    with pytest.raises(ValueError, match=refused):
        model.apply(variables, x)


def test_flax_fp8_ops_run_under_a_policy_without_delayed_scaling():
    """Under current scaling Flax's ops keep their state, which no policy converts: the
    model inits and steps as it does alone."""
    x = jax.random.normal(jax.random.key(0), (2, 8))
    bare = _FlaxOpNamedFreely("Fp8DirectDotGeneralOp")
    model = jaxamp.linen.apply_policy(bare, "p=f32,c=f32,fp8=current")
    variables = model.init(jax.random.key(1), x)

    def loss(apply, params, state):
        return jnp.sum(apply({"params": params, STATE: state}, x) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
    args = variables["params"], variables[STATE]
    np.testing.assert_equal(
        jax.tree.map(np.asarray, grad(model.apply, *args)),
        jax.tree.map(np.asarray, grad(bare.apply, *args)),
    )


class _Siamese(nn.Module):
    """A plain module calling one tower twice."""

    tower: nn.Module

    @nn.compact
    def __call__(self, a, b):
        return self.tower(a) * self.tower(b)


class _Tower(nn.Module):
    """A tower whose Dense runs twice in its own call."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(8)
        return nn.Dense(4)(dense(jnp.tanh(dense(x))))


_SUBMODULE_POLICY = "p=f32,c=f32,fp8=delayed,fp8_history=4"


@pytest.mark.parametrize("tower", [lambda: nn.Dense(8), _Tower], ids=["dense", "shared-inside"])
@settings(max_examples=6, deadline=None)
@given(scale=st.floats(1e-2, 1e2), ratio=st.floats(1e-2, 1e2))
def test_a_delayed_policy_module_run_as_a_submodule_trains_as_the_policy_on_the_root(
    tower, scale, ratio
):
    """A policy module inside a plain Linen module, run twice in a step (a siamese tower;
    a layer shared inside it): its state combines by max, as with the policy applied to the
    outermost module (the reference), over three steps. It was summed (histories too large)."""
    a = scale * jax.random.normal(jax.random.key(1), (2, 8))
    b = ratio * a
    sub = _Siamese(jaxamp.linen.apply_policy(tower(), _SUBMODULE_POLICY))
    root = jaxamp.linen.apply_policy(_Siamese(tower()), _SUBMODULE_POLICY)
    variables = sub.init(jax.random.key(0), a, b)
    assert jax.tree.structure(variables) == jax.tree.structure(root.init(jax.random.key(0), a, b))

    def loss(apply, params, state):
        return jnp.sum(jnp.sin(apply({"params": params, STATE: state}, a, b)))

    step = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)
    got = want = (variables["params"], variables[STATE])
    for i in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g_got, g_want = step(sub.apply, *got), step(root.apply, *want)
        for x, y in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=f"step {i}")
        got = (jax.tree.map(lambda p, d: p - 0.1 * d, got[0], g_got[0]), g_got[1])
        want = (jax.tree.map(lambda p, d: p - 0.1 * d, want[0], g_want[0]), g_want[1])
    if "input_amax_history" in got[1]["tower"]:  # one Dense, run on a and on b
        history = np.asarray(got[1]["tower"]["input_amax_history"])
        want_amax = float(jnp.max(jnp.abs(jnp.concatenate([a, b]))))
        assert np.max(history) == pytest.approx(want_amax)  # the larger amax, not the sum


def test_a_policy_module_run_as_a_submodule_gives_back_its_state_as_given():
    """``apply(..., mutable=True)`` of a plain module holding a delayed policy module: the
    state comes back as it went in (float32), not in its max-combined form."""
    a = jax.random.normal(jax.random.key(1), (2, 8))
    sub = _Siamese(jaxamp.linen.apply_policy(nn.Dense(8), _SUBMODULE_POLICY))
    variables = sub.init(jax.random.key(0), a, a)
    _, updated = jax.jit(lambda v: sub.apply(v, a, a, mutable=True))(variables)
    pairs = zip(jax.tree.leaves(updated[STATE]), jax.tree.leaves(variables[STATE]), strict=True)
    for x, y in pairs:
        assert x.dtype == jnp.float32
        np.testing.assert_array_equal(x, y)


def test_a_delayed_policy_module_a_flax_transformation_lifts_warns_and_max_combined_fixes_it():
    """``nn.remat(PolicyModule)`` called twice by a plain module: each lifted call converts
    the state for itself, so the calls add (scales of 2). It was silent; it warns now, and
    the state passed through max_combined before apply gives the policy on the root's
    gradients (the reference), without the warning."""

    class Twice(nn.Module):
        tower: nn.Module

        @nn.compact
        def __call__(self, a):
            return self.tower(a) * self.tower(3 * a)

    policy = jaxamp.get_policy(_SUBMODULE_POLICY)
    a = jax.random.normal(jax.random.key(1), (2, 8))
    model = Twice(nn.remat(jaxamp.linen.PolicyModule)(module=nn.Dense(4), policy=policy))
    plain = Twice(jaxamp.linen.apply_policy(nn.Dense(4), policy))
    variables = model.init(jax.random.key(0), a)

    def grads(apply, combine=lambda s: s):
        def loss(s):
            return jnp.sum(jnp.sin(apply({"params": variables["params"], STATE: combine(s)}, a)))

        return jax.jit(jax.grad(loss))(variables[STATE])

    with pytest.warns(UserWarning, match=r"\(remat\(tower\) in its scope"):
        summed = grads(model.apply)
    assert float(summed["tower"]["input_scale"][0]) == 2.0  # the sum the warning names
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        maxed = grads(model.apply, jaxamp.ops.max_combined)
        want = grads(plain.apply)
    for x, y in zip(jax.tree.leaves(maxed), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    assert float(want["tower"]["input_scale"][0]) == 1.0


class _Towered(nn.Module):
    tower: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.tower(nn.Dense(5, name="head")(x))


class _TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(nn.relu(nn.Dense(8)(x)))


def _tower():
    return _TwoDense()


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("mixed_bfloat16", "mixed_float8_delayed"),
        ("mixed_float8_delayed", "mixed_bfloat16"),
        ("mixed_float8_delayed", "float32"),
        ("mixed_float8", "mixed_bfloat16"),
        ("mixed_float8_delayed", "p=f32,c=bf16,fp8=delayed,fp8_history=16"),
        ("mixed_bfloat16", "float32"),
        ("float32", "mixed_bfloat16"),
    ],
)
def test_a_policy_module_nested_in_another_policy_is_refused(outer, inner):
    """A policy module inside a model under another policy: the outer policy decided its
    layers (float8 GEMMs and state where it asked for none, none where it asked for them;
    bfloat16 where it asked for float32), silently. Refused now, naming the override that
    does it; the override gives the inner policy's float8 GEMMs."""
    x = jax.random.normal(jax.random.key(1), (3, 5))
    nested = jaxamp.linen.apply_policy(_Towered(jaxamp.linen.apply_policy(_tower(), inner)), outer)
    with pytest.raises(ValueError, match="overrides=\\{'tower'"):
        nested.init(jax.random.key(0), x)
    model = jaxamp.linen.apply_policy(_Towered(_tower()), outer, overrides={"tower": inner})
    variables = model.init(jax.random.key(0), x)
    forward, _ = jaxamp.precision_report(lambda v: model.apply(v, x))(variables).float8_gemms()
    want = 2 * bool(jaxamp.get_policy(inner).fp8) + bool(jaxamp.get_policy(outer).fp8)
    assert forward == want


@pytest.mark.parametrize("policy", ["mixed_float8_delayed", "mixed_bfloat16"])
def test_a_policy_module_nested_in_the_same_policy_runs_as_the_model_without_it(policy):
    """Nesting that changes nothing (the policy the outer one gives there) runs as the
    model without the inner wrapper."""
    x = jax.random.normal(jax.random.key(1), (3, 5))
    nested = jaxamp.linen.apply_policy(
        _Towered(jaxamp.linen.apply_policy(_tower(), policy)), policy
    )
    flat = jaxamp.linen.apply_policy(_Towered(_tower()), policy)
    variables = flat.init(jax.random.key(0), x)
    np.testing.assert_array_equal(
        jax.jit(nested.apply)(variables, x), jax.jit(flat.apply)(variables, x)
    )


def test_a_refused_nested_policy_module_names_its_overrides_under_its_path():
    """The refusal names the nested module's own overrides too, under its path (the
    advice had dropped them, putting a layer it kept out of float8 back in)."""
    x = jax.random.normal(jax.random.key(1), (3, 5))
    inner = jaxamp.linen.apply_policy(
        _tower(), "mixed_float8", overrides={"Dense_1": "mixed_bfloat16"}
    )
    nested = jaxamp.linen.apply_policy(_Towered(inner), "mixed_bfloat16")
    with pytest.raises(ValueError, match=r"'tower': '.*fp8=current', 'tower/Dense_1': '"):
        nested.init(jax.random.key(0), x)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell])
def test_nn_rnn_under_delayed_scaling_is_refused_with_the_way_round(cell):
    """nn.RNN under a delayed policy: its scan broadcasts only the params, so the cell
    finds no state. The error advised variable_axes={state: 0} (a state per time step,
    for weights shared across time); it names the recurrent case and the override now,
    and the override runs (current scaling: float8 GEMMs, no state)."""
    x = jax.random.normal(jax.random.key(1), (2, 5, 4))
    model = jaxamp.linen.apply_policy(nn.RNN(cell(4)), "mixed_float8_delayed")
    with pytest.raises(ValueError, match=r"nn\.RNN .*overrides=\{nn\.RNN: 'mixed_float8'\}"):
        model.init(jax.random.key(0), x)
    model = jaxamp.linen.apply_policy(
        nn.RNN(cell(4)), "mixed_float8_delayed", overrides={nn.RNN: "mixed_float8"}
    )
    variables = model.init(jax.random.key(0), x)
    assert STATE not in variables
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    assert report.float8_gemms()[0] > 0
