"""Mixed precision for Flax NNX models: ``jaxamp.nnx.apply_policy``."""

from jaxamp._src.nnx_policy import apply_policy

__all__ = ("apply_policy",)
