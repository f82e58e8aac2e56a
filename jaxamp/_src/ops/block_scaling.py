"""Block-scaled float8 and float4 (MXFP8, NVFP4): the formats, and quantizing block by block."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.errors import invalid_choice

E4M3 = np.dtype(jnp.float8_e4m3fn)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
_F32_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: values in ``element``, one ``scale`` per ``block`` values.

    Attributes:
      name: ``"mxfp8"`` or ``"nvfp4"``, as the policy grammar spells it.
      element: the values' dtype (``float8_e4m3fn``, ``float4_e2m1fn``).
      scale: the blocks' scale dtype (``float8_e8m0fnu``: powers of two; ``float8_e4m3fn``).
      block: values per scale, consecutive along the contraction.
      tensor_scale: whether a float32 scale per tensor sits above the blocks' (NVFP4).
      weight_tiles: whether the right operand (a layer's kernel) is scaled by square tiles
        of ``block`` x ``block`` values, so that it quantizes to the same values for the
        forward GEMM and, transposed, for the activation gradient's (NVFP4).
      gradient_rounding: ``"nearest"`` or ``"stochastic"``: how output gradients round to
        ``element`` (NVFP4 rounds them stochastically, as TransformerEngine's recipe does).
    """

    name: str
    element: np.dtype
    scale: np.dtype
    block: int
    tensor_scale: bool = False
    weight_tiles: bool = False
    gradient_rounding: str = "nearest"

    @property
    def element_max(self) -> float:
        """The largest finite value of ``element`` (448 for e4m3, 6 for e2m1)."""
        return float(jnp.finfo(self.element).max)


MXFP8 = BlockFormat("mxfp8", E4M3, E8M0, 32)
"""The OCP MX format MXFP8: e4m3 values, a power-of-two (e8m0) scale per 32 values, rounded
up so that no value of the block overflows (TransformerEngine's ``MXFP8BlockScaling``)."""

NVFP4 = BlockFormat("nvfp4", E2M1, E4M3, 16, True, True, "stochastic")
"""NVIDIA's NVFP4: e2m1 values, an e4m3 scale per 16 values under a float32 scale per
tensor, 16 x 16 tiles for weights and stochastic rounding of gradients
(TransformerEngine's ``NVFP4BlockScaling``, without its random Hadamard transform)."""

BLOCK_FORMATS = {f.name: f for f in (MXFP8, NVFP4)}
"""The block-scaled formats by name, as the policy grammar spells them (`fp8=mxfp8`)."""


def block_format(name: Any) -> BlockFormat:
    """The ``BlockFormat`` named ``name`` (``"mxfp8"`` or ``"nvfp4"``).

    Raises:
      ValueError: naming the bad value and the valid names.

    Examples:
      >>> block_format("mxfp8").block
      32
    """
    if isinstance(name, BlockFormat):
        return name
    if name not in BLOCK_FORMATS:
        raise invalid_choice("block format", name, tuple(BLOCK_FORMATS))
    return BLOCK_FORMATS[name]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A tensor quantized block by block: ``values * block_scales * tensor_scale``.

    Attributes:
      values: the values in the format's element dtype, the contraction axis padded with
        zeros to a multiple of the block.
      block_scales: one per block (per tile), in the format's scale dtype.
      tensor_scale: the float32 decode scale per tensor (1 where the format has none).
      tile_rows: rows a scale covers (1, or the block for square tiles).
      fmt: the format.
    """

    values: jax.Array
    block_scales: jax.Array
    tensor_scale: jax.Array
    tile_rows: int = dataclasses.field(metadata=dict(static=True))
    fmt: BlockFormat = dataclasses.field(metadata=dict(static=True))

    def dequantized(self) -> jax.Array:
        """``values * block_scales`` in float32, exact (no rounding: a value's few bits
        times a scale's), the tensor scale left out, as the GEMM applies it to its result.
        A product below float32's smallest normal is flushed to zero, as XLA:CPU's float32
        arithmetic flushes it."""
        values = self.values.astype(FLOAT32)
        spread = functools.partial(_spread, block=self.fmt.block, rows=self.tile_rows)
        if self.fmt.scale != E8M0:
            return values * spread(self.block_scales.astype(FLOAT32))
        # 2**(code - 127) by exponent arithmetic: the scale 2**-127 (code 0) is a float32
        # subnormal, which XLA:CPU reads as zero in a product.
        code = spread(_e8m0_code(self.block_scales))
        return jnp.where(code == 255, jnp.float32(jnp.nan), jnp.ldexp(values, code - 127))


def _spread(per_block: jax.Array, block: int, rows: int) -> jax.Array:
    """A value per block (per tile of ``rows`` rows) repeated over the block's values."""
    out = jnp.repeat(per_block, block, axis=-1)
    return jnp.repeat(out, rows, axis=-2) if rows > 1 else out


def _e8m0_code(scales: jax.Array) -> jax.Array:
    """The e8m0 scales' codes (the biased exponents) as int32: 2**(code - 127), 255 NaN."""
    return lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)


def _e8m0_round_up(amax: jax.Array, element_max: float) -> jax.Array:
    """The smallest power of two >= ``amax / element_max``, as e8m0 bits (2**(code - 127)):
    the quotient's exponent, plus one where it is not a power of two. A quotient below
    2**-127 is code 0 (2**-127); an amax of inf or NaN is 255 (NaN).

    A small amax's quotient is taken 2**32 times larger (exactly: a power of two), so that
    it is a normal float32 where the quotient itself would be subnormal, which XLA:CPU
    flushes to zero (an amax near 4e-36 then took the scale 2**-127, half the one needed,
    and its values clipped)."""
    amax = amax.astype(FLOAT32)
    small = amax < jnp.float32(2.0**-64)
    shift = jnp.where(small, jnp.float32(2.0**32), jnp.float32(1))
    shifted = (amax * shift) / jnp.float32(element_max)
    bits = lax.bitcast_convert_type(shifted, jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) - jnp.where(small, 32, 0)
    normal = exponent + ((bits & 0x7FFFFF) > 0).astype(jnp.int32)
    # Below 2**-126 the quotient is subnormal: 2**-127 holds it up to 2**-127, else 2**-126.
    tiny = jnp.where(small & (shifted <= jnp.float32(2.0**-95)), 0, 1)
    code = jnp.where(exponent >= 1, normal, tiny)
    code = jnp.where(jnp.isfinite(amax), code, 255)
    return lax.bitcast_convert_type(code.astype(jnp.uint8), E8M0)


def _pad_to_blocks(x: jax.Array, block: int, rows: int) -> jax.Array:
    k = x.shape[-1]
    pad = [(0, 0)] * x.ndim
    pad[-1] = (0, -k % block)
    if rows > 1:
        pad[-2] = (0, -x.shape[-2] % rows)
    return jnp.pad(x, pad) if any(p for _, p in pad) else x


def _block_amax(x: jax.Array, block: int, rows: int) -> jax.Array:
    """The largest magnitude of each block of ``block`` values along the last axis (of each
    ``rows`` x ``block`` tile), NaN where the block holds one."""
    if rows == 1:
        return jnp.max(jnp.abs(x).reshape(*x.shape[:-1], x.shape[-1] // block, block), axis=-1)
    *lead, r, k = x.shape
    a = jnp.abs(x).reshape(*lead, r // rows, rows, k // block, block)
    return jnp.max(a, axis=(-3, -1))


def _tensor_encode_scale(amax: jax.Array, fmt: BlockFormat) -> jax.Array:
    """NVFP4's float32 encode scale per tensor, ``448 * 6 / amax``, as TransformerEngine
    computes it: at most float32's largest, and 1 for an amax of zero or inf."""
    s = jnp.minimum(jnp.float32(float(jnp.finfo(fmt.scale).max) * fmt.element_max) / amax, _F32_MAX)
    return jnp.where((amax == 0) | (s == 0), jnp.float32(1), s)


def quantize_blocks(
    x: jax.Array,
    fmt: BlockFormat | str,
    *,
    tiles: bool = False,
    rounding: str = "nearest",
    key: jax.Array | None = None,
    per_leading: bool = False,
) -> Quantized:
    """``x`` quantized block by block along its last axis.

    A last axis that is not a multiple of the block ends in a short block, padded with
    zeros (which change neither its amax nor a product). Values are divided by their
    block's scale, clipped to the element's range and rounded to nearest (even), or
    stochastically with ``rounding="stochastic"`` and ``key``.

    Args:
      x: a floating array; blocks run along its last axis.
      fmt: a ``BlockFormat`` or its name.
      tiles: scale square tiles of ``block`` x ``block`` values of the last two axes.
      rounding: ``"nearest"`` or ``"stochastic"``.
      key: the PRNG key stochastic rounding draws from.
      per_leading: NVFP4's tensor scale per index of the leading axis (a GEMM's batch:
        each expert, each member, scaled as if alone), shaped to broadcast; else one.

    Returns:
      The ``Quantized`` tensor.

    Examples:
      >>> import jax.numpy as jnp
      >>> q = quantize_blocks(jnp.arange(32.0), "mxfp8")
      >>> # 31 / 0.125 = 248 lies halfway between e4m3s 240 and 256: to even, 256
      >>> float(q.block_scales.astype(jnp.float32)[0]), float(q.dequantized()[31])
      (0.125, 32.0)
    """
    fmt = block_format(fmt)
    if rounding not in ("nearest", "stochastic"):
        raise invalid_choice("rounding", rounding, ("nearest", "stochastic"))
    if rounding == "stochastic" and key is None:
        raise ValueError("stochastic rounding needs a key.")
    rows = fmt.block if tiles else 1
    x = _pad_to_blocks(lax.stop_gradient(x).astype(FLOAT32), fmt.block, rows)
    amax = _block_amax(x, fmt.block, rows)
    if fmt.tensor_scale:
        if not x.size:
            whole = jnp.float32(0)
        elif per_leading and x.ndim > 1:
            whole = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)), keepdims=True)
        else:
            whole = jnp.max(jnp.abs(x))
        encode = _tensor_encode_scale(whole, fmt)
        decode = 1.0 / encode
        # The block's decode scale in e4m3, then the encode scale its values are multiplied
        # by, as TransformerEngine's kernels compute them (core_nvfp4.cuh).
        wanted = amax * (encode * jnp.float32(1.0 / fmt.element_max))
        scales = jnp.minimum(wanted, float(jnp.finfo(fmt.scale).max)).astype(fmt.scale)
        wide_scales = scales.astype(FLOAT32)
        block_decode = wide_scales * decode
        # Where that product is a float32 subnormal, which XLA:CPU reads as zero (a block far
        # below its tensor's amax), the quotient ``encode / scale`` instead: 1 / 0 clipped
        # to float32's largest made every value of the block its largest.
        normal = block_decode >= float(jnp.finfo(FLOAT32).smallest_normal)
        block_encode = jnp.minimum(
            jnp.where(normal, 1.0 / block_decode, encode / wide_scales), _F32_MAX
        )
        # A tensor holding inf (whose encode scale falls back to 1) or NaN decodes to NaN:
        # clipping would hide an overflow from loss scaling's check of the gradients.
        tensor_decode = jnp.where(jnp.isfinite(whole), decode, jnp.float32(jnp.nan))
        scaled = x * _spread(block_encode, fmt.block, rows)
    else:
        scales = _e8m0_round_up(amax, fmt.element_max)
        code = _spread(_e8m0_code(scales), fmt.block, rows)
        # x / 2**(code - 127), exact, by exponent arithmetic (see ``dequantized``).
        scaled = jnp.where(code == 255, jnp.float32(jnp.nan), jnp.ldexp(x, 127 - code))
        tensor_decode = jnp.float32(1)
    big = jnp.float32(fmt.element_max)
    scaled = jnp.clip(scaled, -big, big)
    if rounding == "stochastic":
        assert key is not None
        scaled = _stochastic_to_grid(scaled, fmt, key)
    elif fmt.element == E2M1:
        # Rounded here, so the conversion below is exact: XLA:CPU's older fusion emitters
        # (--xla_cpu_use_fusion_emitters=false) convert float32 to e2m1 wrongly (-5.0019
        # to -4, not -6), as if rounding twice; the float8 conversions are right.
        scaled = _nearest_on_grid(scaled, fmt)
    values = scaled.astype(fmt.element)
    return Quantized(values, scales, tensor_decode, rows, fmt)


def _stochastic_to_grid(y: jax.Array, fmt: BlockFormat, key: jax.Array) -> jax.Array:
    """``y`` (within the element's range) moved to one of its two neighbours in the
    element format, the upper with probability its distance from the lower over the gap:
    unbiased. Exact: both neighbours and the result are values of the format."""
    a = jnp.abs(y)
    gap = _grid_gap(a, fmt)
    lower = jnp.floor(a / gap) * gap
    u = jax.random.uniform(key, y.shape, FLOAT32)
    up = u < (a - lower) / gap
    out = jnp.minimum(jnp.where(up, lower + gap, lower), fmt.element_max)
    return jnp.where(jnp.isfinite(y), jnp.sign(y) * out, y)


def _nearest_on_grid(y: jax.Array, fmt: BlockFormat) -> jax.Array:
    """``y`` (within the element's range) rounded to the nearest value of the element
    format, ties to even, in float32: exact, as ``a / gap`` is a division by a power of
    two and an even multiple of the gap has an even last mantissa bit."""
    a = jnp.abs(y)
    gap = _grid_gap(a, fmt)
    out = jnp.round(a / gap) * gap
    return jnp.where(jnp.isfinite(y), jnp.copysign(out, y), y)


def _grid_gap(a: jax.Array, fmt: BlockFormat) -> jax.Array:
    """The gap between the element format's values at ``a >= 0``: 2**(exponent - mantissa
    bits), subnormals at the smallest normal's; frexp's exponent is exact (a log2 may
    round across a power of two)."""
    finfo = jnp.finfo(fmt.element)
    _, exponent = jnp.frexp(jnp.maximum(a, float(finfo.smallest_normal)))
    return jnp.ldexp(jnp.float32(1), exponent - 1 - finfo.nmant)
