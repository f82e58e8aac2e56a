"""Equinox and Haiku models, unmodified, under ``jaxamp.autocast``.

Neither library's modules are Flax modules, so ``autocast`` (op-level rules for
any JAX function) is the path: the loss is wrapped as it stands.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxamp
from tests.compat.harness import POLICIES, check_model
from tests.helpers.promotion import OTHER_LIBRARY

hk = pytest.importorskip("haiku")

BATCH, FEATURES, CLASSES = 8, 12, 3


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


class EqxCNN(eqx.Module):
    """A small convolutional classifier of Equinox layers."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    norm: eqx.nn.GroupNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, key=k2)
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.norm = eqx.nn.GroupNorm(2, 8)
        self.head = eqx.nn.Linear(8 * 2 * 2, CLASSES, key=k3)

    def __call__(self, x):
        x = self.pool(jax.nn.relu(self.conv1(x)))
        x = self.pool(jax.nn.gelu(self.norm(self.conv2(x))))
        return self.head(x.reshape(-1))


class EqxTransformerBlock(eqx.Module):
    """Pre-norm self-attention and MLP blocks of Equinox layers, then a classifier."""

    embed: eqx.nn.Linear
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(FEATURES, 16, key=keys[0])
        self.norm1 = eqx.nn.LayerNorm(16)
        self.attention = eqx.nn.MultiheadAttention(4, 16, key=keys[1])
        self.norm2 = eqx.nn.LayerNorm(16)
        self.mlp = eqx.nn.MLP(16, 16, 32, depth=1, activation=jax.nn.gelu, key=keys[2])
        self.head = eqx.nn.Linear(16, CLASSES, key=keys[3])

    def __call__(self, x):  # x: [tokens, features]
        x = jax.vmap(self.embed)(x)
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        x = x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return self.head(jnp.mean(x, axis=0))


def eqx_mlp():
    model = eqx.nn.MLP(
        FEATURES, CLASSES, 32, depth=2, activation=jax.nn.silu, key=jax.random.key(0)
    )
    return model, jax.random.normal(jax.random.key(1), (BATCH, FEATURES))


def eqx_cnn():
    return EqxCNN(jax.random.key(0)), jax.random.normal(jax.random.key(1), (BATCH, 3, 8, 8))


def eqx_transformer():
    model = EqxTransformerBlock(jax.random.key(0))
    return model, jax.random.normal(jax.random.key(1), (BATCH, 6, FEATURES))


EQUINOX = {"MLP": eqx_mlp, "CNN": eqx_cnn, "Transformer block": eqx_transformer}


def _each_model_one_policy(models):
    """(name, policy): CI runs each model under one policy, the policies in turn; the
    slow run, every pair."""
    return [
        pytest.param(name, policy, marks=() if j == i % len(POLICIES) else (pytest.mark.slow,))
        for i, name in enumerate(models)
        for j, policy in enumerate(POLICIES)
    ]


@pytest.mark.standard_promotion(OTHER_LIBRARY)
@pytest.mark.parametrize(("name", "policy"), _each_model_one_policy(EQUINOX))
def test_equinox_model(name, policy):
    model, x = EQUINOX[name]()
    params, static = eqx.partition(model, eqx.is_array)
    labels = jnp.arange(BATCH) % CLASSES

    def fp32_loss(params, batch):
        model = eqx.combine(params, static)
        return _xent(jax.vmap(model)(batch["x"]), batch["labels"]).mean()

    check_model(
        package="equinox",
        model=name,
        path="autocast",
        policy=policy,
        amp_loss=jaxamp.autocast(fp32_loss, policy),
        fp32_loss=fp32_loss,
        params=params,
        batch={"x": x, "labels": labels},
    )


def haiku_resnet(x):
    net = hk.nets.ResNet(
        blocks_per_group=(1, 1, 1, 1),
        num_classes=CLASSES,
        bottleneck=False,
        channels_per_group=(8, 8, 16, 16),
        use_projection=(True, True, True, True),
    )
    return net(x, is_training=True)  # batch statistics (the state update is dropped)


def haiku_mlp(x):
    return hk.nets.MLP([32, 32, CLASSES], activation=jax.nn.gelu)(x)


HAIKU = {
    "ResNet": (haiku_resnet, (BATCH, 16, 16, 3)),
    "MLP": (haiku_mlp, (BATCH, FEATURES)),
}


# The ResNet (BatchNorm state through hk.transform_with_state) in the slow run: it compiles
# for 40 s on 2 cores under either policy; the MLP in CI.
_HAIKU_CASES = [
    pytest.param(
        *p.values, marks=(*p.marks, *((pytest.mark.slow,) if p.values[0] == "ResNet" else ()))
    )
    for p in _each_model_one_policy(["MLP", "ResNet"])
]


@pytest.mark.standard_promotion(OTHER_LIBRARY)
@pytest.mark.parametrize(("name", "policy"), _HAIKU_CASES)
def test_haiku_model(name, policy):
    forward, shape = HAIKU[name]
    net = hk.transform_with_state(forward)
    x = jax.random.normal(jax.random.key(1), shape)
    params, state = net.init(jax.random.key(0), x)
    labels = jnp.arange(BATCH) % CLASSES

    def fp32_loss(params, batch):
        logits, _ = net.apply(params, state, None, batch["x"])
        return _xent(logits, batch["labels"]).mean()

    check_model(
        package="haiku",
        model=name,
        path="autocast",
        policy=policy,
        amp_loss=jaxamp.autocast(fp32_loss, policy),
        fp32_loss=fp32_loss,
        params=params,
        batch={"x": x, "labels": labels},
    )
