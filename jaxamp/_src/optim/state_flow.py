"""Which leaves of an optax state are statistics: the data flow of ``init`` and ``update``.

A per-parameter statistic (Adam's ``mu``, momentum's ``trace``) is a recurrence: ``update``
computes its new value from its old one. A copy of the params or of the gradients
(L-BFGS's last ``params`` and ``updates``, Adan's ``g``, a line search's ``grad``) is
written over, or kept as it is; a copy of the params that ``init`` makes (SAM's cache,
schedule-free's ``z``) is computed from their values. Both are read here from jaxprs,
through the loops (``scan``, ``while``), branches and calls a transformation traces, so
they hold under ``jit``.

A value's sources are two bit masks over the jaxpr's inputs: those it equals, moved
(copied, reshaped, selected, converted, sliced), and those it is computed from (through
arithmetic). Bit 0 stands for a higher-order primitive this module cannot read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from jaxamp._src.dtypes import is_floating_array
from jaxamp._src.jaxprs import open_jaxpr
from jaxamp._src.optim.loss_scaled import _gradient_structure

Flow = tuple[int, int]  # (sources moved here unchanged, sources computed from): bit masks
_NONE: Flow = (0, 0)
UNKNOWN = 1  # bit 0: computed by a higher-order primitive not read here

# Primitives whose outputs are (parts of) their data operands' values, unchanged but for
# their dtype. Operands not listed as data (a select's predicate, indices) only decide
# where a value goes; they are no source of it.
_MOVES = frozenset(
    {
        "broadcast_in_dim",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "device_put",
        "dynamic_slice",
        "dynamic_update_slice",
        "expand_dims",
        "gather",
        "optimization_barrier",
        "pad",
        "reduce_precision",
        "reshape",
        "rev",
        "scatter",
        "select_n",
        "sharding_constraint",
        "slice",
        "squeeze",
        "stop_gradient",
        "transpose",
    }
)
_DATA: dict[str, Callable[[list[Flow]], list[Flow]]] = {
    "select_n": lambda ins: ins[1:],
    "dynamic_slice": lambda ins: ins[:1],
    "gather": lambda ins: ins[:1],
    "dynamic_update_slice": lambda ins: ins[:2],
    "scatter": lambda ins: [ins[0], ins[2]],
}
_ONE_TO_ONE = frozenset({"device_put", "optimization_barrier"})  # several operands, in order


def _join(flows: Sequence[Flow]) -> Flow:
    moved = mixed = 0
    for m, x in flows:
        moved, mixed = moved | m, mixed | x
    return moved, mixed


def _computed(flows: Sequence[Flow]) -> Flow:
    moved, mixed = _join(flows)
    return 0, moved | mixed


def _jaxprs_in(params: dict[str, Any]) -> bool:
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(open_jaxpr(item)[0], "eqns"):
                return True
    return False


def _call(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs on its own operands (``jit``, ``remat``,
    ``custom_jvp_call``, ``custom_vjp_call``...), or ``None``."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(name)
        if sub is not None and hasattr(open_jaxpr(sub)[0], "eqns"):
            inner = open_jaxpr(sub)[0]
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars):
                return inner
    return None


def _loop(
    body: Any, consts: list[Flow], carry: list[Flow], xs: list[Flow], unread: list[str]
) -> list[Flow]:
    """A loop's carry, then its stacked outputs: the body's flow iterated to a fixed point
    (a value reaches the carry on any trip, or never: the carry's initial value stays)."""
    while True:
        out = flows(body, consts + carry + xs, unread)
        joined = [_join(pair) for pair in zip(carry, out, strict=False)]
        if joined == carry:
            return carry + out[len(carry) :]
        carry = joined


def _eqn(eqn: Any, ins: list[Flow], unread: list[str]) -> list[Flow]:
    name, params, n = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name in _ONE_TO_ONE and len(ins) == n:
        return list(ins)
    if name in _MOVES:
        return [_join(_DATA.get(name, list)(ins))] * n
    if name == "cond":
        branches = [flows(b, ins[1:], unread) for b in params["branches"]]
        return [_join(outs) for outs in zip(*branches, strict=True)]
    if name == "while":
        consts = ins[params["cond_nconsts"] :][: params["body_nconsts"]]
        carry = ins[params["cond_nconsts"] + params["body_nconsts"] :]
        return _loop(params["body_jaxpr"], consts, carry, [], unread)
    if name == "scan":
        k, c = params["num_consts"], params["num_carry"]
        return _loop(params["jaxpr"], ins[:k], ins[k : k + c], ins[k + c :], unread)
    sub = _call(eqn)
    if sub is not None:
        return flows(sub, ins, unread)
    if _jaxprs_in(params):  # shard_map, a custom linear solve...: unread
        if name not in unread:
            unread.append(name)
        moved, mixed = _join(ins)
        return [(0, moved | mixed | UNKNOWN)] * n
    return [_computed(ins)] * n


def flows(jaxpr: Any, inputs: Sequence[Flow], unread: list[str] | None = None) -> list[Flow]:
    """The sources of each output of ``jaxpr``, given those of its inputs; the names of
    the higher-order primitives not read here are appended to ``unread``."""
    unread = [] if unread is None else unread
    jaxpr = open_jaxpr(jaxpr)[0]
    env: dict[Any, Flow] = dict(zip(jaxpr.invars, inputs, strict=True))
    read = lambda v: env.get(v, _NONE) if isinstance(v, jex.core.Var) else _NONE
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if any(m or x for m, x in ins):
            env.update(zip(eqn.outvars, _eqn(eqn, ins, unread), strict=True))
    return [read(v) for v in jaxpr.outvars]


def _spec(x: Any) -> Any:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x


def params_copies(init: Callable[[Any], Any], params: Any) -> list[bool]:
    """Per leaf of ``init(params)``: whether its value is computed from, or is, the
    params' values (SAM's ``cache``, Prodigy's ``params0``, schedule-free's ``z``, a
    float32 master, a copy carried through a loop): a copy of the params, never a
    statistic, whatever its shape. Statistics start from the params' shapes alone
    (``jnp.zeros_like``)."""
    closed = jax.make_jaxpr(init)(jax.tree.map(_spec, params))
    n = len(closed.jaxpr.invars)
    return [bool(m | x) for m, x in flows(closed, [(0, 2)] * n)]


def follows_params(init: Any, params: Any) -> list[bool] | None:
    """Per leaf of ``init(params)``: whether its shape changes when the params' shapes do
    (``init`` traced on params one axis longer). Per-parameter statistics follow the
    params; an optimizer-wide scalar (Prodigy's ``estim_lr``, D-Adaptation's numerator)
    does not, though with a single scalar param it has the param's shape. ``None``
    when the state of the longer params has another structure."""
    spec = lambda x: jax.ShapeDtypeStruct((2, *np.shape(x)), x.dtype) if hasattr(x, "dtype") else x
    try:
        longer = jax.eval_shape(init, jax.tree.map(spec, params))
        state = jax.eval_shape(init, params)
    except Exception:  # an init that needs its own shapes: no information
        return None
    if jax.tree.structure(longer) != jax.tree.structure(state):  # type: ignore[operator]
        return None
    return [
        np.shape(a) != np.shape(b)
        for a, b in zip(jax.tree.leaves(longer), jax.tree.leaves(state), strict=True)
    ]


def _stand_in_loss(params: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(params) if is_floating_array(x)]
    return sum((0.5 * jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves), jnp.float32(0))


def stand_ins(updates: Any) -> list[dict[str, Any]]:
    """The extra arguments optax's transformations take, as stand-ins to trace ``update``
    with (which state leaves it computes from their old values does not depend on what
    they are): none; the line searches' ``value``, ``grad`` and ``value_fn`` (which
    refuse any other); ``reduce_on_plateau``'s ``value``; Sophia's ``obj_fn``; SAM's
    opaque ``grad_fn``."""
    value, loss = jnp.float32(0), _stand_in_loss
    grad_fn = lambda params, _: jax.grad(loss)(params)
    line_search = {"value": value, "grad": updates, "value_fn": loss}
    return [{}, line_search, {"value": value}, {"obj_fn": loss}, {"grad_fn": grad_fn}]


def recurrences(
    update: Callable[..., Any], updates: Any, state: Any, params: Any, extra_args: dict[str, Any]
) -> list[bool | str]:
    """Per leaf of ``state``: whether ``update`` computes its new value from its old one
    (a statistic: a recurrence through arithmetic); where that cannot be told (the value
    goes through a higher-order primitive not read here), that primitive's name. A leaf
    written over from the updates, the params or anything else, or kept, selected or
    moved as it is, is no statistic. Raises whatever tracing ``update`` raises."""
    fun = lambda u, s, p: update(u, s, p, **extra_args)
    args = jax.tree.map(_spec, (updates, state, params))
    closed, (_, new_state) = jax.make_jaxpr(fun, return_shape=True)(*args)
    if jax.tree.structure(new_state) != jax.tree.structure(state):  # type: ignore[operator]
        raise ValueError(
            f"update returned a state of another structure: {jax.tree.structure(new_state)}"
        )
    n_updates, n_state = len(jax.tree.leaves(updates)), len(jax.tree.leaves(state))
    # bit 1: the updates, params and extra arguments; bit 2 + i: the old state's leaf i
    inputs: list[Flow] = [(2, 0)] * len(closed.jaxpr.invars)
    for i in range(n_state):
        inputs[n_updates + i] = (1 << (2 + i), 0)
    unread: list[str] = []
    outs = flows(closed, inputs, unread)[len(closed.jaxpr.outvars) - n_state :]
    return [
        ", ".join(unread) if (m | x) & UNKNOWN else bool(x >> (2 + i) & 1)
        for i, (m, x) in enumerate(outs)
    ]


def update_flow(
    update: Callable[..., Any], state: Any, params: Any
) -> list[bool | str] | Exception:
    """``recurrences`` of ``update`` on ``state`` and gradients shaped like ``params``,
    traced with no extra arguments, then with each set of ``stand_ins``; or the error of
    the first try."""
    updates = _gradient_structure(params)  # optax.lookahead's gradients: the fast params
    errors: list[Exception] = []
    for extra_args in stand_ins(updates):
        try:
            return recurrences(update, updates, state, params, extra_args)
        except Exception as e:  # an update that needs other extra arguments
            errors.append(e)
    return errors[0]  # stand_ins tries the call with no extra arguments first
