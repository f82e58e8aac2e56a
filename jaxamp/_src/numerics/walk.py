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
iteration that makes it.

This is a debugging path: nothing here runs in a training step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._src.audit import short_name
from jaxamp._src.autocast_interpreter import _bind, _open

LOSS_SCALE_SCOPE = "jaxamp_loss_scale"  # the multiplication of the loss by the loss scale
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_CHECKPOINTS = ("checkpoint", "remat2")
_CUSTOM = {
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


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
    """

    primitive: str
    phase: str
    layer: str
    source: str
    name_stack: str
    iteration: tuple[int, ...] = ()
    sixteen_bit: tuple[bool, ...] = ()


Visitor = Callable[[Site, Sequence[Any], Sequence[Any]], bool | None]


class _Stop(Exception):
    pass


def _source(eqn: Any) -> str:
    """The first frame of model code (outside JAX, installed packages and jaxamp's
    machinery; jaxamp's reference models count as model code) that traced ``eqn``,
    else the first frame outside JAX. JAX keeps the innermost frames only
    (``jax_traceback_in_locations_limit``), so a deep stack may show library code."""
    from jax._src import source_info_util  # private: the traceback's frames

    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    if traceback is None:
        return ""
    try:
        frames = list(source_info_util.user_frames(traceback))
    except Exception:
        return ""
    library = (os.sep + "site-packages" + os.sep, os.sep + "jaxamp" + os.sep + "_src" + os.sep)
    models = os.sep + "jaxamp" + os.sep + "_src" + os.sep + "models" + os.sep  # model code

    def own_code(name: str) -> bool:
        return models in name or not any(part in name for part in library)

    own = [f for f in frames if own_code(f.file_name)]
    frame = (own or frames or [None])[0]
    if frame is None:
        return ""
    name = frame.file_name
    with contextlib.suppress(ValueError):  # another drive on Windows
        if os.path.abspath(name).startswith(os.getcwd() + os.sep):
            name = os.path.relpath(name)
    return f"{name}:{frame.start_line} ({frame.function_name})"


def _join(prefix: str, eqn: Any) -> str:
    stack = str(getattr(getattr(eqn, "source_info", None), "name_stack", "") or "")
    return "/".join(p for p in (prefix, stack) if p)


def _inner_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs an equation calls, whose outputs are its outputs (one per branch for
    ``cond``); ``[]`` for primitives without one, and for loops (handled whole)."""
    name, params = eqn.primitive.name, eqn.params
    if name in _CALLS and _CALLS[name] in params:
        return [params[_CALLS[name]]]
    if name in _CHECKPOINTS:
        return [params["jaxpr"]]
    if name in _CUSTOM and params.get(_CUSTOM[name]) is not None:
        return [params[_CUSTOM[name]]]
    if name == "cond":
        return list(params["branches"])
    return []


def primal_equations(jaxpr: Any, needed: Sequence[bool]) -> tuple[set[int], list[bool]]:
    """The equations (by ``id``) that the ``needed`` outputs of ``jaxpr`` depend on, and
    which of its inputs they read.

    In ``jax.value_and_grad``'s program the forward sweep computes the loss and, beside
    it, the derivatives the backward pass will use (``0.5 / sqrt(x)`` for ``sqrt``);
    only the first are the forward pass. Equations inside a loop are all counted when
    any of the loop's outputs is needed."""
    live = {v for v, n in zip(jaxpr.outvars, needed, strict=True) if n and not _literal(v)}
    found: set[int] = set()
    for eqn in reversed(jaxpr.eqns):
        flags = [v in live for v in eqn.outvars]
        if not any(flags):
            continue
        found.add(id(eqn))
        inners = _inner_jaxprs(eqn)
        if not inners:
            if eqn.primitive.name in ("scan", "while"):
                found |= _all_equations(eqn)
            live |= {a for a in eqn.invars if not _literal(a)}
            continue
        reads = [False] * len(eqn.invars)
        offset = 1 if eqn.primitive.name == "cond" else 0  # the branch index
        if offset:
            reads[0] = True
        for closed in inners:
            inner, _ = _open(closed)
            ids, inner_reads = primal_equations(inner, flags)
            found |= ids
            for i, r in enumerate(inner_reads):
                reads[i + offset] = reads[i + offset] or r
        live |= {a for a, r in zip(eqn.invars, reads, strict=True) if r and not _literal(a)}
    return found, [v in live for v in jaxpr.invars]


def _all_equations(eqn: Any) -> set[int]:
    found = {id(eqn)}
    for value in eqn.params.values():
        for closed in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(closed, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
                for inner in _open(closed)[0].eqns:
                    found |= _all_equations(inner)
    return found


def _literal(atom: Any) -> bool:
    return isinstance(atom, jex.core.Literal)


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


def _site(eqn: Any, stack: str, iteration: tuple[int, ...], primal: set[int] | None) -> Site:
    backward = "transpose(" in stack or (primal is not None and id(eqn) not in primal)
    phase = "backward" if backward else "forward"
    return Site(
        primitive=eqn.primitive.name,
        phase=phase,
        layer=_layer(stack, eqn.primitive.name),
        source=_source(eqn),
        name_stack=stack,
        iteration=iteration,
        sixteen_bit=tuple(_is_sixteen(getattr(v.aval, "dtype", None)) for v in eqn.outvars),
    )


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    visit: Visitor,
    prefix: str = "",
    iteration: tuple[int, ...] = (),
    primal: set[int] | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on concrete ``args``, calling ``visit(site, inputs, outputs)``
    after each primitive; a visitor that returns ``True`` stops the evaluation
    (:func:`run` then returns early)."""
    values: dict[Any, Any] = {}

    def read(atom):
        return atom.val if isinstance(atom, jex.core.Literal) else values[atom]

    values.update(zip(jaxpr.constvars, consts, strict=True))
    values.update(zip(jaxpr.invars, args, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        stack = _join(prefix, eqn)
        outs = _evaluate_eqn(eqn, invals, visit, stack, iteration, primal)
        values.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _inner(closed: Any, invals, visit, stack, iteration, primal) -> list[Any]:
    jaxpr, consts = _open(closed)
    return evaluate(jaxpr, consts, invals, visit, stack, iteration, primal)


def _evaluate_eqn(eqn, invals, visit, stack, iteration, primal) -> list[Any]:
    name, params = eqn.primitive.name, eqn.params
    if name in _CALLS and _CALLS[name] in params:
        return _inner(params[_CALLS[name]], invals, visit, stack, iteration, primal)
    if name in _CHECKPOINTS:
        return _inner(params["jaxpr"], invals, visit, stack, iteration, primal)
    if name in _CUSTOM and params.get(_CUSTOM[name]) is not None:
        return _inner(params[_CUSTOM[name]], invals, visit, stack, iteration, primal)
    if name == "cond":
        index, *operands = invals
        branch = params["branches"][int(np.clip(int(index), 0, len(params["branches"]) - 1))]
        return _inner(branch, operands, visit, stack, iteration, primal)
    if name == "scan":
        return _scan(eqn, invals, visit, stack, iteration, primal)
    if name == "while":
        return _while(eqn, invals, visit, stack, iteration, primal)
    outs = _bind_widened(eqn, invals) if _WIDEN.get() else _bind(eqn, invals)
    if visit(_site(eqn, stack, iteration, primal), invals, outs):
        raise _Stop
    return outs


def _scan(eqn, invals, visit, stack, iteration, primal) -> list[Any]:
    p = eqn.params
    n_consts, n_carry, length = p["num_consts"], p["num_carry"], p["length"]
    consts, carry = invals[:n_consts], list(invals[n_consts : n_consts + n_carry])
    xs = invals[n_consts + n_carry :]
    ys: list[list[Any]] = []
    order = range(length - 1, -1, -1) if p.get("reverse", False) else range(length)
    for i in order:
        operands = [*consts, *carry, *(x[i] for x in xs)]
        outs = _inner(p["jaxpr"], operands, visit, stack, (*iteration, i), primal)
        carry, y = outs[:n_carry], outs[n_carry:]
        ys.append(y)
    if p.get("reverse", False):
        ys.reverse()
    n_ys = len(eqn.outvars) - n_carry
    stacked = [
        jnp.stack([y[j] for y in ys]) if ys else jnp.zeros(eqn.outvars[n_carry + j].aval.shape)
        for j in range(n_ys)
    ]
    return [*carry, *stacked]


def _while(eqn, invals, visit, stack, iteration, primal) -> list[Any]:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    carry = list(invals[n_cond + n_body :])
    quiet: Visitor = lambda *_: None  # the loop's condition is not part of the model
    i = 0
    while bool(_inner(p["cond_jaxpr"], [*cond_consts, *carry], quiet, stack, iteration, None)[0]):
        carry = _inner(
            p["body_jaxpr"], [*body_consts, *carry], visit, stack, (*iteration, i), primal
        )
        i += 1
    return carry


def run(
    jaxpr: Any,
    args: Sequence[Any],
    visit: Visitor,
    primal_outputs: int | None = None,
    widen: bool = False,
):
    """Evaluates a ``ClosedJaxpr`` on ``args``; ``None`` when the visitor stopped it.

    ``widen``: compute what the program computes in 16 bits in float32 instead (see
    ``_bind_widened``), so that a visitor sees how large those values get.

    ``primal_outputs``: how many of the outputs are the function's value (the rest being
    its gradient); equations the value does not depend on are reported as backward.
    ``None``: every equation outside a transpose is forward."""
    inner, consts = _open(jaxpr)
    primal = None
    if primal_outputs is not None:
        needed = [i < primal_outputs for i in range(len(inner.outvars))]
        primal = primal_equations(inner, needed)[0]
    token = _WIDEN.set(widen)
    try:
        return evaluate(inner, consts, args, visit, primal=primal)
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
