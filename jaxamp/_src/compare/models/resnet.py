"""ResNet in Flax Linen, layer for layer the torchvision ResNet (v1.5)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# torchvision's BatchNorm defaults: momentum 0.1 (Flax: 0.9), eps 1e-5.
_BatchNorm = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)
_he_normal = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 convolutions with a residual connection."""

    features: int
    strides: int = 1
    expansion: int = 4
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, kernel_init=_he_normal, dtype=self.dtype)
        norm = functools.partial(_BatchNorm, use_running_average=not train, dtype=self.dtype)
        residual = x
        y = nn.relu(norm()(conv(self.features, (1, 1))(x)))
        y = conv(self.features, (3, 3), strides=self.strides, padding=1)(y)
        y = nn.relu(norm()(y))
        y = conv(self.features * self.expansion, (1, 1))(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = conv(self.features * self.expansion, (1, 1), strides=self.strides)(x)
            residual = norm()(residual)
        return nn.relu(residual + y)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet18/34)."""

    features: int
    strides: int = 1
    expansion: int = 1
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, kernel_init=_he_normal, dtype=self.dtype)
        norm = functools.partial(_BatchNorm, use_running_average=not train, dtype=self.dtype)
        residual = x
        y = conv(self.features, (3, 3), strides=self.strides, padding=1)(x)
        y = nn.relu(norm()(y))
        y = conv(self.features, (3, 3), padding=1)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = conv(self.features, (1, 1), strides=self.strides)(x)
            residual = norm()(residual)
        return nn.relu(residual + y)


class ResNet(nn.Module):
    """A ResNet classifier for NHWC images.

    Attributes:
      stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet50.
      block_cls: ``BottleneckBlock`` or ``BasicBlock``.
      num_classes: number of output logits.
      width: channels of the first stage (64 in the paper).
      dtype: Flax's per-layer compute dtype (``None``: inferred, float32 here); set it
        by hand to compare with a policy.
    """

    stage_sizes: Sequence[int]
    block_cls: Any = BottleneckBlock
    num_classes: int = 1000
    width: int = 64
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(
            self.width,
            (7, 7),
            strides=2,
            padding=3,
            use_bias=False,
            kernel_init=_he_normal,
            dtype=self.dtype,
            name="conv1",
        )(x)
        x = nn.relu(_BatchNorm(use_running_average=not train, dtype=self.dtype, name="bn1")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for i, blocks in enumerate(self.stage_sizes):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = self.block_cls(self.width * 2**i, strides=strides, dtype=self.dtype)(
                    x, train=train
                )
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype, name="fc")(x)


def ResNet18(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet18 (11.7M parameters with 1000 classes)."""
    return ResNet((2, 2, 2, 2), BasicBlock, num_classes, **kwargs)


def ResNet50(num_classes: int = 1000, **kwargs: Any) -> ResNet:
    """ResNet50 (25.6M parameters with 1000 classes, as torchvision's)."""
    return ResNet((3, 4, 6, 3), BottleneckBlock, num_classes, **kwargs)
