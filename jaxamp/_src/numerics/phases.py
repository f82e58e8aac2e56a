"""Which equations of ``jax.value_and_grad``'s program are the forward pass: those the
function's value depends on, not the derivatives the forward sweep computes for the
backward pass."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.extend as jex

from jaxamp._src.jaxprs import equations, open_jaxpr, sub_jaxprs

CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
CHECKPOINTS = ("checkpoint", "remat2")
SHARD_MAP = "shard_map"  # its body's outputs are its outputs, per shard
CUSTOM = {
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def inner_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs an equation calls, whose outputs are its outputs (one per branch for
    ``cond``; a ``shard_map``'s body, which computes them shard by shard); ``[]`` for
    primitives without one, and for loops (handled whole)."""
    name, params = eqn.primitive.name, eqn.params
    if name in CALLS and CALLS[name] in params:
        return [params[CALLS[name]]]
    if name == SHARD_MAP and params.get("jaxpr") is not None:
        return [params["jaxpr"]]
    if name in CHECKPOINTS:
        return [params["jaxpr"]]
    if name in CUSTOM and params.get(CUSTOM[name]) is not None:
        return [params[CUSTOM[name]]]
    if name == "cond":
        return list(params["branches"])
    return []


def primal_equations(jaxpr: Any, needed: Sequence[bool]) -> tuple[set[int], list[bool]]:
    """The equations (by ``id``) that the ``needed`` outputs of ``jaxpr`` depend on, and
    which of its inputs they read. Inside a ``while`` loop every equation counts when
    any of the loop's outputs is needed (a loop JAX cannot differentiate computes no
    derivatives)."""
    live = {v for v, n in zip(jaxpr.outvars, needed, strict=True) if n and not literal(v)}
    found: set[int] = set()
    for eqn in reversed(jaxpr.eqns):
        flags = [v in live for v in eqn.outvars]
        if not any(flags):
            continue
        found.add(id(eqn))
        if eqn.primitive.name == "scan":
            ids, reads = _scan_primal(eqn, flags)
            found |= ids
            live |= {a for a, r in zip(eqn.invars, reads, strict=True) if r and not literal(a)}
            continue
        inners = inner_jaxprs(eqn)
        if not inners:
            if eqn.primitive.name == "while":
                found |= _all_equations(eqn)
            live |= {a for a in eqn.invars if not literal(a)}
            continue
        reads = [False] * len(eqn.invars)
        offset = 1 if eqn.primitive.name == "cond" else 0  # the branch index
        if offset:
            reads[0] = True
        for closed in inners:
            inner, _ = open_jaxpr(closed)
            ids, inner_reads = primal_equations(inner, flags)
            found |= ids
            for i, r in enumerate(inner_reads):
                reads[i + offset] = reads[i + offset] or r
        live |= {a for a, r in zip(eqn.invars, reads, strict=True) if r and not literal(a)}
    return found, [v in live for v in jaxpr.invars]


def _scan_primal(eqn: Any, needed: Sequence[bool]) -> tuple[set[int], list[bool]]:
    """``primal_equations`` of a scan's body: a carry the next iteration reads to
    compute a needed value is needed too, until nothing more is (a fixed point)."""
    body, _ = open_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    out_needed = list(needed)
    while True:
        ids, reads = primal_equations(body, out_needed)
        carried = [out_needed[j] or reads[n_consts + j] for j in range(n_carry)]
        if carried == out_needed[:n_carry]:
            return ids, reads
        out_needed[:n_carry] = carried


def _all_equations(eqn: Any) -> set[int]:
    """The ids of ``eqn`` and of every equation inside it."""
    return {id(eqn), *(id(e) for sub in sub_jaxprs(eqn) for e in equations(sub))}


def literal(atom: Any) -> bool:
    return isinstance(atom, jex.core.Literal)
