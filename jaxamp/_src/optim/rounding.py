"""Rounding float32 values to a narrower float: to nearest, or stochastically."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import is_narrow, is_narrower
from jaxamp._src.errors import invalid_choice

ROUNDINGS = ("nearest", "stochastic")


def validate_rounding(rounding: str) -> str:
    """Returns ``rounding`` if it is one of ``ROUNDINGS``, else raises ``ValueError``."""
    if rounding not in ROUNDINGS:
        raise invalid_choice("rounding", rounding, ROUNDINGS, quote=True)
    return rounding


STOCHASTIC_DTYPES = ("bfloat16", "float16", "float32")


def validate_stochastic_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a ``np.dtype`` if ``stochastic_round`` supports it (one of
    ``STOCHASTIC_DTYPES``), else raises ``ValueError``."""
    try:
        canonical = np.dtype(dtype)
    except TypeError:
        canonical = None
    if canonical is None or canonical.name not in STOCHASTIC_DTYPES:
        shown = canonical.name if canonical is not None else repr(dtype)
        raise invalid_choice(
            "dtype",
            dtype,
            STOCHASTIC_DTYPES,
            why=f"stochastic_round cannot round to {shown} (float32 returns x as it is).",
        )
    return canonical


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` stochastically, without bias.

    ``dtype`` is bfloat16 or float16 (float32 gives ``x`` itself: nothing to round);
    any other dtype, float8 ones included (some have no infinity, and jax does not
    promote them in arithmetic), raises a ``ValueError``. The magnitude ``|x|`` goes
    to the neighbour above it with probability ``(|x| - lo) / (hi - lo)`` and the
    sign is put back, so ``-x`` rounds to exactly ``-(rounding of x)`` with the same
    key. Subnormals of ``dtype`` round like any other values. Values that are exact
    in ``dtype`` (zeros of either sign, the max), infinities, NaN, and values beyond
    ``dtype``'s largest finite value give exactly ``x.astype(dtype)`` (round to
    nearest: a value past the max by less than half a unit in the last place gives
    the max, one further out gives ``inf``), whatever their sign.

    bfloat16 is rounded on the bits (16 random bits added to the low half of
    float32's), which is exact for every value, bfloat16's subnormals included
    (they are float32 subnormals, which XLA:CPU flushes to zero in arithmetic).
    float16 compares a uniform draw with the fraction above, exact to 2**-23
    of a unit in the last place.

    Args:
      x: the values (float32).
      dtype: ``bfloat16``, ``float16`` or ``float32``.
      key: a PRNG key; the same key gives the same roundings.

    Returns:
      ``x`` in ``dtype``.

    Raises:
      ValueError: for any other ``dtype``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.full(10_000, 1.0 + 2.0**-10)  # a quarter of a bfloat16 ulp above 1
      >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0)).astype(jnp.float32)
      >>> sorted(set(y.tolist())), round(float(y.mean()) - 1.0, 4)
      ([1.0, 1.0078125], 0.001)
      >>> big = jnp.asarray([1e10, -1e10], jnp.float32)  # beyond float16's max, 65504
      >>> stochastic_round(big, jnp.float16, jax.random.key(0))
      Array([ inf, -inf], dtype=float16)
    """
    dtype = validate_stochastic_dtype(dtype)
    x = jnp.asarray(x, jnp.float32)
    nearest = x.astype(dtype)
    if dtype == jnp.float32:
        return nearest
    # Signs, magnitudes and exactness on the bits: XLA:CPU flushes float32 subnormals
    # to zero in arithmetic and comparisons.
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    magnitude_bits = bits ^ sign
    magnitude = lax.bitcast_convert_type(magnitude_bits, jnp.float32)
    if dtype == jnp.bfloat16:
        noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16
        kept = (magnitude_bits + noise) & jnp.uint32(0xFFFF0000)  # drops the low half: exact
        rounded = lax.bitcast_convert_type(kept | sign, jnp.float32).astype(dtype)
    else:
        near = magnitude.astype(dtype)
        above_x = near.astype(jnp.float32) > magnitude
        zero, inf = jnp.zeros([], dtype), jnp.asarray(jnp.inf, dtype)
        lo = jnp.where(above_x, jnp.nextafter(near, zero), near)
        hi = jnp.where(above_x, near, jnp.nextafter(near, inf))
        lo32, hi32 = lo.astype(jnp.float32), hi.astype(jnp.float32)
        gap = jnp.where(hi32 > lo32, hi32 - lo32, 1.0)
        u = jax.random.uniform(key, x.shape, jnp.float32)
        up = jnp.where(u < (magnitude - lo32) / gap, hi, lo)
        rounded = jnp.where(sign != 0, -up, up)
    # exact (bit for bit), inf or NaN, or beyond the largest finite value: to nearest
    exact = lax.bitcast_convert_type(round_in_float32(x, dtype), jnp.uint32) == bits
    keep = exact | ~(magnitude <= jnp.finfo(dtype).max)
    return jnp.where(keep, nearest, rounded)


def round_in_float32(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` (float32) rounded to nearest in ``dtype``, kept in float32.

    ``x.astype(dtype).astype(float32)`` says the same, but XLA's
    ``xla_allow_excess_precision`` (on by default) lets a compiler drop such a convert
    pair and keep ``x``: Kahan's compensation would then be zero and stochastic
    rounding's exactness test always true. ``lax.reduce_precision`` is the rounding
    itself, which no compiler may elide. It flushes ``dtype``'s subnormals to zero, so
    those (float16's, below 2**-14) take the convert pair.

    Examples:
      >>> import jax.numpy as jnp
      >>> round_in_float32(jnp.float32(1 + 2.0**-9), jnp.bfloat16)
      Array(1., dtype=float32)
    """
    dtype = np.dtype(dtype)
    x = jnp.asarray(x, jnp.float32)
    if not is_narrow(dtype):
        return x
    info = jnp.finfo(dtype)
    reduced = lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    subnormal = jnp.abs(x) < jnp.float32(info.smallest_normal)
    return jnp.where(subnormal, x.astype(dtype).astype(jnp.float32), reduced)


def round_to(x: jax.Array, dtype: Any, rounding: str, key: jax.Array | None) -> jax.Array:
    """``x`` cast to ``dtype`` with ``rounding`` (``key`` is used only for ``"stochastic"``)."""
    if rounding == "stochastic" and is_narrower(dtype, x.dtype):
        if key is None:
            raise ValueError("stochastic rounding needs a key.")
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
