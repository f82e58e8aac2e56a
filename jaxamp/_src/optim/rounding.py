"""Rounding float32 values to a narrower float: to nearest, or stochastically."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import JMP_DTYPE_NAMES, canonical_dtype, is_narrow, is_narrower
from jaxamp._src.errors import invalid_choice

ROUNDINGS = ("nearest", "stochastic")


def validate_rounding(rounding: str) -> str:
    """Returns ``rounding`` if it is one of ``ROUNDINGS``, else raises ``ValueError``."""
    if rounding not in ROUNDINGS:
        raise invalid_choice("rounding", rounding, ROUNDINGS, quote=True)
    return rounding


STOCHASTIC_DTYPES = ("bfloat16", "float16", "float32")


def validate_stochastic_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a ``np.dtype`` if ``stochastic_round`` supports it, else a ``ValueError``
    naming it and listing the choices: ``STOCHASTIC_DTYPES`` and the names of the library's
    dtype vocabulary (``canonical_dtype``: ``"bf16"``, ``"f16"``, ``"half"``...) for them."""
    canonical: np.dtype | None = None
    error: ValueError | None = None
    try:
        canonical = canonical_dtype(dtype)
    except ValueError as e:
        error = e
    if canonical is not None and canonical.name in STOCHASTIC_DTYPES:
        return canonical
    if canonical is not None and isinstance(dtype, str) and canonical.name != dtype:
        shown = f"{dtype!r} ({canonical.name})"  # the name as given, and what it names
    elif canonical is not None:
        shown = repr(dtype) if isinstance(dtype, str) else canonical.name
    else:
        try:
            shown = repr(dtype) if dtype is None or isinstance(dtype, str) else np.dtype(dtype).name
        except TypeError:
            shown = repr(dtype)
    names = [n for n in JMP_DTYPE_NAMES if canonical_dtype(n).name in STOCHASTIC_DTYPES]
    raise invalid_choice(
        "dtype",
        dtype,
        [*STOCHASTIC_DTYPES, *(n for n in names if n not in STOCHASTIC_DTYPES)],
        why=f"stochastic_round cannot round to {shown}: it rounds float32 to bfloat16 or "
        "float16 (float32 returns x as it is).",
    ) from error


_FLOAT32_SIGNIFICAND = 23  # bits stored, below float32's implicit leading one
_FLOAT32_BIAS = 127


def _on_grid(magnitude: jax.Array, dtype: np.dtype) -> tuple[jax.Array, ...]:
    """Where float32 magnitudes (their bits, finite and at most ``dtype``'s max) sit between
    their two neighbours in ``dtype``, in integers only.

    Returns ``(below, step, above, odd)``: the bits of the float32 value of the neighbour at
    or below, the bits to add to them for the neighbour above (a carry into the exponent is
    right), how far above ``below`` the magnitude is as a fraction of the gap scaled to 2**32
    (exact where that gap is at most 2**32 float32 units at the magnitude, which holds above
    2**-33 for float16 and everywhere for bfloat16; rounded down below that), and whether
    ``below``'s last digit in ``dtype`` is odd.
    """
    info = jnp.finfo(dtype)
    tiny_exponent = int(info.minexp) - int(info.nmant)  # log2 of dtype's smallest subnormal
    exponent = jnp.maximum(magnitude >> _FLOAT32_SIGNIFICAND, 1).astype(jnp.int32)
    # log2 of the float32 units at the magnitude in a unit in the last place of dtype
    lowest = tiny_exponent + _FLOAT32_BIAS + _FLOAT32_SIGNIFICAND
    shift = jnp.maximum(lowest - exponent, _FLOAT32_SIGNIFICAND - int(info.nmant))
    inside = shift <= _FLOAT32_SIGNIFICAND  # dtype's ulp within float32's significand
    inner = jnp.minimum(shift, _FLOAT32_SIGNIFICAND).astype(jnp.uint32)
    low = (jnp.uint32(1) << inner) - jnp.uint32(1)
    significand = (magnitude & jnp.uint32(0x7FFFFF)) | jnp.where(
        magnitude >> _FLOAT32_SIGNIFICAND > 0, jnp.uint32(0x800000), jnp.uint32(0)
    )
    # below dtype's smallest subnormal: between 0 and it (a float32 normal)
    tiny_bits = max(tiny_exponent + _FLOAT32_BIAS, 1) << _FLOAT32_SIGNIFICAND
    below = jnp.where(inside, magnitude & ~low, jnp.uint32(0))
    step = jnp.where(inside, jnp.uint32(1) << inner, jnp.uint32(tiny_bits))
    rest = jnp.where(inside, magnitude & low, significand)  # < 2**shift
    up_shift = jnp.clip(32 - shift, 0, 31).astype(jnp.uint32)
    down_shift = jnp.clip(shift - 32, 0, 31).astype(jnp.uint32)
    above = jnp.where(shift <= 32, rest << up_shift, rest >> down_shift)
    odd = inside & ((significand >> inner) & jnp.uint32(1) != 0)
    return below, step, above, odd


def stochastic_round(x: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds ``x`` to ``dtype`` stochastically, without bias.

    ``dtype`` is bfloat16 or float16 (float32 gives ``x`` itself: nothing to round), as a
    dtype or by any name ``jaxamp.cast_floating`` takes (``"bf16"``, ``"f16"``, ``"half"``...);
    any other dtype, float8 ones included (some have no infinity, and jax does not
    promote them in arithmetic), raises a ``ValueError``. The magnitude ``|x|`` goes
    to the neighbour above it with probability ``(|x| - lo) / (hi - lo)`` and the
    sign is put back, so ``-x`` rounds to exactly ``-(rounding of x)`` with the same
    key. Subnormals of ``dtype`` round like any other values. Values that are exact
    in ``dtype`` (zeros of either sign, the max), infinities, NaN, and values beyond
    ``dtype``'s largest finite value give exactly ``x.astype(dtype)`` (round to
    nearest: a value past the max by less than half a unit in the last place gives
    the max, one further out gives ``inf``), whatever their sign.

    The direction is decided on the bits, in integers: 32 random bits against the
    fraction of a unit in the last place above the lower neighbour, which is exact for
    every bfloat16 value and every float16 one above 2**-33 (below, where going up has a
    probability under 2**-9, it is rounded down to a multiple of 2**-32). No float32 ->
    16 bits -> float32 convert pair takes part, so a compiler allowed excess precision
    (XLA's default on GPU and TPU) has none to fold, and XLA:CPU's flushing of float32
    subnormals (bfloat16's) touches nothing.

    Args:
      x: the values (float32).
      dtype: ``bfloat16``, ``float16`` or ``float32``, or a name for one of them.
      key: a PRNG key; the same key gives the same roundings.

    Returns:
      ``x`` in ``dtype``.

    Raises:
      ValueError: for any other ``dtype``, naming it and the choices.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.full(10_000, 1.0 + 2.0**-10)  # a quarter of a bfloat16 ulp above 1
      >>> y = stochastic_round(x, "bf16", jax.random.key(0)).astype(jnp.float32)
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
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    magnitude = bits ^ sign
    below, step, above, _ = _on_grid(magnitude, dtype)
    # up with probability above / 2**32 (~noise < above: bfloat16 keeps its old roundings)
    noise = jax.random.bits(key, x.shape, jnp.uint32)
    kept = below + jnp.where(~noise < above, step, jnp.uint32(0))
    rounded = lax.bitcast_convert_type(kept | sign, jnp.float32).astype(dtype)  # exact
    # inf, NaN, beyond the largest finite value (by the bits): to nearest
    largest = int(np.asarray(jnp.finfo(dtype).max, np.float32).view(np.uint32))
    return jnp.where(magnitude <= jnp.uint32(largest), rounded, nearest)


def round_in_float32(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` (float32) rounded to nearest in ``dtype``, kept in float32.

    ``x.astype(dtype).astype(float32)`` says the same, but XLA's
    ``xla_allow_excess_precision`` (on by default) lets a compiler drop such a convert
    pair and keep ``x``: Kahan's compensation would then be zero. ``lax.reduce_precision``
    is the rounding itself, which no compiler may elide. It flushes ``dtype``'s
    subnormals to zero, so those (float16's below 2**-14, bfloat16's below 2**-126) are
    rounded on the bits, to nearest even, in integers.

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
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    sign = bits & jnp.uint32(0x80000000)
    magnitude = bits ^ sign
    below, step, above, odd = _on_grid(magnitude, dtype)
    half = jnp.uint32(2**31)
    up = (above > half) | ((above == half) & odd)  # ties to the even neighbour
    subnormal = lax.bitcast_convert_type(
        (below + jnp.where(up, step, jnp.uint32(0))) | sign, jnp.float32
    )
    smallest_normal = int(np.asarray(info.smallest_normal, np.float32).view(np.uint32))
    return jnp.where(magnitude < jnp.uint32(smallest_normal), subnormal, reduced)


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
