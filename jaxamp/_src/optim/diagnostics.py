"""What AMP write-ups plot: underflow in float16, the loss scale, skipped steps."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.dtypes import is_floating_array
from jaxamp._src.optim.opt_state import find_loss_scaled_state, nonfinite_gradients


def underflow_fraction(grads: Any, dtype: Any = jnp.float16) -> jax.Array:
    """Fraction of gradient elements that would flush to zero in ``dtype``; jittable.

    An element counts when it is non-zero and becomes zero when cast to
    ``dtype`` (round to nearest even): for float16, magnitudes up to 2**-25;
    those between 2**-25 and 2**-24 round up to the smallest subnormal and are
    kept. Pass the true (unscaled) gradients to see what loss scaling rescues.

    Args:
      grads: a pytree of gradients (non-floating leaves are ignored).
      dtype: the 16-bit dtype to check against.

    Returns:
      A float32 scalar in [0, 1].

    Examples:
      >>> import jax.numpy as jnp
      >>> float(underflow_fraction(jnp.array([1.0, 1e-9, 0.0, 1e-3])))
      0.25
    """
    leaves = [x for x in jax.tree.leaves(grads) if is_floating_array(x)]
    if not leaves:
        return jnp.zeros([], jnp.float32)
    count = sum(jnp.sum((x != 0) & (x.astype(dtype) == 0), dtype=jnp.float32) for x in leaves)
    total = float(sum(x.size for x in leaves))
    if total == 0:  # only empty arrays: nothing flushes
        return jnp.zeros([], jnp.float32)
    return jnp.asarray(count / total)


def loss_scale_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """The loss scale and step counters of a loss-scaled optimizer state; jittable.

    ``applied_steps`` counts the updates applied (the inner optimizer's own step count,
    which schedules read); ``nnx.Optimizer.step`` and Flax's ``TrainState.step`` count
    every call, skipped steps included.

    Returns:
      ``{"loss_scale", "applied_steps", "skipped_steps", "consecutive_skips",
      "last_finite"}``, arrays on device: log them without forcing a host sync every
      step.
    """
    state = find_loss_scaled_state(opt_state)
    return {
        "loss_scale": state.loss_scale.scale,
        "applied_steps": state.step - state.skipped_steps,
        "skipped_steps": state.skipped_steps,
        "consecutive_skips": state.consecutive_skips,
        "last_finite": state.last_finite,
    }


class LossScaleStuckError(RuntimeError):
    """Raised by ``raise_if_stuck`` when training makes no progress."""


def scale_history(opt_state: Any) -> np.ndarray:
    """The scales after the last steps, oldest first (reads the device)."""
    state = find_loss_scaled_state(opt_state)
    history = np.asarray(state.scale_history)
    step = int(state.step)
    length = len(history)
    if step < length:
        return history[:step]
    start = step % length
    return np.concatenate([history[start:], history[:start]])


def raise_if_stuck(opt_state: Any, max_consecutive_skips: int = 20) -> None:
    """Raises if the last ``max_consecutive_skips`` or more steps were all skipped.

    Call it from the training loop where you log (it reads a few scalars from
    the device, so not necessarily every step). A run is stuck when its
    gradients stay non-finite whatever the scale: a NaN in the data or the
    model, a learning rate that diverged, or float16 overflow in the forward
    pass (which no loss scale fixes).

    Args:
      opt_state: a loss-scaled optimizer state (or ``nnx.Optimizer``).
      max_consecutive_skips: how many skipped steps in a row to tolerate.

    Raises:
      LossScaleStuckError: with the recent scale history.
      ValueError: if ``max_consecutive_skips`` < 1.
    """
    if max_consecutive_skips < 1:
        raise ValueError(f"max_consecutive_skips must be >= 1, got {max_consecutive_skips!r}.")
    state = find_loss_scaled_state(opt_state)
    consecutive = int(state.consecutive_skips)
    if consecutive < max_consecutive_skips:
        return
    history = ", ".join(f"{s:g}" for s in scale_history(opt_state))
    raise LossScaleStuckError(
        f"The last {consecutive} steps were skipped for non-finite gradients "
        f"({int(state.skipped_steps)} of {int(state.step)} in all). Loss scale over the "
        f"last steps, oldest first: [{history}]. If the scale keeps falling, the "
        "gradients are non-finite whatever the scale: look for NaN/Inf in the inputs, the "
        "loss or the forward pass (float16 activations overflow above 65504), or a "
        "learning rate that diverged. " + _where_to_look(state)
    )


def _where_to_look(state: Any) -> str:
    """The recorded non-finite leaves, and the tool that finds the operation."""
    hint = (
        "jaxamp.find_nonfinite(loss_fn, loss_scale=opt_state)(params, batch) names the "
        "layer and the operation (forward or backward) that first makes an inf or a NaN"
    )
    if state.nonfinite_grads is None:
        return hint + "; loss_scaled(..., record_nonfinite=True) records which gradients were."
    bad = nonfinite_gradients(state)
    shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
    return f"Non-finite at the last skipped step: {shown or 'none recorded'}. " + hint + "."
