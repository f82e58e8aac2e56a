"""Rounding float32 values to a narrower float: to nearest, or stochastically.

Stochastic rounding sends ``x`` to one of the two representable neighbours
that bracket it, the upper one with probability ``(x - lo) / (hi - lo)``, so
that its expected value is ``x`` exactly. An update smaller than half a unit
in the last place moves a 16-bit weight on average by the right amount,
where rounding to nearest leaves it where it was (the "stall" of pure 16-bit
training). The noise is a pure function of the key, so a run that restores a
checkpointed key draws the same roundings again.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROUNDINGS = ("nearest", "stochastic")


def validate_rounding(rounding: str) -> str:
    """Returns ``rounding`` if it is one of :data:`ROUNDINGS`, else raises ``ValueError``."""
    if rounding not in ROUNDINGS:
        raise ValueError(
            f"Unknown rounding {rounding!r}. Valid choices: {', '.join(map(repr, ROUNDINGS))}."
        )
    return rounding


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` stochastically, without bias.

    Works for any floating ``dtype`` narrower than ``x``'s (bfloat16, float16):
    ``x`` goes to the neighbour above with probability ``(x - lo) / (hi - lo)``.
    Values that are exact in ``dtype``, non-finite values, and values beyond
    ``dtype``'s range round to nearest.

    Args:
      x: the values (float32).
      dtype: the narrower floating dtype.
      key: a PRNG key; the same key gives the same roundings.

    Returns:
      ``x`` in ``dtype``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.full(10_000, 1.0 + 2.0**-10)  # a quarter of a bfloat16 ulp above 1
      >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0)).astype(jnp.float32)
      >>> sorted(set(y.tolist())), round(float(y.mean()) - 1.0, 4)
      ([1.0, 1.0078125], 0.001)
    """
    dtype = np.dtype(dtype)
    x = jnp.asarray(x, jnp.float32)
    nearest = x.astype(dtype)
    wide = nearest.astype(jnp.float32)
    toward = jnp.where(wide > x, -jnp.inf, jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, toward)
    lo = jnp.minimum(wide, other.astype(jnp.float32))
    hi = jnp.maximum(wide, other.astype(jnp.float32))
    gap = hi - lo
    p_hi = jnp.where(gap > 0, (x - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    u = jax.random.uniform(key, x.shape, jnp.float32)
    rounded = jnp.where(u < p_hi, hi, lo).astype(dtype)
    keep = (wide == x) | ~jnp.isfinite(x) | ~jnp.isfinite(other.astype(jnp.float32))
    return jnp.where(keep, nearest, rounded)


def round_to(x: jax.Array, dtype: Any, rounding: str, key: jax.Array | None) -> jax.Array:
    """``x`` cast to ``dtype`` with ``rounding`` (``key`` is used only for ``"stochastic"``)."""
    if rounding == "stochastic" and np.dtype(dtype).itemsize < np.dtype(x.dtype).itemsize:
        return stochastic_round(x, dtype, key)
    return x.astype(dtype)


def leaf_keys(key: jax.Array, tree: Any) -> Any:
    """One key per leaf of ``tree`` (folded in by leaf position), in ``tree``'s structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jax.random.fold_in(key, i) for i in range(len(leaves))])


def step_key(key_data: jax.Array, step: jax.Array) -> jax.Array:
    """The key for ``step``: the stored key (raw ``uint32`` data) folded with the step."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), step)


def new_key_data(seed: int | jax.Array) -> jax.Array:
    """Raw ``uint32`` key data for a seed or a key (state fields hold plain arrays)."""
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(seed)
    return jax.random.key_data(jax.random.key(seed))
