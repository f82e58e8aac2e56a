"""The matmul rule's JAX primitives and their JAX-internal rules: transpose, batching, lowering."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

# A primitive needs JAX's registries of differentiation, batching and lowering rules; they
# live in jax._src (jax.extend exposes the Primitive class only). The convolution's
# transposes are JAX's own rules, called with 16-bit operands.
from jax._src.dispatch import apply_primitive as _apply_primitive
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import convolution as _lax_conv
from jax._src.lax.lax import _precision_strings as _PRECISION_STRINGS
from jax._src.lax.lax import canonicalize_precision as _canonicalize_precision

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.errors import invalid_choice
from jaxamp._src.ops.forms import (
    FORMS,
    MatmulForm,
    free_dims,
    gemm,
    permute,
    platform_form,
    sharded_in_type,
    warn_if_unsafe,
)


def rule_precision(precision: Any) -> Any:
    """The rule chooses the algorithm: a ``lax.Precision`` (or its name) passes through, a
    dot algorithm (or its name, such as ``"BF16_BF16_F32"``) gives way to the rule's own.
    Names are read as ``lax.dot_general`` reads them."""
    if precision is None:
        return None
    if isinstance(precision, (str, list, tuple)):
        try:
            # jax's PrecisionLike omits the two-name list its body accepts (as lax.dot_general)
            precision = _canonicalize_precision(precision)  # type: ignore[arg-type]
        except ValueError as e:
            strings = sorted(k for k in _PRECISION_STRINGS if isinstance(k, str))
            choices = [*strings, "a lax.Precision", "a lax.DotAlgorithmPreset name"]
            raise invalid_choice("precision", precision, choices) from e
    if isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset)):
        return None
    if isinstance(precision, tuple) and any(
        isinstance(p, (lax.DotAlgorithm, lax.DotAlgorithmPreset)) for p in precision
    ):
        return None
    return precision


# ------------------------------------------------------------------ the dot primitive
#
# Parameters: ``dimension_numbers``, ``compute_dtype``, ``out_dtype``, ``precision``,
# ``form`` (a MatmulForm, or None: the lowering platform's), ``sharding`` (the GEMM
# result's, or None) and ``permutation`` (axes the result is transposed by inside the
# primitive, or None: the backward GEMMs give their gradients in their operands' layout,
# and on XLA:CPU that transpose must be materialised, so it belongs to the form).

amp_dot_general_p = jex.core.Primitive("amp_dot_general")


def _dot_impl(
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
    precision: Any,
    form: MatmulForm | None,
    sharding: Any,
    permutation: tuple[int, ...] | None,
    platform: str | None = None,
) -> Any:
    """The primitive's program, for ``platform`` (``None``: a GPU or TPU)."""
    if form is None:
        form = platform_form(platform, compute_dtype)
    else:  # an override (use_matmul_form, JAXAMP_MATMUL_FORM), met where it is lowered
        warn_if_unsafe(form, platform, compute_dtype)
    if form.canonical_layout and (sharding is not None or sharded_in_type(lhs, rhs)):
        form = FORMS["upcast"]  # the canonical layout's reshapes would need shardings
    lhs16, rhs16 = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
    y = gemm(lhs16, rhs16, dimension_numbers, precision, form, sharding).astype(out_dtype)
    if permutation is None:
        return y
    return permute(y, permutation, FORMS["native"] if sharding is not None else form)


def _dot_abstract_eval(
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
    sharding: Any,
    permutation: tuple[int, ...] | None,
    **_: Any,
) -> Any:
    out, _ = lax.dot_general_p.abstract_eval(
        lhs.update(dtype=compute_dtype, weak_type=False),
        rhs.update(dtype=compute_dtype, weak_type=False),
        dimension_numbers=dimension_numbers,
        precision=None,
        preferred_element_type=FLOAT32,
        out_sharding=sharding,
    )
    out = out.update(dtype=out_dtype, weak_type=False)
    if permutation is not None:
        out, _ = lax.transpose_p.abstract_eval(out, permutation=permutation)
    return out


def _ranges_like(*xs: Sequence[Any]) -> Iterator[tuple[int, ...]]:
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def sharding_of_result(aval: Any, order: Sequence[int]) -> Any:
    """The sharding a transposed GEMM's result takes: its operand's, in the result's order.

    ``None`` unless the operand's type lives on a mesh with ``Explicit`` axes: a
    weight gradient's GEMM contracts the sharded batch, and only the weight's own
    sharding (replicated, say) says how its result is laid out, as in JAX's
    transpose of ``dot_general``.
    """
    sharding: Any = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or sharding.mesh.empty or not _has_explicit_axes(sharding.mesh):
        return None
    return sharding.update(spec=spec.update(partitions=tuple(spec[o] for o in order)))


def _has_explicit_axes(mesh: Any) -> bool:
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def _permutation(order: Sequence[int]) -> tuple[int, ...] | None:
    """The permutation that puts a GEMM result in ``order`` back in its operand's layout."""
    axes = tuple(int(a) for a in np.argsort(order))
    return None if axes == tuple(range(len(axes))) else axes


def _dot_transpose_lhs(
    ct: Any,
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any,
    sharding: Any,
    permutation: tuple[int, ...] | None,
    **params: Any,
) -> Any:
    """``d_lhs = dot(g, rhs)``: the activation gradient, under the rule."""
    del sharding
    if permutation is not None:  # the forward result was transposed: undo it on g
        ct = jnp.transpose(ct, [int(a) for a in np.argsort(permutation)])
    x_aval = lhs.aval
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = free_dims(x_aval.ndim, x_contract, x_batch)
    y_kept = free_dims(rhs.ndim, y_contract, y_batch)
    ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_by_y = [int(d) for d in np.take(x_contract, np.argsort(y_contract))]
    order = [*x_batch, *x_kept, *x_contract_by_y]
    return amp_dot_general_p.bind(
        ct,
        rhs,
        dimension_numbers=dims,
        sharding=sharding_of_result(x_aval, order),
        permutation=_permutation(order),
        **{**params, "out_dtype": np.dtype(x_aval.dtype)},
    )


def _dot_transpose_rhs(
    ct: Any,
    lhs: Any,
    rhs: Any,
    *,
    dimension_numbers: Any,
    sharding: Any,
    permutation: tuple[int, ...] | None,
    **params: Any,
) -> Any:
    """``d_rhs = dot(lhs, g)``: ``lhs`` first, so that a weight ``[in, out]`` gets its
    gradient in its own layout, with no transpose after the GEMM."""
    del sharding
    if permutation is not None:
        ct = jnp.transpose(ct, [int(a) for a in np.argsort(permutation)])
    y_aval = rhs.aval
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = free_dims(lhs.ndim, x_contract, x_batch)
    y_kept = free_dims(y_aval.ndim, y_contract, y_batch)
    ans_batch, ans_x, _ = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(x_kept), ans_x), (tuple(x_batch), ans_batch))
    y_contract_by_x = [int(y_contract[i]) for i in np.argsort(x_contract)]
    order = [*y_batch, *y_contract_by_x, *y_kept]
    return amp_dot_general_p.bind(
        lhs,
        ct,
        dimension_numbers=dims,
        sharding=sharding_of_result(y_aval, order),
        permutation=_permutation(order),
        **{**params, "out_dtype": np.dtype(y_aval.dtype)},
    )


def _bump(dims: Sequence[int], b: int) -> tuple[int, ...]:
    return tuple(int(d) + int(d >= b) for d in dims)


def _batch_dimension_numbers(
    ndims: tuple[int, int], batch_dims: tuple[int | None, int | None], dimension_numbers: Any
) -> tuple[Any, int]:
    """Dimension numbers with a ``vmap``-ed dimension added, as JAX's ``dot_general`` does:
    a batch dimension (first) when both operands are mapped, else a free dimension."""
    lhs_ndim, _ = ndims
    lbd, rbd = batch_dims
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if lbd is not None and rbd is not None:
        lhs_batch, rhs_batch = (lbd, *_bump(lhs_batch, lbd)), (rbd, *_bump(rhs_batch, rbd))
        lhs_contract, rhs_contract = _bump(lhs_contract, lbd), _bump(rhs_contract, rbd)
        out_dim = 0
    elif lbd is not None:
        lhs_free = free_dims(lhs_ndim - 1, lhs_contract, lhs_batch)
        out_dim = len(lhs_batch) + sum(int(d < lbd) for d in lhs_free)
        lhs_batch, lhs_contract = _bump(lhs_batch, lbd), _bump(lhs_contract, lbd)
    else:
        assert rbd is not None  # _dot_batch binds two unmapped operands itself
        rhs_free = free_dims(ndims[1] - 1, rhs_contract, rhs_batch)
        out_dim = lhs_ndim - len(lhs_contract) + sum(int(d < rbd) for d in rhs_free)
        rhs_batch, rhs_contract = _bump(rhs_batch, rbd), _bump(rhs_contract, rbd)
    return ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch)), out_dim


def _dot_batch(
    axis_data: Any,
    args: Sequence[Any],
    dims: tuple[int | None, int | None],
    *,
    dimension_numbers: Any,
    sharding: Any,
    permutation: tuple[int, ...] | None,
    **params: Any,
) -> tuple[Any, int | None]:
    lhs, rhs = args
    lbd, rbd = dims
    if lbd is None and rbd is None:
        out = amp_dot_general_p.bind(
            lhs,
            rhs,
            dimension_numbers=dimension_numbers,
            sharding=sharding,
            permutation=permutation,
            **params,
        )
        return out, None
    ndims = (np.ndim(lhs), np.ndim(rhs))
    new_dims, out_dim = _batch_dimension_numbers(ndims, (lbd, rbd), dimension_numbers)
    if sharding is not None:
        sharding = batching.get_sharding_for_vmap(axis_data, sharding, out_dim)
    if permutation is not None:  # the mapped dimension first, the others permuted after it
        permutation = (out_dim, *(p + int(p >= out_dim) for p in permutation))
        out_dim = 0
    out = amp_dot_general_p.bind(
        lhs, rhs, dimension_numbers=new_dims, sharding=sharding, permutation=permutation, **params
    )
    return out, out_dim


def _dispatch(*args: Any, **params: Any) -> Any:
    """An eager call: the primitive compiled for the backend its operands live on."""
    return _apply_primitive(amp_dot_general_p, *args, **params)


amp_dot_general_p.def_impl(_dispatch)
amp_dot_general_p.def_abstract_eval(_dot_abstract_eval)
ad.defbilinear(amp_dot_general_p, _dot_transpose_lhs, _dot_transpose_rhs)
batching.fancy_primitive_batchers[amp_dot_general_p] = _dot_batch
# Without an override the form is the lowering platform's: a program lowered for a GPU
# (jax.export from a CPU host, say) takes the native form, one for a CPU the canonical.
mlir.register_lowering(amp_dot_general_p, mlir.lower_fun(_dot_impl, multiple_results=False))
mlir.register_lowering(
    amp_dot_general_p,
    mlir.lower_fun(functools.partial(_dot_impl, platform="cpu"), multiple_results=False),
    platform="cpu",
)

# ------------------------------------------------------------------- convolutions
# The backward convolutions are JAX's own transposes of ``conv_general_dilated``, called
# with a 16-bit cotangent and a float32 ``preferred_element_type``: they cast the other
# operand to the cotangent's dtype and their result to the dtype of the operand being
# differentiated, which the rule gives as the dtype the operand came in.

amp_conv_general_dilated_p = jex.core.Primitive("amp_conv_general_dilated")


def _conv_impl(
    lhs: Any,
    rhs: Any,
    *,
    conv_params: tuple[tuple[str, Any], ...],
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
) -> Any:
    params = dict(conv_params, preferred_element_type=FLOAT32)
    lhs16, rhs16 = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
    return lax.conv_general_dilated_p.bind(lhs16, rhs16, **params).astype(out_dtype)


def _conv_abstract_eval(
    lhs: Any,
    rhs: Any,
    *,
    conv_params: tuple[tuple[str, Any], ...],
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
) -> Any:
    out, _ = lax.conv_general_dilated_p.abstract_eval(
        lhs.update(dtype=compute_dtype, weak_type=False),
        rhs.update(dtype=compute_dtype, weak_type=False),
        **dict(conv_params, preferred_element_type=FLOAT32),
    )
    return out.update(dtype=out_dtype, weak_type=False)


def _conv_transpose(
    rule: Callable[..., Any],
    ct: Any,
    lhs: Any,
    rhs: Any,
    *,
    conv_params: tuple[tuple[str, Any], ...],
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
) -> Any:
    del out_dtype
    params = dict(conv_params, preferred_element_type=FLOAT32)
    return rule(ct.astype(compute_dtype), lhs, rhs, **params)


def _conv_batch(
    axis_data: Any,
    args: Sequence[Any],
    dims: Sequence[int | None],
    *,
    conv_params: tuple[tuple[str, Any], ...],
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
) -> tuple[Any, int | None]:
    """JAX's batching of ``conv_general_dilated`` (reshapes around one convolution), with
    that convolution bound as the rule again."""
    plain_rule = batching.fancy_primitive_batchers[lax.conv_general_dilated_p]
    params = dict(conv_params, preferred_element_type=FLOAT32)
    out_dims: list[int | None] = []

    def plain(lhs: Any, rhs: Any) -> Any:
        out, out_dim = plain_rule(axis_data, (lhs, rhs), dims, **params)
        out_dims.append(out_dim)
        return out

    shapes = [jax.ShapeDtypeStruct(np.shape(x), compute_dtype) for x in args]
    closed = jax.make_jaxpr(plain)(*shapes)
    env = dict(zip(closed.jaxpr.invars, args, strict=True))
    env.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    read = lambda a: a.val if isinstance(a, jex.core.Literal) else env[a]
    for eqn in closed.jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        if eqn.primitive is lax.conv_general_dilated_p:
            batched = {k: v for k, v in eqn.params.items() if k != "preferred_element_type"}
            out = amp_conv_general_dilated_p.bind(
                *invals,
                conv_params=tuple(batched.items()),
                compute_dtype=compute_dtype,
                out_dtype=out_dtype,
            )
        else:
            out = eqn.primitive.bind(*invals, **eqn.params)
        outs = out if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs, strict=True))
    return read(closed.jaxpr.outvars[0]), out_dims[0]


amp_conv_general_dilated_p.def_impl(_conv_impl)
amp_conv_general_dilated_p.def_abstract_eval(_conv_abstract_eval)
ad.defbilinear(
    amp_conv_general_dilated_p,
    functools.partial(_conv_transpose, _lax_conv._conv_general_dilated_transpose_lhs),
    functools.partial(_conv_transpose, _lax_conv._conv_general_dilated_transpose_rhs),
)
batching.fancy_primitive_batchers[amp_conv_general_dilated_p] = _conv_batch
mlir.register_lowering(
    amp_conv_general_dilated_p, mlir.lower_fun(_conv_impl, multiple_results=False)
)
