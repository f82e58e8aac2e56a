"""Models shared by the tests of jaxamp/_src/numerics (a Linen net, its NNX twin)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jaxamp

X = jnp.linspace(-1.0, 1.0, 24).reshape(4, 6)
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


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


def model_output(params, x):
    return LinenNet().apply(params, x)


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


def dense_loss(dtype):
    def loss(w, x):
        with jax.named_scope("dense"):
            h = x.astype(dtype) @ w.astype(dtype)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    return loss
