"""FP8 state under ``autocast``: a dict of one ``Fp8State`` per GEMM, keyed by its operands."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxamp._src.errors import guide
from jaxamp._src.ops.fp8_state import (
    Fp8State,
    as_fp8_state,
    checked_fp8_state,
    init_gemm_fp8_state,
    max_combined,
    warn_if_state_is_not_differentiated,
)


@dataclasses.dataclass
class Store:
    """One call's FP8 state: ``state`` (``None`` while ``init_fp8_state`` collects the keys),
    the names of the call's arrays (``id: (array, [names])``, an array passed twice has
    two), and how many GEMMs each pair of operand names has had so far. The call makes it
    and hands it to its own evaluation alone (``CallContext.fp8``)."""

    state: Mapping[str, Any] | None
    history_length: int
    names: dict[int, tuple[Any, list[str]]] = dataclasses.field(default_factory=dict)
    collected: dict[str, Fp8State] = dataclasses.field(default_factory=dict)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _argument_names(args: Any, kwargs: Any) -> dict[int, tuple[Any, list[str]]]:
    """``id(array): (array, names)`` for the arrays among a call's arguments, named by where
    they sit: ``args[0]['w1']``, ``kwargs['params']['Dense_0']['kernel']``."""
    names: dict[int, tuple[Any, list[str]]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if _is_array(leaf):
            head = "args" if path[0].idx == 0 else "kwargs"
            names.setdefault(id(leaf), (leaf, []))[1].append(head + jax.tree_util.keystr(path[1:]))
    return names


def _distinct(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` with an array that sits at several places of plain containers
    (tied weights, one array passed twice) copied at each place after its first, so that
    every place is a value of its own, named by its place, as the separate tracers ``jit``
    makes of it are. Other objects (an NNX module, whose updates must reach the caller's)
    are passed as they are, and without a repeated array nothing is rebuilt."""
    opaque = lambda x: not isinstance(x, (Mapping, list, tuple))
    leaves = jax.tree.leaves((args, kwargs), is_leaf=opaque)
    arrays = [id(x) for x in leaves if _is_array(x)]
    if len(set(arrays)) == len(arrays):
        return args, kwargs
    seen: set[int] = set()

    def one(leaf: Any) -> Any:
        if not _is_array(leaf):
            return leaf
        if id(leaf) in seen:
            return leaf.copy()
        seen.add(id(leaf))
        return leaf

    return jax.tree.map(one, (args, kwargs), is_leaf=opaque)


def _named(store: Store, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` as ``_distinct`` gives them, their arrays' names in ``store``."""
    args, kwargs = _distinct(args, kwargs)
    store.names = _argument_names(args, kwargs)
    return args, kwargs


def _names_of(store: Store, value: Any) -> list[str]:
    """The names of ``value``: one per place an argument array sits (one array passed at
    two places has two), ``["·"]`` for a computed value."""
    entry = store.names.get(id(value))
    return list(entry[1]) if entry is not None and entry[0] is value else ["·"]


def rename(store: Store | None, before: Sequence[Any], after: Sequence[Any]) -> None:
    """The values ``after`` take the names of ``before``: the same arguments seen by a trace
    (an abstract trace of the call, a body's parameters). An array that appears twice in
    ``before`` gives its names in order, so each position keeps its own, as under ``jit``."""
    if store is None:
        return
    seen: dict[int, int] = {}
    for old, new in zip(before, after, strict=True):
        entry = store.names.get(id(old))
        if new is old or entry is None or entry[0] is not old:
            continue
        if id(new) in store.names and store.names[id(new)][0] is new:
            continue
        k = seen.get(id(old), 0)
        seen[id(old)] = k + 1
        store.names[id(new)] = (new, [entry[1][min(k, len(entry[1]) - 1)]])


def state_here(store: Store | None, lhs: Any, rhs: Any) -> Fp8State | None:
    """The FP8 state in ``store`` of the GEMM being evaluated, or ``None`` for current scaling
    (no store).

    A GEMM is named by its operands: the argument each comes from (``x @ params['w1']``,
    through casts and transposes) or ``·`` for a computed value, and a count where the
    same pair of names has come before (a layer called twice, slices of one weight), so
    that GEMMs of other operands, present in one trace and not another, change nothing."""
    if store is None:
        return None
    pairs = [f"{a} @ {b}" for a in _names_of(store, lhs) for b in _names_of(store, rhs)]
    keys = [p if store.counts.get(p, 0) == 0 else f"{p} #{store.counts[p]}" for p in pairs]
    # An array at two places (tied weights) is one value here and two under jit, whose
    # tracers init_fp8_state names apart: the first of its places the state holds.
    chosen = 0
    if store.state is not None:
        chosen = next((i for i, k in enumerate(keys) if k in store.state), 0)
    pair, key = pairs[chosen], keys[chosen]
    store.counts[pair] = store.counts.get(pair, 0) + 1
    if store.state is None:
        store.collected.setdefault(key, init_gemm_fp8_state(store.history_length))
        return store.collected[key]
    if key not in store.state:
        raise ValueError(
            f"fp8_state has no state for the GEMM '{key}' (a GEMM is named by the arguments "
            "its operands come from, by position or keyword as f is called: args[1] and "
            "kwargs['x'] are other names; '·' for a computed one); it holds "
            f"{sorted(store.state)[:8]}. The state was made for another function, for "
            "arguments passed otherwise (positionally, not by keyword, or the reverse), or "
            "for shapes that change which GEMMs run (as jnp.einsum's contraction order "
            "can): make it with jaxamp.init_fp8_state(f, ...) given the arguments exactly "
            "as f is called with them."
        )
    state = as_fp8_state(store.state[key])
    return checked_fp8_state(state, store.history_length, f"the GEMM '{key}' of fp8_state")


@dataclasses.dataclass(frozen=True)
class _Delayed:
    """What ``init_fp8_state`` needs of a function ``with_state`` made: ``evaluate`` takes
    the call's ``Store`` first."""

    evaluate: Callable[..., Any]
    history_length: int


def with_state(fun: Callable[..., Any], history_length: int) -> Callable[..., Any]:
    """``fun`` (autocast's evaluation, ``fun(store, *args, **kwargs)``) taking the
    FP8 state as ``fp8_state=``: each call makes its own ``Store`` of it and
    hands it to ``fun``, which passes it down to its evaluation alone."""

    @functools.wraps(fun)
    def call(*args: Any, fp8_state: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        if fp8_state is None:
            raise TypeError(
                "a function autocast runs with delayed float8 scaling takes its state as "
                "fp8_state=: make it with jaxamp.init_fp8_state(f, *args), pass it, and take "
                f"its gradient as the next state ({guide('fp8.md')})."
            )
        if not isinstance(fp8_state, Mapping):
            raise TypeError(
                "fp8_state must be the mapping jaxamp.init_fp8_state made (a GEMM's key to "
                f"its jaxamp.ops.Fp8State), got {type(fp8_state).__name__}."
            )
        warn_if_state_is_not_differentiated((args, kwargs), fp8_state)
        store = Store(max_combined(dict(fp8_state)), history_length)
        args, kwargs = _named(store, args, kwargs)
        # Under jax.disable_jit() lax.cond would run one branch and the other's GEMMs would
        # not be counted, shifting the names of the GEMMs after it: traced as under jit.
        with jax.disable_jit(False):
            return fun(store, *args, **kwargs)

    call._jaxamp_delayed = _Delayed(fun, history_length)  # type: ignore[attr-defined]
    return call


def init_fp8_state(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Fp8State]:
    """The FP8 state of a function ``autocast`` runs in float8 (delayed scaling): one ``Fp8State``
    per GEMM, found by tracing ``fun`` on these arguments (nothing is computed).

    Pass it as ``fun(*args, fp8_state=state)`` and differentiate with respect to it: its
    gradient is the next state (never give it to an optimizer). A GEMM in a loop body
    has one state for all iterations, its amax the largest of theirs; GEMMs inside
    ``custom_jvp``/``custom_vjp`` functions run in the compute dtype, not in float8.

    Args:
      fun: the function ``jaxamp.autocast`` returned for a delayed-scaling policy.
      *args: its arguments, as it will be called (arrays or ``jax.ShapeDtypeStruct``).
      **kwargs: its keyword arguments, passed by keyword as it will be called.

    Returns:
      A dict of each GEMM's key to a fresh ``Fp8State`` (as
      ``jaxamp.ops.init_gemm_fp8_state`` makes one GEMM's): the names of the arguments its
      operands come from (``"args[1] @ args[0]['w1']"``, ``·`` for a computed operand),
      with a count where a pair repeats (``"· @ args[0]['w2'] #1"``).

    Raises:
      TypeError: if ``fun`` is not such a function.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import jaxamp
      >>> f = jaxamp.autocast(lambda w, x: jnp.sum(x @ w), "mixed_float8_delayed")
      >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
      >>> state = init_fp8_state(f, w, x)
      >>> step = jax.jit(jax.grad(lambda w, s: f(w, x, fp8_state=s), argnums=(0, 1)))
      >>> dw, state = step(w, state)
      >>> list(state), float(state["args[1] @ args[0]"].input_amax_history[0])
      (['args[1] @ args[0]'], 1.0)
    """
    delayed = getattr(fun, "_jaxamp_delayed", None)
    if not isinstance(delayed, _Delayed):
        raise TypeError(
            "init_fp8_state expects a function jaxamp.autocast made with a delayed-scaling "
            f"policy (e.g. 'mixed_float8_delayed'), got {fun!r}."
        )
    store = Store(None, delayed.history_length)

    def collect(args: Any, kwargs: Any) -> None:
        args, kwargs = _named(store, args, kwargs)
        with jax.disable_jit(False):
            delayed.evaluate(store, *args, **kwargs)  # traced abstractly, nothing written back

    leaves, tree = jax.tree.flatten((args, kwargs))
    shapes = [isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves]
    if any(shapes):  # the other arguments (a flag, a model) as they are

        def with_arrays(arrays: list[Any]) -> None:
            given = iter(arrays)
            full = [next(given) if s else x for x, s in zip(leaves, shapes, strict=True)]
            collect(*jax.tree.unflatten(tree, full))

        jax.eval_shape(with_arrays, [x for x, s in zip(leaves, shapes, strict=True) if s])
    else:
        collect(args, kwargs)
    return {key: init_gemm_fp8_state(delayed.history_length) for key in store.collected}
