"""Tests for jaxamp/_src/ops/residuals.py: 16-bit residuals, exact gradients, float32 statistics."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from jaxamp._src.jaxprs import equations as _equations
from jaxamp._src.ops.residuals import saved_residuals
from jaxamp.models import BasicBlock, BertClassifier, BertConfig, ResNet
from tests.helpers.promotion import FLAX

TINY_BERT = BertConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    max_position=16,
    num_classes=3,
    dropout_rate=0.0,
)
IMAGES = jax.random.normal(jax.random.key(1), (8, 16, 16, 3))
TOKENS = jax.random.randint(jax.random.key(2), (8, 16), 1, 64)
LABELS = jnp.arange(8)


def resnet_setup(policy, residuals="compute_dtype"):
    plain = ResNet((1, 1), BasicBlock, num_classes=5, width=16)
    variables = plain.init(jax.random.key(0), IMAGES)
    model = jaxamp.linen.apply_policy(plain, policy, residuals=residuals)

    def loss(params):
        logits, _ = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            IMAGES,
            mutable=["batch_stats"],
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS % 5).mean()

    return loss, variables["params"]


def bert_setup(policy, residuals="compute_dtype"):
    plain = BertClassifier(TINY_BERT)
    variables = plain.init(jax.random.key(0), TOKENS)
    model = jaxamp.linen.apply_policy(plain, policy, residuals=residuals)

    def loss(params):
        logits = model.apply({"params": params}, TOKENS)
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS % 3).mean()

    return loss, variables["params"]


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("setup", [resnet_setup, bert_setup])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_activation_bytes_at_most_055_of_float32(setup, policy):
    fp32 = jaxamp.ops.activation_bytes(*setup("float32"))
    mixed = jaxamp.ops.activation_bytes(*setup(policy))
    assert mixed / fp32 <= 0.55, (mixed, fp32)
    dots = jaxamp.ops.activation_bytes(*setup(policy, "dots"))
    assert dots < mixed


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("setup", [resnet_setup, bert_setup])
def test_no_large_float32_residuals(setup):
    loss, params = setup("mixed_bfloat16")
    largest = max(
        int(np.prod(a.shape))
        for a, d in jaxamp.ops.saved_residuals(loss, params)
        if "argument" not in d
    )
    for aval, description in jaxamp.ops.saved_residuals(loss, params):
        if aval.dtype == jnp.float32 and "argument" not in description:
            # statistics (per channel / per token) only
            assert int(np.prod(aval.shape)) * 8 <= largest, (aval, description)


@jax.jit
def _squared_sums(a, b):
    return jnp.sum((a - b) ** 2), jnp.sum(b**2)


def _relative_error(grads, reference):
    sums = [
        _squared_sums(a, b)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True)
    ]
    diff = sum(float(d) for d, _ in sums)
    norm = sum(float(n) for _, n in sums)
    return (diff / norm) ** 0.5


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("setup", [resnet_setup, bert_setup])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_gradients_as_accurate_as_saving_everything(setup, policy):
    """Recomputing float32 temporaries from 16-bit values loses no accuracy.

    Both 16-bit gradients are compared with the float32 model's: recomputation
    repeats the same arithmetic, so its error matches that of saving everything
    (XLA may fuse the two programs differently, which moves 16-bit roundings).
    """
    loss_ref, params = setup("float32", "all")
    loss_all, _ = setup(policy, "all")
    loss_ckpt, _ = setup(policy)
    g_ref = jax.jit(jax.grad(loss_ref))(params)
    err_all = _relative_error(jax.jit(jax.grad(loss_all))(params), g_ref)
    err_ckpt = _relative_error(jax.jit(jax.grad(loss_ckpt))(params), g_ref)
    # bfloat16 keeps 8 bits of mantissa; gradients through BatchNorm's backward
    # (a difference of near-equal terms) lose most of them in early layers.
    limit = 0.3 if policy == "mixed_bfloat16" else 0.01
    assert err_all < limit and err_ckpt < limit, (err_all, err_ckpt)
    assert err_ckpt <= 1.5 * err_all + 1e-3, (err_all, err_ckpt)


@pytest.mark.standard_promotion(FLAX)
def test_batch_statistics_stay_float32():
    plain = ResNet((1, 1), BasicBlock, num_classes=5, width=16)
    variables = plain.init(jax.random.key(0), IMAGES)
    model = jaxamp.linen.apply_policy(plain, "mixed_bfloat16")
    _, updates = jax.jit(lambda v: model.apply(v, IMAGES, mutable=["batch_stats"]))(variables)
    assert {x.dtype for x in jax.tree.leaves(updates)} == {np.dtype("float32")}
    _, ref = plain.apply(variables, IMAGES, mutable=["batch_stats"])
    for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.standard_promotion(FLAX)
def test_short_run_converges():
    loss, params = bert_setup("mixed_bfloat16")
    tx = optax.adam(3e-3)
    opt_state = jax.jit(tx.init)(params)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    values = []
    for _ in range(15):
        params, opt_state, value = step(params, opt_state)
        values.append(float(value))
    assert values[-1] < 0.5 * values[0]


def test_checkpoint_residuals_holds_non_arrays_static():
    def f(x, scale, *, flag):
        return jnp.sum(jnp.sin(x.astype(jnp.float32)) * scale) if flag else 0.0

    wrapped = jaxamp.checkpoint_residuals(lambda x, scale, flag: f(x, scale, flag=flag))
    x = jnp.ones(8, jnp.bfloat16)
    g = jax.grad(wrapped)(x, 2.0, True)
    np.testing.assert_allclose(g.astype(jnp.float32), 2 * np.cos(1.0) * np.ones(8), rtol=1e-2)
    with pytest.raises(ValueError, match="compute_dtype, dots, all"):
        jaxamp.checkpoint_residuals(f, "none")


@pytest.mark.standard_promotion(FLAX)
def test_activation_bytes_by_dtype():
    loss, params = resnet_setup("mixed_bfloat16")
    by_dtype = jaxamp.ops.activation_bytes(loss, params, by_dtype=True)
    assert by_dtype["bfloat16"] > by_dtype.get("float32", 0)
    assert sum(by_dtype.values()) == jaxamp.ops.activation_bytes(loss, params)


def _norm_model_linen(norm_cls):
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(16, (3, 3))(x)
            if norm_cls is nn.BatchNorm:
                x = norm_cls(use_running_average=False)(x)
            elif norm_cls is nn.GroupNorm:
                x = norm_cls(num_groups=4)(x)
            else:
                x = norm_cls()(x)
            x = nn.relu(x)
            return nn.Dense(3)(x.mean((1, 2)))

    return Model()


def _large_float32_residuals(loss, params, activation_elements, *more):
    """float32 residuals at least a tenth of an activation's size (statistics are smaller)."""
    return [
        (a, d)
        for a, d in jaxamp.ops.saved_residuals(loss, params, *more)
        if a.dtype == jnp.float32
        and "argument" not in d
        and int(np.prod(a.shape)) * 10 >= activation_elements
    ]


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("norm", ["BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_linen_normalisation_layers_save_16_bit_residuals(norm, policy):
    import flax.linen as nn

    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    plain = _norm_model_linen(getattr(nn, norm))
    variables = plain.init(jax.random.key(1), x)
    mutable = ["batch_stats"] if "batch_stats" in variables else False

    def loss_of(model):
        def loss(params):
            out = model.apply({**variables, "params": params}, x, mutable=mutable)
            logits = out[0] if mutable else out
            return jnp.sum(logits.astype(jnp.float32) ** 2)

        return loss

    mixed = loss_of(jaxamp.linen.apply_policy(plain, policy))
    activation = 8 * 8 * 8 * 16
    assert _large_float32_residuals(mixed, variables["params"], activation) == []
    dtypes = {
        a.dtype
        for a, d in jaxamp.ops.saved_residuals(mixed, variables["params"])
        if "argument" not in d and int(np.prod(a.shape)) >= activation
    }
    assert dtypes <= {np.dtype(DTYPE_OF[policy]), np.dtype("bool")}, dtypes
    # Saving everything (Flax's per-layer dtype alone) keeps float32 copies of the activations.
    saving_all = loss_of(jaxamp.linen.apply_policy(plain, policy, residuals="all"))
    assert _large_float32_residuals(saving_all, variables["params"], activation)
    # ...while the statistics are still computed in float32: every reduction over an
    # activation in the program reads float32 values.
    jaxpr = jax.make_jaxpr(mixed)(variables["params"])
    reductions = [
        e
        for e in _equations(jaxpr.jaxpr, hi=True)
        if e.primitive.name == "reduce_sum" and int(np.prod(e.invars[0].aval.shape)) >= activation
    ]
    assert reductions and all(e.invars[0].aval.dtype == jnp.float32 for e in reductions)


DTYPE_OF = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("norm", ["BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm"])
def test_nnx_normalisation_layers_save_16_bit_residuals(norm):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 16, (3, 3), rngs=rngs)
            kwargs = {"num_groups": 4} if norm == "GroupNorm" else {}
            self.norm = getattr(nnx, norm)(16, rngs=rngs, **kwargs)
            self.head = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.norm(self.conv(x))).mean((1, 2)))

    x = jax.random.normal(jax.random.key(0), (8, 8, 8, 3))
    model = jaxamp.nnx.apply_policy(Model(nnx.Rngs(0)), "mixed_bfloat16")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, rest):  # rest (batch statistics) is an input too: NNX mutates it
        m = nnx.merge(graphdef, params, rest)
        return jnp.sum(m(x).astype(jnp.float32) ** 2)

    assert _large_float32_residuals(loss, params, 8 * 8 * 8 * 16, rest) == []
    assert jaxamp.ops.activation_bytes(loss, params, rest) > 0
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(model)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {np.dtype("float32")}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_the_16_bit_cast_of_an_activation_is_saved_and_a_weights_copy_is_not(dtype):
    """A float32 GELU cast to 16 bits for a matmul: its cast is kept, so the backward
    pass does not redo the GELU (inside the weight gradient's transposing copy, where
    XLA:CPU is slow); the 16-bit copy of the float32 weight is redone from the weight."""

    def f(w, x):
        h = jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(dtype)
        return jnp.sum(jnp.dot(h, w.astype(dtype), preferred_element_type=jnp.float32))

    w, x = jnp.full((64, 32), 0.01), jnp.linspace(-2, 2, 16 * 64).reshape(16, 64).astype(dtype)
    wrapped = jax.jit(jaxamp.checkpoint_residuals(f))
    saved = [
        (tuple(aval.shape), np.dtype(aval.dtype))
        for aval, description in saved_residuals(jaxamp.checkpoint_residuals(f), w, x)
        if not description.startswith("from the argument")
    ]
    assert ((16, 64), np.dtype(dtype)) in saved, saved  # the activation's cast
    assert ((64, 32), np.dtype(dtype)) not in saved, saved  # the weight's copy
    assert ((16, 64), np.dtype(np.float32)) not in saved, saved  # no float32 GELU
    grads = jax.jit(jax.grad(wrapped, argnums=(0, 1)))(w, x)
    expected = jax.jit(jax.grad(f, argnums=(0, 1)))(w, x)
    for g, e in zip(grads, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(e, np.float32))


_SAME_ARITHMETIC = """
import jax, jax.numpy as jnp, numpy as np
import jaxamp
from jaxamp.models import BertClassifier, BertConfig
bert = BertClassifier(BertConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                 intermediate_size=256, max_position=32, num_classes=3))
tokens = jnp.asarray(np.random.RandomState(0).randint(1, 512, (4, 16)), jnp.int32)
grads = []
for residuals in ("compute_dtype", "all"):
    model = jaxamp.linen.apply_policy(bert, "mixed_bfloat16", residuals=residuals)
    params = model.init(jax.random.key(0), tokens)["params"]
    def loss(p):
        out = model.apply({"params": p}, tokens, train=True, rngs={"dropout": jax.random.key(7)})
        return jnp.mean(out.astype(jnp.float32) ** 2)
    grads.append(jax.tree.leaves(jax.jit(jax.grad(loss))(params)))
print(len(grads[1]), sum(not np.array_equal(a, b) for a, b in zip(*grads)))
"""


def test_recomputation_repeats_the_forward_arithmetic():
    """Without XLA's excess precision, saved and recomputed residuals give the same bits.

    With it (XLA's default) the two programs' fusions may keep different 16-bit
    intermediates at float32 precision; the module docstring says so.
    """
    env = {**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false"}
    result = subprocess.run(
        [sys.executable, "-c", _SAME_ARITHMETIC],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    leaves, differing = map(int, result.stdout.split())
    assert leaves > 30 and differing == 0, result.stdout
