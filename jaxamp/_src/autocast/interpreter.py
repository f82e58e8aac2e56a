"""The interpreter behind ``jaxamp.autocast``: evaluates a traced program equation by equation
(the JAX docs' "custom Jaxpr interpreter"), binding each primitive again on inputs cast by its
rule; higher-order primitives are entered or refused, never passed through."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.autocast import constants, fp8_state
from jaxamp._src.autocast.rules import AutocastConfig, primitive_names
from jaxamp._src.dtypes import (
    FLOAT32,
    is_16bit,
    is_float64,
    is_floating,
    is_narrow,
    is_narrower,
    upcast,
)
from jaxamp._src.jaxprs import (
    bind,
    eqn_context,
    in_backward_pass,
    in_float32_scope,
    in_no_fp8_scope,
    open_jaxpr,
)
from jaxamp._src.ops.fp8 import fp8_dot_general
from jaxamp._src.ops.matmul import amp_conv_from_params, amp_dot_general

# --- The interpreter --------------------------------------------------------------------------


@dataclasses.dataclass
class _Record:
    """What the evaluation of one program learns, shared with the calls evaluated inside
    (their values are the same objects).

    ``wide``: ``id(narrow value): (narrow value, wider value)`` for each narrowing convert,
    so a table cast in one function and gathered in another is found. ``made``:
    ``id(value): (value, equation, its input values, output index)`` for each first-order
    equation, so a value that depends on no input can be computed as written.
    """

    wide: dict[int, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    made: dict[int, tuple[Any, Any, list[Any], int]] = dataclasses.field(default_factory=dict)


class _Env:
    """Values of one jaxpr's variables, and the casts made of them (each made once)."""

    def __init__(
        self,
        config: AutocastConfig,
        parent: _Env | None = None,
        record: _Record | None = None,
    ):
        self.policy, self.rules = config.policy, config.rules
        self.config = config
        self.values: dict[Any, Any] = {} if parent is None else parent.values
        self.casts: dict[tuple[Any, str], Any] = {} if parent is None else parent.casts
        self.record: _Record = parent.record if parent is not None else record or _Record()
        self.wide = self.record.wide

    def remember_wide(self, narrow: Any, wide: Any) -> None:
        self.wide[id(narrow)] = (narrow, wide)

    def wide_of(self, atom: Any) -> Any:
        """The wider value ``atom``'s value was narrowed from, or ``None``."""
        if isinstance(atom, jex.core.Literal):
            return None
        value = self.values.get(atom)
        entry = self.wide.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else None

    def remember_made(self, eqn: Any, outs: Sequence[Any], higher_order: bool) -> None:
        """Records each output of a first-order equation without effects
        (``higher_order``: ``is_higher_order(eqn)``, computed once per equation)."""
        if eqn.effects or higher_order:
            return
        inputs = [a if isinstance(a, jex.core.Literal) else self.values[a] for a in eqn.invars]
        for index, out in enumerate(outs):
            self.record.made[id(out)] = (out, eqn, inputs, index)

    def concrete(self, value: Any, limit: int = 1 << 20) -> Any:
        """``value`` computed now, as the program wrote it, if it depends on no input of
        the function (``jnp.arange(n) * 1e5``) and has at most ``limit`` elements; else
        ``None``."""
        if isinstance(value, jex.core.Literal):
            written = constants.written_value(value)
            return np.asarray(value.val if written is None else written)
        if not isinstance(value, jax.core.Tracer):
            if isinstance(value, (bool, int, float)):
                return np.asarray(value)
            return value if isinstance(value, (np.ndarray, np.generic, jax.Array)) else None
        entry = self.record.made.get(id(value))
        if entry is None or entry[0] is not value or np.size(value) > limit:
            return None
        _, eqn, inputs, index = entry
        known = [self.concrete(v, limit) for v in inputs]
        if any(k is None for k in known):
            return None
        try:
            with jax.ensure_compile_time_eval():
                outs = eqn.primitive.bind(*known, **eqn.params)
        except (TypeError, ValueError):  # written values in other dtypes than traced
            return None
        return np.asarray(outs[index] if eqn.primitive.multiple_results else outs)

    def bound(self, value: Any) -> float | None:
        """An upper bound on ``|value|`` where the program computes it from constants and
        from booleans by moves, selections and arithmetic (``jnp.where(mask, 0.0, -1e9)``,
        ``(1 - mask) * -1e9``), else ``None``: whether a value too large for 16 bits may
        reach a narrowing convert, though no concrete value is known."""
        if isinstance(value, jex.core.Literal) or not isinstance(value, jax.core.Tracer):
            known = self.concrete(value)
            if known is None or np.asarray(known).dtype.kind not in "biuf":
                return None
            known = np.abs(np.asarray(known, np.float64))
            return float(np.max(known, initial=0.0))
        entry = self.record.made.get(id(value))
        if entry is None or entry[0] is not value:
            return None
        _, eqn, inputs, _ = entry
        name = eqn.primitive.name
        if name == "convert_element_type" and getattr(inputs[0], "dtype", None) == np.bool_:
            return 1.0
        if name == "convert_element_type" and isinstance(inputs[0], jex.core.Literal):
            return self.bound(inputs[0])
        operands = _BOUND_OPERANDS.get(name)
        if operands is not None:
            found = [self.bound(v) for v in operands(inputs)]
            bounds = [b for b in found if b is not None]
            if len(bounds) == len(found):
                if name == "mul":
                    return float(np.prod(bounds))
                if name in ("add", "sub"):
                    return float(np.sum(bounds))
                return max(bounds, default=0.0)
        known = self.concrete(value, limit=1 << 16)
        return None if known is None else float(np.max(np.abs(known), initial=0.0))

    def read(self, atom: Any) -> Any:
        if isinstance(atom, jex.core.Literal):
            written = constants.written_value(atom)
            return atom.val if written is None else written
        return self.values[atom]

    def dtype(self, atom: Any) -> Any:
        if isinstance(atom, jex.core.Literal):
            written = constants.written_value(atom)
            return getattr(atom.aval, "dtype", None) if written is None else written.dtype
        return getattr(self.values[atom], "dtype", None)

    def read_as(self, atom: Any, dtype: Any) -> Any:
        """``atom``'s value, cast to ``dtype`` if it is floating and in another dtype."""
        value = self.read(atom)
        current = self.dtype(atom)
        if dtype is None or not is_floating(current) or np.dtype(current) == np.dtype(dtype):
            return value
        if isinstance(atom, jex.core.Literal):  # a constant: cast it here, no convert emitted
            return np.asarray(value, dtype=dtype)
        key = (atom, np.dtype(dtype).name)
        if key not in self.casts:
            self.casts[key] = lax.convert_element_type(value, dtype)
        return self.casts[key]


def _traced_dtype(atom: Any) -> Any:
    return getattr(atom.aval, "dtype", None)


def cast_to_traced(values: Sequence[Any], atoms: Sequence[Any]) -> list[Any]:
    """Casts floating ``values`` to the dtypes ``atoms`` had in the traced program."""
    out = []
    for value, atom in zip(values, atoms, strict=True):
        dtype = _traced_dtype(atom)
        current = getattr(value, "dtype", None)
        if is_floating(dtype) and is_floating(current) and np.dtype(current) != np.dtype(dtype):
            value = lax.convert_element_type(value, dtype)
        out.append(value)
    return out


def _planned_inputs(eqn: Any, env: _Env, wanted: Sequence[Any] | None = None) -> list[Any]:
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
        if is_floating(_traced_dtype(atom)) and is_floating(dtypes[i]):
            groups.setdefault(np.dtype(_traced_dtype(atom)), []).append(i)
    for members in groups.values():
        if len({np.dtype(dtypes[i]) for i in members}) < 2:
            continue
        strong = [i for i in members if not _is_weak(atoms[i])]
        target = functools.reduce(jnp.promote_types, [dtypes[i] for i in strong or members])
        if any(_overflows(env.read(atoms[i]), target) for i in members if _is_weak(atoms[i])):
            target = np.dtype(jnp.promote_types(target, FLOAT32))
            constants.note_kept_wide()
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


def _may_overflow(env: _Env, value: Any, dtype: Any) -> bool:
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


def _as_traced(eqn: Any, env: _Env) -> list[Any]:
    return bind(eqn, [env.read_as(a, _traced_dtype(a)) for a in eqn.invars])


def _promote(eqn: Any, env: _Env) -> list[Any]:
    return bind(eqn, _planned_inputs(eqn, env))


# Reductions whose result must equal one of the elements that flow on (their JVP finds
# the maximum by comparing): they read the 16-bit value, which they reduce exactly.
_CHOOSERS = primitive_names("reduce_max_p", "reduce_min_p", "argmax_p", "argmin_p")


def _wide(env: _Env, atom: Any, value: Any, primitive: str = "") -> Any:
    """``value``, or the wider value of the same dtype a narrowing convert made ``atom`` from."""
    if primitive in _CHOOSERS:
        return value
    wide = env.wide_of(atom)
    if wide is None:
        return value
    return wide if np.dtype(wide.dtype) == np.dtype(getattr(value, "dtype", wide.dtype)) else value


def _float32(eqn: Any, env: _Env) -> list[Any]:
    """A sensitive primitive: floating inputs narrower than float32 are cast up. An input
    the program narrowed from float32 just before (``jnp.linalg.norm`` returns its
    float32 sum in float16 before the square root) is read as the float32 value."""
    wanted = [FLOAT32 if is_narrow(env.dtype(a)) else None for a in eqn.invars]
    name = eqn.primitive.name
    planned = _planned_inputs(eqn, env, wanted)
    values = [_wide(env, a, v, name) for a, v in zip(eqn.invars, planned, strict=True)]
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


def _contracts(eqn: Any) -> bool:
    """Whether a ``dot_general`` sums over a contracting dimension (an outer product such
    as rotary embeddings' ``positions x frequencies`` does not: nothing to accumulate, and
    rounding its operands to 16 bits would only lose precision)."""
    if eqn.primitive is not lax.dot_general_p:
        return True
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    return bool(lhs_contract)


def _wide_operand(env: _Env, atom: Any, compute: Any) -> Any:
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
    return any(is_float64(_traced_dtype(a)) for a in (*eqn.invars, *eqn.outvars))


def _is_vector_dot(eqn: Any) -> bool:
    """A ``dot_general`` with no free dimension on either side (``jnp.dot`` of two vectors,
    ``jnp.vdot``): PyTorch's autocast promotes these to the widest operand dtype."""
    if eqn.primitive is not lax.dot_general_p:
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (a.aval.ndim for a in eqn.invars[:2])
    return len(lc) + len(lb) == lhs and len(rc) + len(rb) == rhs


def _compute(eqn: Any, env: _Env) -> list[Any]:
    """A matmul or convolution on compute-dtype operands, with a compute-dtype result.

    A 16-bit compute dtype runs it under the matmul rule (``jaxamp._src.ops.matmul``),
    which casts the operands itself, so a float32 weight's 16-bit copy is not
    saved for the backward pass and its gradient comes out in float32. A vector dot
    takes the widest dtype its operands arrive in instead. One on float64 operands,
    or with a float64 result, runs as traced (a policy leaves float64 as written).
    """
    if _is_float64(eqn):
        return _as_traced(eqn, env)
    if not all(is_floating(_traced_dtype(a)) for a in eqn.invars[:2]) or not _contracts(eqn):
        return _promote(eqn, env)  # integer matmuls and outer products are left alone
    compute = env.policy.compute_dtype
    if _is_vector_dot(eqn):
        compute = np.dtype(functools.reduce(jnp.promote_types, [env.dtype(a) for a in eqn.invars]))
    params = dict(eqn.params)
    if (
        env.policy.fp8 is not None
        and eqn.primitive is lax.dot_general_p
        and not _is_vector_dot(eqn)
        and not in_no_fp8_scope(eqn)
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
            traced = _traced_dtype(eqn.invars[0])
            wider = is_narrower(compute, preferred) and is_narrower(traced, preferred)
            if not wider and in_backward_pass(eqn):
                # A gradient the function takes itself: its GEMMs keep their traced (float32)
                # result, so a float32 weight's gradient is not rounded to 16 bits.
                preferred = _traced_dtype(eqn.outvars[0])
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


def _fp8_matmul(eqn: Any, env: _Env) -> Any:
    """A ``dot_general`` under a float8 policy, scaled by its operands' current amax, or by
    its state in the ``fp8_state`` autocast was given (delayed scaling). The result is in
    the compute dtype, or wider where the traced program asked for it."""
    compute = env.policy.compute_dtype
    lhs, rhs = (_wide_operand(env, a, compute) for a in eqn.invars)
    preferred = eqn.params.get("preferred_element_type")
    out = preferred if is_narrower(compute, preferred) else compute
    if in_backward_pass(eqn):  # a gradient the function takes itself keeps its traced dtype
        out = _traced_dtype(eqn.outvars[0])
    assert env.policy.fp8 is not None
    dims = eqn.params["dimension_numbers"]
    return fp8_dot_general(
        lhs,
        rhs,
        dims,
        None,
        out,
        meta=fp8_state.meta_here(_source(env, lhs), _source(env, rhs)),
        margin=env.policy.fp8.margin,
        out_sharding=eqn.params.get("out_sharding"),
    )


# Equations that move or cast a value without computing: a GEMM's operand made by them
# from an argument (``x @ w.T``, a kernel cast or reshaped) is that argument's.
_MOVES = frozenset(
    {
        "convert_element_type",
        "transpose",
        "reshape",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "pvary",  # a replicated weight inside shard_map
    }
)


def _source(env: _Env, value: Any) -> Any:
    """The value ``value`` was moved or cast from, through ``_MOVES``."""
    for _ in range(16):
        entry = env.record.made.get(id(value))
        if entry is None or entry[0] is not value or entry[1].primitive.name not in _MOVES:
            return value
        value = entry[2][0]
    return value


def _traced_matmul(eqn: Any, env: _Env) -> list[Any]:
    """A matmul left as traced. One traced on 16-bit operands still accumulates in float32:
    it runs under the matmul rule in its traced dtype (a model's own ``jnp.einsum`` on
    16-bit activations, such as attention written out by hand), its result in the traced
    dtype (float32 where it asked for it), and its backward GEMMs on 16-bit operands too.
    The rule chooses its own dot algorithm, which also works around JAX asking XLA:CPU
    for one it rejects (``jax.nn.dot_product_attention`` in float16 states
    ``F16_F16_F32``, and fails to compile under ``jit`` on CPU). Others run as traced."""
    lhs_dtype, rhs_dtype = (_traced_dtype(a) for a in eqn.invars[:2])
    out_dtype = _traced_dtype(eqn.outvars[0])
    if not (
        is_16bit(lhs_dtype)
        and np.dtype(rhs_dtype) == np.dtype(lhs_dtype)
        and is_floating(out_dtype)
    ):
        return _as_traced(eqn, env)
    policy = dataclasses.replace(env.policy, compute_dtype=np.dtype(lhs_dtype))
    return cast_to_traced(_compute(eqn, _Env(AutocastConfig(policy, env.rules), env)), eqn.outvars)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _broadcast(x: Any, shape: tuple[int, ...], dims: tuple[int, ...]):
    return lax.broadcast_in_dim(x, shape, dims)


@_broadcast.defjvp
def _broadcast_jvp(shape, dims, primals, tangents):
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


def _broadcast_in_dim(eqn: Any, env: _Env) -> list[Any]:
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


def _elementwise(eqn: Any, env: _Env) -> list[Any]:
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


def _convert(eqn: Any, env: _Env) -> list[Any]:
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
        constants.note_kept_wide()
        return [np.asarray(value, jnp.promote_types(current, FLOAT32))]
    if (
        getattr(atom.aval, "weak_type", False)
        and is_16bit(new_dtype)
        and is_floating(current)
        and _may_overflow(env, value, new_dtype)
    ):
        # The same, computed from constants (``s + jnp.arange(n) * 1e5``) or selected by a
        # mask (``s + jnp.where(mask, 0.0, -1e9)``): kept wide.
        constants.note_kept_wide()
        return [lax.convert_element_type(value, jnp.promote_types(current, FLOAT32))]
    (out,) = bind(eqn, [value])
    if is_floating(current) and is_floating(new_dtype) and is_narrower(new_dtype, current):
        env.remember_wide(out, env.read(atom))
    return [out]


# The inputs whose size bounds an equation's output (``_Env.bound``).
_BOUND_OPERANDS: dict[str, Callable[[list[Any]], list[Any]]] = {
    **dict.fromkeys(
        (
            "broadcast_in_dim",
            "reshape",
            "squeeze",
            "expand_dims",
            "transpose",
            "rev",
            "copy",
            "copy_p",
            "slice",
            "reduce_precision",
            "neg",
            "abs",
            "convert_element_type",
        ),
        lambda inputs: inputs[:1],
    ),
    "dynamic_slice": lambda inputs: inputs[:1],
    "gather": lambda inputs: inputs[:1],
    "pad": lambda inputs: inputs[:2],
    "concatenate": lambda inputs: inputs,
    "select_n": lambda inputs: inputs[1:],
    "max": lambda inputs: inputs,
    "min": lambda inputs: inputs,
    "clamp": lambda inputs: inputs[1:2],
    "dynamic_update_slice": lambda inputs: inputs[:2],
    "mul": lambda inputs: inputs,
    "add": lambda inputs: inputs,
    "sub": lambda inputs: inputs,
}

_MATMULS = frozenset({lax.dot_general_p.name, lax.conv_general_dilated_p.name})
_RULES = {"compute": _compute, "float32": _float32, "promote": _promote, "traced": _as_traced}


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    config: AutocastConfig,
    record: _Record | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` with the autocast rules; returns its outputs.

    Where no policy of ``config`` narrows anything (``AutocastConfig.as_traced``: a
    float32 policy), the program is evaluated as traced, rules and all: the identity.
    ``record`` (internal) is the caller's, for calls evaluated inline."""
    if config.as_traced:
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    env = _Env(config, record=record)
    env.values.update(zip(jaxpr.constvars, consts, strict=True))
    env.values.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        higher_order = is_higher_order(eqn)
        with eqn_context(eqn):
            outs = _eval_eqn(eqn, env, higher_order)
        env.values.update(zip(eqn.outvars, outs, strict=True))
        env.remember_made(eqn, outs, higher_order)
    return [env.read(v) for v in jaxpr.outvars]


def _gather(eqn: Any, env: _Env) -> list[Any]:
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
    traced, arrived = _traced_dtype(table), env.dtype(table)
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
def _gather_summing_in_float32_jvp(eqn, primals, tangents):
    indices = primals[1:]
    t32 = bind(eqn, [tangents[0].astype(FLOAT32), *indices])[0]
    return bind(eqn, primals)[0], t32.astype(tangents[0].dtype)


def _is_float32_form(eqn: Any) -> bool:
    """Elementwise forms that PyTorch's autocast runs in float32 (its ``pow`` and ``rdiv``):
    a square ``x * x`` (norms, distances and variances written out overflow float16 at
    256) and a constant divided by a tensor (``1 / x``)."""
    name, atoms = eqn.primitive.name, eqn.invars
    if name == "mul" and len(atoms) == 2:
        return not isinstance(atoms[0], jex.core.Literal) and atoms[0] is atoms[1]
    if name == "div" and len(atoms) == 2:
        return _is_weak(atoms[0]) and not _is_weak(atoms[1])
    return False


def _eval_eqn(eqn: Any, env: _Env, higher_order: bool) -> list[Any]:
    if in_float32_scope(eqn):
        return _as_traced(eqn, env)
    name = eqn.primitive.name
    if name in _HIGHER_ORDER:
        return _HIGHER_ORDER[name](eqn, env)
    if higher_order:
        raise NotImplementedError(
            f"jaxamp cannot evaluate the higher-order primitive {name!r} (jax "
            f"{jax.__version__}) with its rules: it does not enter it, and passing it "
            "through would leave every matmul inside in the dtype it was traced in. Call "
            "the function that binds it outside jaxamp.autocast and apply_policy, or report "
            "it to jaxamp with your jax version."
        )
    if name == "convert_element_type":
        return _convert(eqn, env)
    rule = env.rules.rule_for(name)
    if rule == "promote" and _is_float32_form(eqn):
        return _float32(eqn, env)
    if rule == "promote" and name == "gather":
        return _gather(eqn, env)
    if rule == "traced" and name in _MATMULS:
        return _traced_matmul(eqn, env)
    if rule == "traced" and name == "scatter" and eqn.params.get("update_jaxpr") is None:
        # ``x.at[i].set(v)`` has no typed combiner: its inputs are promoted, so a fill
        # value float16 cannot hold (``.set(-1e9)``) keeps its value.
        return _promote(eqn, env)
    if rule == "promote" and name == "broadcast_in_dim":
        return _broadcast_in_dim(eqn, env)
    if rule == "promote" and name in _IMPLICIT_BROADCAST:
        return _elementwise(eqn, env)
    return _RULES[rule](eqn, env)


# --- Higher-order primitives ------------------------------------------------------------------


def _inline(key: str) -> Callable[[Any, _Env], list[Any]]:
    """A call (``jit``, ``closed_call``): its body is evaluated in place, with the rules."""

    def evaluate(eqn, env):
        if key not in eqn.params:
            return _as_traced(eqn, env)
        jaxpr, consts = open_jaxpr(eqn.params[key])
        args = [env.read(a) for a in eqn.invars]
        return eval_jaxpr(jaxpr, consts, args, env.config, env.record)

    return evaluate


def _checkpoint(eqn: Any, env: _Env) -> list[Any]:
    return _rematerialized(eqn.params["jaxpr"], eqn.params, eqn, env)


def _rematerialized(closed: Any, params: dict[str, Any], eqn: Any, env: _Env) -> list[Any]:
    """``jax.checkpoint`` rebuilt around the body, evaluated with the rules."""
    jaxpr, consts = open_jaxpr(closed)

    outer = [env.read(a) for a in eqn.invars]

    def body(*args):
        fp8_state.rename(fp8_state.active(), outer, args)  # the arguments keep their names
        return eval_jaxpr(jaxpr, consts, args, env.config)

    remat = jax.checkpoint(
        body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy")
    )
    return list(remat(*outer))


def _hi_primitive(eqn: Any, env: _Env) -> list[Any]:
    """A primitive of JAX's newer "hi" kind (``call_hi_primitive``), whose ``_prim`` says
    what it is. ``jax.checkpoint`` under ``jax_remat3`` is one (``RematTraced``, with
    the body and the policy): rebuilt as ``checkpoint`` is; ``jax.custom_vjp`` under
    ``jax_custom_vjp3`` is another (``CustomVJPTraced``). Any other is refused."""
    prim = eqn.params.get("_prim")
    kind = type(prim).__name__
    params = getattr(prim, "params", None) or {}
    if kind == "RematTraced" and "jaxpr" in params:
        return _rematerialized(params["jaxpr"], params, eqn, env)
    if kind == "CustomVJPTraced" and set(params) >= _CUSTOM_VJP3_PARAMS:
        return _custom_vjp3(prim, eqn, env)
    raise NotImplementedError(
        f"jaxamp cannot evaluate the higher-order primitive {kind!r} (call_hi_primitive, "
        f"jax {jax.__version__}) with its rules; passing it through would leave every "
        "matmul inside in the dtype it was traced in. Call the function that binds it "
        "outside jaxamp.autocast and apply_policy, or report it to jaxamp."
    )


_CUSTOM_VJP3_PARAMS = {"traced", "fwd", "bwd", "symbolic_zeros", "static_argnums", "opt_remat"}


def _ruled_function(fun: Callable[..., Any], config: AutocastConfig) -> Callable[..., Any]:
    """``fun`` (of array pytrees) traced and evaluated with the rules, its outputs cast
    back to their traced dtypes: the same signature, 16-bit inside."""

    def ruled(*args):
        closed, shape = jax.make_jaxpr(fun, return_shape=True)(*args)
        outs = jex.core.jaxpr_as_fun(_with_rules(closed, config))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(shape), outs)

    return ruled


def _custom_vjp3(prim: Any, eqn: Any, env: _Env) -> list[Any]:
    """A ``jax.custom_vjp`` function under ``jax_custom_vjp3`` (``CustomVJPTraced``):
    bound again as ``_custom_vjp`` does, with its primal and forward functions evaluated
    with the rules and its backward function as written."""
    config = without_fp8(env.config)
    p = prim.params
    if p["symbolic_zeros"]:
        raise NotImplementedError(
            "jaxamp cannot evaluate a jax.custom_vjp function defined with "
            "symbolic_zeros=True under jax_custom_vjp3 with its rules. Call it outside "
            "jaxamp.autocast and apply_policy, or report it to jaxamp."
        )
    static = frozenset(p["static_argnums"])
    values = [env.read_as(a, _traced_dtype(a)) for a in eqn.invars]
    args = jax.tree.unflatten(prim.in_tree, values)
    dynamic = [a for i, a in enumerate(args) if i not in static]
    traced = p["traced"]

    def primal(*dynamic):
        outs = jex.core.jaxpr_as_fun(_with_rules(traced.jaxpr, config))(*jax.tree.leaves(dynamic))
        return jax.tree.unflatten(traced.out_tree, outs)

    def fwd(*full):
        def fwd_of_dynamic(*dynamic):
            it = iter(dynamic)
            return p["fwd"](*[full[i] if i in static else next(it) for i in range(len(full))])

        return _ruled_function(fwd_of_dynamic, config)(
            *[a for i, a in enumerate(full) if i not in static]
        )

    rebuilt = type(prim)(
        jax.jit(primal).trace(*dynamic),
        fwd,
        p["bwd"],
        prim.in_avals,
        p["symbolic_zeros"],
        p["static_argnums"],
        p["opt_remat"],
    )
    return bind(eqn, values, {**eqn.params, "_prim": rebuilt})


def without_fp8(config: AutocastConfig) -> AutocastConfig:
    """``config`` for the inside of a ``custom_jvp``/``custom_vjp`` function: its GEMMs run
    under the 16-bit matmul rule, not in float8. A float8 GEMM has a custom VJP of its own,
    which JAX can neither differentiate in forward mode (a JVP rule's tangents) nor
    transpose; and a JVP rule runs instead of the body only under differentiation, so
    delayed scaling would find a different set of GEMMs in each."""
    if config.policy.fp8 is None:
        return config
    return dataclasses.replace(config, policy=dataclasses.replace(config.policy, fp8=None))


def _with_rules(closed: Any, config: AutocastConfig) -> Any:
    """``closed`` (a ``ClosedJaxpr``) evaluated with the rules and traced again, its
    outputs cast back to their traced dtypes: the same signature, 16-bit inside."""
    jaxpr, consts = open_jaxpr(closed)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]

    def body(*args):
        return cast_to_traced(eval_jaxpr(jaxpr, consts, args, config), jaxpr.outvars)

    return jax.make_jaxpr(body)(*specs)


def _custom_vjp(eqn: Any, env: _Env) -> list[Any]:
    """A ``jax.custom_vjp`` function: bound again with its primal and forward jaxprs
    evaluated with the rules (outputs and residuals cast back to their traced dtypes, so
    the signatures hold) and its backward function as written, in the dtypes it was
    traced in: a custom backward pass is the user's numerics. The forward jaxpr comes
    from ``fwd_jaxpr_thunk`` (a JAX-internal parameter); with other parameters (another
    JAX version) it is refused."""
    config = without_fp8(env.config)
    p = eqn.params
    if not {"call_jaxpr", "fwd_jaxpr_thunk", "bwd", "out_trees"} <= set(p):
        raise NotImplementedError(
            f"jaxamp cannot evaluate {eqn.primitive.name!r} with parameters "
            f"{sorted(p)} (jax {jax.__version__}) with its rules. Call the custom_vjp "
            "function outside jaxamp.autocast and apply_policy, or report it to jaxamp."
        )
    thunk = p["fwd_jaxpr_thunk"]

    def fwd_with_rules(*zeros):
        fwd = jex.core.ClosedJaxpr(*thunk.call_wrapped(*zeros))
        ruled = _with_rules(fwd, config)
        return ruled.jaxpr, ruled.consts

    params = dict(
        p,
        call_jaxpr=_with_rules(p["call_jaxpr"], config),
        fwd_jaxpr_thunk=jex.linear_util.wrap_init(
            fwd_with_rules, debug_info=getattr(thunk, "debug_info", None)
        ),
    )
    return bind(eqn, [env.read(a) for a in eqn.invars], params)


# Primitives whose jaxpr parameters are scalar combiners (a scatter's update, a generic
# reduction's monoid), not programs with matmuls: evaluated by their rules as they are.
_COMBINERS = frozenset(
    {"reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add"}
    | {"select_and_gather_add", "scatter", "scatter-add", "scatter_add", "scatter-mul"}
    | {"scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max"}
)


def is_higher_order(eqn: Any) -> bool:
    """Whether ``eqn`` calls a program of its own: a jaxpr, a function or a "hi"
    primitive among its parameters (a combiner's jaxpr does not count)."""
    if eqn.primitive.name in _COMBINERS:
        return False

    def holds_program(value: Any) -> bool:
        if isinstance(value, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
            return True
        if isinstance(value, (tuple, list)):
            return any(holds_program(v) for v in value)
        return type(value).__name__ in ("WrappedFun", "RematTraced") or hasattr(value, "vjp_fwd")

    return any(holds_program(v) for v in eqn.params.values())


def _closed_body(closed: Any, config: AutocastConfig) -> Callable[..., list[Any]]:
    """A function evaluating a ``ClosedJaxpr`` with the rules."""
    jaxpr, consts = open_jaxpr(closed)
    return lambda *args: eval_jaxpr(jaxpr, consts, args, config)


def _cast_to(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    """Floating ``values`` cast to ``dtypes`` (``None``: left as they are)."""
    return [
        lax.convert_element_type(v, d)
        if d is not None and is_floating(getattr(v, "dtype", None)) and np.dtype(v.dtype) != d
        else v
        for v, d in zip(values, dtypes, strict=True)
    ]


def _widened(dtypes: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """``dtypes``, each floating one promoted to its ``outs`` dtype where that is wider."""
    return [
        np.dtype(jnp.promote_types(d, o.dtype)) if is_narrower(d, o.dtype) else d
        for d, o in zip(dtypes, outs, strict=True)
    ]


def _output_dtypes(atoms: Sequence[Any], bodies: Sequence[Any], *cases: Any) -> list[Any]:
    """The dtypes control-flow outputs (a loop's carry, a ``cond``'s results) take: their
    traced dtypes, widened where a body holds a constant its 16-bit trace rounded to
    ``inf`` (``a + 1e5`` in float16) and so gives a wider value. ``cases`` are functions
    from the current dtypes to the abstract outputs of each body."""
    dtypes = [np.dtype(d) if is_floating(d := _traced_dtype(a)) else None for a in atoms]
    if not any(constants.may_keep_wide(open_jaxpr(b)[0]) for b in bodies):
        return dtypes
    for _ in range(len(dtypes) + 1):  # a loop's carry widens at most once per entry
        wider = dtypes
        with constants.watching() as kept:
            for case in cases:
                wider = _widened(wider, case(wider))
        if not kept or wider == dtypes:
            break
        dtypes = wider
    return dtypes


def _abstract(values: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    return [
        jax.ShapeDtypeStruct(np.shape(v), d if d is not None else jnp.result_type(v))
        for v, d in zip(values, dtypes, strict=True)
    ]


def _cond(eqn: Any, env: _Env) -> list[Any]:
    index, *operands = (env.read(a) for a in eqn.invars)
    closed = eqn.params["branches"]
    bodies = [_closed_body(b, env.config) for b in closed]
    dtypes = _output_dtypes(
        eqn.outvars,
        closed,
        *[lambda _, body=body: jax.eval_shape(body, *operands) for body in bodies],
    )
    branches = [lambda *a, body=body: _cast_to(body(*a), dtypes) for body in bodies]
    return list(lax.switch(index, branches, *operands))


def _while(eqn: Any, env: _Env) -> list[Any]:
    p = eqn.params
    values = [env.read(a) for a in eqn.invars]
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = values[:n_cond], values[n_cond : n_cond + n_body]
    carry = values[n_cond + n_body :]
    cond = _closed_body(p["cond_jaxpr"], env.config)
    body = _closed_body(p["body_jaxpr"], env.config)
    dtypes = _output_dtypes(
        eqn.outvars,
        [p["body_jaxpr"]],
        lambda d: jax.eval_shape(lambda c: body(*body_consts, *c), _abstract(carry, d)),
    )
    return list(
        lax.while_loop(
            lambda c: cond(*cond_consts, *c)[0],
            lambda c: _cast_to(body(*body_consts, *c), dtypes),
            _cast_to(carry, dtypes),
        )
    )


def _scan(eqn: Any, env: _Env) -> list[Any]:
    p = eqn.params
    values = [env.read(a) for a in eqn.invars]
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, carry, xs = (
        values[:n_consts],
        values[n_consts : n_consts + n_carry],
        values[n_consts + n_carry :],
    )
    body = _closed_body(p["jaxpr"], env.config)
    x_slices = [jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)) for x in xs]
    dtypes = _output_dtypes(
        eqn.outvars[:n_carry],
        [p["jaxpr"]],
        lambda d: jax.eval_shape(
            lambda c, x: body(*consts, *c, *x)[:n_carry], _abstract(carry, d), x_slices
        ),
    )

    def step(carry, xs):
        outs = body(*consts, *carry, *xs)
        return _cast_to(outs[:n_carry], dtypes), outs[n_carry:]

    carry, ys = lax.scan(
        step,
        _cast_to(carry, dtypes),
        xs,
        length=p["length"],
        reverse=p.get("reverse", False),
        unroll=p.get("unroll", 1),
    )
    return [*carry, *ys]


def _shard_map(eqn: Any, env: _Env) -> list[Any]:
    p = eqn.params
    axis_names = p.get("newly_manual_axes", p.get("manual_axes"))
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None or axis_names is None or not {"in_specs", "out_specs"} <= set(p):
        return _as_traced(eqn, env)  # another version's parameters: run it as traced
    jaxpr, consts = open_jaxpr(p["jaxpr"])

    outer = [env.read(a) for a in eqn.invars]

    def body(*args):
        fp8_state.rename(fp8_state.active(), outer, args)  # the arguments keep their names
        return tuple(eval_jaxpr(jaxpr, consts, args, env.config))

    mapped = shard_map(
        body,
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        axis_names=frozenset(axis_names),
        check_vma=p.get("check_vma", True),
    )
    return list(mapped(*outer))


def _zero_tangent(y: Any) -> Any:
    """A zero tangent for ``y``: ``float0`` zeros for an integer or boolean output."""
    if is_floating(getattr(y, "dtype", None)) or jnp.issubdtype(y.dtype, jnp.complexfloating):
        return jnp.zeros_like(y)
    return np.zeros(np.shape(y), jax.dtypes.float0)


def _tangent_like(t: Any, y: Any) -> Any:
    """The rule's tangent in ``y``'s dtype; a ``float0`` tangent (of an integer output) as is."""
    if is_floating(getattr(y, "dtype", None)) and is_floating(getattr(t, "dtype", None)):
        return t.astype(y.dtype)
    return t


_SUMS = primitive_names("reduce_sum_p", "cumsum_p", "cumlogsumexp_p")


def _custom_jvp(eqn: Any, env: _Env) -> list[Any]:
    """A ``jax.custom_jvp`` function (``relu``, ``logaddexp`` and so ``softplus``, ``mish``):
    rebuilt with ``jax.custom_jvp`` around its body and its JVP rule, both evaluated with
    the rules, so that the exponentials and logarithms inside run in float32 and a
    16-bit value passes through ``relu`` without a cast. Its outputs take the dtypes the
    evaluated body gives them, and the JVP's primal and tangent outputs are cast to
    those. The JVP rule's jaxpr comes from the equation's ``jvp_jaxpr_fun`` (a
    JAX-internal parameter); with other parameters (another JAX version) the function
    runs as traced."""
    config = without_fp8(env.config)
    p = eqn.params
    if not {"call_jaxpr", "jvp_jaxpr_fun", "num_consts"} <= set(p):
        return _as_traced(eqn, env)
    n_consts, jvp_jaxpr_fun = p["num_consts"], p["jvp_jaxpr_fun"]
    body, body_consts = open_jaxpr(p["call_jaxpr"])
    values = [env.read(a) for a in eqn.invars]

    def primal(consts, args):
        return eval_jaxpr(body, body_consts, [*consts, *args], config)

    @jax.custom_jvp
    def call(consts, args):
        return primal(consts, args)

    @call.defjvp
    def call_jvp(primals, tangents):
        consts, args = primals
        dtypes = [y.dtype for y in jax.eval_shape(primal, consts, args)]
        jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*[False] * len(args))
        # A rule that sums its tangent (softmax's) sums in float32: the transposed sum
        # of a 16-bit tangent would run in 16 bits. Others (relu's) take them as they are.
        if any(e.primitive.name in _SUMS for e in constants.equations(jaxpr)):
            tangents = (tangents[0], tuple(map(upcast, tangents[1])))
        outs = eval_jaxpr(jaxpr, jvp_consts, [*args, *tangents[1]], config)
        n = len(out_zeros)
        primals_out = [y.astype(d) for y, d in zip(outs[:n], dtypes, strict=True)]
        nonzero = iter(outs[n:])
        tangents_out = [
            _zero_tangent(y) if zero else _tangent_like(next(nonzero), y)
            for y, zero in zip(primals_out, out_zeros, strict=True)
        ]
        return primals_out, tangents_out

    return list(call(tuple(values[:n_consts]), tuple(values[n_consts:])))


# Keyed by name: primitive objects and their module paths move between JAX versions.
_HIGHER_ORDER: dict[str, Callable[[Any, _Env], list[Any]]] = {
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "checkpoint": _checkpoint,
    "remat2": _checkpoint,
    "cond": _cond,
    "while": _while,
    "scan": _scan,
    "shard_map": _shard_map,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "custom_vjp_call_jaxpr": _custom_vjp,
    "call_hi_primitive": _hi_primitive,
}
