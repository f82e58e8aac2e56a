"""Loss scaling and optimizer state as optax transformations, and their records."""

from jaxamp._src.optim.diagnostics import (
    LossScaleStuckError,
    loss_scale_metrics,
    raise_if_stuck,
    scale_history,
    underflow_fraction,
)
from jaxamp._src.optim.gradients import get_loss_scale, reduce_gradients, scale_loss, value_and_grad
from jaxamp._src.optim.loss_scaled import LossScaledState, all_finite, loss_scaled
from jaxamp._src.optim.master_weights import MASTER_WEIGHTS
from jaxamp._src.optim.opt_state import find_loss_scaled_state, nonfinite_gradients
from jaxamp._src.optim.recipes import OPTIMIZER_RECIPES, optimizer_recipe
from jaxamp._src.optim.rounding import stochastic_round
from jaxamp._src.optim.scales import (
    DynamicLossScale,
    LossScaleState,
    NoOpLossScale,
    StaticLossScale,
)
from jaxamp._src.optim.state_dtype import StateDtypeState, with_state_dtype

__all__ = (
    "MASTER_WEIGHTS",
    "OPTIMIZER_RECIPES",
    "DynamicLossScale",
    "LossScaleState",
    "LossScaleStuckError",
    "LossScaledState",
    "NoOpLossScale",
    "StateDtypeState",
    "StaticLossScale",
    "all_finite",
    "find_loss_scaled_state",
    "get_loss_scale",
    "loss_scale_metrics",
    "loss_scaled",
    "nonfinite_gradients",
    "optimizer_recipe",
    "raise_if_stuck",
    "reduce_gradients",
    "scale_history",
    "scale_loss",
    "stochastic_round",
    "underflow_fraction",
    "value_and_grad",
    "with_state_dtype",
)
