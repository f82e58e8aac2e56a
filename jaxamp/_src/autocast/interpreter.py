"""The core of the autocast interpreter: one program's values, the rule tables, ``eval_jaxpr``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np
from jax import lax

from jaxamp._src.autocast.context import CallContext
from jaxamp._src.dtypes import is_floating
from jaxamp._src.errors import invalid_choice
from jaxamp._src.jaxprs import bind, eqn_context, in_float32_scope, in_scopes, scope_path

# The JAX docs' "custom Jaxpr interpreter": a traced program is evaluated equation by
# equation, each primitive bound again on inputs cast by its rule (first_order.py);
# higher-order primitives are entered (higher_order.py) or refused, never passed through.

# --- What one evaluation knows ----------------------------------------------------------------

# Equations that move or cast a value without computing: a GEMM's operand made by them
# from an argument (``x @ w.T``, a kernel cast or reshaped) is that argument's.
MOVES = frozenset(
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


class Env:
    """Values of one jaxpr's variables, and the casts made of them (each made once), with
    the ``CallContext`` of the call evaluating it (``env.context``), which every program
    evaluated inside takes in turn."""

    def __init__(
        self,
        context: CallContext,
        parent: Env | None = None,
        record: _Record | None = None,
    ):
        self.policy, self.rules = context.config.policy, context.config.rules
        self.context = context
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

    def source(self, value: Any, also: frozenset[str] = frozenset()) -> Any:
        """The value ``value`` was moved or cast from, through ``MOVES`` (and ``also``)."""
        for _ in range(16):
            entry = self.record.made.get(id(value))
            if entry is None or entry[0] is not value:
                return value
            if entry[1].primitive.name not in MOVES and entry[1].primitive.name not in also:
                return value
            value = entry[2][0]
        return value

    def concrete(self, value: Any, limit: int = 1 << 20) -> Any:
        """``value`` computed now, as the program wrote it, if it depends on no input of
        the function (``jnp.arange(n) * 1e5``) and has at most ``limit`` elements; else
        ``None``."""
        if isinstance(value, jex.core.Literal):
            written = self.context.written_value(value)
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
            written = self.context.written_value(atom)
            return atom.val if written is None else written
        return self.values[atom]

    def dtype(self, atom: Any) -> Any:
        if isinstance(atom, jex.core.Literal):
            written = self.context.written_value(atom)
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


# The inputs whose size bounds an equation's output (``Env.bound``).
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


def traced_dtype(atom: Any) -> Any:
    """The dtype ``atom`` had in the traced program (``None`` where it has none)."""
    return getattr(atom.aval, "dtype", None)


def cast_to_traced(values: Sequence[Any], atoms: Sequence[Any]) -> list[Any]:
    """Casts floating ``values`` to the dtypes ``atoms`` had in the traced program."""
    out = []
    for value, atom in zip(values, atoms, strict=True):
        dtype = traced_dtype(atom)
        current = getattr(value, "dtype", None)
        if is_floating(dtype) and is_floating(current) and np.dtype(current) != np.dtype(dtype):
            value = lax.convert_element_type(value, dtype)
        out.append(value)
    return out


def as_traced(eqn: Any, env: Env) -> list[Any]:
    """The ``traced`` rule, and every equation in a float32 scope: ``eqn`` bound on its
    inputs cast back to their traced dtypes."""
    return bind(eqn, [env.read_as(a, traced_dtype(a)) for a in eqn.invars])


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


# --- The rule tables --------------------------------------------------------------------------

Handler = Callable[[Any, Env], list[Any]]
"""Evaluates one equation in an ``Env``: ``handler(eqn, env)`` returns its outputs' values."""

RULES = ("compute", "float32", "promote", "traced")
"""The rules ``AutocastRules.rule_for`` gives a primitive."""

# First-order handlers by (primitive name, rule): how an equation of that primitive runs
# when the rule table gives it that rule. ``(None, rule)`` holds the rule's own handler,
# for every primitive without one of its own. A handler for a special form (a square
# ``x * x`` under ``promote``) decides from the equation and calls the rule's handler
# for the equations that are not one.
_FIRST_ORDER: dict[tuple[str | None, str], Handler] = {}

# Higher-order handlers by primitive name, under every rule: each enters the programs its
# equation calls. Keyed by name: primitive objects and their module paths move between
# JAX versions.
_HIGHER_ORDER: dict[str, Handler] = {}

# first_order.py and higher_order.py fill both tables as they are imported. They import
# this module and it imports neither (no cycle); api.py imports both, and any import of
# this module runs ``jaxamp/__init__.py`` first, which imports api.py: no evaluation finds
# the tables empty.


def _check_rule(rule: str) -> None:
    if rule not in RULES:
        raise invalid_choice("autocast rule", rule, RULES, quote=True)


def register_rule(rule: str) -> Callable[[Handler], Handler]:
    """A decorator registering a handler as ``rule``'s own: it evaluates every primitive
    under ``rule`` that has no handler of its own for that rule."""
    _check_rule(rule)

    def register(handler: Handler) -> Handler:
        _FIRST_ORDER[None, rule] = handler
        return handler

    return register


def register_first_order(rule: str, *primitives: str) -> Callable[[Handler], Handler]:
    """A decorator registering a handler for each primitive name in ``primitives`` under
    ``rule``: the key ``(primitive, rule)`` of the first-order table."""
    _check_rule(rule)

    def register(handler: Handler) -> Handler:
        for primitive in primitives:
            _FIRST_ORDER[primitive, rule] = handler
        return handler

    return register


def register_higher_order(*primitives: str) -> Callable[[Handler], Handler]:
    """A decorator registering a handler for each higher-order primitive name in
    ``primitives``, whatever rule the table gives it."""

    def register(handler: Handler) -> Handler:
        for primitive in primitives:
            _HIGHER_ORDER[primitive] = handler
        return handler

    return register


def eval_jaxpr(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    context: CallContext,
    record: _Record | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``args`` with the autocast rules and what the call gave it
    (``context``: a handler passes its ``env.context``); returns its outputs.

    Where no policy of ``context.config`` narrows anything (``AutocastConfig.as_traced``:
    a float32 policy), the program is evaluated as traced, rules and all: the identity.
    ``record`` (internal) is the caller's, for calls evaluated inline."""
    if context.config.as_traced:
        return jax.core.eval_jaxpr(jaxpr, consts, *args)
    env = Env(context, record=record)
    env.values.update(zip(jaxpr.constvars, consts, strict=True))
    env.values.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        higher_order = is_higher_order(eqn)
        with eqn_context(eqn):
            outs = _eval_eqn(eqn, env, higher_order)
        env.values.update(zip(eqn.outvars, outs, strict=True))
        env.remember_made(eqn, outs, higher_order)
        if context.weights is not None:
            inputs = [env.read(a) for a in eqn.invars]
            context.weights.after(eqn, inputs, outs, env.source)
    return [env.read(v) for v in jaxpr.outvars]


def _eval_eqn(eqn: Any, env: Env, higher_order: bool) -> list[Any]:
    """``eqn``'s outputs from its handler: as traced in a float32 scope; a higher-order
    primitive's from ``_HIGHER_ORDER`` (refused without an entry there); any other's
    from ``_FIRST_ORDER``, for its primitive and rule or else for its rule."""
    if in_float32_scope(eqn):
        return as_traced(eqn, env)
    scopes = env.context.config.float32_scopes
    if scopes and (id(eqn) in env.context.float32_eqns or in_scopes(scope_path(eqn), scopes)):
        return as_traced(eqn, env)  # an override's scope (an equation a rule re-traced: its own)
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
    rule = env.rules.rule_for(name)
    handler = _FIRST_ORDER.get((name, rule)) or _FIRST_ORDER[None, rule]
    return handler(eqn, env)
