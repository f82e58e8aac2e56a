"""MXFP8 and NVFP4 as policies: the grammar, Linen, NNX and autocast on the same model, Flax's
layers against the model alone, the precision audit, and overrides out of the format."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from tests.helpers import block_reference as ref

FORMATS = ("mxfp8", "nvfp4")
# The relative error of a layer's output against float32 each format allows: MXFP8's e4m3
# rounds each value by up to 2**-4 (the FP8 tests' 0.1); NVFP4's e2m1 by up to a quarter
# of its value (one mantissa bit), about 0.1 to 0.2 over a sum of random products.
TOLERANCE = {"mxfp8": 0.1, "nvfp4": 0.3}


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("mixed_mxfp8", "params=float32,compute=bfloat16,output=float32,fp8=mxfp8"),
        ("mixed_nvfp4", "params=float32,compute=bfloat16,output=float32,fp8=nvfp4"),
        ("p=f32,c=f32,fp8=MXFP8", "params=float32,compute=float32,output=float32,fp8=mxfp8"),
        ("p=f32,c=f16,o=f32,fp8=nvfp4", "params=float32,compute=float16,output=float32,fp8=nvfp4"),
    ],
)
def test_block_policies_parse_and_round_trip_their_string(spec, expected):
    policy = jaxamp.get_policy(spec)
    assert str(policy) == expected
    assert jaxamp.get_policy(str(policy)) == policy
    assert policy.fp8.block == expected.rsplit("=", 1)[1]


@pytest.mark.parametrize(
    "spec, words",
    [
        ("p=f32,c=bf16,fp8=mxfp8,fp8_margin=2", ("margin", "mxfp8")),
        ("p=f32,c=bf16,fp8=nvfp4,fp8_history=16", ("fp8_history", "nvfp4")),
        ("p=f32,c=bf16,fp8=mxfp4", ("mxfp4", "mxfp8", "nvfp4", "current")),
    ],
)
def test_a_bad_block_policy_is_refused_naming_the_value_and_the_choices(spec, words):
    with pytest.raises(ValueError) as info:
        jaxamp.get_policy(spec)
    assert all(w in str(info.value) for w in words), info.value


class _Two(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(48, name="first")(x))
        return nn.Dense(24, name="second")(h)


class _NnxTwo(nnx.Module):
    def __init__(self, params):
        rngs = nnx.Rngs(0)
        self.first, self.second = nnx.Linear(40, 48, rngs=rngs), nnx.Linear(48, 24, rngs=rngs)
        for name in ("first", "second"):
            layer = getattr(self, name)
            layer.kernel[...] = params[name]["kernel"]
            layer.bias[...] = params[name]["bias"]

    def __call__(self, x):
        return self.second(nnx.relu(self.first(x)))


def _three_ways(policy):
    x = jax.random.normal(jax.random.key(0), (8, 40))
    linen = jaxamp.linen.apply_policy(_Two(), policy)
    variables = jax.jit(linen.init)(jax.random.key(1), x)
    nnx_model = jaxamp.nnx.apply_policy(_NnxTwo(variables["params"]), policy)
    outputs = (
        jax.jit(linen.apply)(variables, x),
        nnx.jit(lambda m, v: m(v))(nnx_model, x),
        jax.jit(jaxamp.autocast(_Two().apply, policy))(variables, x),
    )
    return x, variables, outputs


@pytest.mark.parametrize("fmt", FORMATS)
def test_linen_nnx_and_autocast_compute_the_same_numbers(fmt):
    # Under a float32 compute dtype all three quantize the same float32 operands: equal.
    _, _, (linen, nnx_out, autocast) = _three_ways(f"p=f32,c=f32,fp8={fmt}")
    np.testing.assert_array_equal(linen, nnx_out)
    np.testing.assert_array_equal(linen, autocast)
    # Under bfloat16 compute Linen and NNX still agree bit for bit; autocast quantizes the
    # float32 kernel where the layers quantize it after their cast to bfloat16.
    x, variables, (linen, nnx_out, autocast) = _three_ways(f"mixed_{fmt}")
    np.testing.assert_array_equal(linen, nnx_out)
    plain = jax.jit(_Two().apply)(variables, x)
    for out in (linen, autocast):
        assert np.linalg.norm(out - plain) <= TOLERANCE[fmt] * np.linalg.norm(plain)


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_dense_layer_is_the_numpy_emulation_of_its_gemm(fmt):
    """One Dense layer under ``p=f32,c=f32,fp8=<fmt>`` against the reference: the
    kernel (tiled under NVFP4) and the input quantized by numpy/ml_dtypes, float64 sums."""
    x = np.asarray(jax.random.normal(jax.random.key(0), (8, 40)), np.float32)
    model = jaxamp.linen.apply_policy(nn.Dense(24, use_bias=False), f"p=f32,c=f32,fp8={fmt}")
    variables = model.init(jax.random.key(1), x)
    y = np.asarray(jax.jit(model.apply)(variables, x), np.float64)
    kernel = np.asarray(variables["params"]["kernel"])
    want = ref.block_matmul(x, kernel.T, fmt)
    scale = np.abs(x) @ np.abs(kernel)
    np.testing.assert_allclose(y, want, rtol=0, atol=float(scale.max()) * 42 * 2.0**-24 * 2)


_LINEN_LAYERS = {
    "Dense": lambda: nn.Dense(6),
    "DenseGeneral": lambda: nn.DenseGeneral((2, 3)),
    "Einsum": lambda: nn.Einsum((8, 6), "bi,io->bo"),
    "MultiHeadDotProductAttention": lambda: nn.MultiHeadDotProductAttention(2, qkv_features=8),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layer", sorted(_LINEN_LAYERS))
def test_flax_layers_run_block_scaled_close_to_float32_and_the_audit_says_so(layer, fmt):
    x = jax.random.normal(jax.random.key(0), (4, 40))
    x = x[:, None, :] * jnp.ones((1, 3, 1)) if layer.startswith("Multi") else x
    x = x[..., :8] if layer == "Einsum" else x
    model = jaxamp.linen.apply_policy(_LINEN_LAYERS[layer](), f"p=f32,c=f32,fp8={fmt}")
    variables = jax.jit(model.init)(jax.random.key(1), x)
    plain = _LINEN_LAYERS[layer]()
    y = jax.jit(model.apply)(variables, x)
    want = jax.jit(plain.apply)({"params": variables["params"]}, x)
    assert np.linalg.norm(y - want) <= TOLERANCE[fmt] * np.linalg.norm(want)
    step = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))
    grads = jax.jit(step)(variables)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    report = jaxamp.precision_report(step)(variables)
    gemms = [op for op in report.ops if op.contracts]
    # the layers' GEMMs block-scaled (forward, activation and weight gradients);
    # attention's two matmuls (no hook) and their gradients in the compute dtype
    unhooked = 6 if layer.startswith("Multi") else 0
    assert sum(op.block_format == fmt for op in gemms) == len(gemms) - unhooked, report
    assert report.block_gemms() == {fmt: len(gemms) - unhooked}
    assert f"block-scaled GEMMs among them: {len(gemms) - unhooked} {fmt}" in str(report)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_override_keeps_a_layer_out_of_the_block_format(fmt):
    x = jax.random.normal(jax.random.key(0), (8, 40))
    model = jaxamp.linen.apply_policy(_Two(), f"mixed_{fmt}", overrides={"second": "float32"})
    variables = jax.jit(model.init)(jax.random.key(1), x)
    report = jaxamp.precision_report(lambda v: model.apply(v, x))(variables)
    formats = {op.layer.rsplit("/", 1)[-1]: op.block_format for op in report.ops}
    first = [op.block_format for op in report.ops if "first" in op.name]
    second = [op.block_format for op in report.ops if "second" in op.name]
    assert first == [fmt] and second == [None], formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_inf_in_an_input_reaches_the_output_and_the_gradients_as_nan(fmt):
    """A float8 or float4 value cannot hold inf: the block (MXFP8) or the tensor (NVFP4)
    decodes to NaN, so that loss scaling sees the overflow instead of a clipped value."""
    model = jaxamp.linen.apply_policy(nn.Dense(24), f"mixed_{fmt}")
    x = jnp.ones((4, 64)).at[1, 3].set(jnp.inf)
    variables = jax.jit(model.init)(jax.random.key(1), jnp.ones((4, 64)))
    y = jax.jit(model.apply)(variables, x)
    assert bool(jnp.isnan(y[1]).all())
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x))))(variables)
    assert bool(jnp.isnan(grads["params"]["kernel"]).any())


def test_second_derivatives_are_refused_by_name():
    model = jaxamp.linen.apply_policy(nn.Dense(4), "mixed_mxfp8")
    x = jnp.ones((2, 32))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        jax.jit(jax.hessian(lambda v: jnp.sum(model.apply(v, x))))(variables)


_VOCAB, _WIDTH, _HEADS = 32, 16, 2


class _TiedLm(nn.Module):
    """A one-block language model: embedding, causal self-attention, an MLP, a norm and a
    tied head (``Embed.attend``)."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(_VOCAB, _WIDTH, name="embed")
        x = embed(tokens)
        mask = nn.make_causal_mask(tokens)
        x = x + nn.MultiHeadDotProductAttention(_HEADS, name="attention")(x, mask=mask)
        x = x + nn.Dense(_WIDTH, name="down")(nn.gelu(nn.Dense(2 * _WIDTH, name="up")(x)))
        return embed.attend(nn.LayerNorm(name="norm")(x))


class _NnxTiedLm(nnx.Module):
    def __init__(self, params):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(_VOCAB, _WIDTH, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(_HEADS, _WIDTH, decode=False, rngs=rngs)
        self.up = nnx.Linear(_WIDTH, 2 * _WIDTH, rngs=rngs)
        self.down = nnx.Linear(2 * _WIDTH, _WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(_WIDTH, rngs=rngs)
        nnx.update(self, nnx.State(jax.tree.map(jnp.asarray, params)))

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(x, mask=nn.make_causal_mask(tokens))
        x = x + self.down(nnx.gelu(self.up(x)))
        return self.embed.attend(self.norm(x))


def _tied_lm_three_ways(policy):
    """The model's loss under the Linen policy, the NNX policy and autocast, each a
    function of the Linen variables, and the variables."""
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, _VOCAB)
    variables = _TiedLm().init(jax.random.key(1), tokens)
    linen = jaxamp.linen.apply_policy(_TiedLm(), policy)
    autocast = jaxamp.autocast(_TiedLm().apply, policy)

    def under_nnx(v):
        model = jaxamp.nnx.apply_policy(_NnxTiedLm(v["params"]), policy)
        return model(tokens)

    calls = {
        "linen": lambda v: linen.apply(v, tokens),
        "nnx": under_nnx,
        "autocast": lambda v: autocast(v, tokens),
    }
    return variables, calls


@pytest.mark.parametrize("fmt", [*FORMATS, "current"])
def test_linen_nnx_and_autocast_agree_on_attention_and_a_tied_head(fmt):
    """Autocast sees operations, not layers: it runs a GEMM in the format where one operand
    is a weight, so attention's two matmuls (two activations) and the tied head (the
    table the model looks rows up in) stay in the compute dtype, as the policies keep
    them. Compiled under ``p=f32,c=f32``, the three compute the same bits, outputs and
    gradients; the audit counts the same GEMMs in the format."""
    variables, calls = _tied_lm_three_ways(f"p=f32,c=f32,fp8={fmt}")
    outputs, grads, counts = {}, {}, {}
    for name, call in calls.items():

        def output_and_gradient(v, call=call):
            out, pullback = jax.vjp(call, v)
            return out, pullback(2 * out)[0]  # the gradient of sum(out ** 2)

        outputs[name], grads[name] = jax.jit(output_and_gradient)(variables)
        report = jaxamp.precision_report(call)(variables)
        counts[name] = report.block_gemms() or report.float8_gemms()[0]
    # query, key, value, output, up and down projections: six of the model's nine GEMMs
    assert counts["linen"] == ({fmt: 6} if fmt in FORMATS else 6), counts
    assert counts["nnx"] == counts["linen"] and counts["autocast"] == counts["linen"], counts
    for name in ("nnx", "autocast"):
        np.testing.assert_array_equal(outputs[name], outputs["linen"])
        jax.tree.map(np.testing.assert_array_equal, grads[name], grads["linen"])


class _Ensemble(nn.Module):
    """Four Dense members under ``nn.vmap``; ``shared``: one input for all (``in_axes=None``)."""

    shared: bool

    @nn.compact
    def __call__(self, x):
        members = nn.vmap(
            lambda module, x: module(x),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None if self.shared else 0,
            axis_size=4,
        )
        return members(nn.Dense(32, use_bias=False), x)


@pytest.mark.parametrize("shared", [True, False])
def test_an_ensemble_gets_a_tensor_scale_per_member_as_a_loop_over_them(shared):
    """The guide's format table: NVFP4's tensor scale is one per member, as a loop over
    the members gives, with members 1e6 apart. The policies quantize inside ``vmap``;
    autocast sees one GEMM, batched where the input is (``in_axes=0``), and with a shared
    input gives all members one scale (the guide's limit: the smallest flushes to zero)."""
    x = jax.random.normal(jax.random.key(0), (8, 32))
    model = _Ensemble(shared)
    inputs = x if shared else jnp.broadcast_to(x, (4, 8, 32))
    kernel = jax.jit(model.init)(jax.random.key(1), inputs)["params"]["Dense_0"]["kernel"]
    kernel = kernel * jnp.array([1.0, 1e-3, 1e-4, 1e-6])[:, None, None]
    variables = {"params": {"Dense_0": {"kernel": kernel}}}
    dn = (((1,), (0,)), ((), ()))
    loop = jax.jit(
        lambda x, kernel: jnp.stack(
            [jaxamp.ops.block_dot_general(x, k, dn, "nvfp4") for k in kernel]
        )
    )(x, kernel)
    policy = "p=f32,c=f32,fp8=nvfp4"
    linen = jax.jit(jaxamp.linen.apply_policy(model, policy).apply)(variables, inputs)
    autocast = jax.jit(jaxamp.autocast(model.apply, policy))(variables, inputs)
    np.testing.assert_array_equal(linen, loop)
    if shared:
        assert not np.any(autocast[3]) and np.all(np.isfinite(autocast))
    else:
        np.testing.assert_array_equal(autocast, loop)


def _experts_kernel_on_the_right(h, kernel):
    """``einsum("btef,efd->bted", h, kernel)`` with the kernel as the right operand."""
    dn = (((3,), (1,)), ((2,), (0,)))
    return jnp.transpose(jaxamp.ops.block_dot_general(h, kernel, dn, "nvfp4"), (1, 2, 0, 3))


def test_an_experts_einsum_quantizes_its_kernel_as_the_right_operand():
    """For ``"btef,efd->bted"`` jnp.einsum passes the kernel on the left of its
    ``dot_general``: NVFP4's 16 x 16 tiles go on the kernel all the same, under the Linen
    policy, the NNX policy and autocast (each equal to the GEMMs with the kernel on the
    right, bit for bit)."""
    h = jnp.tanh(jax.random.normal(jax.random.key(0), (2, 16, 4, 64)))
    policy = "p=f32,c=f32,fp8=nvfp4"
    layer = nn.Einsum((4, 64, 32), "btef,efd->bted", use_bias=False)
    variables = jax.jit(layer.init)(jax.random.key(1), h)
    kernel = variables["params"]["kernel"]
    want = jax.jit(_experts_kernel_on_the_right)(h, kernel)
    linen = jax.jit(jaxamp.linen.apply_policy(layer, policy).apply)(variables, h)
    experts = nnx.Einsum("btef,efd->bted", (4, 64, 32), None, rngs=nnx.Rngs(0))
    experts.kernel[...] = kernel
    jaxamp.nnx.apply_policy(experts, policy)
    under_nnx = nnx.jit(lambda m, h: m(h))(experts, h)
    for got in (linen, under_nnx):
        np.testing.assert_array_equal(got, want)
    # Under autocast the kernel is known from the activation it meets (a GEMM's output);
    # a GEMM of two arguments keeps the order it was written in.
    w = jax.random.normal(jax.random.key(2), (64, 64))
    dn = (((3,), (0,)), ((), ()))
    made = jax.jit(lambda h, w: jnp.tanh(jaxamp.ops.block_dot_general(h, w, dn, "nvfp4")))(h, w)

    def experts_after_a_layer(variables, h, w):
        return layer.apply(variables, jnp.tanh(jax.lax.dot_general(h, w, dn)))

    autocast = jax.jit(jaxamp.autocast(experts_after_a_layer, policy))(variables, h, w)
    np.testing.assert_array_equal(autocast, jax.jit(_experts_kernel_on_the_right)(made, kernel))
