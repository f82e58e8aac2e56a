"""Which GEMMs of one call are against a weight: those a float8 or block format runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.extend as jex

from jaxamp._src.jaxprs import equations, sub_jaxprs

# The GEMMs: their outputs are activations, and so is every value computed from one.
GEMMS = frozenset({"dot_general", "conv_general_dilated"})
# Calls evaluated in place (``higher_order._inline``), each with the parameter holding its
# body: their equations are recorded one by one, and their outputs are those equations'
# own values (an argument passed through too).
INLINE_CALLS = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
}


class Weights:
    """What one call's evaluation learns about its GEMMs' operands, for the formats.

    A float8 or block-scaled format runs a GEMM against a weight, as TransformerEngine
    and torchao run linear layers: one operand computed from no GEMM's output (an
    argument, a constant, a kernel cast, reshaped or normalised) and not an embedding
    table. A product of two activations (attention's scores and values, each operand
    downstream of a projection) and a tied head (the table the call also looks rows up
    in, by ``gather``) stay in the compute dtype, as under the Linen and NNX policies.

    ``activations`` holds the values downstream of a GEMM, ``tables`` the values looked
    up by ``gather`` (through casts and reshapes), each by ``id`` with the value kept so
    that the id stays its own. Loop and call bodies take their arguments' kinds from the
    values they were entered with (``enter``).
    """

    def __init__(self) -> None:
        self.activations: dict[int, Any] = {}
        self.tables: dict[int, Any] = {}
        # ``id(body argument): (body argument, what it was entered with)``: a table looked
        # up inside a body (a lookup under ``remat`` or in a branch) is one outside too.
        self._entered: dict[int, tuple[Any, Any]] = {}

    def is_weight(self, value: Any, source: Any) -> bool:
        """Whether ``value`` (moved or cast from ``source``) is a weight."""
        return not _holds(self.activations, value) and not _holds(self.tables, source)

    def after(
        self,
        eqn: Any,
        inputs: Sequence[Any],
        outs: Sequence[Any],
        source: Callable[[Any], Any],
    ) -> None:
        """Records what ``eqn`` made of ``inputs``: its outputs are activations if it is a
        GEMM, holds one in a body, or takes an activation; ``source(value)`` is the value
        ``value`` was moved or cast from (for a lookup, its table)."""
        name = eqn.primitive.name
        if name == "gather" or _is_row_lookup(eqn):
            self._table(source(inputs[0]))
        if name in INLINE_CALLS:
            return
        self.mark(outs, output_kinds(eqn, [_holds(self.activations, v) for v in inputs]))

    def enter(self, outer: Sequence[Any], inner: Sequence[Any], sources: Sequence[Any]) -> None:
        """The arguments ``inner`` of a body take the kinds of the values ``outer`` it
        was entered with, position by position; ``sources``: what each of ``outer`` was
        moved or cast from, which becomes a table where the body looks rows up in its
        argument."""
        for old, new, source in zip(outer, inner, sources, strict=True):
            if _holds(self.activations, old):
                _add(self.activations, [new])
            if _holds(self.tables, old) or _holds(self.tables, source):
                _add(self.tables, [new])
            if source is not new:
                self._entered[id(new)] = (new, source)

    def _table(self, value: Any) -> None:
        """Marks ``value`` a table, and the values outside the bodies it was entered with."""
        for _ in range(64):  # bodies nest a few deep
            _add(self.tables, [value])
            entry = self._entered.get(id(value))
            if entry is None or entry[0] is not value:
                return
            value = entry[1]

    def is_activation(self, value: Any) -> bool:
        return _holds(self.activations, value)

    def mark(self, values: Iterable[Any], activation: Iterable[bool]) -> None:
        """Marks each of ``values`` whose flag in ``activation`` is set as an activation."""
        _add(self.activations, [v for v, a in zip(values, activation, strict=True) if a])


# What a GEMM's operand may be cut from and still be its table's (a padded vocabulary's
# head, ``h @ table[:n].T``), besides moves and casts.
TABLE_CUTS = frozenset({"slice"})


def _is_row_lookup(eqn: Any) -> bool:
    """Whether ``eqn`` reads one row of a matrix at an index computed at run time
    (``table[token]``, which JAX writes as a ``dynamic_slice``): a lookup, as ``gather``
    is. A slice of a stack of matrices (``ws[i]``, a loop's layer) is not one."""
    if eqn.primitive.name != "dynamic_slice":
        return False
    shape: tuple[int, ...] = tuple(getattr(eqn.invars[0].aval, "shape", ()))
    sizes = tuple(eqn.params.get("slice_sizes", ()))
    return len(shape) == 2 and sizes == (1, shape[-1])


def holds_a_gemm(eqn: Any) -> bool:
    """Whether one of the programs ``eqn`` holds (a call's, a loop's body) has a GEMM."""
    return any(e.primitive.name in GEMMS for sub in sub_jaxprs(eqn) for e in equations(sub))


def carried_activations(
    body: Any, before: Sequence[bool], carry: Sequence[bool], after: Sequence[bool]
) -> list[bool]:
    """Which carries of a loop are activations: those entered as one, and those its
    ``body`` (a jaxpr taking ``[*before, *carry, *after]``, returning the carry first)
    rewrites from a GEMM's output or from another such carry, whatever the iteration. A
    loop's counter is not one, so a weight sliced by it (``ws[i]``) stays a weight."""
    kinds = list(carry)
    for _ in range(len(kinds) + 1):
        outs = _downstream_outputs(body, [*before, *kinds, *after])[: len(kinds)]
        grown = [k or o for k, o in zip(kinds, outs, strict=True)]
        if grown == kinds:
            break
        kinds = grown
    return kinds


def output_kinds(eqn: Any, inputs: Sequence[bool]) -> list[bool]:
    """For each output of ``eqn``, whether it is an activation, given which of its inputs
    are (``inputs``): a GEMM's are; a call's, a branch's or a loop's follow their bodies'
    data flow, so a weight a body passes through stays a weight; another equation's are
    if an input is, or (a program it holds, unknown here) if it holds a GEMM."""
    name, p, n = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name in GEMMS:
        return [True] * n
    body = next((p[k] for k in _BODY.get(name, ()) if k in p), None)
    if body is not None and _fits(body, len(inputs), n):
        return _downstream_outputs(body, inputs)
    if name == "cond" and all(_fits(b, len(inputs) - 1, n) for b in p["branches"]):
        outs = [_downstream_outputs(b, inputs[1:]) for b in p["branches"]]
        return [any(kinds) for kinds in zip(*outs, strict=True)]
    if name == "scan" and _fits(p["jaxpr"], len(inputs), n):
        c, k = p["num_consts"], p["num_carry"]
        carry = carried_activations(p["jaxpr"], inputs[:c], inputs[c : c + k], inputs[c + k :])
        return [
            *carry,
            *_downstream_outputs(p["jaxpr"], [*inputs[:c], *carry, *inputs[c + k :]])[k:],
        ]
    if name == "while":
        start = p["cond_nconsts"]
        stop = start + p["body_nconsts"]
        if _fits(p["body_jaxpr"], len(inputs) - start, n):
            return carried_activations(p["body_jaxpr"], inputs[start:stop], inputs[stop:], [])
    return [any(inputs) or holds_a_gemm(eqn)] * n


# The parameter holding the body of a call-like primitive, whose arguments are the
# equation's inputs and whose outputs are its outputs, one for one.
_BODY = {
    **{name: (key,) for name, key in INLINE_CALLS.items()},
    "checkpoint": ("jaxpr",),
    "remat2": ("jaxpr",),
    "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr", "call_jaxpr"),
    "custom_jvp_call": ("call_jaxpr",),
    "shard_map": ("jaxpr",),
}


def _fits(body: Any, n_in: int, n_out: int) -> bool:
    jaxpr = getattr(body, "jaxpr", body)
    invars, outvars = getattr(jaxpr, "invars", None), getattr(jaxpr, "outvars", None)
    return (
        invars is not None
        and outvars is not None
        and (len(invars), len(outvars))
        == (
            n_in,
            n_out,
        )
    )


def _downstream_outputs(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr`` (open or closed), whether it is an activation, given
    which of its inputs are (``inputs``): ``output_kinds``, equation by equation."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    marked = {v for v, m in zip(jaxpr.invars, inputs, strict=True) if m}
    for eqn in jaxpr.eqns:
        kinds = [not isinstance(a, jex.core.Literal) and a in marked for a in eqn.invars]
        marked.update(v for v, k in zip(eqn.outvars, output_kinds(eqn, kinds), strict=True) if k)
    return [not isinstance(v, jex.core.Literal) and v in marked for v in jaxpr.outvars]


def _holds(kind: dict[int, Any], value: Any) -> bool:
    entry = kind.get(id(value))
    return entry is not None and entry is value


def _add(kind: dict[int, Any], values: Iterable[Any]) -> None:
    for value in values:
        if not isinstance(value, jex.core.Literal):
            kind[id(value)] = value
