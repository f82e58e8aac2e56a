"""The float8 GEMMs: e4m3 operands, e5m2 gradients, float32 sums, current or delayed scaling."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.sharding_impls import canonicalize_sharding

from jaxamp._src.dtypes import FLOAT32, is_floating, promote
from jaxamp._src.errors import guide
from jaxamp._src.jaxprs import FP8_SCOPE
from jaxamp._src.ops.forms import free_dims
from jaxamp._src.ops.fp8_max32 import as_dtype_of
from jaxamp._src.ops.fp8_scaling import (
    E4M3,
    E5M2,
    delayed_scale,
    dequantize_product,
    poison,
    quantize,
    scale_from_amax,
    scaling_amax,
)

# Re-exported for compare/ (STATE_COLLECTION) and optim/loss_scaled.py (state_paths),
# which import them from here; their home is fp8_state.
from jaxamp._src.ops.fp8_state import STATE_COLLECTION as STATE_COLLECTION
from jaxamp._src.ops.fp8_state import Fp8State, as_fp8_state, checked_fp8_state
from jaxamp._src.ops.fp8_state import state_paths as state_paths
from jaxamp._src.ops.matmul import same_varying_axes
from jaxamp._src.ops.primitives import sharding_of_result
from jaxamp._src.policy import MAX_MARGIN, recipe_integer


@jax.custom_jvp
def _first_order(x: jax.Array) -> jax.Array:
    """``x``, refusing to be differentiated: a float8 GEMM's passes quantize, and tangents
    or cotangents through them would be cast to float8 unscaled (inf and NaN where they
    outgrow the operands' range), so a second derivative would be silently wrong."""
    return x


@_first_order.defjvp
def _first_order_jvp(primals: Any, tangents: Any) -> Any:
    raise NotImplementedError(
        "second derivatives (jax.hessian, jax.grad of jax.grad) through jaxamp's float8 "
        "GEMMs are not supported: their passes quantize to float8, and the derivatives of "
        "the quantized values would be cast to float8 unscaled. Take one derivative, or "
        f"compute second derivatives under a 16-bit policy ({guide('fp8.md', 'limits')})."
    )


# ------------------------------------------------------------------- the float8 GEMMs


def _gemm(lhs: Any, rhs: Any, dimension_numbers: Any, out_sharding: Any = None) -> jax.Array:
    return lax.dot_general(
        lhs, rhs, dimension_numbers, preferred_element_type=FLOAT32, out_sharding=out_sharding
    )


def _transpose_lhs(g: jax.Array, rhs: jax.Array, lhs: jax.Array, dimension_numbers: Any) -> Any:
    """``d_lhs = dot(g, rhs)`` in float32, in the layout (and sharding) of ``lhs``."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    lhs_ndim = lhs.ndim
    x_kept = free_dims(lhs_ndim, x_contract, x_batch)
    y_kept = free_dims(rhs.ndim, y_contract, y_batch)
    nb, nx = len(x_batch), len(x_kept)
    ans_batch = tuple(range(nb))
    ans_y = tuple(range(nb + nx, nb + nx + len(y_kept)))
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_by_y = [int(d) for d in np.take(x_contract, np.argsort(y_contract))]
    order = [*x_batch, *x_kept, *x_contract_by_y]
    out = _gemm(g, rhs, dims, sharding_of_result(jax.typeof(lhs), order))
    return jnp.transpose(out, [int(a) for a in np.argsort(order)])


def _transpose_rhs(g: jax.Array, lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> Any:
    """``d_rhs = dot(g, lhs)`` in float32, in the layout (and sharding) of ``rhs``: ``g``
    first, as Flax's ``fp8_ops`` and JAX's transpose of ``dot_general`` order it (the
    other order sums the same products in another order, a last bit apart)."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = free_dims(lhs.ndim, x_contract, x_batch)
    y_kept = free_dims(rhs.ndim, y_contract, y_batch)
    nb = len(x_batch)
    ans_batch = tuple(range(nb))
    ans_x = tuple(range(nb, nb + len(x_kept)))
    dims = ((ans_x, tuple(x_kept)), (ans_batch, tuple(x_batch)))
    y_contract_by_x = [int(d) for d in np.take(y_contract, np.argsort(x_contract))]
    order = [*y_batch, *y_kept, *y_contract_by_x]
    out = _gemm(g, lhs, dims, sharding_of_result(jax.typeof(rhs), order))
    return jnp.transpose(out, [int(a) for a in np.argsort(order)])


def _current(
    lhs: Any, rhs: Any, dimension_numbers: Any, out_dtype: np.dtype, margin: int, sharding: Any
) -> Any:
    static = (dimension_numbers, out_dtype, margin, sharding)
    return _as_custom_vjp(_current_fwd, _current_bwd, (lhs, rhs), static)


def _as_custom_vjp(
    fwd: Callable[..., Any], bwd: Callable[..., Any], arrays: Any, static: tuple[Any, ...]
) -> Any:
    """``fwd(*arrays, *static)[0]`` with the gradient ``bwd(*static, res, g)``, through a
    ``custom_vjp`` of the arrays' leaves alone, made once per set of static arguments and
    closing over them. A workaround in the open: under the next JAX's ``jax_custom_vjp3``
    without ``jax_remat3``, a ``custom_vjp`` defined with ``nondiff_argnums`` or taking a
    pytree (the state) fails inside ``jax.checkpoint`` (JAX's bug: plain ones fail the
    same way; tested by tests/next_jax_test.py)."""
    leaves, treedef = jax.tree.flatten(arrays)
    return _flat_custom_vjp(fwd, bwd, treedef, static)(*leaves)


@functools.cache
def _flat_custom_vjp(
    fwd: Callable[..., Any], bwd: Callable[..., Any], treedef: Any, static: tuple[Any, ...]
) -> Any:
    def unflat(leaves: Any) -> Any:
        return jax.tree.unflatten(treedef, leaves)

    gemm = jax.custom_vjp(lambda *leaves: fwd(*unflat(leaves), *static)[0])
    gemm.defvjp(
        lambda *leaves: fwd(*unflat(leaves), *static),
        lambda res, g: tuple(jax.tree.leaves(bwd(*static, res, g))),
    )
    return gemm


def _saved(q: jax.Array) -> jax.Array:
    """An e4m3 operand as the backward pass keeps it: its bits, as ``uint8``. A workaround
    in the open: JAX rounds each residual that ``jax.checkpoint`` saves with
    ``reduce_precision`` at its dtype's exponent and mantissa bits, which for e4m3fn (4 and
    3) is an IEEE-like format whose largest finite value is 240, not 448: every value above
    240, the operand's largest always among them, came back NaN (tests/ops/fp8_test.py)."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def _restored(bits: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(bits, E4M3)


def _current_fwd(
    lhs: Any, rhs: Any, dimension_numbers: Any, out_dtype: np.dtype, margin: int, sharding: Any
) -> tuple[jax.Array, tuple[Any, ...]]:
    lhs, rhs = _first_order(lhs), _first_order(rhs)
    amax_l, amax_r = scaling_amax(lhs), scaling_amax(rhs)
    s_l, s_r = (scale_from_amax(a, E4M3, margin) for a in (amax_l, amax_r))
    q_l, q_r = quantize(lhs, E4M3, s_l), quantize(rhs, E4M3, s_r)
    y = dequantize_product(_gemm(q_l, q_r, dimension_numbers, sharding), s_l, s_r)
    y = y * poison(amax_l, amax_r)
    # An operand's inf or NaN reaches the other operand's gradient through its saved scale.
    s_l, s_r = s_l * poison(amax_l), s_r * poison(amax_r)
    like = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    res = (_saved(q_l), s_l, _saved(q_r), s_r, *like)
    return y.astype(out_dtype), res


def _current_bwd(
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
    res: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    q_l, s_l, q_r, s_r, lhs_like, rhs_like = res
    q_l, q_r = _restored(q_l), _restored(q_r)
    g = _first_order(g)
    amax_g = scaling_amax(g)
    s_g = scale_from_amax(amax_g, E5M2, margin)
    q_g = quantize(g, E5M2, s_g)
    s_g = s_g * poison(amax_g)
    d_l = dequantize_product(_transpose_lhs(q_g, q_r, q_l, dimension_numbers), s_r, s_g)
    d_r = dequantize_product(_transpose_rhs(q_g, q_l, q_r, dimension_numbers), s_l, s_g)
    return d_l.astype(lhs_like.dtype), d_r.astype(rhs_like.dtype)


def _delayed(
    lhs: Any,
    rhs: Any,
    state: Fp8State,
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
) -> Any:
    static = (dimension_numbers, out_dtype, margin, sharding)
    return _as_custom_vjp(_delayed_fwd, _delayed_bwd, (lhs, rhs, state), static)


def _delayed_fwd(
    lhs: Any,
    rhs: Any,
    state: Fp8State,
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
) -> tuple[jax.Array, tuple[Any, ...]]:
    lhs, rhs = _first_order(lhs), _first_order(rhs)
    amax_l, amax_r = scaling_amax(lhs, state.input_scale), scaling_amax(rhs, state.kernel_scale)
    s_l, h_l = delayed_scale(amax_l, state.input_scale, state.input_amax_history, E4M3, margin)
    s_r, h_r = delayed_scale(amax_r, state.kernel_scale, state.kernel_amax_history, E4M3, margin)
    q_l, q_r = quantize(lhs, E4M3, s_l), quantize(rhs, E4M3, s_r)
    y = dequantize_product(_gemm(q_l, q_r, dimension_numbers, sharding), s_l, s_r)
    y = y * poison(amax_l, amax_r)
    like = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    used = (s_l * poison(amax_l), s_r * poison(amax_r))  # as in _current_fwd
    res = (_saved(q_l), s_l, h_l, _saved(q_r), s_r, h_r, state, like, used)
    return y.astype(out_dtype), res


def _delayed_bwd(
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
    res: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, Fp8State]:
    q_l, s_l, h_l, q_r, s_r, h_r, state, (lhs_like, rhs_like), (s_l_used, s_r_used) = res
    q_l, q_r = _restored(q_l), _restored(q_r)
    g = _first_order(g)
    amax_g = scaling_amax(g, state.output_grad_scale)
    s_g, h_g = delayed_scale(
        amax_g, state.output_grad_scale, state.output_grad_amax_history, E5M2, margin
    )
    q_g = quantize(g, E5M2, s_g)
    s_g_used = s_g * poison(amax_g)
    d_l = dequantize_product(_transpose_lhs(q_g, q_r, q_l, dimension_numbers), s_r_used, s_g_used)
    d_r = dequantize_product(_transpose_rhs(q_g, q_l, q_r, dimension_numbers), s_l_used, s_g_used)
    new = Fp8State(h_l, h_r, h_g, s_l, s_r, s_g)
    new = Fp8State(*(as_dtype_of(v, old) for v, old in zip(new, state, strict=True)))
    return d_l.astype(lhs_like.dtype), d_r.astype(rhs_like.dtype), new


def _out_dtype(lhs: Any, rhs: Any, preferred_element_type: Any) -> np.dtype:
    if preferred_element_type is not None:
        return np.dtype(preferred_element_type)
    return promote(lhs.dtype, rhs.dtype)


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    fp8_state: Fp8State | None = None,
    margin: int = 0,
    out_sharding: Any = None,
    block: str | None = None,
) -> jax.Array:
    """``lax.dot_general`` in float8: e4m3 operands, an e5m2 output gradient, float32 sums.

    Without ``fp8_state`` each operand is scaled by its own amax (current scaling); with it,
    by the amax history in it (delayed scaling), and the gradient with respect to
    ``fp8_state`` is its next value. An operand holding inf or NaN gives a NaN result.

    Args:
      lhs: left operand (any floating dtype).
      rhs: right operand.
      dimension_numbers: as for ``lax.dot_general``.
      precision: ignored (the GEMM's precision is its float8 operands').
      preferred_element_type: the result dtype; ``None`` promotes the operands' dtypes.
      fp8_state: the GEMM's FP8 state (an ``Fp8State`` from ``init_gemm_fp8_state``, or a
        mapping of its six names), or ``None`` for current scaling.
      margin: powers of two of headroom below the float8 maximum, an integer >= 0
        (as ``Fp8Recipe.margin``).
      out_sharding: the result's sharding, as for ``lax.dot_general``.
      block: ``"mxfp8"`` or ``"nvfp4"`` for a block-scaled GEMM (``block_dot_general``;
        no state, no margin), or ``None``.

    Returns:
      The product, dequantized.

    Raises:
      ValueError: for a ``margin`` that is not an integer >= 0, or a block format with a
        state, a margin or an explicit ``out_sharding``.

    Examples:
      >>> import jax.numpy as jnp
      >>> dn = (((1,), (0,)), ((), ()))
      >>> y = fp8_dot_general(jnp.ones((2, 3)), jnp.full((3, 4), 0.5), dn)
      >>> y.shape, round(float(y[0, 0]), 4)
      ((2, 4), 1.5)
    """
    del precision
    margin = recipe_integer("fp8_dot_general's margin", margin, 0, MAX_MARGIN)
    floating = all(is_floating(x.dtype) for x in (lhs, rhs))
    if not floating or not (preferred_element_type is None or is_floating(preferred_element_type)):
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    dims = tuple(tuple(tuple(int(d) for d in ax) for ax in part) for part in dimension_numbers)
    out = _out_dtype(lhs, rhs, preferred_element_type)
    if block is not None:
        return _block(lhs, rhs, dims, out, block, fp8_state, margin, out_sharding)
    sharding = canonicalize_sharding(out_sharding, "fp8_dot_general")
    lhs, rhs = same_varying_axes(lhs, rhs)  # inside shard_map: a weight's gradient summed
    with jax.named_scope(FP8_SCOPE):  # autocast evaluates it as traced
        if fp8_state is None:
            return _current(lhs, rhs, dims, out, margin, sharding)
        state = checked_fp8_state(as_fp8_state(fp8_state), None, "fp8_dot_general's fp8_state")
        return _delayed(lhs, rhs, state, dims, out, margin, sharding)


def _block(
    lhs: Any, rhs: Any, dims: Any, out: Any, block: str, state: Any, margin: int, sharding: Any
) -> jax.Array:
    from jaxamp._src.ops.block_gemm import block_dot_general  # it imports this module

    if state is not None or margin:
        raise ValueError(
            f"a {block} GEMM scales each block by its own amax: it takes no fp8_state and "
            f"no margin, got fp8_state={'given' if state is not None else None}, "
            f"margin={margin}."
        )
    if sharding is not None:
        raise ValueError(
            f"the {block} GEMMs do not take an explicit out_sharding yet (got {sharding}); "
            f"run them under jit's automatic sharding ({guide('block-scaling.md', 'limits')})."
        )
    lhs, rhs = same_varying_axes(lhs, rhs)
    return block_dot_general(lhs, rhs, dims, block, out)


def with_operands_swapped(
    gemm: Callable[..., jax.Array], lhs: Any, rhs: Any, dimension_numbers: Any, out_dtype: Any
) -> jax.Array:
    """``gemm(lhs, rhs, dimension_numbers, None, out_dtype)``, computed as ``gemm(rhs, lhs,
    ...)`` and transposed back: the same product, with ``lhs`` (a weight written on the
    left) quantized as the right operand. ``gemm`` takes ``lax.dot_general``'s arguments."""
    (lc, rc), (lb, rb) = dimension_numbers
    out = gemm(rhs, lhs, ((rc, lc), (rb, lb)), None, out_dtype)
    n_batch, n_rhs = len(lb), rhs.ndim - len(rc) - len(rb)
    order = [*range(n_batch), *range(n_batch + n_rhs, out.ndim)]
    return lax.transpose(out, [*order, *range(n_batch, n_batch + n_rhs)])


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """``fp8_dot_general`` as a ``dot_general`` for Flax layers (and an ``einsum``).

    Attributes:
      compute_dtype: the dtype results come back in (the policy's compute dtype).
      margin: the recipe's powers of two of headroom.
      state: the layer's FP8 state, or ``None`` for current scaling.
      block: ``"mxfp8"`` or ``"nvfp4"`` for block-scaled GEMMs, or ``None``.
    """

    compute_dtype: Any
    margin: int = 0
    state: Fp8State | None = None
    # keyword-only: a subclass's fields (NnxDelayed's history_length) keep their positions
    block: str | None = dataclasses.field(default=None, kw_only=True)
    # An einsum layer's kernel shape: a block format quantizes that operand as the right
    # one (NVFP4's 16 x 16 tiles), where jnp.einsum passes it on the left.
    kernel_shape: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)

    def __call__(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        out_sharding: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        if kwargs:
            raise TypeError(
                f"jaxamp's float8 matmul got unexpected arguments {sorted(kwargs)}; it takes "
                "those of lax.dot_general."
            )
        out_dtype = preferred_element_type or self.compute_dtype
        kernel = self.kernel_shape
        if (
            self.block is not None
            and out_sharding is None
            and kernel is not None
            and tuple(lhs.shape) == kernel
            and tuple(rhs.shape) != kernel
        ):
            gemm = functools.partial(fp8_dot_general, margin=self.margin, block=self.block)
            return with_operands_swapped(gemm, lhs, rhs, dimension_numbers, out_dtype)
        return fp8_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            out_dtype,
            fp8_state=self.state,
            margin=self.margin,
            out_sharding=out_sharding,
            block=self.block,
        )

    def einsum(self, subscripts: str, *operands: Any, **kwargs: Any) -> jax.Array:
        """``jnp.einsum`` whose contractions run in float8."""
        if kwargs.get("preferred_element_type") is None:
            kwargs["preferred_element_type"] = self.compute_dtype
        dot_general: Any = self
        if self.state is not None:
            # jnp.einsum hashes its _dot_general (a static argument): the state's arrays go
            # in a closure, a new one per call, never reused from jnp.einsum's cache.
            def dot_general(*args: Any, **kw: Any) -> jax.Array:
                return self(*args, **kw)

        return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
