"""Mixed precision for Flax NNX models: ``jaxamp.nnx.apply_policy``."""

from jaxamp._src.flax_policy.fp8 import OverwriteWithGradient, update_fp8_state
from jaxamp._src.flax_policy.nnx import apply_policy

__all__ = ("OverwriteWithGradient", "apply_policy", "update_fp8_state")
