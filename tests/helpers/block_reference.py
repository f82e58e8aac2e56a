"""An independent numpy/ml_dtypes emulation of the OCP MX (MXFP8) and NVFP4 formats.

Written from the formats' definitions, not from jaxamp's code: block by block in numpy,
the MX scale as an exact power of two from ``frexp``, NVFP4's scales in float32 numpy as
TransformerEngine's kernels compute them, values rounded by ml_dtypes' casts, and
products summed in float64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32


def flushed(x: np.ndarray) -> np.ndarray:
    """``x`` with float32 subnormals read as zero, as XLA:CPU's float32 arithmetic reads
    them (tests/ops/block_scaling_test.py measures it): the emulation's inputs, as every
    float32 operation of a model on that backend sees them."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0) * x, x)


def _blocks(x: np.ndarray, block: int, rows: int) -> np.ndarray:
    """``x`` (2-D) padded with zeros to whole blocks (and tiles of ``rows`` rows)."""
    r, k = x.shape
    return np.pad(flushed(x), ((0, -r % rows), (0, -k % block)))


def _tile_amax(x: np.ndarray, block: int, rows: int) -> np.ndarray:
    """One amax per tile, repeated over the tile's values (NaN if the tile holds one)."""
    out = np.empty_like(x)
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], block):
            tile = np.abs(x[i : i + rows, j : j + block])
            out[i : i + rows, j : j + block] = np.nan if np.isnan(tile).any() else tile.max()
    return out


def mx_scale(amax: np.ndarray) -> np.ndarray:
    """The smallest power of two ``s`` with ``amax / s <= 448``, as float64; e8m0 clamps
    it to [2**-127, 2**127]; NaN for an amax that is inf or NaN."""
    ratio = amax.astype(np.float64) / 448.0
    mantissa, exponent = np.frexp(ratio)  # ratio = mantissa * 2**exponent, 0.5 <= m < 1
    exponent = np.where(mantissa == 0.5, exponent - 1, exponent)  # an exact power of two
    exponent = np.where(ratio == 0, -127, np.clip(exponent, -127, 127))
    return np.where(np.isfinite(ratio), np.ldexp(1.0, exponent), np.nan)


def quantize_mxfp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(values, scales)`` of a 2-D float32 array in blocks of 32 along its last axis, both
    float64 and of the padded shape: ``values`` e4m3 numbers, ``scales`` each value's."""
    x = _blocks(np.asarray(x, np.float64), 32, 1)
    scale = mx_scale(_tile_amax(x, 32, 1))
    with np.errstate(invalid="ignore"):
        scaled = np.clip(x / scale, -448, 448)
    values = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values, scale


def nvfp4_scaled(x: np.ndarray, tiles: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """``(scaled values before rounding, block scales, tensor decode scale)`` of a 2-D
    float32 array in blocks of 16 (16 x 16 tiles with ``tiles``): an e4m3 scale per block
    and a float32 scale per tensor, as TransformerEngine's NVFP4 recipe defines them."""
    x = _blocks(np.asarray(x, np.float32), 16, 16 if tiles else 1)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        whole = F32(np.abs(x).max()) if x.size else F32(0)
        encode = np.minimum(F32(448 * 6) / whole, np.finfo(F32).max)
        if whole == 0 or encode == 0:
            encode = F32(1)
        decode = F32(1) / encode
        amax = _tile_amax(x, 16, 16 if tiles else 1).astype(F32)
        wanted = amax * (encode * F32(1 / 6))
        scales = np.minimum(wanted, F32(448)).astype(ml_dtypes.float8_e4m3fn).astype(F32)
        block_encode = np.minimum(F32(1) / (scales * decode), np.finfo(F32).max).astype(F32)
        scaled = np.clip(x * block_encode, -6, 6)
    tensor = float(decode) if np.isfinite(whole) else float("nan")
    return scaled, scales.astype(np.float64), tensor


def quantize_nvfp4(x: np.ndarray, tiles: bool = False) -> tuple[np.ndarray, np.ndarray, float]:
    """``(values, block scales, tensor decode scale)``: ``nvfp4_scaled``'s values rounded to
    e2m1 (to nearest, ties to even)."""
    scaled, scales, tensor = nvfp4_scaled(x, tiles)
    return scaled.astype(ml_dtypes.float4_e2m1fn).astype(np.float64), scales, tensor


def dequantized(x: np.ndarray, fmt: str, tiles: bool = False) -> tuple[np.ndarray, float]:
    """``x`` quantized and decoded block by block (padded), and the tensor's decode scale
    (1 for MXFP8). The decoded values are float32 numbers (held in float64): a value
    float32 cannot hold (e4m3's 256 times the scale 2**120, from an amax within one e4m3
    step of float32's largest) is inf there, as the format decodes it in float32."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN values times NaN scales
        if fmt == "mxfp8":
            values, scales = quantize_mxfp8(x)
            tensor = 1.0
        else:
            values, scales, tensor = quantize_nvfp4(x, tiles)
        return (values * scales).astype(np.float32).astype(np.float64), tensor


def block_matmul(a: np.ndarray, b: np.ndarray, fmt: str) -> np.ndarray:
    """``a @ b.T`` for 2-D ``a`` (m, k) and ``b`` (n, k), both quantized in blocks along k
    (``b`` in tiles under NVFP4), multiplied and summed in float64."""
    qa, sa = dequantized(a, fmt)
    qb, sb = dequantized(b, fmt, tiles=fmt == "nvfp4")
    with np.errstate(invalid="ignore", over="ignore"):
        y = (qa @ qb.T) * (sa * sb)
    return y[: a.shape[0], : b.shape[0]]
