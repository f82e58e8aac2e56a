"""The 16-bit matmul rule: one definition of the forward and both backward GEMMs.

Every matmul jaxamp runs in a 16-bit compute dtype goes through
:func:`amp_dot_general` (convolutions through :func:`amp_conv_general_dilated`):
``apply_policy`` installs it as the ``dot_general`` of Flax's layers, the
attention matmuls use it, and ``autocast`` rewrites ``dot_general`` to it. It is
a ``jax.custom_vjp`` whose three GEMMs have one shape:

* forward: ``y = dot(lhs16, rhs16, preferred_element_type=float32)``, then
  ``y`` is cast to the compute dtype (activations stay 16-bit);
* backward, activations: ``dx = dot(g16, rhs16, preferred_element_type=float32)``,
  cast to the dtype ``lhs`` came in (the compute dtype for activations);
* backward, weights: ``dw = dot(lhs16, g16, preferred_element_type=float32)``,
  cast to the dtype ``rhs`` came in: a float32 weight gets a float32 gradient
  straight from its GEMM, never rounded to 16 bits on the way.

The float32-to-16-bit cast of a weight happens inside the rule, on both passes,
so the backward pass saves the float32 weight it already holds and no 16-bit
copy. Letting ``jax.grad`` transpose a ``preferred_element_type=float32`` dot
instead gives float32 x 16-bit dots in the backward pass (the cotangent is
float32), which no backend runs as a 16-bit GEMM.

The one thing that differs by backend is the operand layout. The form is chosen
when tracing, from the default backend and, on CPU, from ``/proc/cpuinfo``:

==========================  ===========================================================
backend                     form
==========================  ===========================================================
CPU with ``avx512_bf16``    16-bit operands, float32 accumulation; operands laid out
or ``amx_bf16`` (float16:   ``[batch, free, contracting]`` (a 2-D right operand may be
``avx512_fp16``,            ``[contracting, free]``), transposes materialised where the
``amx_fp16``)               layout differs, because XLA:CPU runs only those layouts on
                            its bf16 kernels (a weight-gradient dot, contracting dim 0
                            of both operands, otherwise runs in float32)
other CPUs                  16-bit operands, float32 accumulation, XLA's layouts
                            (XLA:CPU computes them in float32)
GPU                         16-bit operands, float32 accumulation, XLA's layouts
                            (cuBLAS/cuDNN 16-bit GEMMs with float32 accumulation)
TPU                         16-bit operands, float32 accumulation, XLA's layouts
==========================  ===========================================================

``benchmarks/matmul_forms.py`` measures the forms on the machine it runs on.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxamp._src.environment import cpu_info

_F32 = np.dtype(np.float32)
# The /proc/cpuinfo flags of CPUs with 16-bit GEMM units, per dtype. float16 was not
# measured here (no such CPU at hand); on CPUs without them float16 gains nothing.
_CPU_16BIT_UNITS = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}


@dataclasses.dataclass(frozen=True)
class MatmulForm:
    """How the 16-bit GEMMs are laid out for one backend.

    Attributes:
      name: the row of the table in this module's docstring.
      canonical_layout: materialise operand transposes so that each GEMM sees
        ``[batch, free, contracting]`` operands.
    """

    name: str
    canonical_layout: bool = False


FORMS = {
    "cpu-bf16-units": MatmulForm("cpu-bf16-units", canonical_layout=True),
    "cpu": MatmulForm("cpu"),
    "gpu": MatmulForm("gpu"),
    "tpu": MatmulForm("tpu"),
}


@functools.cache
def _cpu_has_16bit_units(dtype_name: str = "bfloat16") -> bool:
    flags = _CPU_16BIT_UNITS.get(dtype_name, ())
    return any(flag in cpu_info()[1] for flag in flags)


def matmul_form(platform: str | None = None, dtype: Any = jnp.bfloat16) -> MatmulForm:
    """The form of the 16-bit GEMMs in ``dtype`` on ``platform`` (default: the default backend).

    Example:
      >>> matmul_form("gpu").name
      'gpu'
    """
    platform = jax.default_backend() if platform is None else platform
    if platform == "cpu":
        units = _cpu_has_16bit_units(np.dtype(dtype).name)
        return FORMS["cpu-bf16-units" if units else "cpu"]
    if platform in ("gpu", "cuda", "rocm"):
        return FORMS["gpu"]
    return FORMS.get(platform, FORMS["tpu"])


# --------------------------------------------------------------------------- layouts


def _materialize(x: jax.Array, perm: Sequence[int]) -> jax.Array:
    """``jnp.transpose(x, perm)`` that XLA cannot fold back into the consumer's layout.

    XLA folds a transpose into the dimension numbers of the dot that reads it;
    flattening the transposed value behind an optimisation barrier makes it a
    row-major array of its own.
    """
    if list(perm) == list(range(x.ndim)):
        return x
    y = jnp.transpose(x, perm)
    return lax.optimization_barrier(y.reshape(-1)).reshape(y.shape)


def _free(ndim: int, *used: Sequence[int]) -> list[int]:
    taken = {int(d) for dims in used for d in dims}
    return [d for d in range(ndim) if d not in taken]


def _canonical_dot(lhs, rhs, dimension_numbers, precision, preferred):
    """``dot_general`` on operands laid out ``[batch, free, contracting]``, as matrices.

    Free and contracting dims are each collapsed into one, so XLA:CPU sees a
    (batched) matrix product: it has no 16-bit kernel for a dot with several
    contracting dims and fails on one ("Unsupported element type for DotThunk").
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lfree, rfree = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    batch_shape = tuple(lhs.shape[d] for d in lb)
    lfree_shape = tuple(lhs.shape[d] for d in lfree)
    rfree_shape = tuple(rhs.shape[d] for d in rfree)
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    m = int(np.prod(lfree_shape, dtype=np.int64))
    n = int(np.prod(rfree_shape, dtype=np.int64))
    nb = len(lb)
    a = _materialize(lhs, [*lb, *lfree, *lc]).reshape(*batch_shape, m, k)
    if not rb and list(rc) + rfree == list(range(rhs.ndim)):
        b = rhs.reshape(k, n)  # [contracting, free]: as fast as [free, contracting]
        b_contract = 0
    else:
        b = _materialize(rhs, [*rb, *rfree, *rc]).reshape(*batch_shape, n, k)
        b_contract = nb + 1
    batch = tuple(range(nb))
    dn = (((nb + 1,), (b_contract,)), (batch, batch))
    out = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=preferred)
    # Behind a barrier too: XLA:CPU would fold a transpose of the result (``vmap`` adds
    # them) into a new dot after choosing the 16-bit kernels, and that dot fails to run.
    out = lax.optimization_barrier(out.reshape(-1))
    return out.reshape(*batch_shape, *lfree_shape, *rfree_shape)


def _dot(lhs, rhs, dimension_numbers, spec: _Spec):
    """The one GEMM shape: 16-bit operands, float32 result."""
    if spec.form.canonical_layout:
        return _canonical_dot(lhs, rhs, dimension_numbers, spec.precision, _F32)
    return lax.dot_general(
        lhs, rhs, dimension_numbers, precision=spec.precision, preferred_element_type=_F32
    )


# ------------------------------------------------------------ the dot_general rule


@dataclasses.dataclass(frozen=True)
class _Spec:
    compute_dtype: np.dtype
    out_dtype: np.dtype
    precision: Any
    form: MatmulForm


def _ranges_like(*xs):
    start = 0
    for x in xs:
        yield tuple(range(start, start + len(x)))
        start += len(x)


def _transpose_lhs(g, y, x_ndim, dimension_numbers, spec):
    """The cotangent of ``x`` in ``dot_general(x, y)``: ``dot(g, y)``, as in JAX's rule."""
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _free(x_ndim, x_contract, x_batch)
    y_kept = _free(y.ndim, y_contract, y_batch)
    ans_batch, _, ans_y = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    x_contract_by_y = list(np.take(x_contract, np.argsort(y_contract)))
    out_axes = np.argsort(list(x_batch) + x_kept + x_contract_by_y)
    return _permute(_dot(g, y, dims, spec), out_axes, spec)


def _transpose_rhs(g, x, y_ndim, dimension_numbers, spec):
    """The cotangent of ``y`` in ``dot_general(x, y)``: ``dot(x, g)``.

    ``x`` comes first so that a weight ``[in, out]`` gets its gradient in its own
    layout, with no transpose after the GEMM for XLA to fold into its operands.
    """
    (x_contract, y_contract), (x_batch, y_batch) = dimension_numbers
    x_kept = _free(x.ndim, x_contract, x_batch)
    y_kept = _free(y_ndim, y_contract, y_batch)
    ans_batch, ans_x, _ = _ranges_like(x_batch, x_kept, y_kept)
    dims = ((tuple(x_kept), ans_x), (tuple(x_batch), ans_batch))
    y_contract_by_x = [y_contract[i] for i in np.argsort(x_contract)]
    out_axes = np.argsort(list(y_batch) + y_contract_by_x + y_kept)
    return _permute(_dot(x, g, dims, spec), out_axes, spec)


def _permute(x, axes, spec):
    """Transposes a GEMM's result; materialised where XLA:CPU would fold it into the GEMM.

    XLA:CPU folds ``transpose(dot(a, b))`` into a new dot after it has chosen
    which dots run on 16-bit kernels, and the new one fails at run time
    ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32").
    """
    axes = tuple(int(a) for a in axes)
    if spec.form.canonical_layout:
        return _materialize(x, axes)
    return x if axes == tuple(range(x.ndim)) else jnp.transpose(x, axes)


# The rule's result is named, so that ``jax.checkpoint`` policies can save it (the 16-bit
# activation) rather than the float32 GEMM result it is cast from (see residuals.py).
MATMUL_OUTPUT = "jaxamp_matmul_output"


def _dot_forward(lhs, rhs, dimension_numbers, spec):
    cd = spec.compute_dtype
    y = _dot(lhs.astype(cd), rhs.astype(cd), dimension_numbers, spec).astype(spec.out_dtype)
    return checkpoint_name(y, MATMUL_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _amp_dot(lhs, rhs, dimension_numbers, spec):
    return _dot_forward(lhs, rhs, dimension_numbers, spec)


def _perturbed(primal) -> tuple | None:
    """``()`` if the operand needs a gradient, ``None`` if not: static in the residuals' tree."""
    return () if primal.perturbed else None


def _amp_dot_fwd(lhs, rhs, dimension_numbers, spec):
    y = _dot_forward(lhs.value, rhs.value, dimension_numbers, spec)
    return y, (lhs.value, rhs.value, _perturbed(lhs), _perturbed(rhs))


def _amp_dot_bwd(dimension_numbers, spec, residuals, g):
    """Only the gradients that are needed: an input batch gets no GEMM of its own."""
    lhs, rhs, lhs_needed, rhs_needed = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    cd = spec.compute_dtype
    g = g.astype(cd)
    d_lhs = d_rhs = None
    if lhs_needed is not None:
        d_lhs = _transpose_lhs(g, rhs.astype(cd), lhs.ndim, dimension_numbers, spec)
        d_lhs = d_lhs.astype(lhs.dtype)
    if rhs_needed is not None:
        d_rhs = _transpose_rhs(g, lhs.astype(cd), rhs.ndim, dimension_numbers, spec)
        d_rhs = d_rhs.astype(rhs.dtype)
    return d_lhs, d_rhs


_amp_dot.defvjp(_amp_dot_fwd, _amp_dot_bwd, symbolic_zeros=True)


def _is_16bit_float(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def _normalize_dimension_numbers(dimension_numbers):
    (lc, rc), (lb, rb) = dimension_numbers
    return tuple(
        tuple(tuple(int(d) for d in dims) for dims in pair) for pair in ((lc, rc), (lb, rb))
    )


def _rule_precision(precision: Any) -> Any:
    """The rule chooses the algorithm; a ``lax.Precision`` passes through."""
    if isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset, str)):
        return None
    if isinstance(precision, tuple) and any(
        isinstance(p, (lax.DotAlgorithm, lax.DotAlgorithmPreset, str)) for p in precision
    ):
        return None
    return precision


def amp_dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    compute_dtype: Any,
    form: MatmulForm | None = None,
    **kwargs: Any,
) -> jax.Array:
    """``lax.dot_general`` under the 16-bit matmul rule (see this module's docstring).

    Floating operands are cast to ``compute_dtype`` inside the rule and
    multiplied with float32 accumulation; the result comes back in
    ``preferred_element_type`` if that is a floating dtype, else in
    ``compute_dtype``. Gradients come back in the dtypes the operands came in.
    Non-floating operands or a float32 ``compute_dtype`` leave the call to
    ``lax.dot_general``; so does an argument the rule does not take (an explicit
    ``out_sharding``), with the operands cast to ``compute_dtype`` (JAX's own
    backward pass then, not the rule's).

    Args:
      lhs: left operand.
      rhs: right operand (a float32 weight stays float32 outside the rule).
      dimension_numbers: as for ``lax.dot_general``.
      precision: a ``lax.Precision`` passed to the GEMMs; dot algorithms are
        replaced by the rule's own.
      preferred_element_type: the result dtype, or ``None`` for ``compute_dtype``.
      compute_dtype: the 16-bit dtype of the GEMM operands.
      form: a :class:`MatmulForm`; ``None`` picks :func:`matmul_form`.
      **kwargs: other ``lax.dot_general`` arguments.

    Returns:
      The product.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x, w = jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4))
      >>> dn = (((1,), (0,)), ((), ()))
      >>> y = amp_dot_general(x, w, dn, compute_dtype=jnp.bfloat16)
      >>> dw = jax.grad(lambda w: amp_dot_general(x, w, dn, compute_dtype=jnp.bfloat16)
      ...               .astype(jnp.float32).sum())(w)
      >>> y.dtype, dw.dtype
      (dtype(bfloat16), dtype('float32'))
    """
    compute = np.dtype(compute_dtype)
    floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in (lhs, rhs))
    if kwargs.get("out_sharding") is None:
        kwargs.pop("out_sharding", None)
    if not (_is_16bit_float(compute) and floating):
        return lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **kwargs,
        )
    if kwargs:  # e.g. an explicit out_sharding: JAX's own dot, on 16-bit operands
        return lax.dot_general(
            lhs.astype(compute),
            rhs.astype(compute),
            dimension_numbers,
            precision=_rule_precision(precision),
            preferred_element_type=preferred_element_type or compute,
            **kwargs,
        )
    out = compute
    if preferred_element_type is not None and jnp.issubdtype(preferred_element_type, jnp.floating):
        out = np.dtype(preferred_element_type)
    spec = _Spec(compute, out, _rule_precision(precision), form or matmul_form(dtype=compute))
    lhs, rhs = _same_varying_axes(lhs, rhs)
    return _amp_dot(lhs, rhs, _normalize_dimension_numbers(dimension_numbers), spec)


def _varying_axes(aval) -> frozenset:
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def _same_varying_axes(*operands):
    """Inside ``shard_map``, marks each operand varying over the axes any of them varies over.

    A custom VJP must return each cotangent with its operand's type; a replicated
    weight times a sharded batch has a sharded cotangent. Marked varying before
    the rule, the weight's cotangent is summed over the mesh axes by the marking's
    own transpose, as JAX does for its built-in dot.
    """
    vmas = [_varying_axes(jax.typeof(x)) for x in operands]
    union = frozenset().union(*vmas)
    if all(v == union for v in vmas):
        return operands
    return tuple(
        x if v == union else lax.pcast(x, tuple(sorted(union - v)), to="varying")
        for x, v in zip(operands, vmas, strict=True)
    )


# ------------------------------------------------------------------- convolutions
# The backward convolutions come from JAX's own transpose rules for
# ``conv_general_dilated``, called with 16-bit operands and a float32
# ``preferred_element_type``; they cast their result to the dtype of the operand
# being differentiated, which the rule gives as the dtype the operand came in.


def _conv_params(lhs, rhs, kwargs: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The parameters ``lax.conv_general_dilated`` binds, in the primitive's own form."""
    conv = functools.partial(lax.conv_general_dilated, **kwargs, preferred_element_type=_F32)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (lhs, rhs)]
    (eqn,) = [e for e in jax.make_jaxpr(conv)(*shapes).jaxpr.eqns if e.primitive is _CONV]
    return tuple(eqn.params.items())


_CONV = lax.conv_general_dilated_p


def _conv_forward(lhs, rhs, params, out_dtype):
    y = _CONV.bind(lhs, rhs.astype(lhs.dtype), **dict(params)).astype(out_dtype)
    return checkpoint_name(y, MATMUL_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _amp_conv(lhs, rhs, params, out_dtype):
    return _conv_forward(lhs, rhs, params, out_dtype)


def _amp_conv_fwd(lhs, rhs, params, out_dtype):
    y = _conv_forward(lhs.value, rhs.value, params, out_dtype)
    return y, (lhs.value, rhs.value, _perturbed(lhs), _perturbed(rhs))


def _amp_conv_bwd(params, out_dtype, residuals, g):
    from jax._src.interpreters import ad  # JAX's transpose rules (internal API)

    lhs, rhs, lhs_needed, rhs_needed = residuals
    if isinstance(g, SymbolicZero):
        return None, None
    transpose = ad.primitive_transposes[_CONV]
    g, rhs16 = g.astype(lhs.dtype), rhs.astype(lhs.dtype)
    undefined = lambda x: ad.UndefinedPrimal(jax.core.ShapedArray(x.shape, x.dtype))
    d_lhs = d_rhs = None
    if lhs_needed is not None:
        d_lhs, _ = transpose(g, undefined(lhs), rhs16, **dict(params))
    if rhs_needed is not None:
        _, d_rhs = transpose(g, lhs, undefined(rhs), **dict(params))
    return d_lhs, d_rhs


_amp_conv.defvjp(_amp_conv_fwd, _amp_conv_bwd, symbolic_zeros=True)


def amp_conv_general_dilated(
    lhs: jax.Array, rhs: jax.Array, *args: Any, compute_dtype: Any, **kwargs: Any
) -> jax.Array:
    """``lax.conv_general_dilated`` under the 16-bit matmul rule.

    The convolution and its two backward convolutions take ``compute_dtype``
    operands and accumulate in float32; the result comes back in
    ``compute_dtype`` (or a floating ``preferred_element_type``), gradients in
    the dtypes the operands came in (a float32 kernel gets a float32 gradient).
    Other operands, or a float32 ``compute_dtype``, leave the call to
    ``lax.conv_general_dilated``.

    Args:
      lhs: the input.
      rhs: the kernel.
      *args: ``window_strides``, ``padding`` and the rest, as for
        ``lax.conv_general_dilated``.
      compute_dtype: the 16-bit dtype of the operands.
      **kwargs: as for ``lax.conv_general_dilated``.

    Returns:
      The convolution.

    Example:
      >>> import jax.numpy as jnp
      >>> x, k = jnp.ones((1, 4, 4, 2), jnp.bfloat16), jnp.ones((3, 3, 2, 5))
      >>> y = amp_conv_general_dilated(x, k, (1, 1), "SAME",
      ...     dimension_numbers=("NHWC", "HWIO", "NHWC"), compute_dtype=jnp.bfloat16)
      >>> y.dtype, y.shape
      (dtype(bfloat16), (1, 4, 4, 5))
    """
    compute = np.dtype(compute_dtype)
    floating = all(jnp.issubdtype(x.dtype, jnp.floating) for x in (lhs, rhs))
    if not (_is_16bit_float(compute) and floating):
        return lax.conv_general_dilated(lhs, rhs, *args, **kwargs)
    names = (
        "window_strides",
        "padding",
        "lhs_dilation",
        "rhs_dilation",
        "dimension_numbers",
        "feature_group_count",
        "batch_group_count",
        "precision",
    )
    kwargs.update(zip(names, args, strict=False))
    preferred = kwargs.pop("preferred_element_type", None)
    out = compute
    if preferred is not None and jnp.issubdtype(preferred, jnp.floating):
        out = np.dtype(preferred)
    kwargs["precision"] = _rule_precision(kwargs.get("precision"))
    lhs, rhs = _same_varying_axes(lhs.astype(compute), rhs)
    params = _conv_params(lhs, rhs.astype(compute), kwargs)
    return _amp_conv(lhs, rhs, params, out)


def amp_conv_from_params(lhs, rhs, params: dict[str, Any], compute_dtype: Any) -> jax.Array:
    """The rule on a traced ``conv_general_dilated``'s parameters (for ``autocast``)."""
    params = {
        **params,
        "preferred_element_type": _F32,
        "precision": _rule_precision(params.get("precision")),
    }
    compute = np.dtype(compute_dtype)
    lhs, rhs = _same_varying_axes(lhs.astype(compute), rhs)
    return _amp_conv(lhs, rhs, tuple(params.items()), compute)


# ------------------------------------------------------- the rule as Flax layer hooks


@dataclasses.dataclass(frozen=True)
class DotGeneral:
    """:func:`amp_dot_general` as a ``dot_general`` for Flax layers (and an ``einsum``).

    Example:
      >>> import jax.numpy as jnp
      >>> rule = DotGeneral(jnp.bfloat16)
      >>> rule.einsum("ij,jk->ik", jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
      dtype(bfloat16)
    """

    compute_dtype: Any

    def __call__(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ):
        return amp_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            preferred_element_type,
            compute_dtype=self.compute_dtype,
            **kwargs,
        )

    def einsum(self, subscripts, *operands, **kwargs):
        """``jnp.einsum`` whose contractions run under the rule, in the compute dtype."""
        if kwargs.get("preferred_element_type") is None:
            kwargs["preferred_element_type"] = self.compute_dtype
        return jnp.einsum(subscripts, *operands, _dot_general=self, **kwargs)


@dataclasses.dataclass(frozen=True)
class ConvGeneralDilated:
    """:func:`amp_conv_general_dilated` as a ``conv_general_dilated`` for Flax layers."""

    compute_dtype: Any

    def __call__(self, lhs, rhs, *args, **kwargs):
        return amp_conv_general_dilated(lhs, rhs, *args, compute_dtype=self.compute_dtype, **kwargs)
