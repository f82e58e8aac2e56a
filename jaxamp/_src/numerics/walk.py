"""Evaluating a loss and its gradient one primitive at a time, on concrete values.

The numerics tools (:func:`jaxamp.find_nonfinite`, :func:`jaxamp.range_report`,
:func:`jaxamp.numerics_diff`) trace ``jax.value_and_grad(fun)`` once, exactly as
the training step would (``tracing.py``), then evaluate the program's equations
one by one, handing each primitive's inputs and outputs to a visitor with where
it runs: forward or backward, the layer (from the name stack that Flax Linen,
``jax.named_scope`` and, through ``tracing.layer_scopes``, NNX leave), the
primitive, and the source line. Calls, ``checkpoint`` and custom derivatives are
entered; ``cond`` takes the branch the values select; ``scan`` and
``while`` loops run iteration by iteration, so a fault is found in the
iteration that makes it. A :class:`Tagger` can follow values through the program
(``find_nonfinite`` follows where each inf and NaN comes from).

This is a debugging path: nothing here runs in a training step.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._src.audit import short_name
from jaxamp._src.autocast_interpreter import _bind, _open
from jaxamp._src.numerics import phases, sources

LOSS_SCALE_SCOPE = "jaxamp_loss_scale"  # the multiplication of the loss by the loss scale


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a primitive runs.

    Attributes:
      primitive: the JAX primitive (``"log"``, ``"dot_general"``...).
      phase: ``"forward"`` or ``"backward"`` (the gradient's computation).
      layer: the module path, e.g. ``"Model/Dense_0"``; ``""`` outside any layer.
      source: ``file:line (function)`` of the user code that traced it.
      name_stack: the name stack JAX recorded, in full.
      iteration: the loop iterations it runs in (outermost first), ``()`` outside loops.
      sixteen_bit: per output, whether the program holds it in a 16-bit type (when
        evaluated widened, the value seen is its float32 counterpart).
      eqn: the equation itself (for :func:`in_float32`).
    """

    primitive: str
    phase: str
    layer: str
    source: str
    name_stack: str
    iteration: tuple[int, ...] = ()
    sixteen_bit: tuple[bool, ...] = ()
    eqn: Any = dataclasses.field(default=None, repr=False, compare=False)


Visitor = Callable[[Site, Sequence[Any], Sequence[Any]], bool | None]


class _Stop(Exception):
    pass


class Tagger(Protocol):
    """Follows values through an evaluation: each value carries a tag, which the tagger
    computes for every primitive's outputs from its inputs' tags.

    Attributes:
      constant: the tag of a literal or a constant of the program (the arguments'
        tag is ``None``).
    """

    constant: Any

    def op(
        self, site: Site, tags: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any]
    ) -> tuple[list[Any], bool]:
        """The outputs' tags, and whether to stop the evaluation."""
        ...

    def merge(self, tags: Sequence[Any]) -> Any:
        """The tag of a scan's stacked output, from its iterations' (``[]``: none ran)."""
        ...


@dataclasses.dataclass
class _Context:
    visit: Visitor
    primal: set[int] | None = None
    tagger: Tagger | None = None
    rules: Callable[[], dict[Any, str]] | None = None  # custom_vjp backward rules


def _join(prefix: str, eqn: Any) -> str:
    stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
    return "/".join(p for p in (prefix, stack) if p)


def _layer(stack: str, primitive: str) -> str:
    """The layer path of a name stack. A module that evaluates its call again inside its
    own scope (``jaxamp.nnx``'s policy interprets the call it traced) repeats its name;
    the repeats are one layer. ``jnp.einsum``'s scope (its spec) belongs to the layer
    that calls it."""
    # jnp.einsum names a scope after its spec ("...qhd,...khd->...hqk"): not a layer
    parts = short_name(f"f/{stack}/{primitive}").split("/")
    parts = [p for p in parts if "->" not in p and p != LOSS_SCALE_SCOPE]
    return "/".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])


_WIDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxamp_widen", default=False)
_SIXTEEN = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _is_sixteen(dtype: Any) -> bool:
    try:
        return np.dtype(dtype) in _SIXTEEN
    except TypeError:
        return False


def _widened(value: Any) -> Any:
    if _is_sixteen(getattr(value, "dtype", None)):
        return value.astype(jnp.float32) if hasattr(value, "astype") else np.float32(value)
    return value


def _bind_widened(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """``eqn`` computed in float32 where the program computes in 16 bits: its 16-bit
    inputs and the 16-bit dtypes among its parameters (a convert's target, a dot's
    preferred result) widened, so that a value past float16's range shows its size
    rather than an inf. ``reduce_precision`` passes its input through. A primitive that
    refuses the widened operands runs as traced."""
    if eqn.primitive.name == "reduce_precision":
        return [_widened(invals[0])]
    params = {k: (np.dtype(jnp.float32) if _is_sixteen(v) else v) for k, v in eqn.params.items()}
    try:
        return _bind(eqn, [_widened(v) for v in invals], params)
    except (TypeError, ValueError):
        traced = [
            v.astype(a.aval.dtype) if hasattr(v, "astype") and hasattr(a, "aval") else v
            for v, a in zip(invals, eqn.invars, strict=True)
        ]
        return _bind(eqn, traced)


def _site(eqn: Any, stack: str, iteration: tuple[int, ...], ctx: _Context, where: str) -> Site:
    backward = "transpose(" in stack or (ctx.primal is not None and id(eqn) not in ctx.primal)
    return Site(
        primitive=eqn.primitive.name,
        phase="backward" if backward else "forward",
        layer=_layer(stack, eqn.primitive.name),
        source=sources.source(eqn, ctx.rules if backward else None, where),
        name_stack=stack,
        iteration=iteration,
        sixteen_bit=tuple(_is_sixteen(getattr(v.aval, "dtype", None)) for v in eqn.outvars),
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
    ``True`` stops the evaluation (:func:`run` then returns early). Returns the outputs
    and their tags (all ``None`` without a tagger). ``where``: the source of the call
    ``jaxpr`` is the body of, for equations whose own traceback shows no model code."""
    values: dict[Any, Any] = {}
    tagged: dict[Any, Any] = {}
    constant = ctx.tagger.constant if ctx.tagger is not None else None

    def read(atom):
        return atom.val if isinstance(atom, jex.core.Literal) else values[atom]

    def tag(atom):
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


def _inner(closed: Any, invals, tags, ctx, stack, iteration, where) -> tuple[list, list]:
    jaxpr, consts = _open(closed)
    return evaluate(jaxpr, consts, invals, ctx, stack, iteration, tags, where)


def _evaluate_eqn(eqn, invals, tags, ctx, stack, iteration, where) -> tuple[list, list]:
    name = eqn.primitive.name
    inners = phases.inner_jaxprs(eqn)
    if inners or name in ("scan", "while"):
        where = sources.own_source(eqn) or where
    if name == "cond":
        index, *operands = invals
        branch = inners[int(np.clip(int(index), 0, len(inners) - 1))]
        return _inner(branch, operands, tags[1:], ctx, stack, iteration, where)
    if inners:
        return _inner(inners[0], invals, tags, ctx, stack, iteration, where)
    if name == "scan":
        return _scan(eqn, invals, tags, ctx, stack, iteration, where)
    if name == "while":
        return _while(eqn, invals, tags, ctx, stack, iteration, where)
    outs = _bind_widened(eqn, invals) if _WIDEN.get() else _bind(eqn, invals)
    site = _site(eqn, stack, iteration, ctx, where)
    if ctx.visit(site, invals, outs):
        raise _Stop
    if ctx.tagger is None:
        return outs, [None] * len(outs)
    out_tags, stop = ctx.tagger.op(site, tags, invals, outs)
    if stop:
        raise _Stop
    return outs, out_tags


def _scan(eqn, invals, tags, ctx, stack, iteration, where) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry = invals[:n_consts], list(invals[n_consts : n_consts + n_carry])
    const_tags, carry_tags = tags[:n_consts], list(tags[n_consts : n_consts + n_carry])
    xs, xs_tags = invals[n_consts + n_carry :], tags[n_consts + n_carry :]
    ys: list[list[Any]] = []
    ys_tags: list[list[Any]] = []
    order = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
    for i in order:
        operands = [*consts, *carry, *(x[i] for x in xs)]
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
        jnp.stack([y[j] for y in ys]) if ys else jnp.zeros(eqn.outvars[n_carry + j].aval.shape)
        for j in range(n_ys)
    ]
    merged = [
        ctx.tagger.merge([t[j] for t in ys_tags]) if ctx.tagger is not None else None
        for j in range(n_ys)
    ]
    return [*carry, *stacked], [*carry_tags, *merged]


def _while(eqn, invals, tags, ctx, stack, iteration, where) -> tuple[list[Any], list[Any]]:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    body_tags = tags[n_cond : n_cond + n_body]
    carry, carry_tags = list(invals[n_cond + n_body :]), list(tags[n_cond + n_body :])
    quiet = _Context(lambda *_: None)  # the loop's condition is not part of the model
    i = 0
    while bool(
        _inner(p["cond_jaxpr"], [*cond_consts, *carry], None, quiet, stack, iteration, where)[0][0]
    ):
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
    inner, consts = _open(jaxpr)
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


def is_floating(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def finite(x: Any) -> bool:
    """Whether every element of a floating value is finite (non-floating values are)."""
    return not is_floating(x) or bool(np.all(np.isfinite(np.asarray(x))))
