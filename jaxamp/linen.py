"""Mixed precision for Flax Linen models: ``jaxamp.linen.apply_policy``."""

from jaxamp._src.flax_policy.linen import PolicyModule, apply_policy

__all__ = ("PolicyModule", "apply_policy")
