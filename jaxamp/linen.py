"""Mixed precision for Flax Linen models: ``jaxamp.linen.apply_policy``."""

from jaxamp._src.linen_policy import PolicyModule, apply_policy

__all__ = ("PolicyModule", "apply_policy")
