"""How ``loss_scaled`` applies an update to 16-bit params: the four master-weight recipes.

=============  =====================================  ==========================  ==========
recipe         state kept for 16-bit params            the new param                bytes (1)
=============  =====================================  ==========================  ==========
``float32``    a float32 master copy                   master + u, rounded          2 + 4
``kahan``      a 16-bit compensation buffer            p + (u + c), rounded; c      2 + 2
               (what earlier roundings lost)           takes what this one lost
``stochastic`` a PRNG key                              p + u, stochastically        2
                                                       rounded (unbiased)
``none``       nothing                                 p + u, rounded to nearest    2
=============  =====================================  ==========================  ==========

(1) per parameter, params and master only; the optimizer's moments come on top
(8 bytes for Adam's two float32 moments, 4 for bfloat16 ones through
:func:`jaxamp.with_state_dtype`).

``none`` is the naive baseline: an update smaller than half a unit in the last
place of a 16-bit weight is lost every step, so the weight stalls. The other
three follow the float32 sum: exactly (``float32``), to within the rounding of
the compensation (``kahan``), or in expectation (``stochastic``). Float32 params
are updated as they are in every recipe.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxamp._src.policy import is_floating_array
from jaxamp._src.rounding import leaf_keys, new_key_data, step_key, stochastic_round

MASTER_WEIGHTS = ("float32", "kahan", "stochastic", "none")


def validate_master_weights(master_weights: str) -> str:
    if master_weights not in MASTER_WEIGHTS:
        raise ValueError(
            f"Unknown master_weights {master_weights!r}. Valid choices: "
            f"{', '.join(map(repr, MASTER_WEIGHTS))}."
        )
    return master_weights


def is_16_bit(x: Any) -> bool:
    return is_floating_array(x) and x.dtype.itemsize < 4


def to_float32(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(jnp.float32) if is_floating_array(x) else x, tree)


def init(params: Any, recipe: str, seed: int) -> tuple[Any, Any, Any]:
    """``(master, compensation, rounding_key)`` for ``params`` (``None`` where unused)."""
    if not any(is_16_bit(x) for x in jax.tree.leaves(params)):
        return None, None, None
    if recipe == "float32":
        return to_float32(params), None, None
    if recipe == "kahan":
        compensation = jax.tree.map(
            lambda p: jnp.zeros_like(p) if is_16_bit(p) else jnp.zeros([], jnp.float32), params
        )
        return None, compensation, None
    if recipe == "stochastic":
        return None, None, new_key_data(seed)
    return None, None, None


def inner_params(params: Any, master: Any, compensation: Any) -> Any:
    """The float32 params the inner optimizer sees (for weight decay and the like)."""
    if master is not None:
        return master
    f32 = to_float32(params)
    if compensation is None:
        return f32
    return jax.tree.map(
        lambda p, c: p + c.astype(jnp.float32) if is_16_bit(c) else p, f32, compensation
    )


def landing_updates(new_params: Any, params: Any) -> Any:
    """Updates ``u`` with ``optax.apply_updates(params, u) == new_params`` exactly.

    ``new_params`` is float32 (a master) or already in each param's dtype; the
    difference of two 16-bit values is exact in float32, so ``p + u`` lands on
    the rounded value.
    """

    def delta(new, p):
        if not is_floating_array(p):
            return jnp.zeros_like(p)
        return new.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)

    return jax.tree.map(delta, new_params, params)


def apply(
    recipe: str, updates: Any, params: Any, compensation: Any, key_data: Any, step: jax.Array
) -> tuple[Any, Any]:
    """``(updates for optax.apply_updates, new compensation)`` for the recipes without a
    float32 master. ``updates`` are the inner optimizer's, in float32; each lands the
    param exactly on its recipe's rounding of ``p + u``."""
    if recipe == "kahan":

        def kahan(u, p, c):
            if not is_16_bit(p):
                return u, c
            y = u + c.astype(jnp.float32)
            new = (p.astype(jnp.float32) + y).astype(p.dtype)
            applied = new.astype(jnp.float32) - p.astype(jnp.float32)
            return applied, (y - applied).astype(c.dtype)

        pairs = jax.tree.map(kahan, updates, params, compensation)
        outer = jax.tree.structure(updates)
        applied, new_c = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
        return applied, new_c
    if recipe == "stochastic":
        keys = leaf_keys(step_key(key_data, step), params)

        def stochastic(u, p, k):
            if not is_16_bit(p):
                return u
            new = stochastic_round(p.astype(jnp.float32) + u, p.dtype, k)
            return new.astype(jnp.float32) - p.astype(jnp.float32)

        return jax.tree.map(stochastic, updates, params, keys), compensation

    return updates, compensation  # "none": optax.apply_updates rounds p + u to nearest
