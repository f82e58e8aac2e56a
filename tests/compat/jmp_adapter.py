"""jmp's API on top of jaxamp, so that jmp's own tests (``tests/compat/jmp_tests``) run on jaxamp.

Only names and call shapes are translated here; every rule comes from jaxamp:

* policies, their grammar and their casts are ``jaxamp.Policy`` and
  ``jaxamp.get_policy`` themselves; ``half_dtype``, ``cast_to_full`` and
  ``cast_to_half`` are jaxamp's ``"half"``/``"full"`` policies;
* a jmp loss scale is an object that carries its state. jaxamp splits that in
  two: a frozen configuration (``jaxamp.DynamicLossScale`` ...) and a
  ``jaxamp.optim.LossScaleState`` of arrays, moved by ``config.adjust(state, finite)``.
  The classes below hold both and call ``adjust``; ``scale``/``unscale``
  multiply by the scale in jaxamp's state (jaxamp has no tree-level
  scale/unscale of its own: ``jaxamp.scale_loss`` reads the scale from a
  ``loss_scaled`` optimizer state, whose ``update`` unscales the gradients);
* ``all_finite`` is ``jaxamp.optim.all_finite``.

Left out, because jaxamp has no equivalent (jmp's tests of them fail, and
``jmp_test.py`` marks them): ``select_tree`` (``jaxamp.loss_scaled`` keeps or
discards a step itself, on device) and the warning jmp's ``DynamicLossScale``
gives for an integer setting (jaxamp takes any real scalar and keeps the scale
in float32).

jmp itself passes every one of these tests (97 of 97, jmp 0.0.4 on jax 0.10.2).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

import jaxamp

T = TypeVar("T")

# Policies ---------------------------------------------------------------------------

Policy = jaxamp.Policy
get_policy = jaxamp.get_policy


def half_dtype() -> np.dtype:
    """jmp's half dtype (float16, bfloat16 on TPU): the compute dtype of jaxamp's ``"half"``."""
    return jaxamp.get_policy("half").compute_dtype


def cast_to_full(tree: T) -> T:
    """Floating leaves to float32, as jaxamp's ``"full"`` policy casts them."""
    return jaxamp.get_policy("full").cast_to_compute(tree)


def cast_to_half(tree: T) -> T:
    """Floating leaves to the half dtype, as jaxamp's ``"half"`` policy casts them."""
    return jaxamp.get_policy("half").cast_to_compute(tree)


# Not an API: jmp's test_str reads this table of jmp's to know what ``str(policy)`` must
# print. It is jmp's own spelling (the reference), so the test asks whether
# ``str(jaxamp.Policy)`` prints what ``str(jmp.Policy)`` prints.
dtype_to_names = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}

# Loss scales ------------------------------------------------------------------------

all_finite = jaxamp.optim.all_finite


def _times(tree: T, factor: jax.Array) -> T:
    return jax.tree.map(lambda x: x * factor, tree)


def _register_static(cls: type) -> type:
    """A pytree without leaves, as jmp registers its static scales (the config is static)."""
    jax.tree_util.register_pytree_node(cls, lambda x: ((), x), lambda x, _: x)
    return cls


@_register_static
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """jmp's ``NoOpLossScale``: ``jaxamp.NoOpLossScale``, whose scale is 1 and never moves."""

    config: jaxamp.NoOpLossScale = dataclasses.field(default_factory=jaxamp.NoOpLossScale)

    @property
    def loss_scale(self) -> jax.Array:
        return self.config.init().scale

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite  # jaxamp's adjust returns the state unchanged
        return self


@_register_static
@dataclasses.dataclass(frozen=True, init=False)
class StaticLossScale:
    """jmp's ``StaticLossScale(loss_scale)``: ``jaxamp.StaticLossScale(loss_scale)``."""

    config: jaxamp.StaticLossScale

    def __init__(self, loss_scale: Any):
        object.__setattr__(self, "config", jaxamp.StaticLossScale(loss_scale))

    @property
    def loss_scale(self) -> jax.Array:
        return self.config.init().scale

    def scale(self, tree: T) -> T:
        return _times(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _times(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite  # jaxamp's adjust returns the state unchanged
        return self


_JMP_MIN_LOSS_SCALE = np.ones([], np.float32)  # jmp's default floor, np.ones([], np.float32)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, init=False)
class DynamicLossScale:
    """jmp's ``DynamicLossScale``: a ``jaxamp.DynamicLossScale`` and its ``LossScaleState``.

    jmp's arguments map onto jaxamp's settings one to one: ``period`` is
    ``growth_interval``, ``factor`` is ``growth_factor`` and ``1 / factor`` the
    ``backoff_factor``, ``min_loss_scale`` is ``min_scale``; ``loss_scale`` and
    ``counter`` start the state (``scale``, ``growth_tracker``). The pytree's
    leaves are the state's arrays, the configuration is static.
    """

    config: jaxamp.DynamicLossScale
    state: jaxamp.optim.LossScaleState

    def __init__(
        self,
        loss_scale: Any,
        counter: Any = 0,
        period: Any = 2000,
        factor: Any = 2,
        min_loss_scale: Any = _JMP_MIN_LOSS_SCALE,
    ):
        config = jaxamp.DynamicLossScale(
            init_scale=loss_scale,
            growth_factor=factor,
            backoff_factor=1 / factor,
            growth_interval=period,
            min_scale=min_loss_scale,
        )
        state = config.init()._replace(growth_tracker=jnp.asarray(counter, jnp.int32))
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "state", state)

    @classmethod
    def _of(cls, config: jaxamp.DynamicLossScale, state: Any) -> DynamicLossScale:
        self = object.__new__(cls)
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "state", jaxamp.optim.LossScaleState(*state))
        return self

    def tree_flatten(self) -> tuple[tuple[jax.Array, ...], jaxamp.DynamicLossScale]:
        return tuple(self.state), self.config

    @classmethod
    def tree_unflatten(cls, config: jaxamp.DynamicLossScale, leaves: Any) -> DynamicLossScale:
        return cls._of(config, leaves)

    @property
    def loss_scale(self) -> jax.Array:
        return self.state.scale

    @property
    def counter(self) -> jax.Array:
        return self.state.growth_tracker

    @property
    def period(self) -> int:
        return self.config.growth_interval

    @property
    def factor(self) -> float:
        return self.config.growth_factor

    @property
    def min_loss_scale(self) -> float | None:
        return self.config.min_scale

    def scale(self, tree: T) -> T:
        return _times(tree, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _times(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        return self._of(self.config, self.config.adjust(self.state, grads_finite))


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale
