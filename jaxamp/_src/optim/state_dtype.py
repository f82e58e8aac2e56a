"""``with_state_dtype``: any optax transformation with its state stored in 16 bits."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src.dtypes import canonical_dtype, is_float64, is_floating_array, upcast
from jaxamp._src.errors import invalid_choice
from jaxamp._src.optim.loss_scaled import LossScaledState
from jaxamp._src.optim.opt_state import hide_never_cast, is_masked
from jaxamp._src.optim.rounding import (
    leaf_keys,
    new_key_data,
    round_to,
    step_key,
    validate_rounding,
)
from jaxamp._src.optim.state_flow import follows_params, params_copies, update_flow

# Folded into the seed's key: the state's rounding noise is independent of the params'
# (loss_scaled(master_weights="stochastic") draws from the same seed's key unfolded).
_STATE_STREAM = 0x57A7E


class StateDtypeState(NamedTuple):
    """State of ``with_state_dtype`` (every leaf an array).

    Attributes:
      inner_state: the wrapped transformation's state, floating leaves in their
        storage dtypes.
      rounding_key: raw ``uint32`` PRNG key data for stochastic rounding.
      count: updates made, int32, saturating (folded into the key each step).
    """

    inner_state: Any
    rounding_key: jax.Array
    count: jax.Array  # type: ignore[assignment]  # a field, as optax states name it


def _field_names(path: tuple[Any, ...]) -> list[str]:
    """The state fields (``NamedTuple`` attributes such as ``mu``) on a leaf's path."""
    return [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]


def _references(like: Any) -> tuple[dict[Any, list[list[Any]]], set[int]]:
    """The tree structures of ``like`` and of each of its subtrees that is not a single
    leaf (a wrapper such as ``optax.lookahead`` keeps statistics shaped like a part of
    its params), each with the leaf shapes of every subtree that has it; and the total
    sizes of those subtrees (the sizes a flattened statistic may have).

    ``optax.MaskedNode`` is a leaf here, with no shape: the params a transformation
    inside ``optax.masked`` (or ``optax.multi_transform``) sees hold one for each
    masked param, as its state does."""
    leaves, treedef = jax.tree.flatten(like, is_leaf=is_masked)
    refs: dict[Any, list[list[Any]]] = {}
    sizes: set[int] = set()

    def visit(treedef: Any, shapes: list[Any]) -> None:
        refs.setdefault(treedef, []).append(shapes)
        size = sum(int(np.prod(s)) for s in shapes if s is not None)
        if size:
            sizes.add(size)
        start = 0
        for child in treedef.children():
            n = child.num_leaves
            if n and child.num_nodes > 1:
                visit(child, shapes[start : start + n])
            start += n

    visit(treedef, [None if is_masked(x) else np.shape(x) for x in leaves])
    return refs, sizes


def _statistics(state: Any, like: Any) -> list[tuple[Any, ...] | None]:
    """Per leaf of ``state``: the path of the subtree shaped like ``like`` (the params or
    the updates), or like a part of it, that holds it, for the per-parameter statistics;
    ``None`` for the rest. A state with no such leaf is looked at as a flattened one:
    its 1-D floating leaves of a total size of ``like`` (or of a part of it) are the
    statistics, each with its own path. Never-cast fields are never statistics."""
    state = hide_never_cast(state)
    refs, sizes = _references(like)

    def params_like(node: Any) -> bool:
        return jax.tree.structure(node, is_leaf=is_masked) in refs

    out: list[Any] = []
    for path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=params_like)[0]:
        if not params_like(node):  # a leaf outside any params-shaped subtree
            out.append(None)
            continue
        leaves, treedef = jax.tree.flatten(node, is_leaf=is_masked)
        for i, x in enumerate(leaves):
            if not is_masked(x):
                ok = is_floating_array(x) and any(np.shape(x) == s[i] for s in refs[treedef])
                out.append(path if ok else None)
    if any(path is not None for path in out):
        return out
    return [  # optax.flatten: each statistic is one vector of all the params
        path if is_floating_array(x) and np.ndim(x) == 1 and np.size(x) in sizes else None
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
    ]


def _copies_found(state: Any, copies: list[bool]) -> str:
    """The leaves of ``state`` that are copies of the params, for messages."""
    found = [
        jax.tree_util.keystr(path)
        for (path, _), copy in zip(
            jax.tree_util.tree_flatten_with_path(state)[0], copies, strict=True
        )
        if copy
    ]
    return f"; copies of the params or gradients, never cast: {', '.join(found)}" if found else ""


def _contains_loss_scaled(state: Any) -> bool:
    is_state = lambda x: isinstance(x, LossScaledState)
    return any(is_state(x) for x in jax.tree.leaves(state, is_leaf=is_state))


def _name(inner: Any) -> str:
    """A transformation's name for messages: ``optax.flatten``, ``optax.chain``..."""
    init = getattr(inner, "init", None)
    qualname = getattr(init, "__qualname__", None)
    if not qualname:
        return type(inner).__name__
    module = getattr(init, "__module__", None) or ""
    parts = module.split(".")
    prefix = ".".join(parts[:2] if parts[1:2] == ["contrib"] else parts[:1])
    function = qualname.split(".<locals>")[0]
    return f"{prefix}.{function}" if prefix else function


def _floating_leaves(state: Any) -> str:
    """The state's floating leaves with their shapes, for messages."""
    found = [
        f"{jax.tree_util.keystr(path)} {np.shape(x)}"
        for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
        if is_floating_array(x)
    ]
    shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
    return shown or "none"


def _name_the_fields(state: Any, stats: list[Any], dtype: Any, what: str, name: str) -> ValueError:
    fields = sorted({f for path in stats if path is not None for f in _field_names(path)[-1:]})
    shown = np.dtype(canonical_dtype(dtype)).name
    among = f", among those shaped like the params ({', '.join(map(repr, fields))})"
    return ValueError(
        f"with_state_dtype({name}, {shown}) cannot tell the per-parameter statistics in its "
        f"state ({type(state).__name__}) from copies of the params or gradients, which are "
        f"never rounded: {what}. Name the fields that hold statistics"
        f"{among if fields else ''}: with_state_dtype(inner, {{{(fields or ['mu'])[0]!r}: "
        f"jnp.{shown}}})."
    )


def _copies(inner: Any, state: Any, params: Any, dtype: Any, name: str) -> list[bool]:
    """Per leaf of ``state``: whether it holds a copy of the params or of the gradients,
    never a statistic: computed by ``init`` from the params' values, or shaped like a
    statistic but not computed by ``update`` from its old value (L-BFGS's last params
    and gradient, written over each step). A dtype per field is the caller's decision
    where ``update`` cannot be read; one dtype for all is refused there."""
    copies = params_copies(inner.init, params)
    stats = [
        None if c else path for path, c in zip(_statistics(state, params), copies, strict=True)
    ]
    if all(path is None for path in stats):  # nothing shaped like a statistic
        return copies
    flow = update_flow(inner.update, state, params)
    if isinstance(flow, Exception):
        if isinstance(dtype, Mapping):
            return copies
        why = f"its update could not be traced ({type(flow).__name__}: {flow})"
        raise _name_the_fields(state, stats, dtype, why, name) from flow
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    hidden = [
        (p, f)
        for p, s, f in zip(paths, stats, flow, strict=True)
        if s is not None and isinstance(f, str)
    ]
    if hidden and not isinstance(dtype, Mapping):
        where = ", ".join(jax.tree_util.keystr(p) for p, _ in hidden[:4])
        why = f"update computes {where} through {hidden[0][1]}, which jaxamp does not read"
        raise _name_the_fields(state, stats, dtype, why, name)
    return [
        c or (path is not None and f is False)
        for c, path, f in zip(copies, stats, flow, strict=True)
    ]


def _targets(
    state: Any,
    like: Any,
    dtype: Any,
    name: str = "inner",
    copies: list[bool] | None = None,
    follows: list[bool] | None = None,
) -> list[Any]:
    """The storage dtype of each per-parameter statistic of ``state`` (``None``: every
    other leaf, kept as ``inner`` makes it, every leaf marked in ``copies`` and every
    leaf not marked in ``follows``)."""
    stats = _statistics(state, like)
    if copies is not None:
        stats = [None if copy else path for path, copy in zip(stats, copies, strict=True)]
    if follows is not None:
        stats = [path if f else None for path, f in zip(stats, follows, strict=True)]
    if not isinstance(dtype, Mapping):
        return [None if path is None else canonical_dtype(dtype) for path in stats]
    wanted = {str(k): canonical_dtype(v, f"the dtype for {k!r}") for k, v in dtype.items()}
    found = {field for path in stats if path is not None for field in _field_names(path)}
    unknown = sorted(set(wanted) - found)
    if unknown and found:
        raise invalid_choice(
            "state field",
            unknown,
            sorted(found),
            quote=True,
            why=f"with_state_dtype({name}): no state field of per-parameter statistics named "
            f"{', '.join(map(repr, unknown))} in this optimizer's state.",
        )
    if unknown:
        raise ValueError(
            f"with_state_dtype({name}): no state field of per-parameter statistics named "
            f"{', '.join(map(repr, unknown))}: this optimizer's state "
            f"({type(state).__name__}) holds no per-parameter statistic at all. Its "
            f"floating leaves: {_floating_leaves(state)}."
        )
    targets = []
    for path in stats:
        names = [] if path is None else [n for n in _field_names(path) if n in wanted]
        targets.append(wanted[names[-1]] if names else None)
    return targets


def _cast_leaves(state: Any, targets: list[Any], rounding: str, key: jax.Array | None) -> Any:
    leaves, treedef = jax.tree.flatten(state)
    keys = leaf_keys(key, leaves) if key is not None else [None] * len(leaves)
    out = [
        x if t is None else round_to(x.astype(jnp.float32), t, rounding, k)
        for x, t, k in zip(leaves, targets, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, out)


def _up(state: Any) -> Any:
    """Floating leaves narrower than float32, cast up to float32 (the update's dtype)."""
    return jax.tree.map(
        upcast,
        state,
    )


def _restore_dtypes(state: Any, stored: Any) -> Any:
    """``state`` with every floating leaf back in the dtype it had in ``stored``, to
    nearest (the leaves not cast to a storage dtype: computed in float32, or widened
    by ``inner`` itself, as optax's Adam turns a bfloat16 ``nu`` into float32)."""
    return jax.tree.map(
        lambda x, s: x.astype(s.dtype) if is_floating_array(x) and is_floating_array(s) else x,
        state,
        stored,
    )


def _warn_if_float16(targets: list[Any], name: str) -> None:
    """Warns where a statistic is stored in float16, whose range squared gradients leave."""
    if not any(t is not None and np.dtype(t) == np.float16 for t in targets):
        return
    warnings.warn(
        f"with_state_dtype({name}) stores statistics in float16, whose smallest value is "
        "6e-8: a squared gradient below about 2.4e-4 (Adam's nu, RMSprop's) flushes to "
        "zero there, and the update then divides by eps alone (Adam on gradients of 1e-4 "
        "moved 4.7x as far as float32 optax in 50 steps). bfloat16 keeps float32's range; "
        'float16 suits first moments: {"mu": jnp.float16, "nu": jnp.bfloat16}.',
        stacklevel=3,
    )


def with_state_dtype(
    inner: optax.GradientTransformation,
    dtype: Any,
    *,
    rounding: str = "nearest",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Stores the per-parameter statistics of ``inner`` in ``dtype``; updates in float32.

    The statistics are the floating state leaves shaped like the params (in a subtree
    with the params' structure, with a param's shape): Adam's ``mu`` and ``nu``,
    momentum's ``trace``; under ``optax.flatten``, the 1-D leaves of the params' total
    size; of those, the leaves ``update`` computes from their old values. Copies of the
    params (leaves ``init`` computes from their values: SAM's cache, Prodigy's
    ``params0``, schedule-free's ``z``) and the params and gradients ``update`` writes
    (L-BFGS's last ``params``, ``updates`` and line-search ``grad``, Adan's ``g``) are
    never cast.
    Hyperparameters (``optax.inject_hyperparams``), schedule-free's weight sum
    and ``b1``, ``reduce_on_plateau``'s state and the line searches' step sizes are
    never cast, whatever their shapes; counts are not floating. Every state leaf
    keeps its dtype across ``update``, so a jitted step traces once. ``init`` warns
    (``UserWarning``) when the state has floating leaves but no statistic.

    Args:
      inner: any optax transformation, e.g. ``optax.adam(1e-3)``.
      dtype: the storage dtype of every per-parameter statistic, or a mapping from
        state field names (``"mu"``, ``"nu"``, ``"trace"``...) to dtypes; fields
        not named keep the dtype ``inner.init`` gives them (updated in float32 too,
        and cast back to it to nearest).
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; the noise is a pure
        function of ``seed`` and the step, so a restored run rounds alike).
      seed: the seed of the stochastic rounding noise; its bits are independent of
        those ``jaxamp.loss_scaled(master_weights="stochastic", seed=seed)`` draws
        for the params.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      ``StateDtypeState``.

    Raises:
      ValueError: for an unknown rounding, a dtype that is not floating, or a field
        name that holds no per-parameter statistic of the state (raised by ``init``,
        which sees the state); by ``init`` too, for one ``dtype`` where ``update``
        cannot be read (it needs extra arguments of its own, or computes a leaf shaped
        like the params through a primitive jaxamp does not read): name the fields.
      TypeError: if ``inner`` is not an optax transformation.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxamp
      >>> tx = jaxamp.with_state_dtype(optax.adam(1e-3), {"mu": jnp.bfloat16, "nu": jnp.bfloat16})
      >>> state = tx.init({"w": jnp.zeros(3)})
      >>> state.inner_state[0].mu["w"].dtype, state.inner_state[0].count.dtype
      (dtype(bfloat16), dtype('int32'))
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            "with_state_dtype expects an optax.GradientTransformation (e.g. optax.adam(1e-3)) "
            f"as inner, got {type(inner).__name__}: {inner!r}."
        )
    validate_rounding(rounding)
    if isinstance(dtype, Mapping):
        for name, d in dtype.items():
            canonical_dtype(d, f"the dtype for state field {name!r}")
    else:
        canonical_dtype(dtype)
    name = _name(inner)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: Any) -> StateDtypeState:
        state = inner.init(params)
        if _contains_loss_scaled(state):
            raise ValueError(
                "with_state_dtype(jaxamp.loss_scaled(...), dtype): loss_scaled must be the "
                "whole optimizer: its float32 master copy of 16-bit params stays float32 "
                "and its updates land as they are. Put with_state_dtype inside: "
                "jaxamp.loss_scaled(jaxamp.with_state_dtype(inner, dtype))."
            )
        copies = _copies(inner, state, params, dtype, name)
        follows = follows_params(inner.init, params)
        targets = _targets(state, params, dtype, name, copies, follows)
        # float64 statistics (of float64 params, under x64) are left as written
        targets = [
            None if is_float64(getattr(leaf, "dtype", None)) else target
            for leaf, target in zip(jax.tree.leaves(state), targets, strict=True)
        ]
        _warn_if_float16(targets, name)
        floating = [x for x in jax.tree.leaves(state) if is_floating_array(x)]
        if floating and all(t is None for t in targets):
            warnings.warn(
                f"with_state_dtype({name}, {np.dtype(canonical_dtype(dtype))}) found no "
                f"per-parameter statistic to cast in its state ({type(state).__name__}): no "
                "floating leaf that update computes from its old value sits where a param "
                "does in a subtree shaped like the params, and none is a flattened "
                "statistic (1-D, of the params' total size); hyperparameters are never "
                f"cast{_copies_found(state, copies)}. Every leaf keeps the dtype it has: "
                f"{_floating_leaves(state)}.",
                stacklevel=2,
            )
        return StateDtypeState(
            inner_state=_cast_leaves(state, targets, "nearest", None),
            rounding_key=new_key_data(jax.random.fold_in(jax.random.key(seed), _STATE_STREAM)),
            count=jnp.zeros([], jnp.int32),
        )

    def update_fn(
        updates: Any, state: StateDtypeState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, StateDtypeState]:
        stored = state.inner_state
        # the updates have the params' structure and shapes (params may be None)
        targets = [
            None if t is None or is_float64(x.dtype) else x.dtype
            for x, t in zip(
                jax.tree.leaves(stored), _targets(stored, updates, dtype, name), strict=True
            )
        ]
        new_updates, new_inner = inner.update(updates, _up(stored), params, **extra_args)
        key = step_key(state.rounding_key, state.count) if rounding == "stochastic" else None
        new_inner = _cast_leaves(new_inner, targets, rounding, key)
        return new_updates, StateDtypeState(
            inner_state=_restore_dtypes(new_inner, stored),
            rounding_key=state.rounding_key,
            count=optax.safe_increment(state.count),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
