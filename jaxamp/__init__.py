"""jaxamp: automatic mixed precision for JAX.

Flax policies, op-level autocast, loss scaling as an optax transformation, precision tools."""

from jaxamp import checkpoint, debug, linen, nnx, ops, optim
from jaxamp._src.advisor.suggest import PolicySuggestion, suggest_policy
from jaxamp._src.audit.report import precision_report
from jaxamp._src.autocast.api import autocast, autocast_float32
from jaxamp._src.autocast.fp8_state import init_fp8_state
from jaxamp._src.autocast.rules import AUTOCAST_RULES, AutocastRules
from jaxamp._src.backend import auto_policy
from jaxamp._src.numerics.find_nonfinite import find_nonfinite
from jaxamp._src.numerics.numerics_diff import numerics_diff
from jaxamp._src.numerics.range_report import range_report
from jaxamp._src.ops.attention import dot_product_attention, softmax_float32
from jaxamp._src.ops.residuals import checkpoint_residuals
from jaxamp._src.optim.gradients import scale_loss, value_and_grad
from jaxamp._src.optim.loss_scaled import loss_scaled
from jaxamp._src.optim.recipes import optimizer_recipe
from jaxamp._src.optim.scales import DynamicLossScale, NoOpLossScale, StaticLossScale
from jaxamp._src.optim.state_dtype import with_state_dtype
from jaxamp._src.policy import PRESETS, Fp8Recipe, Policy, PolicyLike, cast_floating, get_policy

__version__ = "0.2.0"

__all__ = (
    "AUTOCAST_RULES",
    "PRESETS",
    "AutocastRules",
    "DynamicLossScale",
    "Fp8Recipe",
    "NoOpLossScale",
    "Policy",
    "PolicyLike",
    "PolicySuggestion",
    "StaticLossScale",
    "auto_policy",
    "autocast",
    "autocast_float32",
    "cast_floating",
    "checkpoint",
    "checkpoint_residuals",
    "debug",
    "dot_product_attention",
    "find_nonfinite",
    "get_policy",
    "init_fp8_state",
    "linen",
    "loss_scaled",
    "nnx",
    "numerics_diff",
    "ops",
    "optim",
    "optimizer_recipe",
    "precision_report",
    "range_report",
    "scale_loss",
    "softmax_float32",
    "suggest_policy",
    "value_and_grad",
    "with_state_dtype",
)
