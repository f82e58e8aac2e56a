"""The float8 scaling arithmetic: quantize, dequantize, and scales from amaxes and histories."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.jaxprs import varying_axes
from jaxamp._src.ops.fp8_max32 import as_float32

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)


def fp8_max(dtype: Any) -> float:
    """The largest finite value of a float8 dtype (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def quantize(x: jax.Array, dtype: Any, scale: jax.Array) -> jax.Array:
    """``x / scale``, clipped to the float8 dtype's range and rounded to it (in float32).

    Examples:
      >>> import jax.numpy as jnp
      >>> quantize(jnp.array([1.0, 1000.0]), jnp.float8_e4m3fn, jnp.float32(2.0))
      Array([0.5, 448], dtype=float8_e4m3fn)
    """
    big = jnp.float32(fp8_max(dtype))
    scale = jnp.reshape(scale, ()).astype(FLOAT32)
    return jnp.clip(x.astype(FLOAT32) / scale, -big, big).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = FLOAT32) -> jax.Array:
    """``q * scale`` in ``dtype``."""
    return q.astype(dtype) * jnp.reshape(scale, ()).astype(dtype)


def scale_from_amax(amax: jax.Array, dtype: Any, margin: int = 0, previous: Any = 1.0) -> jax.Array:
    """The scale that maps ``amax`` to the dtype's largest value, as Flax's ``fp8_ops`` and
    TransformerEngine compute it (``1 / ((max / amax) / 2**margin)``).

    An ``amax`` of zero, one that is not finite, or one so small that the scale would not be
    a normal float32 keeps ``previous``.
    """
    amax, previous = amax.astype(FLOAT32), jnp.asarray(previous, FLOAT32)
    factor = (jnp.float32(fp8_max(dtype)) / amax) / jnp.float32(2.0**margin)
    # The reciprocal after the select, in Flax's order: XLA folds 1 / (max / amax) otherwise,
    # and the scale comes out one ulp away from Flax's.
    usable = (amax > 0) & jnp.isfinite(amax)
    scale = 1.0 / jnp.where(usable, factor, 1.0 / previous)
    return jnp.where(usable & (scale >= jnp.finfo(FLOAT32).tiny), scale, previous)


def dequantize_product(y: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``y * (a * b)`` as Flax's ``fp8_ops`` computes it, or ``(y * a) * b`` where the
    product of the two scales would underflow or overflow float32 (operands near 1e-20 or
    1e20) although the result does not. A scale of one value is a scalar; a block-scaled
    GEMM's per-member scales (shaped to broadcast against ``y``) stay as they are."""
    a, b = (jnp.reshape(s, ()) if jnp.size(s) == 1 else s for s in (a, b))
    a, b = (jnp.asarray(s).astype(FLOAT32) for s in (a, b))
    both = a * b
    normal = jnp.isfinite(both) & (jnp.abs(both) >= jnp.finfo(FLOAT32).tiny)
    return jnp.where(normal, y * both, (y * a) * b)


def scaling_amax(x: jax.Array, state: Any = None) -> jax.Array:
    """The tensor's largest magnitude, for scaling it (or for ``state``, the scale this amax
    updates). Under ``vmap`` over a batch the state does not have (a data batch,
    per-example gradients), one amax over the whole batch, so that the state stays
    unbatched, as without ``vmap``; over a batch the state has too (an ensemble of layers
    run by ``nnx.vmap``), one per member, as for layers run one by one. Inside
    ``shard_map``, of every device's shard (the whole tensor, as under ``jit``). A scale is
    no function of what it scales to differentiate: a constant to higher derivatives."""
    x = lax.stop_gradient(x)
    if state is None:
        return _batch_amax(x)
    return _state_amax(x, lax.stop_gradient(as_float32(state)))


@jax.custom_batching.custom_vmap
def _batch_amax(x: jax.Array) -> jax.Array:
    amax = jnp.max(jnp.abs(x.astype(FLOAT32))) if x.size else jnp.float32(0)
    axes = varying_axes(jax.typeof(x))
    return lax.pmax(amax, tuple(sorted(axes))) if axes else amax


@_batch_amax.def_vmap
def _amax_vmap(axis_size: int, in_batched: Any, x: jax.Array) -> tuple[jax.Array, bool]:
    del axis_size, in_batched
    return _batch_amax(x), False


@jax.custom_batching.custom_vmap
def _state_amax(x: jax.Array, state: jax.Array) -> jax.Array:
    del state
    return _batch_amax(x)


@_state_amax.def_vmap
def _state_amax_vmap(
    axis_size: int, in_batched: Any, x: jax.Array, state: jax.Array
) -> tuple[jax.Array, bool]:
    x_batched, state_batched = in_batched
    if not (x_batched and state_batched):
        return _state_amax(x, state), False
    # One amax per member, each taken as this function takes it at the levels outside this
    # one: a loop over the members, so that no ``vmap`` here meets this rule again.
    del axis_size
    return lax.map(lambda member: _state_amax(*member), (x, state)), True


def poison(*amaxes: jax.Array) -> jax.Array:
    """1, or NaN where an operand holds inf or NaN: float8 has no infinity, and clipping an
    overflow to 448 would hide it from loss scaling's check of the gradients."""
    finite = functools.reduce(jnp.logical_and, [jnp.isfinite(a) for a in amaxes])
    return jnp.where(finite, jnp.float32(1), jnp.float32(jnp.nan))


def delayed_scale(
    x_amax: jax.Array, scale: Any, history: Any, dtype: Any, margin: int
) -> tuple[jax.Array, jax.Array]:
    """The scale this step quantizes with (from the history before it) and the history with
    this step's amax pushed in front; a non-finite amax is pushed as 0 (no information: an
    inf would freeze the scale for the length of the history), so that the histories of
    two uses of one state stay aligned for their max."""
    scale32, history32 = as_float32(scale), as_float32(history)
    # A scale that is not positive (a state zeroed by a gradient no GEMM wrote) starts over.
    scale32 = jnp.where((scale32 > 0) & jnp.isfinite(scale32), scale32, jnp.float32(1))
    new_scale = scale_from_amax(jnp.max(history32, axis=0), dtype, margin, scale32)
    amax = jnp.where(jnp.isfinite(x_amax), x_amax, jnp.float32(0))
    return new_scale, jnp.roll(history32, shift=-1, axis=0).at[0].set(amax)
