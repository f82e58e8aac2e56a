"""Tests for jaxamp/_src/flax_policy/nnx.py on unmodified NNX models (ResNet and Transformer)."""

import pickle
import re

import flax.linen as nn_linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jaxamp
from jaxamp._src.flax_policy.plan import nnx_promote_keeping_kernel
from jaxamp._src.ops.matmul import DotGeneral
from tests.helpers.nnx_models import ConvBlock, ResNet, Transformer
from tests.helpers.promotion import FLAX

DTYPES = {"float32": jnp.float32, "mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}
IMAGES = jax.random.normal(jax.random.key(1), (4, 8, 8, 3))
TOKENS = jax.random.randint(jax.random.key(2), (4, 8), 1, 50).at[:, -2:].set(0)


# Each model built in one program compiled once (an eager build compiles each of its ops).
_BUILD = {
    "resnet": nnx.jit(lambda: ResNet(rngs=nnx.Rngs(0))),
    "transformer": nnx.jit(lambda: Transformer(rngs=nnx.Rngs(0))),
}


# A model called on its input in one compiled program (eagerly, each op compiles alone).
_forward = nnx.jit(lambda m, x: m(x))


def make(kind, policy=None, **kwargs):
    model = _BUILD[kind]()
    return model if policy is None else jaxamp.nnx.apply_policy(model, policy, **kwargs)


def inputs(kind):
    return IMAGES if kind == "resnet" else TOKENS


def train_step_report(model, x):
    """The precision report of a whole nnx training step (forward, backward, update)."""
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss, nnx.state((model, optimizer))

    return jaxamp.precision_report(step)(state, x)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("kind", ["resnet", "transformer"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_dtypes_and_precision_report(kind, name):
    model = make(kind, name)
    params = nnx.state(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype("float32")}
    out = _forward(model, inputs(kind))
    assert out.dtype == jnp.float32
    report = train_step_report(model, inputs(kind))
    report.check(DTYPES[name])
    assert report.all_operands_in(DTYPES[name]), report
    assert {op.direction for op in report.ops} == {"forward", "backward"}
    if kind == "resnet":
        stats = nnx.state(model, nnx.BatchStat)
        assert {x.dtype for x in jax.tree.leaves(stats)} == {np.dtype("float32")}
        assert report.count(kind="convolution") >= 6


def test_layer_settings():
    model = make("transformer", "mixed_bfloat16")
    layer = model.layers[0]
    assert layer.up.dtype == jnp.bfloat16 and layer.norm1.dtype == jnp.bfloat16
    assert layer.attn.attention_fn is jaxamp.dot_product_attention
    # The 16-bit matmul rule is the projection's dot_general; the kernel is left to it.
    assert layer.attn.query.dot_general == DotGeneral(jnp.bfloat16)
    assert layer.attn.query.promote_dtype is nnx_promote_keeping_kernel
    assert isinstance(model, Transformer)
    # Embedding lookups gather in float32 and cast the rows.
    assert model.embed.embedding.dtype == jnp.float32
    assert model.embed(TOKENS).dtype == jnp.bfloat16
    # A tied output layer (Embed.attend) is a bfloat16 matmul with float32 accumulation.
    query = jnp.ones((2, 16), jnp.float32)
    report = jaxamp.precision_report(lambda q: model.embed.attend(q))(query)
    assert report.all_operands_in("bfloat16") and report.ops[0].accumulation_dtype == "float32"
    # It computes query @ table.T from bfloat16 operands, and leaves the layer as it was.
    settings, table = dict(vars(model.embed)), model.embed.embedding.get_raw_value()
    query = jax.random.normal(jax.random.key(4), (2, 16))
    out = model.embed.attend(query)
    dims = (((1,), (1,)), ((), ()))
    bf16 = jnp.bfloat16
    reference = lax.dot_general(
        query.astype(bf16), table.astype(bf16), dims, preferred_element_type=jnp.float32
    )
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), reference, rtol=2**-7, atol=1e-6)
    assert all(vars(model.embed)[name] is value for name, value in settings.items())
    assert model.embed.embedding.get_raw_value() is table and table.dtype == jnp.float32


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("kind", ["resnet", "transformer"])
@pytest.mark.parametrize("name", ["mixed_bfloat16", "mixed_float16"])
def test_close_to_float32_model(kind, name):
    reference = _forward(make(kind), inputs(kind))
    out = _forward(make(kind, name), inputs(kind))
    tol = 5e-2 if name == "mixed_bfloat16" else 1e-2
    np.testing.assert_allclose(out, reference, atol=tol, rtol=tol)


@pytest.mark.standard_promotion(FLAX)
def test_train_with_optimizer_compiles_once_and_learns():
    model = make("resnet", "mixed_bfloat16")
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    traces = []
    target = jax.random.normal(jax.random.key(3), (4, 10))

    @nnx.jit
    def step(model, optimizer, x):
        traces.append(1)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, IMAGES)) for _ in range(5)]
    assert len(traces) == 1
    assert losses[-1] < losses[0]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("float32")}


@pytest.mark.standard_promotion(FLAX)
def test_bfloat16_params_are_cast():
    model = make("resnet", "bfloat16")
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))} == {
        np.dtype("float32")
    }
    assert _forward(model, IMAGES).dtype == jnp.bfloat16


def test_overrides():
    model = make("resnet", "mixed_bfloat16", overrides={"head": "float32"})
    assert model.head.dtype == jnp.float32 and model.stem.conv.dtype == jnp.bfloat16
    model = make("resnet", "mixed_bfloat16", overrides={ConvBlock: "float32"})
    assert model.stem.conv.dtype == jnp.float32 and model.head.dtype == jnp.bfloat16
    model = make("transformer", "mixed_bfloat16", overrides={"layers/1/*": "float32"})
    assert model.layers[1].up.dtype == jnp.float32 and model.layers[0].up.dtype == jnp.bfloat16


@pytest.mark.parametrize("key", ["haed", "layers/7/*", nnx.Embed])
def test_an_override_that_matches_no_layer_warns(key):
    name = key.__name__ if isinstance(key, type) else repr(key)
    with pytest.warns(UserWarning, match=re.escape(name) + ".*'head'"):
        model = make("resnet", "mixed_bfloat16", overrides={key: "float32", "head": "float32"})
    assert model.head.dtype == jnp.float32  # the override that matches still applies


def test_an_override_that_matches_a_layer_does_not_warn(recwarn):
    make("resnet", "mixed_bfloat16", overrides={"head": "float32", ConvBlock: "float32"})
    assert not [w for w in recwarn if "override" in str(w.message)]


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("kind", ["resnet", "transformer"])
@pytest.mark.parametrize("first", ["mixed_bfloat16", "mixed_float16"])
def test_apply_twice_replaces_the_policy(kind, first):
    """mixed_bfloat16 then float32 kept the first policy's 16-bit matmuls in every Linear
    and Conv (the layers said float32): the second policy now starts from the model as
    it was, so float32 is the model alone, bit for bit, outputs and gradients."""
    alone = make(kind)
    model = make(kind, first)
    jaxamp.nnx.apply_policy(model, "float32")
    assert type(model).__mro__[1] in (ResNet, Transformer)

    def loss(m):
        return jnp.sum(m(inputs(kind)).astype(jnp.float32) ** 2)

    np.testing.assert_array_equal(_forward(model, inputs(kind)), _forward(alone, inputs(kind)))
    got, want = nnx.jit(nnx.grad(loss))(model), nnx.jit(nnx.grad(loss))(alone)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(g, w)
    model.eval()  # a traced call may not update the batch statistics of a captured model
    report = jaxamp.precision_report(lambda x: model(x))(inputs(kind))
    assert report.ops and {(op.lhs_dtype, op.rhs_dtype) for op in report.ops} == {
        ("float32", "float32")
    }
    jaxamp.nnx.apply_policy(model, "mixed_float16")  # and on to another 16-bit policy
    assert _forward(model, inputs(kind)).dtype == jnp.float32


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"jaxamp\.linen\.apply_policy"):
        jaxamp.nnx.apply_policy(object(), "float32")
    with pytest.raises(TypeError, match=r"got str: 'mixed_bfloat16'"):  # arguments swapped
        jaxamp.nnx.apply_policy("mixed_bfloat16", make("resnet"))
    with pytest.raises(TypeError, match=r"AutocastRules, got str: 'strict'"):
        jaxamp.nnx.apply_policy(make("resnet"), "float32", rules="strict")
    with pytest.raises(ValueError, match="Valid choices"):
        jaxamp.nnx.apply_policy(make("resnet"), "p=f32,c=fp8")


@pytest.mark.standard_promotion(FLAX)
def test_a_model_under_a_policy_pickles():
    model = make("transformer", "mixed_bfloat16")
    restored = pickle.loads(pickle.dumps(model))
    assert isinstance(restored, Transformer) and type(restored) is type(model)
    np.testing.assert_array_equal(_forward(restored, TOKENS), _forward(model, TOKENS))
    assert restored.embed(TOKENS).dtype == jnp.bfloat16  # the embedding wrapper survives too


class DirectAttention(nnx.Module):
    """Calls NNX's and JAX's attention and softmax functions directly."""

    def __init__(self, rngs):
        self.qkv = nnx.LinearGeneral(8, (3, 2, 4), rngs=rngs)
        self.out = nnx.LinearGeneral((2, 4), 8, axis=(-2, -1), rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        y = nnx.dot_product_attention(q, k, v) + jax.nn.dot_product_attention(q, k, v)
        y = self.norm(self.out(y))
        return jax.nn.log_softmax(y) + jax.nn.softmax(y)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("name", list(DTYPES))
def test_directly_called_softmax_runs_in_float32(name):
    model = jaxamp.nnx.apply_policy(DirectAttention(nnx.Rngs(0)), name)
    x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    graphdef, state = nnx.split(model)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    report = jaxamp.precision_report(jax.value_and_grad(loss))(state).check(DTYPES[name])
    exps = [op for op in report.sensitive if op.primitive == "exp"]
    assert len(exps) >= 4 and {op.dtype for op in exps} == {"float32"}
    assert report.by_dtype() == {np.dtype(DTYPES[name]).name: len(report.ops)}
    grads = jax.jit(jax.grad(loss))(state)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}


class DropoutHead(nnx.Module):
    """A linear layer and a dropout that draws from the RNG streams passed to the call."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.dropout = nnx.Dropout(0.5)

    def __call__(self, x, *, rngs, calls):
        calls[0][...] += 1
        return self.dropout(self.linear(x), rngs=rngs)


def _dropout_head_calls(policy, under_nnx_jit, times=3):
    """The outputs of ``times`` calls, the call counter and the Rngs after them."""
    model = DropoutHead(nnx.Rngs(0))
    if policy is not None:
        jaxamp.nnx.apply_policy(model, policy)
    rngs, calls = nnx.Rngs(dropout=5), [nnx.Variable(jnp.zeros((), jnp.int32))]

    def call(model, x, rngs, calls):
        return model(x, rngs=rngs, calls=calls)

    call = nnx.jit(call) if under_nnx_jit else call
    x = jax.random.normal(jax.random.key(4), (4, 8))
    return [call(model, x, rngs, calls) for _ in range(times)], calls, rngs


@pytest.mark.parametrize("under_nnx_jit", [False, True])
@pytest.mark.parametrize("name", ["float32", "mixed_bfloat16"])
def test_rngs_and_variables_passed_to_the_call_keep_their_updates(name, under_nnx_jit):
    """An ``nnx.Rngs`` argument advances (a new dropout mask each call, the masks of the
    model without a policy) and a variable in a list argument keeps its update."""
    outs, calls, rngs = _dropout_head_calls(name, under_nnx_jit)
    plain, _, _ = _dropout_head_calls(None, under_nnx_jit)
    masks = [np.asarray(y == 0) for y in outs]
    for mask, y, y_plain in zip(masks, outs, plain, strict=True):
        np.testing.assert_array_equal(mask, np.asarray(y_plain == 0))
        if name == "float32":
            np.testing.assert_allclose(y, y_plain, rtol=1e-6, atol=1e-6)
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    assert int(rngs.dropout.count[...]) == 3 and int(calls[0][...]) == 3


@pytest.mark.parametrize("decode", [False, True])
def test_an_override_of_the_models_own_class_is_its_policy(decode):
    """{nnx.MultiHeadAttention: "float32"} on the attention layer itself: its attention
    matmuls ran bfloat16 (its projections float32); all of it is the layer alone's now."""
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))

    def make():
        layer = nnx.MultiHeadAttention(2, 8, decode=decode, rngs=nnx.Rngs(0))
        if decode:
            layer.init_cache(x.shape)
        return layer

    steps = [x[:, t : t + 1] for t in range(3)] if decode else [x]
    call = nnx.jit(lambda layer, s: layer(s))
    alone = make()
    want = [call(alone, s) for s in steps]
    model = jaxamp.nnx.apply_policy(
        make(), "mixed_bfloat16", overrides={nnx.MultiHeadAttention: "float32"}
    )
    got = [call(model, s) for s in steps]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


_NORMS = {
    "LayerNorm": (lambda: nn_linen.LayerNorm(), lambda: nnx.LayerNorm(16, rngs=nnx.Rngs(0))),
    "RMSNorm": (lambda: nn_linen.RMSNorm(), lambda: nnx.RMSNorm(16, rngs=nnx.Rngs(0))),
    "GroupNorm": (
        lambda: nn_linen.GroupNorm(num_groups=4),
        lambda: nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0)),
    ),
}


class _LinenResidual(nn_linen.Module):
    """A float32 position parameter added to the (16-bit) input, then a norm."""

    norm: str

    @nn_linen.compact
    def __call__(self, x):
        pos = self.param("pos", nn_linen.initializers.normal(0.02), (16,), jnp.float32)
        return _NORMS[self.norm][0]()(x + pos)


class _NnxResidual(nnx.Module):
    def __init__(self, norm, pos):
        self.pos = nnx.Param(pos)
        self.norm = _NORMS[norm][1]()

    def __call__(self, x):
        return self.norm(x + self.pos[...])


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("norm", sorted(_NORMS))
def test_a_norm_reads_a_float32_residual_as_given_as_linen_does(norm, policy):
    """A norm's statistics and normalisation run in float32 on its input as it arrives, a
    residual stream the model keeps in float32 (``x + pos``) included, its output rounded
    once to the compute dtype: Flax's own layer in float32, rounded, under the NNX policy
    as under the Linen policy. NNX's own ``promote_dtype`` rounded that input to 16 bits
    first, so the two policies differed on the same model."""
    compute = DTYPES[policy]
    x = 3.0 + jax.random.normal(jax.random.key(0), (4, 16)) * 0.02
    variables = jax.jit(_LinenResidual(norm).init)(jax.random.key(1), x)
    pos = variables["params"]["pos"]
    arrived = x.astype(compute).astype(jnp.float32) + pos  # the policy casts the input
    plain = _NORMS[norm][0]()
    norm_variables = {"params": variables["params"][f"{_NORMS[norm][0]().__class__.__name__}_0"]}
    want = jax.jit(plain.apply)(norm_variables, arrived).astype(compute)
    linen = jax.jit(jaxamp.linen.apply_policy(_LinenResidual(norm), policy).apply)(variables, x)
    model = _NnxResidual(norm, pos)
    jaxamp.nnx.apply_policy(model, policy)
    under_nnx = _forward(model, x)
    np.testing.assert_array_equal(linen, want)
    np.testing.assert_array_equal(under_nnx, want)
