"""The block-scaled GEMMs (MXFP8, NVFP4): forward, activation- and weight-gradient, emulated."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxamp._src.backend import has_block_scaled_gemm
from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.errors import guide
from jaxamp._src.jaxprs import BLOCK_SCOPE_PREFIX, FP8_SCOPE
from jaxamp._src.ops.block_scaling import BlockFormat, Quantized, block_format, quantize_blocks
from jaxamp._src.ops.fp8 import _as_custom_vjp, _first_order
from jaxamp._src.ops.fp8_scaling import dequantize_product


def _gemm(a: Quantized, b: Quantized, spec: str) -> jax.Array:
    """The block-scaled GEMM of two quantized operands, in float32: each value times its
    block's scale (exact), summed in float32, then times the tensors' scales, as the
    Blackwell GEMM scales its result by ``alpha``. ``spec`` names the operands' axes
    (``"bmk,bnk->bmn"``); they are brought to that layout and back."""
    ins, out = spec.split("->")
    lhs_spec, rhs_spec = ins.split(",")
    (contraction,) = set(lhs_spec) & set(rhs_spec) - set(out)
    canonical = ("b" + out[1] + contraction, "b" + out[2] + contraction)
    a_values, a_scales = _row_form(a, lhs_spec, canonical[0])
    b_values, b_scales = _row_form(b, rhs_spec, canonical[1])
    y = _block_matmul(a_values, b_values, a_scales, b_scales, a.fmt)
    return dequantize_product(y, a.tensor_scale, b.tensor_scale)


def _row_form(q: Quantized, spec: str, want: str) -> tuple[jax.Array, jax.Array]:
    """``q``'s values and a scale per block of each row, in the axes ``want`` (batch, rows,
    the contraction last). Stored the other way round (``spec`` its transpose), ``q`` must
    be in square tiles, which scale its columns' blocks as they scale its rows'."""
    values, scales = q.values, q.block_scales
    if spec != want:
        assert spec == want[0] + want[2] + want[1] and q.tile_rows == q.fmt.block, (spec, want)
        values, scales = jnp.swapaxes(values, 1, 2), jnp.swapaxes(scales, 1, 2)
    if q.tile_rows > 1:
        scales = jnp.repeat(scales, q.tile_rows, axis=-2)[..., : values.shape[-2], :]
    return values, scales


def _emulated(a: Any, b: Any, a_scales: Any, b_scales: Any, fmt: BlockFormat) -> jax.Array:
    """``einsum('bmk,bnk->bmn')`` of the decoded operands, float32 sums: the GEMM emulated."""
    qa = Quantized(a, a_scales, jnp.float32(1), 1, fmt)
    qb = Quantized(b, b_scales, jnp.float32(1), 1, fmt)
    return jnp.einsum(
        "bmk,bnk->bmn",
        qa.dequantized(),
        qb.dequantized(),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=FLOAT32,
    )


# ---------------------------------------------------------- sharding and batching
# The emulated GEMM takes the quantized values and their scales, as the block-scaled
# GEMM of a Blackwell GPU does, and tells XLA's partitioner how to shard it (as JAX's
# own ``scaled_matmul`` does): its contraction whole on every device, so that a weight
# sharded along it (FSDP) is all-gathered as one byte per value and its scales, never
# decoded first (a plain einsum of the decoded values gathered them as float32).


def _specs(shardings: Any) -> tuple[Any, Any, Any]:
    a, b = (tuple(s.spec) + (None,) * (3 - len(s.spec)) for s in shardings[:2])
    batch, m, n = a[0], a[1], b[1]
    overlap = {x for x in (m if isinstance(m, tuple) else (m,)) if x} & {
        x for x in (n if isinstance(n, tuple) else (n,)) if x
    }
    return batch, m, None if overlap else n


def _infer(fmt: Any, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    batch, m, n = _specs([x.sharding for x in arg_shapes])
    return NamedSharding(mesh, P(batch, m, n))


def _partition(fmt: Any, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    batch, m, n = _specs([x.sharding for x in arg_shapes])
    lhs, rhs = NamedSharding(mesh, P(batch, m, None)), NamedSharding(mesh, P(batch, n, None))

    def local(a: Any, b: Any, a_scales: Any, b_scales: Any) -> jax.Array:
        return _emulated(a, b, a_scales, b_scales, fmt)

    return mesh, local, NamedSharding(mesh, P(batch, m, n)), (lhs, rhs, lhs, rhs)


_partitioned = custom_partitioning(_emulated, static_argnums=(4,))
_partitioned.def_partition(
    infer_sharding_from_operands=_infer,
    partition=_partition,
    sharding_rule="b m k, b n k, b m s, b n s -> b m n",
    need_replication_factors=("k", "s"),  # the contraction and its blocks, whole
)


@functools.cache
def _block_matmul_in(fmt: BlockFormat) -> Any:
    """The emulated GEMM of ``fmt``, partitioned, with a ``vmap`` rule: under ``vmap`` the
    mapped axis joins the GEMM's batch axis (``custom_partitioning`` has no batching rule
    of its own)."""

    @jax.custom_batching.custom_vmap
    def gemm(a: Any, b: Any, a_scales: Any, b_scales: Any) -> jax.Array:
        return _partitioned(a, b, a_scales, b_scales, fmt)

    @gemm.def_vmap
    def _vmap(axis_size: int, in_batched: Any, *arrays: Any) -> Any:
        full = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(arrays, in_batched, strict=True)
        ]
        y = gemm(*(x.reshape(-1, *x.shape[2:]) for x in full))
        return y.reshape(axis_size, -1, *y.shape[1:]), True

    return gemm


def _block_matmul(a: Any, b: Any, a_scales: Any, b_scales: Any, fmt: BlockFormat) -> jax.Array:
    """``einsum('bmk,bnk->bmn')`` of the block-scaled operands, float32: on a GPU with the
    block-scaled GEMM (Blackwell, compute capability 10 and up) JAX's ``scaled_matmul``,
    which XLA lowers to cuDNN's kernel; elsewhere the emulation, which computes the same
    numbers up to the order of float32's sums."""
    if has_block_scaled_gemm():
        return jax.nn.scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=FLOAT32)
    return _block_matmul_in(fmt)(a, b, a_scales, b_scales)


def _digest(x: jax.Array) -> jax.Array:
    """A 32-bit hash of ``x``'s bits and their positions (each value's bits mixed with its
    index by MurmurHash3's finalizer, then summed): a changed value, a flipped sign or a
    swap changes it, where a plain sum of the bits let ``-g`` cancel to ``g``'s."""
    if not x.size:
        return jnp.uint32(0)
    bits = lax.bitcast_convert_type(x.astype(FLOAT32), jnp.uint32)
    # each value's flat index, from iotas (a reshape to one axis made a sharded x gathered)
    index, stride = jnp.zeros(x.shape, jnp.uint32), 1
    for axis in reversed(range(x.ndim)):
        index = index + lax.broadcasted_iota(jnp.uint32, x.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= x.shape[axis]
    h = bits ^ (index * jnp.uint32(0x9E3779B9))
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return jnp.sum(h ^ (h >> 16), dtype=jnp.uint32)


def _keys(g: jax.Array, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two PRNG keys for the gradient's stochastic rounding, drawn from a hash of the
    gradient, the layer's input and its weight: no key to thread through the model; other
    at every step (the weights move), for every layer (its own input and weight), and for
    ``g`` and ``-g``. A step repeated exactly (same weights, same batch) repeats its
    rounding, as any function of its inputs does."""
    key = jax.random.key(_digest(g))
    key = jax.random.fold_in(jax.random.fold_in(key, _digest(a)), _digest(b))
    first, second = jax.random.split(key)
    return first, second


def _forward(fmt: BlockFormat, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum('bmk,bnk->bmn')``: both operands in blocks along k; ``b`` (the weight) in
    square tiles under NVFP4."""
    qa = quantize_blocks(a, fmt, per_leading=True)
    qb = quantize_blocks(b, fmt, tiles=fmt.weight_tiles, per_leading=True)
    y = _gemm(qa, qb, "bmk,bnk->bmn")
    return y[:, : a.shape[1], : b.shape[1]]


def _backward(
    fmt: BlockFormat, a: jax.Array, b: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The activation gradient ``g @ b`` (blocks along n) and the weight gradient
    ``g.T @ a`` (blocks along m): each operand quantized again along the axis its GEMM
    contracts, the gradient rounded as the format says."""
    m, k, n = a.shape[1], a.shape[2], b.shape[1]
    key_a, key_b = _keys(g, a, b)
    rounding = fmt.gradient_rounding
    quantize = functools.partial(quantize_blocks, fmt=fmt, per_leading=True)
    qg = quantize(g, rounding=rounding, key=key_a)
    if fmt.weight_tiles:  # the forward's tiles: the same values, transposed
        qb = quantize(b, tiles=True)
        d_a = _gemm(qg, qb, "bmn,bnk->bmk")
    else:
        qb = quantize(jnp.swapaxes(b, 1, 2))
        d_a = _gemm(qg, qb, "bmn,bkn->bmk")
    qg_t = quantize(jnp.swapaxes(g, 1, 2), rounding=rounding, key=key_b)
    qa_t = quantize(jnp.swapaxes(a, 1, 2))
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
    for operand in (lhs, rhs):
        spec = getattr(getattr(jax.typeof(operand), "sharding", None), "spec", ())
        if any(s is not None for s in spec):
            raise ValueError(
                f"jaxamp's {fmt.name} GEMMs do not run on arrays sharded in JAX's explicit "
                f"sharding mode yet (an operand typed {jax.typeof(operand).str_short()}); "
                "use a mesh of AxisType.Auto axes under jit "
                f"({guide('block-scaling.md', 'limits')})."
            )
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
