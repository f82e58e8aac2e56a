"""The matmul rule in float8: e4m3 operands, e5m2 gradients, float32 accumulation, with current
or delayed per-tensor scaling (guides/fp8.md)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# An extended dtype whose cotangents combine by max (the scaling state under fan-in), as
# Flax's fp8_ops defines one: JAX's registry of extended dtypes lives in jax._src.
from jax._src import ad_util as _ad_util
from jax._src import core as _jax_core
from jax._src import dtypes as _jax_dtypes
from jax._src import earray as _earray
from jax._src.interpreters import ad as _ad  # JVPTracer: is a value being differentiated
from jax._src.interpreters import pxla as _pxla
from jax._src.sharding_impls import canonicalize_sharding

from jaxamp._src.dtypes import FLOAT32, is_floating
from jaxamp._src.errors import guide
from jaxamp._src.jaxprs import FP8_SCOPE, varying_axes
from jaxamp._src.ops.forms import free_dims
from jaxamp._src.ops.matmul import same_varying_axes
from jaxamp._src.ops.primitives import sharding_of_result
from jaxamp._src.policy import MAX_MARGIN, recipe_integer

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)

STATE_COLLECTION = "_overwrite_with_gradient"
"""Where the delayed-scaling state lives: Flax's ``fp8_ops.OVERWRITE_WITH_GRADIENT``, whose
gradient is the state's next value."""


# ----------------------------------------------------------------- max-combined values


class _MaxRules:
    """Rules of the ``fp8_max32`` dtype: float32 values whose cotangents add by ``max``."""

    @staticmethod
    def physical_element_aval(dtype: Any) -> Any:
        return jax.core.ShapedArray((), dtype.float_dtype)

    @staticmethod
    def convert_from(dtype: Any, other: Any) -> bool:
        return dtype.float_dtype == other

    @staticmethod
    def convert_to(other: Any, dtype: Any) -> bool:
        return dtype.float_dtype == other

    @staticmethod
    def add(dtype: Any, x: Any, y: Any) -> Any:
        x, y = (lax.convert_element_type(v, dtype.float_dtype) for v in (x, y))
        return lax.convert_element_type(lax.max(x, y), dtype)

    @staticmethod
    def zero(dtype: Any) -> Any:
        return lax.convert_element_type(np.array(-np.inf, dtype.float_dtype), dtype)

    @staticmethod
    def tangent_dtype(dtype: Any) -> Any:
        return dtype

    @staticmethod
    def full(shape: Any, fill_value: Any, dtype: Any) -> Any:
        fill = lax.convert_element_type(fill_value, dtype.float_dtype)
        return lax.convert_element_type(lax.full(shape, fill, dtype.float_dtype), dtype)

    @staticmethod
    def global_sharded_result_handler(aval: Any, out_sharding: Any, committed: bool) -> Any:
        # Values made outside jit (an eager jax.grad) are arrays of their float32 values.
        physical = _pxla.global_result_handlers[_jax_core.ShapedArray](
            _jax_core.physical_aval(aval), out_sharding, committed
        )
        return lambda buffers: _earray.EArray(aval, physical(buffers))


class _max_combined(_jax_dtypes.extended):  # a dtype kind, named as JAX's are
    pass


@dataclasses.dataclass(frozen=True)
class _MaxCombinedDType(_jax_dtypes.ExtendedDType):
    float_dtype: Any
    _rules: type = _MaxRules
    type: type = _max_combined

    @property
    def name(self) -> str:
        return "fp8_max32"

    def __repr__(self) -> str:
        return self.name


MAX32 = _MaxCombinedDType(FLOAT32)

# Outside jit, JAX adds two cotangents through a table keyed by the array's type, which
# has no entry for an extended dtype's arrays (EArray): add them under jit, by the rules.
_ad_util.raw_jaxval_adders.setdefault(
    _earray.EArray, lambda x, y: jax.jit(_MaxRules.add, static_argnums=0)(x.dtype, x, y)
)


def _unused_kept(old: list[jax.Array], new: list[jax.Array], paths: list[tuple]) -> list:
    """The next state, with the old values kept where no float8 GEMM's backward pass wrote
    one: a layer left out of the loss (an auxiliary output, ``stop_gradient``) gets a zero
    or ``-inf`` gradient, and a scale of 0 would zero the layer's outputs from then on.
    A used operand's next scale is always positive; its history goes with it."""
    new = [jnp.where(n == -jnp.inf, o, n) for o, n in zip(old, new, strict=True)]
    index = {path: i for i, path in enumerate(paths)}
    for path, i in index.items():
        name = path[-1] if path else ""
        if not name.endswith("_scale"):
            continue
        unused = jnp.all(new[i] <= 0)
        history = index.get((*path[:-1], name[: -len("scale")] + "amax_history"))
        for j in (i, history):
            if j is not None:
                new[j] = jnp.where(unused, old[j], new[j])
    return new


def path_names(path: tuple) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def max_combined(tree: Any) -> Any:
    """Delayed-scaling state as values whose gradients combine by ``max`` instead of sum
    where a value is used more than once (a layer called twice, a loop body).

    The policies convert the state they are given; convert it yourself before a loop
    that calls the model several times in one differentiated step (micro-batches
    accumulated in a ``lax.scan``), so that the loop's uses combine by max too. The
    gradient of a state that reaches the loss but that no float8 GEMM used is the state
    itself; a state the differentiated function never reads gets JAX's zero gradient,
    which the next step treats as a fresh state (scales of 1).

    Examples:
      >>> meta = max_combined(init_meta(4))
      >>> meta.input_scale.dtype
      fp8_max32
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [path_names(p) for p, _ in flat]
    for path, (_, x) in zip(paths, flat, strict=True):
        if hasattr(x, "dtype"):
            _check_state_dtype(x.dtype, f"the float8 state at {'/'.join(path) or 'the root'}")
    done = [getattr(x, "dtype", None) == MAX32 for _, x in flat]
    values = [x if d else jnp.asarray(x, FLOAT32) for (_, x), d in zip(flat, done, strict=True)]
    todo = [v for v, d in zip(values, done, strict=True) if not d]
    todo_paths = [p for p, d in zip(paths, done, strict=True) if not d]

    # A custom_vjp of arrays, not of a list: see _as_custom_vjp.
    @jax.custom_vjp
    def convert(*xs: Any) -> tuple[Any, ...]:
        return tuple(lax.convert_element_type(x, MAX32) for x in xs)

    def fwd(*xs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return convert(*xs), xs

    def bwd(xs: tuple[Any, ...], cts: Any) -> tuple[Any, ...]:
        cts = [lax.convert_element_type(c, FLOAT32) for c in cts]
        return tuple(_unused_kept(list(xs), cts, todo_paths))

    convert.defvjp(fwd, bwd)
    converted = iter(convert(*todo) if todo else [])
    out = [v if d else next(converted) for v, d in zip(values, done, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def as_float32(x: Any) -> Any:
    """A max-combined value back in float32 (other values as they are)."""
    return lax.convert_element_type(x, FLOAT32) if x.dtype == MAX32 else x


def _like(value: Any, like: Any) -> Any:
    return lax.convert_element_type(value, MAX32) if like.dtype == MAX32 else value


def state_paths(tree: Any) -> list[str]:
    """Paths of ``tree`` that hold delayed-scaling state: under the ``_overwrite_with_gradient``
    collection (Linen), or a layer's full set of ``Fp8Meta`` fields (NNX)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = [path_names(path) for path, _ in flat]
    # An NNX State's leaves sit under their Variable's value: input_scale/value.
    keys = [k[:-1] if len(k) > 1 and k[-1] in ("value", "raw_value") else k for k in keys]
    by_parent: dict[tuple[str, ...], set[str]] = {}
    for key in keys:
        if key:
            by_parent.setdefault(key[:-1], set()).add(key[-1])
    found = []
    for key in keys:
        in_collection = STATE_COLLECTION in key
        in_layer = bool(key) and set(Fp8Meta._fields) <= by_parent.get(key[:-1], set())
        if in_collection or (in_layer and key[-1] in Fp8Meta._fields):
            found.append("/".join(key))
    return found


# --------------------------------------------------------- a state left undifferentiated

_DIFFERENTIATING = tuple(
    t for t in (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)) if t
)


def _differentiated(x: Any) -> bool:
    return isinstance(x, _DIFFERENTIATING)


def warn_if_state_is_not_differentiated(params: Any, state: Any) -> None:
    """Warns where params are being differentiated and the delayed-scaling state is not:
    its next value is its gradient, so it would never move from its first scale of 1
    (values above 448 clipped, small ones flushed to zero, every step)."""
    leaves = jax.tree.leaves(state)
    if not leaves or any(map(_differentiated, leaves)):
        return
    if any(map(_differentiated, jax.tree.leaves(params))):
        warnings.warn(
            "Delayed float8 scaling: the params are being differentiated but the scaling "
            "state is not, so it will never update (its gradient is its next value). "
            "Differentiate it too and keep its gradient: Linen, jax.grad(loss, argnums=(0, 1))"
            "(params, variables['_overwrite_with_gradient']); NNX, nnx.grad(loss, argnums="
            "nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))) and "
            "jaxamp.nnx.update_fp8_state; autocast, jax.grad(lambda p, s: f(p, x, "
            f"fp8_state=s), argnums=(0, 1)) ({guide('fp8.md')}).",
            stacklevel=4,
        )


# ------------------------------------------------------------------------ quantization


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


def _dequantize_product(y: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``y * (a * b)`` as Flax's ``fp8_ops`` computes it, or ``(y * a) * b`` where the
    product of the two scales would underflow or overflow float32 (operands near 1e-20 or
    1e20) although the result does not."""
    a, b = (jnp.reshape(s, ()).astype(FLOAT32) for s in (a, b))
    both = a * b
    normal = jnp.isfinite(both) & (jnp.abs(both) >= jnp.finfo(FLOAT32).tiny)
    return jnp.where(normal, y * both, (y * a) * b)


def _amax(x: jax.Array, state: Any = None) -> jax.Array:
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


def _poison(*amaxes: jax.Array) -> jax.Array:
    """1, or NaN where an operand holds inf or NaN: float8 has no infinity, and clipping an
    overflow to 448 would hide it from loss scaling's check of the gradients."""
    finite = functools.reduce(jnp.logical_and, [jnp.isfinite(a) for a in amaxes])
    return jnp.where(finite, jnp.float32(1), jnp.float32(jnp.nan))


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
    amax_l, amax_r = _amax(lhs), _amax(rhs)
    s_l, s_r = (scale_from_amax(a, E4M3, margin) for a in (amax_l, amax_r))
    q_l, q_r = quantize(lhs, E4M3, s_l), quantize(rhs, E4M3, s_r)
    y = _dequantize_product(_gemm(q_l, q_r, dimension_numbers, sharding), s_l, s_r)
    y = y * _poison(amax_l, amax_r)
    # An operand's inf or NaN reaches the other operand's gradient through its saved scale.
    s_l, s_r = s_l * _poison(amax_l), s_r * _poison(amax_r)
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
    amax_g = _amax(g)
    s_g = scale_from_amax(amax_g, E5M2, margin)
    q_g = quantize(g, E5M2, s_g)
    s_g = s_g * _poison(amax_g)
    d_l = _dequantize_product(_transpose_lhs(q_g, q_r, q_l, dimension_numbers), s_r, s_g)
    d_r = _dequantize_product(_transpose_rhs(q_g, q_l, q_r, dimension_numbers), s_l, s_g)
    return d_l.astype(lhs_like.dtype), d_r.astype(rhs_like.dtype)


class Fp8Meta(NamedTuple):
    """The delayed-scaling state of one float8 GEMM, named as Flax's ``Fp8DotGeneralBase``
    names its variables: a scale (``amax / max``) and an amax history per operand."""

    input_amax_history: jax.Array
    kernel_amax_history: jax.Array
    output_grad_amax_history: jax.Array
    input_scale: jax.Array
    kernel_scale: jax.Array
    output_grad_scale: jax.Array


def init_meta(amax_history_length: int = 1024) -> Fp8Meta:
    """A fresh state: amax histories of zeros and scales of one, as Flax initialises them.

    Examples:
      >>> meta = init_meta(4)
      >>> meta.input_amax_history.shape, meta.input_scale.shape
      ((4,), (1,))
    """
    n = recipe_integer("amax_history_length", amax_history_length, 1)
    history = jnp.zeros((n,), FLOAT32)
    scale = jnp.ones((1,), FLOAT32)
    return Fp8Meta(history, history, history, scale, scale, scale)


def as_meta(meta: Any) -> Fp8Meta:
    """An ``Fp8Meta`` from one, a mapping of its six names (as Orbax restores it without a
    target) or a sequence of its six values."""
    if isinstance(meta, Mapping):
        missing = sorted(set(Fp8Meta._fields) - set(meta))
        if missing:
            raise ValueError(f"a float8 state without {missing}; it holds {sorted(meta)}.")
        return Fp8Meta(**{name: meta[name] for name in Fp8Meta._fields})
    return Fp8Meta(*meta)


def _check_state_dtype(dtype: Any, what: str) -> None:
    """Refuses a floating state value that is neither float32 nor float64."""
    if dtype == MAX32 or not is_floating(dtype):
        return
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(
            f"{what} is {np.dtype(dtype).name}; the state is float32 (its scales and amaxes "
            "rounded to 16 bits would scale wrongly, and its next value would stay "
            "rounded). Keep it float32 when casting or saving the model's variables."
        )


def checked_meta(meta: Fp8Meta, history_length: int | None, where: str) -> Fp8Meta:
    """``meta``, refused by name where it is not one GEMM's state: amax histories of one
    length (``history_length``, the policy's ``fp8_history``, where given) and scales of one
    element, all float32 (float64 under ``jax_enable_x64``). A state made under another
    ``fp8_history``, a stack's state given to one layer, or one cast to 16 bits (its
    scales rounded, its next state kept in 16 bits) would otherwise run as it is."""
    histories = Fp8Meta._fields[:3]
    for name, value in zip(Fp8Meta._fields, meta, strict=True):
        array: Any = value if hasattr(value, "dtype") else np.asarray(value)  # or a number
        shape, dtype = np.shape(array), array.dtype
        is_history = name in histories
        if (len(shape) != 1) if is_history else (int(np.prod(shape)) != 1):
            want = "(history length,)" if is_history else "(1,)"
            raise ValueError(
                f"{where}: its float8 state's {name} has shape {shape}, and one GEMM's state "
                f"holds {want}. A stack's state ((layers, ...), from nn.scan, nn.vmap or "
                "nnx.vmap) belongs to the stack, and each layer of it gets its own slice."
            )
        _check_state_dtype(dtype, f"{where}: its float8 state's {name}")
    lengths = sorted({np.shape(getattr(meta, name))[0] for name in histories})
    if len(lengths) > 1:
        raise ValueError(
            f"{where}: its float8 state has amax histories of different lengths {lengths}: "
            "not one GEMM's state. Make a fresh one under the policy."
        )
    if history_length is not None and lengths != [history_length]:
        raise ValueError(
            f"{where}: its float8 state has amax histories of length {lengths[0]}, and the "
            f"policy's fp8_history is {history_length}. A state made under another "
            "fp8_history (restored from a checkpoint, say) needs that policy "
            f"(fp8_history={lengths[0]}), or a fresh state made under this one."
        )
    return meta


def _next(
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


def _delayed(
    lhs: Any,
    rhs: Any,
    meta: Fp8Meta,
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
) -> Any:
    static = (dimension_numbers, out_dtype, margin, sharding)
    return _as_custom_vjp(_delayed_fwd, _delayed_bwd, (lhs, rhs, meta), static)


def _delayed_fwd(
    lhs: Any,
    rhs: Any,
    meta: Fp8Meta,
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
) -> tuple[jax.Array, tuple[Any, ...]]:
    lhs, rhs = _first_order(lhs), _first_order(rhs)
    amax_l, amax_r = _amax(lhs, meta.input_scale), _amax(rhs, meta.kernel_scale)
    s_l, h_l = _next(amax_l, meta.input_scale, meta.input_amax_history, E4M3, margin)
    s_r, h_r = _next(amax_r, meta.kernel_scale, meta.kernel_amax_history, E4M3, margin)
    q_l, q_r = quantize(lhs, E4M3, s_l), quantize(rhs, E4M3, s_r)
    y = _dequantize_product(_gemm(q_l, q_r, dimension_numbers, sharding), s_l, s_r)
    y = y * _poison(amax_l, amax_r)
    like = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    used = (s_l * _poison(amax_l), s_r * _poison(amax_r))  # as in _current_fwd
    res = (_saved(q_l), s_l, h_l, _saved(q_r), s_r, h_r, meta, like, used)
    return y.astype(out_dtype), res


def _delayed_bwd(
    dimension_numbers: Any,
    out_dtype: np.dtype,
    margin: int,
    sharding: Any,
    res: tuple[Any, ...],
    g: jax.Array,
) -> tuple[jax.Array, jax.Array, Fp8Meta]:
    q_l, s_l, h_l, q_r, s_r, h_r, meta, (lhs_like, rhs_like), (s_l_used, s_r_used) = res
    q_l, q_r = _restored(q_l), _restored(q_r)
    g = _first_order(g)
    amax_g = _amax(g, meta.output_grad_scale)
    s_g, h_g = _next(amax_g, meta.output_grad_scale, meta.output_grad_amax_history, E5M2, margin)
    q_g = quantize(g, E5M2, s_g)
    s_g_used = s_g * _poison(amax_g)
    d_l = _dequantize_product(_transpose_lhs(q_g, q_r, q_l, dimension_numbers), s_r_used, s_g_used)
    d_r = _dequantize_product(_transpose_rhs(q_g, q_l, q_r, dimension_numbers), s_l_used, s_g_used)
    new = Fp8Meta(h_l, h_r, h_g, s_l, s_r, s_g)
    new = Fp8Meta(*(_like(v, old) for v, old in zip(new, meta, strict=True)))
    return d_l.astype(lhs_like.dtype), d_r.astype(rhs_like.dtype), new


def _out_dtype(lhs: Any, rhs: Any, preferred_element_type: Any) -> np.dtype:
    if preferred_element_type is not None:
        return np.dtype(preferred_element_type)
    return np.dtype(jnp.promote_types(lhs.dtype, rhs.dtype))


def fp8_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    meta: Fp8Meta | None = None,
    margin: int = 0,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` in float8: e4m3 operands, an e5m2 output gradient, float32 sums.

    Without ``meta`` each operand is scaled by its own amax (current scaling); with it, by
    the amax history in ``meta`` (delayed scaling), and the gradient with respect to
    ``meta`` is its next value. An operand holding inf or NaN gives a NaN result.

    Args:
      lhs: left operand (any floating dtype).
      rhs: right operand.
      dimension_numbers: as for ``lax.dot_general``.
      precision: ignored (the GEMM's precision is its float8 operands').
      preferred_element_type: the result dtype; ``None`` promotes the operands' dtypes.
      meta: delayed-scaling state (``init_meta``, or a mapping of its six names), or
        ``None`` for current scaling.
      margin: powers of two of headroom below the float8 maximum, an integer >= 0
        (as ``Fp8Recipe.margin``).
      out_sharding: the result's sharding, as for ``lax.dot_general``.

    Returns:
      The product, dequantized.

    Raises:
      ValueError: for a ``margin`` that is not an integer >= 0.

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
    sharding = canonicalize_sharding(out_sharding, "fp8_dot_general")
    lhs, rhs = same_varying_axes(lhs, rhs)  # inside shard_map: a weight's gradient summed
    with jax.named_scope(FP8_SCOPE):  # autocast evaluates it as traced
        if meta is None:
            return _current(lhs, rhs, dims, out, margin, sharding)
        meta = checked_meta(as_meta(meta), None, "fp8_dot_general's meta")
        return _delayed(lhs, rhs, meta, dims, out, margin, sharding)


@dataclasses.dataclass(frozen=True)
class Fp8DotGeneral:
    """``fp8_dot_general`` as a ``dot_general`` for Flax layers (and an ``einsum``).

    Attributes:
      compute_dtype: the dtype results come back in (the policy's compute dtype).
      margin: the recipe's powers of two of headroom.
      meta: the layer's delayed-scaling state, or ``None`` for current scaling.
    """

    compute_dtype: Any
    margin: int = 0
    meta: Fp8Meta | None = None

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
        return fp8_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type or self.compute_dtype,
            meta=self.meta,
            margin=self.margin,
            out_sharding=out_sharding,
        )

    def einsum(self, subscripts: str, *operands: Any, **kwargs: Any) -> jax.Array:
        """``jnp.einsum`` whose contractions run in float8."""
        if kwargs.get("preferred_element_type") is None:
            kwargs["preferred_element_type"] = self.compute_dtype
        dot_general: Any = self
        if self.meta is not None:
            # jnp.einsum hashes its _dot_general (a static argument): the state's arrays go
            # in a closure, a new one per call, never reused from jnp.einsum's cache.
            def dot_general(*args: Any, **kw: Any) -> jax.Array:
                return self(*args, **kw)

        return jnp.einsum(subscripts, *operands, _dot_general=dot_general, **kwargs)
