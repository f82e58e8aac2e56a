"""How ``loss_scaled`` applies an update to 16-bit params: the four master-weight recipes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._src.dtypes import float32_tree, is_inexact_array, is_narrow_array
from jaxamp._src.errors import invalid_choice
from jaxamp._src.optim.rounding import (
    leaf_keys,
    new_key_data,
    round_in_float32,
    step_key,
    stochastic_round,
)

MASTER_WEIGHTS = ("float32", "kahan", "stochastic", "none")
"""How ``loss_scaled`` updates 16-bit params: the valid ``master_weights=`` choices."""


def validate_master_weights(master_weights: str) -> str:
    if master_weights not in MASTER_WEIGHTS:
        raise invalid_choice("master_weights", master_weights, MASTER_WEIGHTS, quote=True)
    return master_weights


# A float32 scalar, never the param itself: a state that shared a buffer with the params
# could not be donated with them.
def _placeholder() -> jax.Array:
    """The master's or the compensation's leaf for a param that is not 16-bit."""
    return jnp.zeros([], jnp.float32)


def init(params: Any, recipe: str, seed: int) -> tuple[Any, Any, Any]:
    """``(master, compensation, rounding_key)`` for ``params`` (``None`` where unused)."""
    if not any(is_narrow_array(x) for x in jax.tree.leaves(params)):
        return None, None, None
    if recipe == "float32":
        master = jax.tree.map(
            lambda p: p.astype(jnp.float32) if is_narrow_array(p) else _placeholder(), params
        )
        return master, None, None
    if recipe == "kahan":
        compensation = jax.tree.map(
            lambda p: jnp.zeros_like(p) if is_narrow_array(p) else _placeholder(), params
        )
        return None, compensation, None
    if recipe == "stochastic":
        return None, None, new_key_data(seed)
    return None, None, None


def adopt_changes(master: Any, params: Any) -> Any:
    """The master, where a 16-bit param no longer equals the master rounded to its dtype
    taking the param's value: a change made to the params outside ``update`` (clipping,
    a projection, surgery) is kept, not undone by the next step. One comparison per
    element; placeholders are kept as they are."""

    def adopt(m: Any, p: Any) -> Any:
        if not is_narrow_array(p):
            return m
        return jnp.where(
            round_in_float32(m, p.dtype) == p.astype(jnp.float32), m, p.astype(jnp.float32)
        )

    return jax.tree.map(adopt, master, params)


def valid_compensation(params: Any, compensation: Any) -> Any:
    """The Kahan compensation, dropped (set to 0) where it does not fit its param.

    The compensation ``c`` an update leaves is what rounding ``p + y`` to the new
    ``p`` lost, so ``|c|`` is at most half the gap from ``p`` to its neighbour on
    ``c``'s side. A param zeroed, clipped or otherwise set outside ``update`` mostly
    breaks this (a zeroed weight would take its old compensation as its value), and
    its compensation is dropped. A param set to a value whose half-gap still holds
    the old ``c`` keeps it: then ``p + c`` rounds to ``p``, and ``c`` moves later
    sums by less than half a unit in the last place of ``p``.
    """

    def fit(p: Any, c: Any) -> Any:
        if not is_narrow_array(p):
            return c
        p32, c32 = p.astype(jnp.float32), c.astype(jnp.float32)
        toward = jnp.where(c32 > 0, jnp.inf, -jnp.inf).astype(p.dtype)
        gap = jnp.abs(jnp.nextafter(p, toward).astype(jnp.float32) - p32)
        return jnp.where(2 * jnp.abs(c32) <= gap, c, jnp.zeros_like(c))

    return jax.tree.map(fit, params, compensation)


def inner_params(params: Any, master: Any, compensation: Any) -> Any:
    """The float32 params the inner optimizer sees (for weight decay and the like)."""
    if master is not None:
        return jax.tree.map(lambda m, p: m if is_narrow_array(p) else p, master, params)
    f32 = float32_tree(params)
    if compensation is None:
        return f32
    compensation = valid_compensation(params, compensation)
    return jax.tree.map(
        lambda p, c: p + c.astype(jnp.float32) if is_narrow_array(c) else p, f32, compensation
    )


def step_master(master: Any, updates: Any, params: Any) -> tuple[Any, Any]:
    """``(updates for optax.apply_updates, new master)`` of the ``float32`` recipe.

    A 16-bit param's master takes the inner update ``u`` in float32, and the param
    lands exactly on the new master rounded to its dtype (the difference of two
    16-bit values is exact in float32, so ``p + (new - p)`` is ``new``). Every other
    inexact leaf (float32, float64, complex) takes ``u`` as it is, as plain optax
    applies it; integer and boolean params take none. Both keep their placeholder.
    """

    def step(m: Any, u: Any, p: Any) -> tuple[Any, Any]:
        if not is_inexact_array(p):
            return jnp.zeros_like(p), m
        if not is_narrow_array(p):
            return u, m
        new = m + u
        return round_in_float32(new, p.dtype) - p.astype(jnp.float32), new

    pairs = jax.tree.map(step, master, updates, params)
    outer = jax.tree.structure(updates)
    landing, new_master = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
    return landing, new_master


def apply(
    recipe: str, updates: Any, params: Any, compensation: Any, key_data: Any, step: jax.Array
) -> tuple[Any, Any]:
    """``(updates for optax.apply_updates, new compensation)`` for the recipes without a
    float32 master. ``updates`` are the inner optimizer's, in float32; each lands the
    param exactly on its recipe's rounding of ``p + u``."""
    if recipe == "kahan":
        compensation = valid_compensation(params, compensation)

        def kahan(u: Any, p: Any, c: Any) -> tuple[Any, Any]:
            if not is_narrow_array(p):
                return u, c
            y = u + c.astype(jnp.float32)
            # the rounding no compiler may fold away (see round_in_float32)
            applied = round_in_float32(p.astype(jnp.float32) + y, p.dtype) - p.astype(jnp.float32)
            return applied, (y - applied).astype(c.dtype)

        pairs = jax.tree.map(kahan, updates, params, compensation)
        outer = jax.tree.structure(updates)
        applied, new_c = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
        return applied, new_c
    if recipe == "stochastic":
        keys = leaf_keys(step_key(key_data, step), params)

        def stochastic(u: Any, p: Any, k: Any) -> Any:
            if not is_narrow_array(p):
                return u
            new = stochastic_round(p.astype(jnp.float32) + u, p.dtype, k)
            return new.astype(jnp.float32) - p.astype(jnp.float32)

        return jax.tree.map(stochastic, updates, params, keys), compensation

    return updates, compensation  # "none": optax.apply_updates rounds p + u to nearest
