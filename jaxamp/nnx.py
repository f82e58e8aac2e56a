"""Mixed precision for Flax NNX models: ``jaxamp.nnx.apply_policy``."""

from jaxamp._src.flax_policy.nnx import apply_policy

__all__ = ("apply_policy",)
