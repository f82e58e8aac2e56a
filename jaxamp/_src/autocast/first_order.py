"""The autocast interpreter's first-order handlers: what each rule does to one equation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.autocast import fp8_state
from jaxamp._src.autocast.interpreter import (
    RULES,
    Env,
    as_traced,
    cast_to_traced,
    register_first_order,
    register_rule,
    traced_dtype,
)
from jaxamp._src.autocast.rules import AutocastConfig, primitive_names
from jaxamp._src.autocast.weights import TABLE_CUTS
from jaxamp._src.dtypes import (
    FLOAT32,
    is_16bit,
    is_float64,
    is_floating,
    is_narrow,
    is_narrower,
    promote,
)
from jaxamp._src.jaxprs import bind, in_backward_pass, in_no_fp8_scope
from jaxamp._src.ops.fp8 import fp8_dot_general, with_operands_swapped
from jaxamp._src.ops.matmul import amp_conv_from_params, amp_dot_general

# --- Inputs -----------------------------------------------------------------------------------


def _planned_inputs(eqn: Any, env: Env, wanted: Sequence[Any] | None = None) -> list[Any]:
    """Input values: each floating input in its ``wanted`` dtype (``None``: as it arrives),
    then inputs that shared a floating dtype in the trace promoted to the widest of them
    (to float32 where a constant among them is too large for that dtype)."""
    atoms = eqn.invars
    dtypes = [
        (w if w is not None and is_floating(env.dtype(a)) else env.dtype(a))
        for a, w in zip(atoms, wanted or [None] * len(atoms), strict=True)
    ]
    groups: dict[Any, list[int]] = {}
    for i, atom in enumerate(atoms):
        if is_floating(traced_dtype(atom)) and is_floating(dtypes[i]):
            groups.setdefault(np.dtype(traced_dtype(atom)), []).append(i)
    for members in groups.values():
        if len({np.dtype(dtypes[i]) for i in members}) < 2:
            continue
        strong = [i for i in members if not _is_weak(atoms[i])]
        target = promote(*[dtypes[i] for i in strong or members])
        if any(_overflows(env.read(atoms[i]), target) for i in members if _is_weak(atoms[i])):
            target = promote(target, FLOAT32)
            env.context.kept.note()
        for i in members:
            dtypes[i] = target
    return [env.read_as(a, d) for a, d in zip(atoms, dtypes, strict=True)]


def _overflows(value: Any, dtype: Any, limit: int | None = 16) -> bool:
    """Whether a constant (a Python scalar in the traced program) is finite but too large
    for ``dtype``: ``1e30`` in float16 would become ``inf`` (and ``inf * 0`` a NaN)."""
    if not isinstance(value, (int, float, np.ndarray, np.generic)) or not is_floating(dtype):
        return False
    value = np.asarray(value)
    if value.dtype.kind not in "fiu" or (limit is not None and value.size > limit):
        return False
    finite = np.isfinite(value.astype(np.float64))
    return bool(np.any(finite & (np.abs(value.astype(np.float64)) > jnp.finfo(dtype).max)))


def _may_overflow(env: Env, value: Any, dtype: Any) -> bool:
    """Whether ``value`` (traced) may hold a finite value too large for ``dtype``."""
    if _overflows(env.concrete(value), dtype, limit=None):
        return True
    bound = env.bound(value)
    return bound is not None and np.isfinite(bound) and bound > float(jnp.finfo(dtype).max)


def _is_weak(atom: Any) -> bool:
    """Scalar literals and weakly typed values (Python scalars) follow the other inputs'
    dtype. An array literal is a constant the function closed over (under
    ``jax_use_simplified_jaxpr_constants`` JAX writes those inline, not as ``constvars``):
    like a constant, it keeps its dtype."""
    if isinstance(atom, jex.core.Literal) and np.ndim(atom.val) == 0:
        return True
    return bool(getattr(atom.aval, "weak_type", False))


# --- The rules' own handlers ------------------------------------------------------------------

register_rule("traced")(as_traced)  # in the core, which also runs float32 scopes with it


@register_rule("promote")
def _promote(eqn: Any, env: Env) -> list[Any]:
    """The ``promote`` rule: inputs that shared a floating dtype in the trace are
    promoted to the widest dtype among those that arrive."""
    return bind(eqn, _planned_inputs(eqn, env))


# Reductions whose result must equal one of the elements that flow on (their JVP finds
# the maximum by comparing): they read the 16-bit value, which they reduce exactly.
_CHOOSERS = primitive_names("reduce_max_p", "reduce_min_p", "argmax_p", "argmin_p")


def _unrounded(env: Env, atom: Any, value: Any, primitive: str = "") -> Any:
    """``value``, or the wider value of the same dtype a narrowing convert made ``atom`` from
    (``atom`` before its rounding)."""
    if primitive in _CHOOSERS:
        return value
    wide = env.wide_of(atom)
    if wide is None:
        return value
    return wide if np.dtype(wide.dtype) == np.dtype(getattr(value, "dtype", wide.dtype)) else value


@register_rule("float32")
def _float32(eqn: Any, env: Env) -> list[Any]:
    """A sensitive primitive: floating inputs narrower than float32 are cast up. An input
    the program narrowed from float32 just before (``jnp.linalg.norm`` returns its
    float32 sum in float16 before the square root) is read as the float32 value."""
    wanted = [FLOAT32 if is_narrow(env.dtype(a)) else None for a in eqn.invars]
    name = eqn.primitive.name
    planned = _planned_inputs(eqn, env, wanted)
    values = [_unrounded(env, a, v, name) for a, v in zip(eqn.invars, planned, strict=True)]
    if eqn.primitive is lax.scatter_add_p:  # its combiner is typed: build it again
        p = eqn.params
        operand, indices, updates = values
        return [
            lax.scatter_add(
                operand,
                indices,
                updates,
                p["dimension_numbers"],
                indices_are_sorted=p["indices_are_sorted"],
                unique_indices=p["unique_indices"],
                mode=p["mode"],
            )
        ]
    return bind(eqn, values)


# --- Matmuls and convolutions -----------------------------------------------------------------


def _contracts(eqn: Any) -> bool:
    """Whether a ``dot_general`` sums over a contracting dimension (an outer product such
    as rotary embeddings' ``positions x frequencies`` does not: nothing to accumulate, and
    rounding its operands to 16 bits would only lose precision)."""
    if eqn.primitive is not lax.dot_general_p:
        return True
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    return bool(lhs_contract)


def _wide_operand(env: Env, atom: Any, compute: Any) -> Any:
    """A matmul operand: the float32 value the program narrowed to ``compute``, if it did
    (from float64, the narrow value: the matmul the program wrote is a 16-bit one)."""
    wide = env.wide_of(atom)
    if (
        wide is not None
        and np.dtype(env.dtype(atom)) == np.dtype(compute)
        and not is_float64(wide.dtype)
    ):
        return wide
    return env.read(atom)


def _is_float64(eqn: Any) -> bool:
    """Whether an operand or the result of ``eqn`` is float64 (under ``jax_enable_x64``)."""
    return any(is_float64(traced_dtype(a)) for a in (*eqn.invars, *eqn.outvars))


def _is_vector_dot(eqn: Any) -> bool:
    """A ``dot_general`` with no free dimension on either side (``jnp.dot`` of two vectors,
    ``jnp.vdot``): PyTorch's autocast promotes these to the widest operand dtype."""
    if eqn.primitive is not lax.dot_general_p:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (a.aval.ndim for a in eqn.invars[:2])
    return len(lc) + len(lb) == lhs and len(rc) + len(rb) == rhs


@register_rule("compute")
def _compute(eqn: Any, env: Env) -> list[Any]:
    """A matmul or convolution on compute-dtype operands, with a compute-dtype result.

    A 16-bit compute dtype runs it under the matmul rule (``jaxamp._src.ops.matmul``),
    which casts the operands itself, so a float32 weight's 16-bit copy is not
    saved for the backward pass and its gradient comes out in float32. A vector dot
    takes the widest dtype its operands arrive in instead. One on float64 operands,
    or with a float64 result, runs as traced (a policy leaves float64 as written).
    """
    if _is_float64(eqn):
        return as_traced(eqn, env)
    if not all(is_floating(traced_dtype(a)) for a in eqn.invars[:2]) or not _contracts(eqn):
        return _promote(eqn, env)  # integer matmuls and outer products are left alone
    compute = env.policy.compute_dtype
    if _is_vector_dot(eqn):
        compute = promote(*[env.dtype(a) for a in eqn.invars])
    params = dict(eqn.params)
    if (
        env.policy.fp8 is not None
        and eqn.primitive is lax.dot_general_p
        and not _is_vector_dot(eqn)
        and not in_no_fp8_scope(eqn)
        and _against_a_weight(eqn, env)
    ):
        return [_fp8_matmul(eqn, env)]
    if is_16bit(compute):
        # An operand the program narrowed just before (a kernel cast to the compute dtype,
        # as Flax's ConvTranspose does) is read as the wider value: the rule casts it
        # itself, so its gradient comes out of the GEMM in float32, never rounded.
        lhs, rhs = (_wide_operand(env, a, compute) for a in eqn.invars)
        if eqn.primitive is lax.dot_general_p:
            dims = params["dimension_numbers"]
            # A result the traced program asked to be wider than its operands (16-bit
            # operands, float32 logits) stays that wide; other results are 16-bit.
            preferred = params.get("preferred_element_type")
            traced = traced_dtype(eqn.invars[0])
            wider = is_narrower(compute, preferred) and is_narrower(traced, preferred)
            if not wider and in_backward_pass(eqn):
                # A gradient the function takes itself: its GEMMs keep their traced (float32)
                # result, so a float32 weight's gradient is not rounded to 16 bits.
                preferred = traced_dtype(eqn.outvars[0])
                wider = is_narrower(compute, preferred)
            return [
                amp_dot_general(
                    lhs,
                    rhs,
                    dims,
                    params.get("precision"),
                    preferred if wider else None,
                    compute_dtype=compute,
                    out_sharding=params.get("out_sharding"),
                )
            ]
        return [amp_conv_from_params(lhs, rhs, params, compute)]
    # A result type the program asked for (preferred_element_type) is kept.
    return bind(eqn, _planned_inputs(eqn, env, [compute] * len(eqn.invars)), params)


def _against_a_weight(eqn: Any, env: Env) -> bool:
    """Whether one operand of the GEMM ``eqn`` is a weight (``weights.Weights``): the
    formats leave a product of two activations (attention's) and a tied head alone."""
    weights = env.context.weights
    if weights is None:
        return True
    operands = [env.read(a) for a in eqn.invars[:2]]
    return any(weights.is_weight(v, env.source(v, TABLE_CUTS)) for v in operands)


def _fp8_matmul(eqn: Any, env: Env) -> Any:
    """A ``dot_general`` under a float8 policy, scaled by its operands' current amax, or by
    its state in the ``fp8_state`` autocast was given (delayed scaling). The result is in
    the compute dtype, or wider where the traced program asked for it."""
    compute = env.policy.compute_dtype
    lhs, rhs = (_wide_operand(env, a, compute) for a in eqn.invars)
    preferred = eqn.params.get("preferred_element_type")
    out = preferred if is_narrower(compute, preferred) else compute
    if in_backward_pass(eqn):  # a gradient the function takes itself keeps its traced dtype
        out = traced_dtype(eqn.outvars[0])
    assert env.policy.fp8 is not None
    dims = eqn.params["dimension_numbers"]
    sharding = eqn.params.get("out_sharding")
    if env.policy.fp8.block is not None and sharding is None and _weight_on_the_left(eqn, env):
        # The block formats quantize a layer's kernel as the right operand (NVFP4 in
        # 16 x 16 tiles): a weight written on the left (``W @ h.T``) goes there too.
        gemm = functools.partial(fp8_dot_general, block=env.policy.fp8.block)
        return with_operands_swapped(gemm, lhs, rhs, dims, out)
    return fp8_dot_general(
        lhs,
        rhs,
        dims,
        None,
        out,
        fp8_state=fp8_state.state_here(env.context.fp8, env.source(lhs), env.source(rhs)),
        margin=env.policy.fp8.margin,
        out_sharding=sharding,
        block=env.policy.fp8.block,
    )


def _weight_on_the_left(eqn: Any, env: Env) -> bool:
    """Whether the GEMM ``eqn``'s left operand is its weight and its right one is not."""
    weights = env.context.weights
    if weights is None:
        return False
    lhs, rhs = (env.read(a) for a in eqn.invars[:2])
    return weights.is_weight(lhs, env.source(lhs, TABLE_CUTS)) and not weights.is_weight(
        rhs, env.source(rhs, TABLE_CUTS)
    )


@register_first_order("traced", lax.dot_general_p.name, lax.conv_general_dilated_p.name)
def _traced_matmul(eqn: Any, env: Env) -> list[Any]:
    """A matmul left as traced. One traced on 16-bit operands still accumulates in float32:
    it runs under the matmul rule in its traced dtype (a model's own ``jnp.einsum`` on
    16-bit activations, such as attention written out by hand), its result in the traced
    dtype (float32 where it asked for it), and its backward GEMMs on 16-bit operands too.
    The rule chooses its own dot algorithm, which also works around JAX asking XLA:CPU
    for one it rejects (``jax.nn.dot_product_attention`` in float16 states
    ``F16_F16_F32``, and fails to compile under ``jit`` on CPU). Others run as traced."""
    lhs_dtype, rhs_dtype = (traced_dtype(a) for a in eqn.invars[:2])
    out_dtype = traced_dtype(eqn.outvars[0])
    if not (
        is_16bit(lhs_dtype)
        and np.dtype(rhs_dtype) == np.dtype(lhs_dtype)
        and is_floating(out_dtype)
    ):
        return as_traced(eqn, env)
    policy = dataclasses.replace(env.policy, compute_dtype=np.dtype(lhs_dtype))
    context = env.context.with_config(AutocastConfig(policy, env.rules))
    return cast_to_traced(_compute(eqn, Env(context, env)), eqn.outvars)


# --- Broadcasts: gradients summed in float32 --------------------------------------------------


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _broadcast(x: Any, shape: tuple[int, ...], dims: tuple[int, ...]) -> Any:
    return lax.broadcast_in_dim(x, shape, dims)


@_broadcast.defjvp
def _broadcast_jvp(
    shape: tuple[int, ...], dims: tuple[int, ...], primals: Any, tangents: Any
) -> tuple[Any, Any]:
    """The tangent is broadcast in float32, so the transpose JAX derives from it (the
    backward pass) sums the cotangent in float32 and rounds the sum once."""
    (x,), (t,) = primals, tangents
    t32 = lax.broadcast_in_dim(t.astype(FLOAT32), shape, dims)
    return lax.broadcast_in_dim(x, shape, dims), t32.astype(t.dtype)


def broadcast_summing_in_float32(x: Any, shape: Sequence[int], dims: Sequence[int]) -> Any:
    """``lax.broadcast_in_dim(x, shape, dims)`` whose gradient is summed in float32.

    JAX's transpose of a broadcast sums in the cotangent's dtype: 16 bits for a bias
    or a positional embedding added to 16-bit activations. Forward mode (``jax.jvp``)
    goes through it too."""
    return _broadcast(x, tuple(shape), tuple(int(d) for d in dims))


def _needs_float32_sum(
    x: Any, atom: Any, out_shape: Sequence[Any], dims: Sequence[int] | None = None
) -> bool:
    """A 16-bit value (not a constant) whose values an operation repeats to fill
    ``out_shape`` (``x``'s dimension ``k`` going to ``dims[k]``; the same dimension for an
    elementwise operation). Dimensions may be symbolic (``jax.export``): a symbolic one is
    taken to be more than 1."""
    if isinstance(atom, jex.core.Literal) or not is_16bit(getattr(x, "dtype", None)):
        return False
    shape = np.shape(x)
    if len(shape) > len(out_shape):
        return False
    dims = range(len(shape)) if dims is None else dims
    one = lambda d: isinstance(d, int) and d == 1
    new = set(range(len(out_shape))) - set(dims)
    return any(not one(out_shape[i]) for i in new) or any(
        one(n) and not one(out_shape[d]) for n, d in zip(shape, dims, strict=True)
    )


@register_first_order("promote", "broadcast_in_dim")
def _broadcast_in_dim(eqn: Any, env: Env) -> list[Any]:
    """``broadcast_in_dim`` of a 16-bit value: its gradient is summed in float32."""
    (x,) = _planned_inputs(eqn, env) if len(eqn.invars) == 1 else (None,)
    out_shape = eqn.outvars[0].aval.shape
    if x is None or eqn.params.get("sharding") is not None:
        return _promote(eqn, env)
    dims = eqn.params["broadcast_dimensions"]
    if not _needs_float32_sum(x, eqn.invars[0], out_shape, dims):
        return _promote(eqn, env)
    return [broadcast_summing_in_float32(x, out_shape, eqn.params["broadcast_dimensions"])]


# Elementwise primitives that take operands of different shapes (size-1 dimensions
# broadcast): their transpose sums the broadcast dimensions in the cotangent's dtype.
_IMPLICIT_BROADCAST = primitive_names(
    "add_p", "sub_p", "mul_p", "div_p", "max_p", "min_p", "atan2_p"
)


def _elementwise(eqn: Any, env: Env) -> list[Any]:
    """An elementwise primitive; 16-bit operands it broadcasts (size-1 dimensions, or a
    rank-0 operand: a learnable gate or temperature) are broadcast first, by
    ``broadcast_summing_in_float32``, so their gradients are summed in float32."""
    values = _planned_inputs(eqn, env)
    out_shape = tuple(eqn.outvars[0].aval.shape)
    broadcast = []
    for v, a in zip(values, eqn.invars, strict=True):
        ndim = np.ndim(v)
        dims = range(ndim) if ndim == len(out_shape) else () if ndim == 0 else None
        if dims is not None and _needs_float32_sum(v, a, out_shape, dims):
            v = broadcast_summing_in_float32(v, out_shape, dims)
        broadcast.append(v)
    return bind(eqn, broadcast)


# ``mul`` and ``div`` come to it through ``_square_or_product`` and ``_reciprocal_or_quotient``.
register_first_order("promote", *(_IMPLICIT_BROADCAST - {"mul", "div"}))(_elementwise)


@register_first_order("promote", "mul")
def _square_or_product(eqn: Any, env: Env) -> list[Any]:
    """``mul``: a square ``x * x`` runs in float32, as PyTorch's autocast runs ``pow``
    (norms, distances and variances written out overflow float16 at 256); other
    products as ``_elementwise``."""
    atoms = eqn.invars
    if len(atoms) == 2 and not isinstance(atoms[0], jex.core.Literal) and atoms[0] is atoms[1]:
        return _float32(eqn, env)
    return _elementwise(eqn, env)


@register_first_order("promote", "div")
def _reciprocal_or_quotient(eqn: Any, env: Env) -> list[Any]:
    """``div``: a constant divided by a tensor (``1 / x``) runs in float32, as PyTorch's
    autocast runs ``rdiv``; other quotients as ``_elementwise``."""
    atoms = eqn.invars
    if len(atoms) == 2 and _is_weak(atoms[0]) and not _is_weak(atoms[1]):
        return _float32(eqn, env)
    return _elementwise(eqn, env)


# --- Moves and casts --------------------------------------------------------------------------


def _convert(eqn: Any, env: Env) -> list[Any]:
    """``convert_element_type``: skipped when the value already has the new dtype (and
    the convert does not change weak typing: one that makes a weakly typed value strong
    is kept, or the output would promote differently in the caller)."""
    (atom,) = eqn.invars
    current = env.dtype(atom)
    new_dtype = eqn.params.get("new_dtype")
    if (
        not isinstance(atom, jex.core.Literal)
        and is_floating(current)
        and np.dtype(current) == np.dtype(new_dtype)
        and not eqn.params.get("weak_type", False)
        and not getattr(atom.aval, "weak_type", False)
        and eqn.params.get("sharding") is None
    ):
        return [env.read(atom)]
    value = env.read(atom)
    if getattr(atom.aval, "weak_type", False) and _overflows(value, new_dtype):
        # A Python scalar JAX narrows to a 16-bit operand's dtype (``jnp.where(m, s, -1e9)``
        # traced in float16): it keeps the value written, in float32, not ``inf``.
        env.context.kept.note()
        return [np.asarray(value, promote(current, FLOAT32))]
    if (
        getattr(atom.aval, "weak_type", False)
        and is_16bit(new_dtype)
        and is_floating(current)
        and _may_overflow(env, value, new_dtype)
    ):
        # The same, computed from constants (``s + jnp.arange(n) * 1e5``) or selected by a
        # mask (``s + jnp.where(mask, 0.0, -1e9)``): kept wide.
        env.context.kept.note()
        return [lax.convert_element_type(value, promote(current, FLOAT32))]
    (out,) = bind(eqn, [value])
    if is_floating(current) and is_floating(new_dtype) and is_narrower(new_dtype, current):
        env.remember_wide(out, env.read(atom))
    return [out]


for _rule in RULES:  # whatever rule the table gives it
    register_first_order(_rule, "convert_element_type")(_convert)


@register_first_order("traced", "scatter")
def _scatter(eqn: Any, env: Env) -> list[Any]:
    """``scatter`` as traced, but ``x.at[i].set(v)``, which has no typed combiner (no
    ``update_jaxpr``), has its inputs promoted, so a fill value float16 cannot hold
    (``.set(-1e9)``) keeps its value."""
    if eqn.params.get("update_jaxpr") is None:
        return _promote(eqn, env)
    return as_traced(eqn, env)


@register_first_order("promote", "gather")
def _gather(eqn: Any, env: Env) -> list[Any]:
    """``gather``, whose gradient is a scatter-add (a sum, where indices repeat).

    From a table the program cast to 16 bits just before (an embedding layer that casts
    its float32 table, then looks rows up), the rows are gathered from the float32 table
    and cast, so the table's gradient is summed in float32. From a 16-bit value where
    the program had a wider one (a loss's ``take_along_axis`` of logits a 16-bit matmul
    made, under autocast), the gather runs in the traced dtype, for the same reason. From
    a 16-bit value the program made in 16 bits (a 16-bit layer's output under
    ``apply_policy``), it gathers in 16 bits and sums its gradient in float32."""
    table = eqn.invars[0]
    wide = env.wide_of(table)
    if wide is not None:
        narrow = env.dtype(table)
        values = [wide, *(env.read(a) for a in eqn.invars[1:])]
        return [out.astype(narrow) for out in bind(eqn, values)]
    traced, arrived = traced_dtype(table), env.dtype(table)
    if is_narrower(arrived, traced):
        return bind(eqn, [env.read_as(table, traced), *(env.read(a) for a in eqn.invars[1:])])
    if is_16bit(arrived) and not isinstance(table, jex.core.Literal):
        rest = [env.read(a) for a in eqn.invars[1:]]
        return [_gather_summing_in_float32(eqn, env.read(table), *rest)]
    return _promote(eqn, env)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _gather_summing_in_float32(eqn: Any, table: Any, *indices: Any) -> Any:
    """The gather ``eqn`` of a 16-bit ``table`` (an activation a 16-bit layer made),
    whose gradient, a scatter-add where indices repeat, is summed in float32."""
    return bind(eqn, [table, *indices])[0]


@_gather_summing_in_float32.defjvp
def _gather_summing_in_float32_jvp(eqn: Any, primals: Any, tangents: Any) -> tuple[Any, Any]:
    indices = primals[1:]
    t32 = bind(eqn, [tangents[0].astype(FLOAT32), *indices])[0]
    return bind(eqn, primals)[0], t32.astype(tangents[0].dtype)
