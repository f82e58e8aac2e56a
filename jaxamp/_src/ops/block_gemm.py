"""The block-scaled GEMMs (MXFP8, NVFP4): forward, activation- and weight-gradient, emulated."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.jaxprs import BLOCK_SCOPE_PREFIX, FP8_SCOPE
from jaxamp._src.ops.block_scaling import BlockFormat, Quantized, block_format, quantize_blocks
from jaxamp._src.ops.fp8 import _as_custom_vjp, _first_order
from jaxamp._src.ops.fp8_scaling import dequantize_product


def _gemm(a: Quantized, b: Quantized, spec: str) -> jax.Array:
    """The block-scaled GEMM of two quantized operands, in float32: each value times its
    block's scale (exact), summed in float32, then times the tensors' scales, as the
    Blackwell GEMM scales its result by ``alpha``."""
    y = jnp.einsum(
        spec,
        a.dequantized(),
        b.dequantized(),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=FLOAT32,
    )
    return dequantize_product(y, a.tensor_scale, b.tensor_scale)


def _keys(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two PRNG keys for the gradient's stochastic rounding, drawn from the gradient's own
    bits (a wrapping sum): reproducible, no key to thread through the model, and new at
    every step the gradient changes."""
    bits = lax.bitcast_convert_type(g.astype(FLOAT32), jnp.uint32)
    digest = jnp.sum(bits, dtype=jnp.uint32) if g.size else jnp.uint32(0)
    key = jax.random.key(digest)
    return jax.random.split(key)[0], jax.random.split(key)[1]


def _forward(fmt: BlockFormat, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum('bmk,bnk->bmn')``: both operands in blocks along k; ``b`` (the weight) in
    square tiles under NVFP4."""
    qa = quantize_blocks(a, fmt)
    qb = quantize_blocks(b, fmt, tiles=fmt.weight_tiles)
    y = _gemm(qa, qb, "bmk,bnk->bmn")
    return y[:, : a.shape[1], : b.shape[1]]


def _backward(
    fmt: BlockFormat, a: jax.Array, b: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The activation gradient ``g @ b`` (blocks along n) and the weight gradient
    ``g.T @ a`` (blocks along m): each operand quantized again along the axis its GEMM
    contracts, the gradient rounded as the format says."""
    m, k, n = a.shape[1], a.shape[2], b.shape[1]
    key_a, key_b = _keys(g)
    rounding = fmt.gradient_rounding
    qg = quantize_blocks(g, fmt, rounding=rounding, key=key_a)
    if fmt.weight_tiles:  # the forward's tiles: the same values, transposed
        qb = quantize_blocks(b, fmt, tiles=True)
        d_a = _gemm(qg, qb, "bmn,bnk->bmk")
    else:
        qb = quantize_blocks(jnp.swapaxes(b, 1, 2), fmt)
        d_a = _gemm(qg, qb, "bmn,bkn->bmk")
    qg_t = quantize_blocks(jnp.swapaxes(g, 1, 2), fmt, rounding=rounding, key=key_b)
    qa_t = quantize_blocks(jnp.swapaxes(a, 1, 2), fmt)
    d_b = _gemm(qg_t, qa_t, "bnm,bkm->bnk")
    return d_a[:, :m, :k], d_b[:, :n, :k]


def _matmul_fwd(a: jax.Array, b: jax.Array, fmt: BlockFormat, out: np.dtype) -> Any:
    a, b = _first_order(a), _first_order(b)
    return _forward(fmt, a, b).astype(out), (a, b)


def _matmul_bwd(fmt: BlockFormat, out: np.dtype, res: Any, g: jax.Array) -> Any:
    a, b = res
    d_a, d_b = _backward(fmt, a, b, _first_order(g))
    return d_a.astype(a.dtype), d_b.astype(b.dtype)


def _matmul(a: jax.Array, b: jax.Array, fmt: BlockFormat, out: np.dtype) -> jax.Array:
    return _as_custom_vjp(_matmul_fwd, _matmul_bwd, (a, b), (fmt, out))


def _to_bmk(x: jax.Array, contract: tuple[int, ...], batch: tuple[int, ...]) -> jax.Array:
    """``x`` as ``(batch, free, contraction)``, each group of axes flattened in order."""
    free = tuple(d for d in range(x.ndim) if d not in contract and d not in batch)
    x = jnp.transpose(x, (*batch, *free, *contract))
    size = [
        math.prod(x.shape[: len(batch)]),
        math.prod(x.shape[len(batch) : len(batch) + len(free)]),
    ]
    return x.reshape(*size, math.prod(x.shape[len(batch) + len(free) :]))


def block_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    fmt: BlockFormat | str,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``lax.dot_general`` as a block-scaled GEMM (MXFP8 or NVFP4), float32 sums.

    Blocks run along the contraction (its axes flattened in the order
    ``dimension_numbers`` lists them); the activation gradient's blocks along the
    output's features, the weight gradient's along the rows (tokens). The GEMMs are
    emulated: each block's values times its scale, exact in float32, summed in float32.

    Args:
      lhs: left operand (floating).
      rhs: right operand; a layer's kernel, tiled under NVFP4.
      dimension_numbers: as for ``lax.dot_general``.
      fmt: ``"mxfp8"``, ``"nvfp4"`` or a ``BlockFormat``.
      preferred_element_type: the result dtype; ``None`` promotes the operands'.

    Returns:
      The product, in ``dot_general``'s layout.

    Examples:
      >>> import jax.numpy as jnp
      >>> dn = (((1,), (0,)), ((), ()))
      >>> y = block_dot_general(jnp.ones((2, 64)), jnp.full((64, 3), 0.5), dn, "mxfp8")
      >>> y.shape, float(y[0, 0])
      ((2, 3), 32.0)
    """
    fmt = block_format(fmt)
    (lc, rc), (lb, rb) = (
        tuple(tuple(int(d) for d in ax) for ax in part) for part in dimension_numbers
    )
    out = np.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    lhs_free = [lhs.shape[d] for d in range(lhs.ndim) if d not in lc and d not in lb]
    rhs_free = [rhs.shape[d] for d in range(rhs.ndim) if d not in rc and d not in rb]
    batch = [lhs.shape[d] for d in lb]
    with jax.named_scope(FP8_SCOPE), jax.named_scope(BLOCK_SCOPE_PREFIX + fmt.name):
        y = _matmul(_to_bmk(lhs, lc, lb), _to_bmk(rhs, rc, rb), fmt, out)
        return y.reshape(*batch, *lhs_free, *rhs_free)
