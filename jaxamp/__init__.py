"""jaxamp: automatic mixed precision for JAX.

Precision policies that apply to unmodified Flax models (``jaxamp.linen``,
``jaxamp.nnx``), op-level autocast for any JAX function (``jaxamp.autocast``),
loss scaling as an optax transformation, and reports that show what precision
a compiled program really runs in.
"""

from jaxamp import linen, nnx
from jaxamp._src.attention import dot_product_attention, softmax_float32
from jaxamp._src.audit import PrecisionError, Problem, SensitiveOp
from jaxamp._src.autocast import autocast, autocast_float32
from jaxamp._src.autocast_rules import AUTOCAST_RULES, AutocastRules
from jaxamp._src.backend import auto_policy, dot_algorithm
from jaxamp._src.diagnostics import (
    LossScaleStuckError,
    loss_scale_metrics,
    raise_if_stuck,
    scale_history,
    underflow_fraction,
)
from jaxamp._src.distributed import (
    data_parallel_mesh,
    fsdp_shardings,
    reduce_gradients,
    replicated,
    shard_batch,
)
from jaxamp._src.loss_scale import DynamicLossScale, LossScaleState, NoOpLossScale, StaticLossScale
from jaxamp._src.loss_scaled import (
    LossScaledState,
    all_finite,
    loss_scaled,
    nonfinite_gradients,
)
from jaxamp._src.master_weights import MASTER_WEIGHTS
from jaxamp._src.matmul_forms import FORMS as MATMUL_FORMS
from jaxamp._src.matmul_forms import MatmulForm, matmul_form, use_matmul_form
from jaxamp._src.numerics.find_nonfinite import NonFinite, ValueRange, find_nonfinite
from jaxamp._src.numerics.numerics_diff import LayerDiff, NumericsDiff, numerics_diff
from jaxamp._src.numerics.range_report import (
    LayerRange,
    RangeReport,
    Recommendation,
    range_report,
)
from jaxamp._src.policy import PRESETS, Policy, cast_floating, get_policy
from jaxamp._src.precision_report import MatmulOp, PrecisionReport, precision_report
from jaxamp._src.residuals import activation_bytes, checkpoint_residuals, saved_residuals
from jaxamp._src.rounding import stochastic_round
from jaxamp._src.scale_loss import (
    find_loss_scaled_state,
    get_loss_scale,
    scale_loss,
    value_and_grad,
)
from jaxamp._src.state_dtype import (
    OPTIMIZER_RECIPES,
    StateDtypeState,
    optimizer_recipe,
    with_state_dtype,
)

__version__ = "0.1.0"

__all__ = (
    "AUTOCAST_RULES",
    "MASTER_WEIGHTS",
    "MATMUL_FORMS",
    "OPTIMIZER_RECIPES",
    "PRESETS",
    "AutocastRules",
    "DynamicLossScale",
    "LayerDiff",
    "LayerRange",
    "LossScaleState",
    "LossScaleStuckError",
    "LossScaledState",
    "MatmulForm",
    "MatmulOp",
    "NoOpLossScale",
    "NonFinite",
    "NumericsDiff",
    "Policy",
    "PrecisionError",
    "PrecisionReport",
    "Problem",
    "RangeReport",
    "Recommendation",
    "SensitiveOp",
    "StateDtypeState",
    "StaticLossScale",
    "ValueRange",
    "activation_bytes",
    "all_finite",
    "auto_policy",
    "autocast",
    "autocast_float32",
    "cast_floating",
    "checkpoint_residuals",
    "data_parallel_mesh",
    "dot_algorithm",
    "dot_product_attention",
    "find_loss_scaled_state",
    "find_nonfinite",
    "fsdp_shardings",
    "get_loss_scale",
    "get_policy",
    "linen",
    "loss_scale_metrics",
    "loss_scaled",
    "matmul_form",
    "nnx",
    "nonfinite_gradients",
    "numerics_diff",
    "optimizer_recipe",
    "precision_report",
    "raise_if_stuck",
    "range_report",
    "reduce_gradients",
    "replicated",
    "saved_residuals",
    "scale_history",
    "scale_loss",
    "shard_batch",
    "softmax_float32",
    "stochastic_round",
    "underflow_fraction",
    "use_matmul_form",
    "value_and_grad",
    "with_state_dtype",
)
