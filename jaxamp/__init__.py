"""jaxamp: automatic mixed precision for JAX.

Precision policies that apply to unmodified Flax models (``jaxamp.linen``,
``jaxamp.nnx``), loss scaling as an optax transformation, and reports that
show what precision a compiled program really runs in.
"""

from jaxamp import linen, nnx
from jaxamp._src.attention import dot_product_attention, softmax_float32
from jaxamp._src.backend import auto_policy, dot_algorithm
from jaxamp._src.policy import PRESETS, Policy, cast_floating, get_policy
from jaxamp._src.precision_report import MatmulOp, PrecisionReport, precision_report
from jaxamp._src.residuals import activation_bytes, checkpoint_residuals, saved_residuals

__version__ = "0.1.0"

__all__ = (
    "PRESETS",
    "MatmulOp",
    "Policy",
    "PrecisionReport",
    "activation_bytes",
    "auto_policy",
    "cast_floating",
    "checkpoint_residuals",
    "dot_algorithm",
    "dot_product_attention",
    "get_policy",
    "linen",
    "nnx",
    "precision_report",
    "saved_residuals",
    "softmax_float32",
)
