"""The 16-bit matmul rule: one definition of the forward and both backward GEMMs, as JAX
primitives (``amp_dot_general``, ``amp_conv_general_dilated``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

# --- JAX internals, in one place ------------------------------------------------------------
# A primitive needs JAX's registries of differentiation, batching and lowering rules; they
# live in jax._src (jax.extend exposes the Primitive class only). The convolution's
# transposes are JAX's own rules, called with 16-bit operands.
from jax._src.dispatch import apply_primitive as _apply_primitive
from jax._src.interpreters import ad, batching, mlir
from jax._src.lax import convolution as _lax_conv
from jax._src.lax.lax import _precision_strings as _PRECISION_STRINGS
from jax._src.lax.lax import canonicalize_precision as _canonicalize_precision
from jax._src.sharding_impls import canonicalize_sharding

from jaxamp._src.dtypes import FLOAT32, is_16bit
from jaxamp._src.errors import invalid_choice
from jaxamp._src.jaxprs import varying_axes
from jaxamp._src.ops.forms import (
    FORMS,
    MatmulForm,
    free_dims,
    gemm,
    get_form,
    override,
    permute,
    platform_form,
    sharded_in_type,
    warn_if_unsafe,
)


def _rule_precision(precision: Any) -> Any:
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


def _normalize_dimension_numbers(dimension_numbers: Any) -> Any:
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(
        tuple(tuple(int(d) for d in dims) for dims in pair) for pair in ((lc, rc), (lb, rb))
    )


def same_varying_axes(*operands: Any) -> tuple[Any, ...]:
    """Inside ``shard_map``, marks each operand varying over the axes any of them varies over.

    A replicated weight times a sharded batch has a sharded cotangent. Marked
    varying before the rule, the weight's cotangent is summed over the mesh axes
    by the marking's own transpose, as JAX does for its built-in dot.
    """
    vmas = [varying_axes(jax.typeof(x)) or frozenset() for x in operands]
    union = frozenset().union(*vmas)
    if all(v == union for v in vmas):
        return operands
    return tuple(
        x if v == union else lax.pcast(x, tuple(sorted(union - v)), to="varying")
        for x, v in zip(operands, vmas, strict=True)
    )


def amp_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    compute_dtype: Any,
    form: str | MatmulForm | None = None,
    out_sharding: Any = None,
) -> jax.Array:
    """``lax.dot_general`` under the 16-bit matmul rule (guides/matmul-rule.md).

    Floating operands are cast to ``compute_dtype`` inside the rule and
    multiplied with float32 products and sums; the result comes back in
    ``preferred_element_type`` if that is a floating dtype, else in
    ``compute_dtype``. Gradients come back in the dtypes the operands came in.
    Non-floating operands, a non-floating ``preferred_element_type`` or a float32
    ``compute_dtype`` leave the call to ``lax.dot_general``.

    Args:
      lhs: left operand.
      rhs: right operand (a float32 weight stays float32 outside the rule).
      dimension_numbers: as for ``lax.dot_general``.
      precision: a ``lax.Precision`` (or its name) passed to the GEMMs; dot
        algorithms are replaced by the rule's own.
      preferred_element_type: the result dtype, or ``None`` for ``compute_dtype``.
      compute_dtype: the 16-bit dtype of the GEMM operands.
      form: a ``jaxamp.ops.MatmulForm`` or its name; ``None`` takes an override
        (``jaxamp.ops.use_matmul_form``) if one is set, else the form of the
        platform the program is lowered for (``jaxamp.ops.matmul_form``).
      out_sharding: the result's sharding, as for ``lax.dot_general``.

    Returns:
      The product.

    Raises:
      ValueError: for an unknown ``form`` or ``precision`` name.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4))
      >>> dn = (((1,), (0,)), ((), ()))
      >>> f = lambda w: amp_dot_general(x, w, dn, compute_dtype=jnp.bfloat16)
      >>> dw = jax.grad(lambda w: f(w).astype(jnp.float32).sum())(w)
      >>> f(w).dtype, dw.dtype
      (dtype(bfloat16), dtype('float32'))
      >>> jax.jvp(f, (w,), (w,))[1].dtype  # forward mode too
      dtype(bfloat16)
    """
    compute = np.dtype(compute_dtype)
    floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in (lhs, rhs))
    preferred_floating = preferred_element_type is None or jnp.issubdtype(
        preferred_element_type, jnp.floating
    )
    if not (is_16bit(compute) and floating and preferred_floating):
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            out_sharding=out_sharding,
        )
    out = compute if preferred_element_type is None else np.dtype(preferred_element_type)
    chosen = override() if form is None else get_form(form)
    sharding = canonicalize_sharding(out_sharding, "amp_dot_general")
    lhs, rhs = same_varying_axes(lhs, rhs)
    return amp_dot_general_p.bind(
        lhs,
        rhs,
        dimension_numbers=_normalize_dimension_numbers(dimension_numbers),
        compute_dtype=compute,
        out_dtype=out,
        precision=_rule_precision(precision),
        form=chosen,
        sharding=sharding,
        permutation=None,
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


def _conv_params(lhs: Any, rhs: Any, kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The parameters ``lax.conv_general_dilated`` binds, in the primitive's own form."""
    conv = functools.partial(lax.conv_general_dilated, **kwargs, preferred_element_type=FLOAT32)
    shapes = [jax.ShapeDtypeStruct(np.shape(x), lhs.dtype) for x in (lhs, rhs)]
    (eqn,) = [
        e
        for e in jax.make_jaxpr(conv)(*shapes).jaxpr.eqns
        if e.primitive is lax.conv_general_dilated_p
    ]
    return tuple((k, v) for k, v in eqn.params.items() if k != "preferred_element_type")


def _bind_conv(
    lhs: Any,
    rhs: Any,
    conv_params: tuple[tuple[str, Any], ...],
    compute: np.dtype,
    out: np.dtype,
) -> jax.Array:
    conv_params = tuple(
        (k, _rule_precision(v) if k == "precision" else v)
        for k, v in conv_params
        if k != "preferred_element_type"
    )
    lhs, rhs = same_varying_axes(lhs, rhs)
    return amp_conv_general_dilated_p.bind(
        lhs, rhs, conv_params=conv_params, compute_dtype=compute, out_dtype=out
    )


_CONV_ARGS = (
    "window_strides",
    "padding",
    "lhs_dilation",
    "rhs_dilation",
    "dimension_numbers",
    "feature_group_count",
    "batch_group_count",
    "precision",
)


def amp_conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, *args: Any, compute_dtype: Any, **kwargs: Any
) -> jax.Array:
    """``lax.conv_general_dilated`` under the 16-bit matmul rule.

    The convolution and its two backward convolutions take ``compute_dtype``
    operands and accumulate in float32; the result comes back in
    ``compute_dtype`` (or a floating ``preferred_element_type``), gradients in
    the dtypes the operands came in (a float32 kernel or input gets a float32
    gradient). Other operands, or a float32 ``compute_dtype``, leave the call
    to ``lax.conv_general_dilated``.

    Args:
      lhs: the input.
      rhs: the kernel.
      *args: ``window_strides``, ``padding`` and the rest, as for
        ``lax.conv_general_dilated``.
      compute_dtype: the 16-bit dtype of the operands.
      **kwargs: as for ``lax.conv_general_dilated``.

    Returns:
      The convolution.

    Examples:
      >>> import jax.numpy as jnp
      >>> x, k = jnp.ones((1, 4, 4, 2), jnp.bfloat16), jnp.ones((3, 3, 2, 5))
      >>> y = amp_conv_general_dilated(x, k, (1, 1), "SAME",
      ...     dimension_numbers=("NHWC", "HWIO", "NHWC"), compute_dtype=jnp.bfloat16)
      >>> y.dtype, y.shape
      (dtype(bfloat16), (1, 4, 4, 5))
    """
    compute = np.dtype(compute_dtype)
    floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in (lhs, rhs))
    if not (is_16bit(compute) and floating):
        return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)
    kwargs.update(zip(_CONV_ARGS, args, strict=False))
    preferred = kwargs.pop("preferred_element_type", None)
    out = compute
    if preferred is not None and jnp.issubdtype(preferred, jnp.floating):
        out = np.dtype(preferred)
    kwargs["precision"] = _rule_precision(kwargs.get("precision"))
    return _bind_conv(lhs, rhs, _conv_params(lhs.astype(compute), rhs, kwargs), compute, out)


def amp_conv_from_params(
    lhs: Any, rhs: Any, params: dict[str, Any], compute_dtype: Any
) -> jax.Array:
    """The rule on a traced ``conv_general_dilated``'s parameters (for ``autocast``)."""
    compute = np.dtype(compute_dtype)
    return _bind_conv(lhs, rhs, tuple(params.items()), compute, compute)


# ------------------------------------------------------- the rule as Flax layer hooks


@dataclasses.dataclass(frozen=True)
class DotGeneral:
    """``amp_dot_general`` as a ``dot_general`` for Flax layers (and an ``einsum``).

    Attributes:
      compute_dtype: the 16-bit dtype of the GEMM operands.
      form: a ``jaxamp.ops.MatmulForm``, or ``None`` for ``jaxamp.ops.matmul_form``'s
        choice where the GEMM is traced.

    Examples:
      >>> import jax.numpy as jnp
      >>> rule = DotGeneral(jnp.bfloat16)
      >>> rule.einsum("ij,jk->ik", jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
      dtype(bfloat16)
    """

    compute_dtype: Any
    form: MatmulForm | None = None

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
                f"jaxamp's matmul rule got unexpected arguments {sorted(kwargs)}; it takes "
                "those of lax.dot_general."
            )
        return amp_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            compute_dtype=self.compute_dtype,
            form=self.form,
            out_sharding=out_sharding,
        )

    def einsum(self, subscripts: str, *operands: Any, **kwargs: Any) -> jax.Array:
        """``jnp.einsum`` whose contractions run under the rule, in the compute dtype.

        ``jnp.einsum`` caches its traces by its ``_dot_general`` argument, so the rule is
        passed with the form ``jaxamp.ops.use_matmul_form`` sets, if any: an einsum
        traced under another form is traced again, not taken from the cache.
        """
        if kwargs.get("preferred_element_type") is None:
            kwargs["preferred_element_type"] = self.compute_dtype
        rule = self if self.form is not None else dataclasses.replace(self, form=override())
        return jnp.einsum(subscripts, *operands, _dot_general=rule, **kwargs)


@dataclasses.dataclass(frozen=True)
class ConvGeneralDilated:
    """``amp_conv_general_dilated`` as a ``conv_general_dilated`` for Flax layers."""

    compute_dtype: Any

    def __call__(self, lhs: Any, rhs: Any, *args: Any, **kwargs: Any) -> jax.Array:
        return amp_conv_general_dilated(lhs, rhs, *args, compute_dtype=self.compute_dtype, **kwargs)
