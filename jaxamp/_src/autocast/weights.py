"""Which GEMMs of one call are against a weight: those a float8 or block format runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax.extend as jex

from jaxamp._src.jaxprs import equations, sub_jaxprs

# The GEMMs: their outputs are activations, and so is every value computed from one.
GEMMS = frozenset({"dot_general", "conv_general_dilated"})
# Calls evaluated in place (``higher_order._inline``): their equations are recorded one by
# one, and their outputs are those equations' own values (an argument passed through too).
INLINE_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})


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

    def after(self, eqn: Any, inputs: Sequence[Any], outs: Sequence[Any], source: Any) -> None:
        """Records what ``eqn`` made of ``inputs``: its outputs are activations if it is a
        GEMM, holds one in a body, or takes an activation; ``source`` is the value its
        first input was moved or cast from (the table of a ``gather``)."""
        name = eqn.primitive.name
        if name == "gather":
            self._table(source)
        if name in INLINE_CALLS:
            return
        if name in GEMMS or any(_holds(self.activations, v) for v in inputs) or holds_a_gemm(eqn):
            _add(self.activations, outs)

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


def _downstream_outputs(jaxpr: Any, inputs: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr`` (open or closed), whether it is computed from a GEMM
    or from an input whose flag in ``inputs`` is set."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    marked = {v for v, m in zip(jaxpr.invars, inputs, strict=True) if m}
    for eqn in jaxpr.eqns:
        variables = [a for a in eqn.invars if not isinstance(a, jex.core.Literal)]
        if eqn.primitive.name in GEMMS or holds_a_gemm(eqn) or any(a in marked for a in variables):
            marked.update(eqn.outvars)
    return [not isinstance(v, jex.core.Literal) and v in marked for v in jaxpr.outvars]


def _holds(kind: dict[int, Any], value: Any) -> bool:
    entry = kind.get(id(value))
    return entry is not None and entry is value


def _add(kind: dict[int, Any], values: Iterable[Any]) -> None:
    for value in values:
        if not isinstance(value, jex.core.Literal):
            kind[id(value)] = value
