"""Small, unmodified Flax NNX models the tests put under policies."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx


class ConvBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(cout, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.conv(x)))


class ResNet(nnx.Module):
    """Two residual blocks with BatchNorm and a linear head."""

    def __init__(self, num_classes: int = 10, width: int = 8, *, rngs: nnx.Rngs):
        self.stem = ConvBlock(3, width, rngs=rngs)
        self.block1 = ConvBlock(width, width, rngs=rngs)
        self.block2 = ConvBlock(width, width, rngs=rngs)
        self.head = nnx.Linear(width, num_classes, rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        x = x + self.block2(self.block1(x))
        return self.head(jnp.mean(x, axis=(1, 2)))


class EncoderLayer(nnx.Module):
    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x, mask):
        x = self.norm1(x + self.attn(x, mask=mask))
        return self.norm2(x + self.down(nnx.gelu(self.up(x))))


class Transformer(nnx.Module):
    """Token and position embeddings, two encoder layers, a classifier on token 0."""

    def __init__(
        self,
        vocab: int = 50,
        dim: int = 16,
        heads: int = 2,
        num_classes: int = 3,
        max_len: int = 16,
        *,
        rngs: nnx.Rngs,
    ):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.layers = nnx.List([EncoderLayer(dim, heads, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(dim, num_classes, rngs=rngs)

    def __call__(self, ids):
        x = self.norm(self.embed(ids) + self.pos(jnp.arange(ids.shape[-1]))[None])
        mask = nnx.make_attention_mask(ids > 0, ids > 0)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x[:, 0])
