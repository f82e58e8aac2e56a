"""FP8 state (delayed float8 scaling) beside Flax layers: a Linen collection, NNX variables."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops as flax_fp8_ops
from jax import lax

from jaxamp._src.dtypes import FLOAT32
from jaxamp._src.errors import guide
from jaxamp._src.flax_policy.graph import is_node
from jaxamp._src.ops.fp8 import Fp8DotGeneral
from jaxamp._src.ops.fp8_max32 import MAX32, as_float32
from jaxamp._src.ops.fp8_state import (
    STATE_COLLECTION,
    Fp8State,
    checked_fp8_state,
    max_combined,
    path_names,
    state_paths,
    warn_if_state_is_not_differentiated,
)
from jaxamp._src.policy import Fp8Recipe

# Flax's own float8 ops (their common base, and each class by name where a Flax lacks it).
FLAX_FP8_OPS: tuple[type, ...] = tuple(
    cls
    for name in ("Fp8DotGeneralBase", "Fp8DotGeneralOp", "Fp8DirectDotGeneralOp", "Fp8Einsum")
    if isinstance(cls := getattr(flax_fp8_ops, name, None), type)
)


def refuse_flax_fp8_op(module: Any, policies: Any) -> None:
    """Refuses one of Flax's own float8 ops (told by its class, whatever its name) in a
    model under a delayed float8 policy (one of ``policies``, the root's and the
    overrides'): the two keep their state in one collection under the same names, and
    the policy's conversion of the collection reaches the op's state too. A layer of
    one's own named ``Fp8...`` is a layer like any other."""
    if not isinstance(module, FLAX_FP8_OPS):
        return
    if not any(p.fp8 is not None and p.fp8.scaling == "delayed" for p in policies):
        return
    scope = getattr(module, "scope", None)
    path = "/".join(str(p) for p in scope.path) if scope else type(module).__name__
    raise ValueError(
        f"Flax's own float8 op {type(module).__name__} ({path}) in a model under a jaxamp "
        "policy with delayed float8 scaling: the two keep their state in one collection "
        f"('{STATE_COLLECTION}') under the same names. Use one or the other: jaxamp's "
        "policy on plain layers, or Flax's ops under a policy without fp8=delayed."
    )


def _initial(name: str, length: int) -> jax.Array:
    if name.endswith("_scale"):
        return jnp.ones((1,), FLOAT32)
    return jnp.zeros((length,), FLOAT32)


def linen_fp8_state(module: Any, recipe: Fp8Recipe) -> Fp8State:
    """The FP8 state of a Linen layer's float8 GEMM, in the ``_overwrite_with_gradient``
    collection of the layer's scope (created by ``init`` as Flax's ``fp8_ops`` creates it)."""
    length = recipe.amax_history_length
    values = []
    for name in Fp8State._fields:
        try:
            variable = module.variable(STATE_COLLECTION, name, _initial, name, length)
        except flax.errors.ScopeCollectionNotFound as e:
            raise ValueError(_missing_state(module, str(e))) from e
        values.append(variable.value)
    path = "/".join(str(p) for p in module.scope.path) or "the model"
    return checked_fp8_state(Fp8State(*values), length, f"the float8 layer {path}")


def _missing_state(module: Any, flax_message: str) -> str:
    path = "/".join(str(p) for p in module.scope.path) or "the model"
    lifted = any(t in flax_message for t in ("scan(", "vmap(", "remat(", "jit("))
    if lifted:
        return (
            f"the float8 layer {path} found no '{STATE_COLLECTION}' collection: a lifted "
            "transformation (nn.scan, nn.vmap, ...) around it does not carry it. For a "
            f"stack of layers, add '{STATE_COLLECTION}': 0 to its variable_axes, beside "
            "'params', so each layer has its own state; for a loop over one layer whose "
            f"params it broadcasts (a recurrent cell), add '{STATE_COLLECTION}' to its "
            "variable_broadcast. nn.RNN (and nn.Bidirectional) broadcasts only the params "
            "and cannot take it: keep it out of delayed scaling with an override, "
            "overrides={nn.RNN: 'mixed_float8'} (current scaling) or a 16-bit policy "
            f"({guide('fp8.md')})."
        )
    return (
        f"the float8 layer {path} found no '{STATE_COLLECTION}' collection in the "
        "variables apply was given: delayed scaling keeps its state there. Pass it beside "
        f"the params, {{'params': params, '{STATE_COLLECTION}': state}}, with the state init "
        f"made ({guide('fp8.md')})."
    )


@dataclasses.dataclass(frozen=True, eq=False)
class LinenDelayed:
    """A Linen layer's ``dot_general`` under delayed scaling: reads the layer's state.

    Attributes:
      module: the bound layer whose scope holds the state.
      compute_dtype: the dtype results come back in.
      recipe: the policy's float8 recipe.
    """

    module: Any
    compute_dtype: Any
    recipe: Fp8Recipe

    def _rule(self) -> Fp8DotGeneral:
        state = linen_fp8_state(self.module, self.recipe)
        return Fp8DotGeneral(self.compute_dtype, self.recipe.margin, state)

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        return self._rule()(*args, **kwargs)

    def einsum(self, *args: Any, **kwargs: Any) -> jax.Array:
        """``jnp.einsum`` in float8 with this layer's state."""
        return self._rule().einsum(*args, **kwargs)


def max_combined_collection(variables: Any, combined: dict, prefix: tuple) -> Any:
    """``variables`` (of a model under a delayed float8 policy) with jaxamp's FP8 state
    as values whose gradients combine by max. Other variables of the collection (a model's
    own, by Flax's convention) are left as they are; Flax's own float8 ops, whose state has
    the same names, are refused by type when they run (``refuse_flax_fp8_op``).

    ``combined`` (layer path, under ``prefix``, to its values and their conversion) makes
    every call of one apply that reads the same values share one conversion, so that a
    layer run by several calls (a policy module used twice by a plain parent) combines by
    max across them too."""
    if not hasattr(variables, "get") or variables.get(STATE_COLLECTION) is None:
        return variables
    collection = variables[STATE_COLLECTION]
    ours = set(state_paths(collection))  # full sets of the six names, per layer
    flat, treedef = jax.tree_util.tree_flatten_with_path(collection)
    leaves = [leaf for _, leaf in flat]
    # By layer, then name, for max_combined to pair each scale with its history.
    picked: dict[int, tuple[str, str]] = {}
    state: dict[str, dict[str, Any]] = {}
    for i, (path, leaf) in enumerate(flat):
        name = "/".join(path_names(path))
        if name in ours:
            layer, _, field = name.rpartition("/")
            picked[i] = (layer, field)
            state.setdefault(layer, {})[field] = leaf
    keys = {layer: (*prefix, layer) for layer in state}
    todo = {layer: v for layer, v in state.items() if not _cached(combined, keys[layer], v)}
    warn_if_state_is_not_differentiated(variables.get("params"), todo)
    for layer, values in max_combined(todo).items():
        combined[keys[layer]] = (todo[layer], values)
    for i, (layer, field) in picked.items():
        leaves[i] = combined[keys[layer]][1][field]
    return {**variables, STATE_COLLECTION: jax.tree_util.tree_unflatten(treedef, leaves)}


def _cached(cache: dict, key: tuple, values: dict[str, Any]) -> bool:
    """Whether ``cache`` holds the conversion of these very values (not of others that
    were at the layer's path: a mutable state written between two calls)."""
    entry = cache.get(key)
    return (
        entry is not None
        and entry[0].keys() == values.keys()
        and all(entry[0][name] is value for name, value in values.items())
    )


# Per apply (its root scope): layer path to the values read and their max-combined form.
_BY_APPLY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_combined_groups(groups: Any, delayed: bool, scope: Any, own: str) -> Any:
    """The variable groups a lifted policy call gets (Flax's ``lift.pack``: per filter, per
    scope, collections) with the FP8 state max-combined, one conversion per apply for
    each layer's values, however many calls read them. Warns where the call runs inside
    a Flax transformation of a plain module (other than ``own``, the policy's), whose
    calls each convert their own."""
    scopes = _outermost(jax.tree.leaves(scope))  # as lift.pack groups the variables
    if not delayed or not all(isinstance(s, flax.core.Scope) for s in scopes):
        return groups
    converted = False

    def combined(group: Any, scope: Any) -> Any:
        nonlocal converted
        cache = _BY_APPLY.setdefault(scope.root, {})
        before = set(cache)
        prefix = tuple(str(p) for p in scope.path)
        out = max_combined_collection(group, cache, prefix)
        new = [cache[key][0] for key in set(cache) - before]  # the values converted here
        converted |= any(not _is_max32(v) for values in new for v in values.values())
        return out

    out = tuple(
        tuple(combined(g, s) for g, s in zip(per_scope, scopes, strict=True))
        for per_scope in groups
    )
    lifts = [p for p in scopes[0].root.debug_path if "(" in p and not p.startswith(own + "(")]
    if converted and lifts:
        warnings.warn(
            f"A delayed float8 policy module runs inside a Flax transformation of a plain "
            f"module ({lifts[-1]} in its scope's path): each call of that transformation "
            "converts the layers' state for itself. Where a layer runs in more than one "
            "such call in a step (the transformed module called twice, the steps of an "
            "nn.scan with the state broadcast) its state adds instead of taking the max; "
            "one call, or a state on the scanned or mapped axis, is right as it is. Apply "
            "the policy to the outermost module, or pass the state through "
            f"jaxamp.ops.max_combined before apply, which also silences this ({guide('fp8.md')}).",
            stacklevel=2,
        )
    return out


def _outermost(scopes: list[Any]) -> list[Any]:
    """``scopes`` without repeats and without those inside another of them, in order."""
    unique = list(dict.fromkeys(scopes))

    def inside(scope: Any) -> bool:
        parent = getattr(scope, "parent", None)
        while parent is not None:
            if parent in unique:
                return True
            parent = parent.parent
        return False

    return [s for s in unique if not inside(s)]


def as_given_groups(out_groups: Any, given_groups: Any) -> Any:
    """The mutable variables a lifted policy call gives back (grouped as it was given them),
    with the state values it was given (float32, not their max-combined form) where it left
    them as they were."""

    def as_given(out: Any, given: Any) -> Any:
        if not hasattr(out, "get") or out.get(STATE_COLLECTION) is None:
            return out
        before = {
            path_names(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(given.get(STATE_COLLECTION))[0]
        }

        def restore(path: tuple, leaf: Any) -> Any:
            return before.get(path_names(path), leaf) if _is_max32(leaf) else leaf

        state = jax.tree_util.tree_map_with_path(restore, out[STATE_COLLECTION])
        return type(out)({**out, STATE_COLLECTION: state})

    return tuple(
        tuple(as_given(o, g) for o, g in zip(outs, givens, strict=True))
        for outs, givens in zip(out_groups, given_groups, strict=True)
    )


def as_float32_collection(variables: Any) -> Any:
    """``variables`` with a max-combined FP8 state back in float32 (a mutable apply)."""
    if not hasattr(variables, "get") or variables.get(STATE_COLLECTION) is None:
        return variables
    state = jax.tree.map(as_float32, variables[STATE_COLLECTION])
    return type(variables)({**variables, STATE_COLLECTION: state})


def _is_max32(x: Any) -> bool:
    return getattr(x, "dtype", None) == MAX32


def float32_state(tree: Any) -> Any:
    """``tree`` (a model's outputs) with any max-combined state value back in float32
    (graph nodes, an NNX module or variable returned, as they are)."""
    # A value to monitor: no gradient flows back through it (the state's gradient is its
    # next value, which the GEMMs write).
    return jax.tree.map(
        lambda x: lax.stop_gradient(as_float32(x)) if _is_max32(x) and not is_node(x) else x,
        tree,
        is_leaf=is_node,
    )


class OverwriteWithGradient(nnx.Variable):
    """An NNX layer's FP8 state (delayed float8 scaling): its gradient is its next value."""


def _stacked(module: nnx.Module) -> tuple[int, ...]:
    """The leading axes of a layer made by ``nnx.vmap`` (a stack of layers that ``nnx.scan``
    runs one by one): the kernel's axes beyond those the layer declares. A layer of a class
    of one's own declares all of its kernel's axes (its rank is its own business)."""
    kernel = getattr(module, "kernel", None)
    if not isinstance(kernel, nnx.Variable):
        return ()
    shape = kernel.get_value().shape
    if isinstance(module, nnx.Einsum):
        declared = len(module.kernel_shape)
    elif isinstance(module, nnx.LinearGeneral):  # its batch_axis dimensions lead the kernel
        declared = len(getattr(module, "batch_axis", None) or ())
        declared += len(module.in_features) + len(module.out_features)
    elif isinstance(module, nnx.Linear):  # (in, out)
        declared = 2
    else:
        declared = len(shape)
    return tuple(shape[: max(len(shape) - declared, 0)])


def attach_nnx_fp8_state(module: nnx.Module, recipe: Fp8Recipe) -> None:
    """Gives an NNX layer its FP8 state (kept if it has one of the same shape): one per
    layer of a stack made by ``nnx.vmap``."""
    length, stack = recipe.amax_history_length, _stacked(module)
    for name in Fp8State._fields:
        current = getattr(module, name, None)
        value = jnp.broadcast_to(_initial(name, length), stack + _initial(name, length).shape)
        if isinstance(current, OverwriteWithGradient) and current.get_value().shape == value.shape:
            continue
        setattr(module, name, OverwriteWithGradient(jnp.array(value)))


def detach_nnx_fp8_state(module: nnx.Module) -> None:
    """Removes a layer's FP8 state (a policy without delayed scaling)."""
    for name in Fp8State._fields:
        if isinstance(getattr(module, name, None), OverwriteWithGradient):
            delattr(module, name)


# The max-combined state of the layers of the call being traced: id(layer) to its Fp8State.
_COMBINED: list[dict[int, Fp8State]] = []


def nnx_fp8_state(module: nnx.Module) -> Fp8State:
    """The values of an NNX layer's FP8 state (max-combined during a policy's call)."""
    combined = _COMBINED[-1].get(id(module)) if _COMBINED else None
    if combined is not None:
        return combined
    return Fp8State(*(getattr(module, name).get_value() for name in Fp8State._fields))


def has_nnx_fp8_state(module: Any) -> bool:
    return isinstance(getattr(module, Fp8State._fields[0], None), OverwriteWithGradient)


@contextlib.contextmanager
def nnx_max_combined(modules: Any) -> Iterator[dict[Any, Fp8State]]:
    """The FP8 state of ``modules`` (``(path, module)`` pairs) as max-combined values,
    converted once for the call and written into the variables for its duration, so that
    the copies NNX transformations inside the call make (``nnx.remat``, ``nnx.scan``) carry
    them too. A model closed over by ``jax.jit`` or ``jax.vmap`` holds variables of another
    trace, which cannot be written: their values are yielded by path instead, for
    ``nnx_combined_state`` (the layers' own calls read them)."""
    modules = list(modules)
    params = [
        v.get_value() for _, m in modules for v in vars(m).values() if isinstance(v, nnx.Param)
    ]
    holders = [(path, m) for path, m in modules if has_nnx_fp8_state(m)]
    values = [nnx_fp8_state(m) for _, m in holders]
    warn_if_state_is_not_differentiated(params, values)
    if not values or any(v.dtype == MAX32 for state in values for v in state):
        yield {}
        return
    combined = max_combined(values)  # one conversion: a layer no GEMM used keeps its state
    saved: list[tuple[Any, Any]] = []
    by_path: dict[Any, Fp8State] = {}
    try:
        for (_, module), old, new in zip(holders, values, combined, strict=True):
            for name, before, after in zip(Fp8State._fields, old, new, strict=True):
                variable = getattr(module, name)
                variable.set_value(after)
                saved.append((variable, before))
    except flax.errors.TraceContextError:
        for variable, before in reversed(saved):
            variable.set_value(before)
        saved = []
        by_path = {path: state for (path, _), state in zip(holders, combined, strict=True)}
    try:
        yield by_path
    finally:
        for variable, before in reversed(saved):
            variable.set_value(before)


@contextlib.contextmanager
def nnx_combined_state(modules: Any, combined: dict[Any, Fp8State]) -> Iterator[None]:
    """The layers among ``modules`` (``(path, module)`` pairs: the copies a traced call
    works on) read their state from ``combined``, by path, for the duration."""
    _COMBINED.append({id(m): combined[path] for path, m in modules if path in combined})
    try:
        yield
    finally:
        _COMBINED.pop()


# The NNX layers being called: (their matmul hook, (its Fp8State, the layer's class name)),
# innermost last.
_CALLING: list[tuple[NnxDelayed, tuple[Fp8State, str]]] = []


@dataclasses.dataclass(frozen=True, eq=False)
class NnxDelayed(Fp8DotGeneral):
    """An NNX layer's ``dot_general`` under delayed scaling: reads the state of the layer
    being called (``nnx_delayed_call``). The layer is never written to during its call, so
    it may run inside ``jax.lax.scan``, ``jax.checkpoint`` or ``jax.vmap`` in a model's call.
    """

    history_length: int = 1024

    def _rule(self) -> Fp8DotGeneral:
        for hook, (state, name) in reversed(_CALLING):
            if hook is self:
                state = checked_fp8_state(state, self.history_length, f"the float8 layer {name}")
                return Fp8DotGeneral(self.compute_dtype, self.margin, state)
        raise RuntimeError(
            "an NNX layer's float8 matmul under delayed scaling ran outside the layer's call; "
            "call the layer itself (its state is read there)."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> jax.Array:
        return self._rule()(*args, **kwargs)

    def einsum(self, *args: Any, **kwargs: Any) -> jax.Array:
        """``jnp.einsum`` in float8 with the state of the layer being called."""
        return self._rule().einsum(*args, **kwargs)


def nnx_delayed_call(self: nnx.Module, base_call: Any, *args: Any, **kwargs: Any) -> Any:
    """An NNX layer's call with its matmul hook given the layer's FP8 state."""
    hook = getattr(self, "dot_general", None) or getattr(self, "einsum_op", None)
    rule = getattr(hook, "__self__", hook)
    if not isinstance(rule, NnxDelayed):  # running as written: Flax's own hook
        return base_call(self, *args, **kwargs)
    _CALLING.append((rule, (nnx_fp8_state(self), type(self).__name__)))
    try:
        return base_call(self, *args, **kwargs)
    finally:
        _CALLING.pop()


def update_fp8_state(model: nnx.Module, grads: nnx.State) -> nnx.State:
    """Sets ``model``'s FP8 state to its gradient (its next value) and returns
    the other gradients, for the optimizer.

    Args:
      model: an NNX model under a ``fp8=delayed`` policy.
      grads: gradients taken with respect to ``nnx.Param`` and
        ``OverwriteWithGradient`` (``nnx.DiffState(0, (nnx.Param, OverwriteWithGradient))``).

    Returns:
      ``grads`` without the state.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxamp
      >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
      >>> model = jaxamp.nnx.apply_policy(model, "mixed_float8_delayed")
      >>> wrt = nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))
      >>> grads = nnx.grad(lambda m: m(jnp.ones((1, 4))).sum(), argnums=wrt)(model)
      >>> grads = jaxamp.nnx.update_fp8_state(model, grads)
      >>> float(model.input_amax_history[0])
      1.0
    """
    state, rest = nnx.split_state(grads, OverwriteWithGradient, ...)
    nnx.update(model, state)
    return rest
