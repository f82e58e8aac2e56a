"""The divergence floor of ``jaxamp compare`` (jaxamp/_src/compare/numerics_checks.py) against
planted precision faults: a LayerNorm, a long reduction and a softmax computed in 16 bits,
and a 5% error injected into one layer of a well-conditioned MLP. Each must be flagged at
its own layer, before any other forward row; the same models done right (their norm,
reduction and softmax in float32, as the bfloat16 policy runs them) must flag nothing.

Each fault rounds to bfloat16 with ``lax.reduce_precision``, which no compiler may
remove, in the model the variant runs; the reference is the same model without it, in
true float32, as ``jaxamp compare`` runs it."""

import functools
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxamp._src.compare import app as compare_lib
from jaxamp._src.compare import numerics_checks
from jaxamp._src.compare.config import CompareConfig
from jaxamp._src.compare.run import Run
from jaxamp._src.compare.task import Task, make_task
from jaxamp._src.compare.variants import get_variant
from jaxamp._src.flax_policy.linen import apply_policy
from tests.helpers.promotion import FLAX, SUBJECT


def _in16(value, planted):
    """``value`` rounded to bfloat16's precision where ``planted``: one 16-bit operation."""
    return jax.lax.reduce_precision(value, 8, 7) if planted else value


def _sum_in16(values, planted):
    """The sum over the last axis, its running total kept in 16 bits where ``planted`` (a
    16-bit accumulator, as a reduction computed in bfloat16 keeps it)."""
    if not planted:
        return jnp.sum(values, axis=-1)

    def add(i, total):
        return _in16(total + jax.lax.dynamic_index_in_dim(values, i, -1, keepdims=False), True)

    zeros = jnp.zeros(values.shape[:-1], values.dtype)
    return jax.lax.fori_loop(0, values.shape[-1], add, zeros)


class HandLayerNorm(nn.Module):
    """A LayerNorm written by hand, variance as E[x^2] - E[x]^2 (as fused kernels write it);
    every operation in 16 bits where ``planted``."""

    planted: bool = False

    @nn.compact
    def __call__(self, h):
        r = lambda v: _in16(v, self.planted)
        h = r(h.astype(jnp.float32))
        mean = r(jnp.mean(h, -1, keepdims=True))
        square = r(jnp.mean(r(h * h), -1, keepdims=True))
        inverse = r(jax.lax.rsqrt(r(square - r(mean * mean)) + 1e-5))
        scale = self.param("scale", nn.initializers.ones, (h.shape[-1],))
        bias = self.param("bias", nn.initializers.zeros, (h.shape[-1],))
        return r(r(r(h - mean) * inverse) * scale + bias)


class NormNet(nn.Module):
    """Features with a mean of 6 and a spread of about 1 into the hand-written LayerNorm."""

    planted: bool = False

    @nn.compact
    def __call__(self, x, attention_mask=None, train: bool = True):
        h = nn.Dense(64, name="embed", bias_init=nn.initializers.constant(6.0))(x)
        h = HandLayerNorm(self.planted, name="norm")(h)
        h = nn.relu(nn.Dense(64, name="hidden")(h))
        return nn.Dense(3, name="head")(h)


class MeanPool(nn.Module):
    """The mean over a long axis (512 positions), summed in 16 bits where ``planted``."""

    planted: bool = False

    @nn.compact
    def __call__(self, h):
        return _sum_in16(jnp.swapaxes(h, -1, -2), self.planted) / h.shape[-2]


class PoolNet(nn.Module):
    planted: bool = False

    @nn.compact
    def __call__(self, x, attention_mask=None, train: bool = True):
        h = nn.relu(nn.Dense(16, name="embed")(x))  # (batch, 512, 16)
        h = MeanPool(self.planted, name="pool")(h)
        return nn.Dense(3, name="head")(h)


class HandSoftmax(nn.Module):
    """``exp(s - max s) / sum exp(s - max s)`` over 256 keys; in 16 bits where
    ``planted``, its normalising sum accumulated in 16 bits."""

    planted: bool = False

    @nn.compact
    def __call__(self, scores):
        r = lambda v: _in16(v, self.planted)
        shifted = r(scores - jnp.max(scores, axis=-1, keepdims=True))
        e = r(jnp.exp(shifted))
        return r(e / _sum_in16(e, self.planted)[..., None])


class SoftmaxNet(nn.Module):
    planted: bool = False

    @nn.compact
    def __call__(self, x, attention_mask=None, train: bool = True):
        scores = nn.Dense(256, name="scores")(x)
        weights = HandSoftmax(self.planted, name="softmax")(scores)
        return nn.Dense(3, name="head")(weights)


class NoisyDense(nn.Module):
    """A Dense layer whose output carries a relative error of ``error`` (a fixed draw)."""

    features: int
    error: float = 0.0

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        kernel = self.param("kernel", init, (x.shape[-1], self.features))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        out = x @ kernel + bias
        if not self.error:
            return out
        noise = jax.random.normal(jax.random.key(42), out.shape, jnp.float32)
        return out * (1.0 + self.error * noise).astype(out.dtype)


class MLP(nn.Module):
    """A well-conditioned MLP, 256 wide; ``planted``: a 5% error in the output of ``middle``
    (15 times the bfloat16 policy's own error there)."""

    planted: bool = False

    @nn.compact
    def __call__(self, x, attention_mask=None, train: bool = True):
        h = nn.relu(nn.Dense(256, name="first")(x))
        h = nn.relu(NoisyDense(256, 0.05 if self.planted else 0.0, name="middle")(h))
        h = nn.relu(nn.Dense(256, name="last")(h))
        return nn.Dense(3, name="head")(h)


def _inputs(model):
    key = jax.random.key(1)
    shape = {PoolNet: (16, 512, 4), MLP: (32, 64)}.get(model, (32, 16))
    return jax.random.normal(key, shape), jnp.arange(shape[0]) % 3


@functools.cache
def _divergence(model, planted):
    """compare's divergence rows of its bf16 variant run on ``model(planted)`` against
    ``model()`` in float32, on one batch, each beside its floor (computed once)."""
    x, y = _inputs(model)
    return _rows(model(), model(planted), x, y, "bf16")


def _rows(reference, module, x, y, variant, has_batch_stats=False):
    """``_numerics_before_training``'s rows of ``variant`` run on ``module`` (its policy
    applied, as compare's ``Run.loss_fn`` traces it), against ``reference`` in float32."""
    task = Task(reference, has_batch_stats, 1e-3)
    variables = task.module.init(jax.random.key(0), x)
    mixed = apply_policy(module, get_variant(variant).policy)

    def loss_fn(rng):
        def loss(params, state, x, y):
            logits, _ = task.apply(mixed, params, state, x, True, rng)
            logits = logits.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return loss

    run = types.SimpleNamespace(
        variant=get_variant(variant), loss_fn=loss_fn, divergence=None, divergence_loss_scale=None
    )
    config = CompareConfig(variants=("fp32", variant), batch_size=len(x))
    compare_lib._numerics_before_training([run], task, variables, (x, y), config, print)
    return run.divergence


# Each model, the layer of its fault, and the layers that run before it.
PLANTED = [
    (NormNet, "norm", ["embed"]),
    (PoolNet, "pool", ["embed"]),
    (SoftmaxNet, "softmax", ["scores"]),
    (MLP, "middle", ["first"]),
]
IDS = [layer for _, layer, _ in PLANTED]


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("model, layer, upstream", PLANTED, ids=IDS)
def test_a_planted_precision_fault_is_flagged_at_its_layer(model, layer, upstream):
    path = lambda name: f"{model.__name__}/{name}"
    faulty = {(d["layer"], d["phase"]): d for d in _divergence(model, planted=True)}
    clean = {(d["layer"], d["phase"]): d for d in _divergence(model, planted=False)}
    fault, healthy = faulty[(path(layer), "forward")], clean[(path(layer), "forward")]
    # the fault is there, and is a precision fault: finite, of the value's own size
    assert np.isfinite(fault["scale_error"]) and 0.5 < fault["size_ratio"] < 2, fault
    assert fault["scale_error"] > 5 * healthy["scale_error"], (fault, healthy)
    assert fault["floor"] is not None and fault["flagged"], fault
    assert fault["fault"] == "above its floor", fault
    for name in upstream:  # the layers before it are not blamed
        assert not faulty[(path(name), "forward")]["flagged"], faulty[(path(name), "forward")]


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("model", [m for m, _, _ in PLANTED], ids=IDS)
def test_the_same_models_done_right_flag_nothing(model):
    rows = _divergence(model, planted=False)
    with_floor = [d for d in rows if d["floor"] is not None]
    assert len(with_floor) == len(rows) > 4, rows
    assert not any(d["flagged"] for d in rows), [d for d in rows if d["flagged"]]
    # and no row stands near the flag: the floor is no lower than a healthy policy needs
    ratios = [d["scale_error"] / d["floor"] for d in with_floor if d["floor"] > 0]
    assert max(ratios) < numerics_checks.FLAG_RATIO, ratios


def _healthy(rows):
    """No row flagged, every row with a floor, and no error that could be flagged (1% or
    more) at even half the ratio that flags it."""
    assert rows and all(d["floor"] is not None for d in rows), rows
    assert not any(d["flagged"] for d in rows), [d for d in rows if d["flagged"]]
    large = [d for d in rows if d["scale_error"] >= numerics_checks.FLAG_MINIMUM]
    ratios = [d["scale_error"] / d["floor"] for d in large]
    assert not ratios or max(ratios) < numerics_checks.FLAG_RATIO / 2, sorted(ratios)[-5:]


@pytest.mark.standard_promotion(FLAX)
def test_a_resnet_whose_batch_norms_cancel_flags_nothing():
    """A narrow ResNet18 at its initial weights, BatchNorm over the batch: its backward
    passes cancel, so bfloat16's gradients depart from fp32's by tens of percent; the
    ideal recipe's do too, and nothing is flagged."""
    from jaxamp._src.compare.data import load_digits_28x28
    from jaxamp._src.compare.models.resnet import ResNet18

    data = load_digits_28x28()
    x, y = jnp.asarray(data.train_x[:32]), jnp.asarray(data.train_y[:32])
    model = ResNet18(data.num_classes, width=8)
    rows = _rows(model, model, x, y, "bf16", has_batch_stats=True)
    backward = [d["scale_error"] for d in rows if d["phase"] == "backward"]
    assert max(backward) > 0.1, backward  # badly conditioned, as the guide says
    _healthy(rows)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet18", "bert"])
def test_the_cpu_default_models_flag_nothing(model):
    """The models ``jaxamp compare`` runs on a CPU (a ResNet18 of width 32; the
    BERT-shaped transformer of width 384), their first batch, every variant that
    computes in fewer bits: nothing flagged (the twin CI runs: the ResNet above, and
    the tiny BERT of tests/compare/app_test.py)."""
    from jaxamp._src.compare import data as data_lib
    from jaxamp._src.compare.choice import CPU_CONVNET, CPU_TRANSFORMER

    shape = {"model": "resnet18", "width": CPU_CONVNET["width"]}
    if model == "bert":
        shape = {"model": "bert", **CPU_TRANSFORMER}
    variants = ("bf16", "fp16", "fp8")
    config = CompareConfig(variants=("fp32", *variants), data="embedded", **shape)
    tokenizer = None
    if model == "bert":
        tokenizer = data_lib.HashingTokenizer(config.vocab_size, config.seq_len)
    kind = "text" if model == "bert" else "images"
    dataset, _ = data_lib.load_dataset(kind, "embedded", None, tokenizer)
    task = make_task(config, dataset.num_classes)
    sample = jax.device_put((dataset.train_x[:32], dataset.train_y[:32]))
    variables = task.module.init(jax.random.key(0), sample[0][:1])
    runs = [Run(get_variant(v), task, variables, config, sample) for v in variants]
    compare_lib._numerics_before_training(runs, task, variables, sample, config, print)
    for run in runs:
        _healthy(run.divergence)
