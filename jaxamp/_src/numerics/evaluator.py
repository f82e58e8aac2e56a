"""Evaluating a loss and its gradient one primitive at a time, on concrete values, for the
numerics tools (a debugging path: nothing here runs in a training step)."""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._src.dtypes import FLOAT32, is_16bit, is_inexact, upcast_16bit
from jaxamp._src.jaxprs import is_backward_name, open_jaxpr, sub_jaxprs
from jaxamp._src.numerics import phases, sources
from jaxamp._src.numerics.shards import (
    Shards,
    bind_eqn,
    current,
    from_shards,
    inside,
    lead,
    same_on_every_shard,
    shards_of,
    to_shards,
)
from jaxamp._src.numerics.sites import Site, Tagger, Visitor, layer


class _Stop(Exception):
    pass


@dataclasses.dataclass
class _Context:
    visit: Visitor
    primal: set[int] | None = None
    tagger: Tagger | None = None
    rules: Callable[[], dict[Any, str]] | None = None  # custom_vjp backward rules


def _join(prefix: str, eqn: Any) -> str:
    stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
    return "/".join(p for p in (prefix, stack) if p)


_WIDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_widen", default=False)


def _bind_widened(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn`` computed in float32 where the program computes in 16 bits: its 16-bit
    inputs and the 16-bit dtypes among its parameters (a convert's target, a dot's
    preferred result) widened, so that a value past float16's range shows its size
    rather than an inf. ``reduce_precision`` passes its input through. A primitive that
    refuses the widened operands runs as traced."""
    if eqn.primitive.name == "reduce_precision":
        return [upcast_16bit(invals[0])]
    params = {k: (FLOAT32 if is_16bit(v) else v) for k, v in eqn.params.items()}
    try:
        return bind_eqn(eqn, [upcast_16bit(v) for v in invals], params)
    except (TypeError, ValueError):
        traced = [
            v.astype(a.aval.dtype) if hasattr(v, "astype") and hasattr(a, "aval") else v
            for v, a in zip(invals, eqn.invars, strict=True)
        ]
        return bind_eqn(eqn, traced)


def _site(eqn: Any, stack: str, iteration: tuple[int, ...], ctx: _Context, where: str) -> Site:
    backward = is_backward_name(stack) or (ctx.primal is not None and id(eqn) not in ctx.primal)
    return Site(
        primitive=eqn.primitive.name,
        phase="backward" if backward else "forward",
        layer=layer(stack, eqn.primitive.name),
        source=sources.source(eqn, ctx.rules if backward else None, where),
        name_stack=stack,
        iteration=iteration,
        sixteen_bit=tuple(is_16bit(getattr(v.aval, "dtype", None)) for v in eqn.outvars),
        eqn=eqn,
    )


def in_float32(site: Site, inputs: Sequence[Any]) -> list[Any]:
    """The outputs of the primitive at ``site`` on ``inputs``, computed in float32 where
    the program computes in 16 bits (see ``_bind_widened``)."""
    return _bind_widened(site.eqn, inputs)


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    ctx: _Context,
    prefix: str = "",
    iteration: tuple[int, ...] = (),
    tags: Sequence[Any] | None = None,
    where: str = "",
) -> tuple[list[Any], list[Any]]:
    """Evaluates ``jaxpr`` on concrete ``args`` (tagged ``tags``), calling
    ``ctx.visit(site, inputs, outputs)`` after each primitive; a visitor that returns
    ``True`` stops the evaluation (``run`` then returns early). Returns the outputs
    and their tags (all ``None`` without a tagger). ``where``: the source of the call
    ``jaxpr`` is the body of, for equations whose own traceback shows no model code."""
    values: dict[Any, Any] = {}
    tagged: dict[Any, Any] = {}
    constant = ctx.tagger.constant if ctx.tagger is not None else None

    shards = current()

    def read(atom: Any) -> Any:
        if not isinstance(atom, jex.core.Literal):
            return values[atom]
        if shards is None:
            return atom.val
        value = jnp.asarray(atom.val, getattr(atom.aval, "dtype", None))
        return jnp.broadcast_to(value, shards.sizes + value.shape)  # the same on every shard

    if shards is not None:  # a constant is the same on every shard
        consts = [jnp.broadcast_to(c, shards.sizes + jnp.shape(c)) for c in consts]

    def tag(atom: Any) -> Any:
        return constant if isinstance(atom, jex.core.Literal) else tagged.get(atom)

    values.update(zip(jaxpr.constvars, consts, strict=True))
    values.update(zip(jaxpr.invars, args, strict=True))
    tagged.update((v, constant) for v in jaxpr.constvars)
    tagged.update(zip(jaxpr.invars, tags or [None] * len(args), strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        outs, out_tags = _evaluate_eqn(
            eqn, invals, [tag(a) for a in eqn.invars], ctx, _join(prefix, eqn), iteration, where
        )
        values.update(zip(eqn.outvars, outs, strict=True))
        tagged.update(zip(eqn.outvars, out_tags, strict=True))
    return [read(v) for v in jaxpr.outvars], [tag(v) for v in jaxpr.outvars]


def _inner(
    closed: Any,
    invals: Sequence[Any],
    tags: Sequence[Any] | None,
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    jaxpr, consts = open_jaxpr(closed)
    return evaluate(jaxpr, consts, invals, ctx, stack, iteration, tags, where)


def _evaluate_eqn(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    name = eqn.primitive.name
    inners = phases.inner_jaxprs(eqn)
    if inners or name in ("scan", "while"):
        where = sources.own_source(eqn) or where
    if name == "cond":
        index, *operands = invals
        chosen = same_on_every_shard(index)
        if chosen is not None:
            branch = inners[int(np.clip(int(chosen), 0, len(inners) - 1))]
            return _inner(branch, operands, tags[1:], ctx, stack, iteration, where)
        # shards that take different branches: the cond runs whole
    elif name == "shard_map":
        shards = shards_of(eqn)
        if shards is not None:
            return _shard_map(eqn, shards, invals, tags, ctx, stack, iteration, where)
    elif inners:
        return _inner(inners[0], invals, tags, ctx, stack, iteration, where)
    if name == "scan":
        return _scan(eqn, invals, tags, ctx, stack, iteration, where)
    if name == "while":
        return _while(eqn, invals, tags, ctx, stack, iteration, where)
    return _primitive(eqn, invals, tags, ctx, stack, iteration, where)


def _shard_map(
    eqn: Any,
    shards: Shards,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    """A ``shard_map``'s body evaluated on its shards (see ``Shards``)."""
    p = eqn.params
    args = [to_shards(x, s, shards) for x, s in zip(invals, p["in_specs"], strict=True)]
    with inside(shards):
        outs, out_tags = _inner(p["jaxpr"], args, tags, ctx, stack, iteration, where)
    outs = [from_shards(o, s, shards) for o, s in zip(outs, p["out_specs"], strict=True)]
    return outs, out_tags


def _primitive(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    """One primitive (or an equation run whole), visited and tagged."""
    outs = _bind_widened(eqn, invals) if _WIDEN.get() else bind_eqn(eqn, invals)
    site = _site(eqn, stack, iteration, ctx, where)
    if ctx.visit(site, invals, outs):
        raise _Stop
    if ctx.tagger is None:
        return outs, [None] * len(outs)
    out_tags, stop = ctx.tagger.op(site, tags, invals, outs)
    if stop:
        raise _Stop
    return outs, out_tags


def _scan(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry = invals[:n_consts], list(invals[n_consts : n_consts + n_carry])
    const_tags, carry_tags = tags[:n_consts], list(tags[n_consts : n_consts + n_carry])
    xs, xs_tags = invals[n_consts + n_carry :], tags[n_consts + n_carry :]
    ys: list[list[Any]] = []
    ys_tags: list[list[Any]] = []
    order = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
    n_lead = lead()  # the shards' axes come first inside a shard_map
    for i in order:
        operands = [*consts, *carry, *(x[(slice(None),) * n_lead + (i,)] for x in xs)]
        outs, out_tags = _inner(
            p["jaxpr"],
            operands,
            [*const_tags, *carry_tags, *xs_tags],
            ctx,
            stack,
            (*iteration, i),
            where,
        )
        carry, y = outs[:n_carry], outs[n_carry:]
        carry_tags = out_tags[:n_carry]
        ys.append(y)
        ys_tags.append(out_tags[n_carry:])
    if p.get("reverse", False):
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [
        jnp.stack([y[j] for y in ys], axis=n_lead) if ys else _empty(eqn.outvars[n_carry + j].aval)
        for j in range(n_ys)
    ]
    merged = [
        ctx.tagger.merge([t[j] for t in ys_tags]) if ctx.tagger is not None else None
        for j in range(n_ys)
    ]
    return [*carry, *stacked], [*carry_tags, *merged]


def _empty(aval: Any) -> Any:
    """The stacked output of a scan of no iterations: ``aval``'s shape and dtype (per
    shard inside a ``shard_map``)."""
    shards = current()
    return jnp.zeros((shards.sizes if shards is not None else ()) + aval.shape, aval.dtype)


def _while(
    eqn: Any,
    invals: Sequence[Any],
    tags: Sequence[Any],
    ctx: _Context,
    stack: str,
    iteration: tuple[int, ...],
    where: str,
) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    body_tags = tags[n_cond : n_cond + n_body]
    carry, carry_tags = list(invals[n_cond + n_body :]), list(tags[n_cond + n_body :])
    quiet = _Context(lambda *_: None)  # the loop's condition is not part of the model
    i = 0
    while True:
        pred = _inner(p["cond_jaxpr"], [*cond_consts, *carry], None, quiet, stack, iteration, where)
        go = same_on_every_shard(pred[0][0])
        if go is None:  # shards that stop at different iterations: the rest runs whole
            rest = [*cond_consts, *body_consts, *carry]
            rest_tags = [*tags[:n_cond], *body_tags, *carry_tags]
            return _primitive(eqn, rest, rest_tags, ctx, stack, (*iteration, i), where)
        if not bool(go):
            break
        carry, carry_tags = _inner(
            p["body_jaxpr"],
            [*body_consts, *carry],
            [*body_tags, *carry_tags],
            ctx,
            stack,
            (*iteration, i),
            where,
        )
        i += 1
    return carry, carry_tags


def run(
    jaxpr: Any,
    args: Sequence[Any],
    visit: Visitor,
    primal_outputs: int | None = None,
    widen: bool = False,
    tagger: Tagger | None = None,
    rules: Callable[[], dict[Any, str]] | None = None,
) -> tuple[list[Any], list[Any]] | None:
    """Evaluates a ``ClosedJaxpr`` on ``args``: its outputs and their tags (``None``
    without a ``tagger``), or ``None`` when the visitor or the tagger stopped it.

    ``widen``: compute what the program computes in 16 bits in float32 instead (see
    ``_bind_widened``), so that a visitor sees how large those values get.

    ``primal_outputs``: how many of the outputs are the function's value (the rest being
    its gradient); equations the value does not depend on are reported as backward.
    ``None``: every equation outside a transpose is forward.

    ``rules``: where each ``custom_vjp``'s backward rule is, per call site
    (``sources.custom_vjp_rules`` of the forward program), to name the rule as the
    source of its equations; called only when one is met."""
    inner, consts = open_jaxpr(jaxpr)
    primal = None
    if primal_outputs is not None:
        needed = [i < primal_outputs for i in range(len(inner.outvars))]
        primal = phases.primal_equations(inner, needed)[0]
    token = _WIDEN.set(widen)
    try:
        return evaluate(inner, consts, args, _Context(visit, primal, tagger, rules))
    except _Stop:
        return None
    finally:
        _WIDEN.reset(token)


# Control flow whose evaluation here reads a value (a cond's index, a loop's condition,
# a shard's view of its inputs): a program holding one is evaluated eagerly.
_READS_VALUES = frozenset({"cond", "while", "shard_map"})
# The most equations an unrolled staged evaluation may hold (scans run iteration by
# iteration here, so a long scan would compile one copy of its body per iteration).
STAGED_EQUATIONS = 20_000


def _unrolled(jaxpr: Any) -> int | None:
    """How many equations evaluating ``jaxpr`` binds (each scan's body once per
    iteration), or ``None`` when it holds control flow that reads a value."""
    total = 0
    for eqn in open_jaxpr(jaxpr)[0].eqns:
        if eqn.primitive.name in _READS_VALUES:
            return None
        inner = [_unrolled(sub) for sub in sub_jaxprs(eqn)]
        if any(n is None for n in inner):
            return None
        count = sum(n for n in inner if n is not None) or 1
        total += count * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    return total


def stageable(jaxpr: Any) -> bool:
    """Whether ``run`` can evaluate ``jaxpr`` inside ``jax.jit`` (one compiled program
    instead of one per primitive): no ``cond``, ``while`` or ``shard_map``, whose
    evaluation here reads values, and at most ``STAGED_EQUATIONS`` equations unrolled.
    Its visitor then sees tracers, and may only keep them (to return from the jit)."""
    n = _unrolled(jaxpr)
    return n is not None and n <= STAGED_EQUATIONS


def finite(x: Any) -> bool:
    """Whether every element of a floating value is finite (non-floating values are); a
    literal of the program counts by its dtype (JAX gives its Python scalars one)."""
    return not is_inexact(getattr(x, "dtype", None)) or bool(np.all(np.isfinite(np.asarray(x))))
