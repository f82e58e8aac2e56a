"""Loss-scale configurations: how the scale starts and how it moves after each step."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class LossScaleState(NamedTuple):
    """The part of a loss scale that changes during training (all arrays).

    Attributes:
      scale: the current loss scale, float32 ``[]``.
      growth_tracker: finite steps since the scale last changed, int32 ``[]``
        (``torch.amp.GradScaler``'s ``_growth_tracker``).
      hysteresis_left: overflows still tolerated before the next backoff, int32 ``[]``.
    """

    scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_left: jax.Array


def _state(scale: float, hysteresis: int = 1) -> LossScaleState:
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        growth_tracker=jnp.zeros([], jnp.int32),
        hysteresis_left=jnp.asarray(hysteresis, jnp.int32),
    )


def _real(name: str, value: Any) -> float:
    """``value`` as a Python float: a Python, NumPy (including a 0-d array, such as
    jmp's ``np.ones([], np.float32)``) or JAX real scalar (not a bool)."""
    scalar_types = (numbers.Real, np.generic, np.ndarray, jax.Array)
    if isinstance(value, bool) or not isinstance(value, scalar_types):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__}).")
    if np.ndim(np.asarray(value)) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
        raise TypeError(f"{name} must be a real scalar, got {value!r}.")
    return float(value)


def _integer(name: str, value: Any) -> int:
    """``value`` as a Python int: a Python, NumPy or JAX integer scalar (not a bool)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}.")
    try:
        return operator.index(value)
    except TypeError as e:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.") from e


def _check_scale(name: str, value: Any) -> float:
    """A scale the float32 state holds as it is: a normal float32 number (from 2**-126
    to float32's largest); 1e39 would be inf, and 1e-50 zero, which no step leaves."""
    value = _real(name, value)
    f32 = np.finfo(np.float32)
    if not (math.isfinite(value) and float(f32.tiny) <= value <= float(f32.max)):
        raise ValueError(
            f"{name} must be a positive, finite float32 number, from 2**-126 (~1.2e-38) to "
            f"~3.4e38, got {value!r}."
        )
    return value


def _normalize(config: Any, reals: tuple[str, ...], integers: tuple[str, ...] = ()) -> None:
    """Stores NumPy/JAX scalars of a frozen config as Python numbers (hashable, static)."""
    for name in reals:
        if getattr(config, name) is not None:
            object.__setattr__(config, name, _real(name, getattr(config, name)))
    for name in integers:
        object.__setattr__(config, name, _integer(name, getattr(config, name)))


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """A scale of 1 that never changes: no scaling, but non-finite steps are still skipped.

    The usual choice for bfloat16, whose range equals float32's.

    Examples:
      >>> NoOpLossScale().init().scale
      Array(1., dtype=float32)
    """

    dynamic = False

    def init(self) -> LossScaleState:
        """The initial state."""
        return _state(1.0)

    def adjust(self, state: LossScaleState, grads_finite: jax.Array) -> LossScaleState:
        """The state after a step; unchanged."""
        del grads_finite
        return state


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale.

    Attributes:
      scale: the scale; positive and finite.

    Examples:
      >>> StaticLossScale(128.0).init().scale
      Array(128., dtype=float32)
    """

    scale: float
    dynamic = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "scale", _check_scale("StaticLossScale.scale", self.scale))

    def init(self) -> LossScaleState:
        """The initial state."""
        return _state(self.scale)

    def adjust(self, state: LossScaleState, grads_finite: jax.Array) -> LossScaleState:
        """The state after a step; unchanged."""
        del grads_finite
        return state


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """A loss scale that backs off on overflow and grows after a run of finite steps.

    With the defaults this is ``torch.amp.GradScaler``'s rule, step for step: a
    step with non-finite gradients multiplies the scale by ``backoff_factor``
    and restarts the count; ``growth_interval`` consecutive finite steps
    multiply it by ``growth_factor`` (unless that would overflow float32). The
    scale is float32 and is multiplied in float32, as GradScaler's is (for
    factors that float32 represents exactly, such as the defaults, the results
    are bit-identical; GradScaler multiplies by a float64 factor).

    Opt-in extensions, off by default:

    * ``min_scale``: the scale never backs off below it. Without it the scale stops
      at float32's smallest normal number, 2**-126: XLA flushes subnormal floats to
      zero on CPU, and a scale of 0 could never grow back.
    * ``max_scale``: the scale never grows above it.
    * ``hysteresis``: tolerate this many overflows before backing off, as
      DeepSpeed and Megatron-LM do; the count is restored when the scale grows.
      ``hysteresis=1`` (the default) backs off at the first overflow.

    Attributes:
      init_scale: the initial scale.
      growth_factor: factor applied after ``growth_interval`` finite steps, > 1.
      backoff_factor: factor applied on overflow, in (0, 1).
      growth_interval: finite steps between growths, >= 1.
      min_scale: lower bound, or ``None`` (float32's smallest normal number).
      max_scale: upper bound, or ``None``.
      hysteresis: overflows tolerated before a backoff, >= 1.

    Raises:
      ValueError: for a setting outside its range; the message names it.

    Examples:
      >>> import jax.numpy as jnp
      >>> rule = DynamicLossScale(init_scale=8.0, growth_interval=2)
      >>> state = rule.adjust(rule.init(), jnp.array(False))  # overflow: back off
      >>> float(state.scale)
      4.0
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1
    dynamic = True

    def __post_init__(self) -> None:
        _normalize(
            self,
            ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"),
            ("growth_interval", "hysteresis"),
        )
        _check_scale("init_scale", self.init_scale)
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor!r}.")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor!r}.")
        if self.growth_interval < 1:
            raise ValueError(
                f"growth_interval must be an integer >= 1, got {self.growth_interval!r}."
            )
        if self.hysteresis < 1:
            raise ValueError(f"hysteresis must be an integer >= 1, got {self.hysteresis!r}.")
        for name in ("min_scale", "max_scale"):
            if getattr(self, name) is not None:
                _check_scale(name, getattr(self, name))
        low, high = self.min_scale or 0.0, self.max_scale or math.inf
        if low > high:
            raise ValueError(
                f"min_scale ({self.min_scale!r}) must not exceed max_scale ({self.max_scale!r})."
            )
        if not low <= self.init_scale <= high:
            raise ValueError(
                f"init_scale ({self.init_scale!r}) must lie within "
                f"[min_scale, max_scale] = [{self.min_scale!r}, {self.max_scale!r}]."
            )

    def init(self) -> LossScaleState:
        """The initial state."""
        return _state(self.init_scale, self.hysteresis)

    def adjust(self, state: LossScaleState, grads_finite: jax.Array) -> LossScaleState:
        """The state after a step whose gradients were (not) all finite; jittable.

        Args:
          state: the state before the step.
          grads_finite: boolean scalar, whether every gradient was finite.

        Returns:
          The new state.

        Raises:
          ValueError: if ``grads_finite`` is not a scalar (a vector would turn the
            state into a batch of states).
        """
        if jnp.shape(grads_finite) != ():
            raise ValueError(
                "grads_finite must be a boolean scalar (e.g. jaxamp.optim.all_finite(grads)), got "
                f"shape {jnp.shape(grads_finite)}."
            )
        scale, tracker, hysteresis_left = state
        f32 = jnp.float32

        # Overflow: restart the count, spend one unit of hysteresis, back off when none is left.
        hysteresis_after = jnp.maximum(hysteresis_left - 1, 0)
        backed_off = scale * jnp.asarray(self.backoff_factor, f32)
        floor = jnp.finfo(f32).tiny if self.min_scale is None else self.min_scale
        backed_off = jnp.maximum(backed_off, jnp.asarray(floor, f32))
        overflow_scale = jnp.where(hysteresis_after == 0, backed_off, scale)

        # Finite: count; at growth_interval grow (if the result is finite) and restore hysteresis.
        successful = tracker + 1
        grow = successful >= self.growth_interval
        grown = scale * jnp.asarray(self.growth_factor, f32)
        if self.max_scale is not None:
            grown = jnp.minimum(grown, jnp.asarray(self.max_scale, f32))
        finite_scale = jnp.where(grow & jnp.isfinite(grown), grown, scale)
        finite_tracker = jnp.where(grow, 0, successful)
        finite_hysteresis = jnp.where(grow, jnp.int32(self.hysteresis), hysteresis_left)

        return LossScaleState(
            scale=jnp.where(grads_finite, finite_scale, overflow_scale).astype(f32),
            growth_tracker=jnp.where(grads_finite, finite_tracker, 0).astype(jnp.int32),
            hysteresis_left=jnp.where(grads_finite, finite_hysteresis, hysteresis_after).astype(
                jnp.int32
            ),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
