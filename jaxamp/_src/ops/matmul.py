"""The 16-bit matmul rule: ``amp_dot_general``, ``amp_conv_general_dilated``, Flax hooks."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.sharding_impls import canonicalize_sharding

from jaxamp._src.dtypes import FLOAT32, is_16bit
from jaxamp._src.jaxprs import varying_axes
from jaxamp._src.ops.forms import MatmulForm, get_form, override
from jaxamp._src.ops.primitives import (
    amp_conv_general_dilated_p,
    amp_dot_general_p,
    rule_precision,
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
        precision=rule_precision(precision),
        form=chosen,
        sharding=sharding,
        permutation=None,
    )


# ------------------------------------------------------------------- convolutions


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
        (k, rule_precision(v) if k == "precision" else v)
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
    kwargs["precision"] = rule_precision(kwargs.get("precision"))
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
