"""Applying a policy to an existing Flax NNX model, in place."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from flax import nnx

from jaxamp._src.autocast.api import interpreter
from jaxamp._src.autocast.rules import AutocastConfig, AutocastRules, policy_rules
from jaxamp._src.backend import auto_policy
from jaxamp._src.flax_policy import fp8 as fp8_state
from jaxamp._src.flax_policy import plan as layer_plan
from jaxamp._src.flax_policy.graph import is_node as is_graph_node
from jaxamp._src.ops.residuals import validate_residuals
from jaxamp._src.policy import Policy, PolicyLike, cast_floating, get_policy

_POLICY_ATTR = "jaxamp_policy"
_RESIDUALS_ATTR = "jaxamp_residuals"
_RULES_ATTR = "jaxamp_rules"
_OVERRIDES_ATTR = "jaxamp_override_policies"
_EMBED_DTYPE_ATTR = "jaxamp_embed_dtype"
_ATTEND_PLAN_ATTR = "jaxamp_attend_plan"
_SCOPE_ATTR = "jaxamp_scope_policies"  # (root, layer): a layer run as traced or out of float8
_WRAPPED_ATTR = "_jaxamp_policy_wrapper"  # on the subclasses that wrap a layer
# The attributes a policy changed on a layer, as they were before the first policy: a
# second ``apply_policy`` starts from them (a float32 policy puts Flax's matmuls back).
_ORIGINALS_ATTR = "jaxamp_original_attributes"


def iter_modules(model: nnx.Module) -> Iterator[tuple[Any, nnx.Module]]:
    iter_modules = getattr(nnx, "iter_modules", None)
    if iter_modules is not None:
        return iter_modules(model)
    return model.iter_modules()  # flax releases before nnx.iter_modules


def _get_value(variable: nnx.Variable) -> Any:
    get_value = getattr(variable, "get_value", None)  # flax >= 0.12
    return get_value() if get_value is not None else variable.value


def _set_value(variable: nnx.Variable, value: Any) -> None:
    set_value = getattr(variable, "set_value", None)
    if set_value is not None:
        set_value(value)
    else:
        variable.value = value


def _cast_caches(model: nnx.Module) -> None:
    """Decode caches (``init_cache`` makes float32 ones unless told otherwise) put in their
    layer's compute dtype, which the layer writes into them."""
    for _, module in iter_modules(model):
        dtype = getattr(module, "dtype", None)
        for variable in vars(module).values():
            if isinstance(variable, nnx.Cache):
                value = _get_value(variable)
                cast = layer_plan.in_layer_dtype(value, dtype)
                if cast is not value:
                    _set_value(variable, cast)


def _policy_call(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a model under a policy: inputs cast, the call evaluated with the
    policy's rules (see ``jaxamp.linen.apply_policy``), outputs cast."""
    policy: Policy = getattr(self, _POLICY_ATTR)
    # Graph nodes among the arguments (an nnx.Rngs, Variables) are passed as they are:
    # a tree map would copy them, and their updates would go to the copies.
    args, kwargs = jax.tree.map(
        lambda x: x if is_graph_node(x) else policy.cast_to_compute(x),
        (args, kwargs),
        is_leaf=is_graph_node,
    )
    _cast_caches(self)
    config = AutocastConfig(policy, getattr(self, _RULES_ATTR), getattr(self, _OVERRIDES_ATTR))
    residuals = getattr(self, _RESIDUALS_ATTR)

    def call(
        module: nnx.Module, *args: Any, **kwargs: Any
    ) -> Any:  # cast in the program, as the Linen policy does
        with fp8_state.nnx_combined_state(iter_modules(module), combined):
            return policy.cast_to_output(_own_call(module, *args, **kwargs))

    # Delayed float8 scaling: the layers' state, converted once for the call. Under a
    # policy that narrows nothing the program is evaluated as traced, constants included.
    as_written = None if config.as_traced else _as_written
    with (
        layer_plan.explaining_carry_errors(policy),
        fp8_state.nnx_max_combined(iter_modules(self)) as combined,
    ):
        out = interpreter(call, config, residuals, as_written)(None, self, *args, **kwargs)
    return fp8_state.float32_state(out)  # a model returning its state: float32


@contextlib.contextmanager
def _as_written(tree: Any) -> Iterator[None]:
    """The layers of the modules in ``tree`` without the policy's settings, as their
    author wrote them, for the duration (see ``layer_plan.layers_as_written``)."""
    changed = []
    models = [x for x in jax.tree.leaves(tree, is_leaf=is_graph_node) if isinstance(x, nnx.Module)]
    for module in {id(m): m for model in models for _, m in iter_modules(model)}.values():
        originals = getattr(module, _ORIGINALS_ATTR, None) or {}
        changed.append((module, {name: getattr(module, name) for name in originals}))
        for name, value in originals.items():
            setattr(module, name, value)
    try:
        with layer_plan.layers_as_written():
            yield
    finally:
        for module, settings in changed:
            for name, value in settings.items():
                setattr(module, name, value)


def _embed_call(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """``Embed.__call__`` that gathers in the table's dtype and casts the rows."""
    out = _own_call(self, *args, **kwargs)
    if layer_plan.running_as_written():
        return out
    return cast_floating(out, getattr(self, _EMBED_DTYPE_ATTR))


def _as_traced_call(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a layer an override keeps wider than the root policy (float32), or
    takes out of its float8 (see ``layer_plan.layer_scope``)."""
    with layer_plan.layer_scope(*getattr(self, _SCOPE_ATTR)):
        return _own_call(self, *args, **kwargs)


def _embed_attend(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """``Embed.attend`` (a tied output layer) as a compute-dtype matmul."""
    plan: layer_plan.LayerPlan = getattr(self, _ATTEND_PLAN_ATTR)
    float64 = layer_plan.has_float64((args, kwargs))  # a float64 query: as written
    if plan.matmul is None or layer_plan.running_as_written() or float64:
        embed: Any = type(self).__mro__[1]  # nnx.Embed, or a user's subclass of it
        return embed.attend(self, *args, **kwargs)
    return layer_plan.run_unhooked(self, plan, *args, **kwargs)


def _own_call(module: nnx.Module, *args: Any, **kwargs: Any) -> Any:
    """The layer's own ``__call__`` (every wrapper ends here, the policy's call too); under
    delayed float8 scaling its GEMM reads its state. Called with a float64 input (under
    ``jax_enable_x64``), it runs as written, without the policy's settings: Flax computes
    such a layer in float64, and a policy leaves float64 as written."""
    call = type(module).__mro__[1].__call__
    if layer_plan.has_float64((args, kwargs)):
        with _layer_as_written(module):
            return call(module, *args, **kwargs)
    if fp8_state.has_nnx_fp8_state(module):
        return fp8_state.nnx_delayed_call(module, call, *args, **kwargs)
    return call(module, *args, **kwargs)


@contextlib.contextmanager
def _layer_as_written(module: nnx.Module) -> Iterator[None]:
    """``module`` without the settings the policy gave it, for the duration (Flax computes
    a layer called with float64 inputs in float64; a policy leaves float64 as written)."""
    originals = getattr(module, _ORIGINALS_ATTR, None) or {}
    settings = {name: getattr(module, name) for name in originals}
    for name, value in originals.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in settings.items():
            setattr(module, name, value)


def _keeping_carry(call: Any) -> Any:
    """A recurrent cell's ``call`` returning its new carry in the given carry's dtypes
    (see ``layer_plan.carry_as_given``)."""

    def cell_call(self: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        return layer_plan.carry_as_given(self, "__call__", args, call(self, *args, **kwargs))

    return cell_call


@functools.cache
def _subclass(cls: type, call_name: str) -> type:
    """A subclass of ``cls`` whose ``__call__`` is one of the wrappers above (cached); a
    recurrent cell's keeps its carry's dtypes too."""
    table: dict[str, dict[str, Callable[..., Any]]] = {
        "policy": {"__call__": _policy_call},
        "embed": {"__call__": _embed_call, "attend": _embed_attend},
        "as_traced": {"__call__": _as_traced_call},
        "fp8": {"__call__": _own_call},
        "cell": {"__call__": _own_call},
        "planned": {"__call__": _own_call},  # a layer with settings: as written for float64
    }
    methods = table[call_name]
    if issubclass(cls, nnx.RNNCellBase) and call_name != "policy":
        methods = {**methods, "__call__": _keeping_carry(methods["__call__"])}

    def __reduce__(
        self: nnx.Module,
    ) -> tuple[Any, ...]:  # pickled as the original class plus the name of the wrapper
        return _rebuild, (cls, call_name, self.__getstate__())

    namespace = {
        **methods,
        "__reduce__": __reduce__,
        "__module__": cls.__module__,
        _WRAPPED_ATTR: True,
    }
    return type(cls.__name__, (cls,), namespace)


def _rebuild(cls: type, call_name: str, state: Any) -> nnx.Module:
    """Unpickles a module under a policy: the original class, wrapped again."""
    module: Any = object.__new__(_subclass(cls, call_name))
    module.__setstate__(state)
    return module


def _original_class(module: nnx.Module) -> type:
    cls = type(module)
    if cls.__dict__.get(_WRAPPED_ATTR, False):
        return cls.__mro__[1]  # the policy was applied before
    return cls


def _runs_delayed(module: nnx.Module, policy: Policy) -> bool:
    """Whether the layer's matmul hook runs in float8 with delayed scaling."""
    if policy.fp8 is None or policy.fp8.scaling != "delayed":
        return False
    hook = getattr(module, "dot_general", None) or getattr(module, "einsum_op", None)
    return isinstance(getattr(hook, "__self__", hook), fp8_state.Fp8DotGeneral)


def _swap_class(module: nnx.Module, call_name: str | None) -> None:
    """Wraps ``module``'s original class with ``call_name``'s wrapper (``None``: none)."""
    cls = _original_class(module)
    module.__class__ = cls if call_name is None else _subclass(cls, call_name)


def apply_policy(
    model: nnx.Module,
    policy: PolicyLike | None = None,
    *,
    overrides: Mapping[str | type, PolicyLike] | None = None,
    residuals: str = "compute_dtype",
    rules: AutocastRules | None = None,
) -> nnx.Module:
    """Puts an existing NNX model under a precision policy, in place, and returns it.

    Every layer gets the settings ``jaxamp.linen.apply_policy`` gives Linen
    layers (``dtype``, ``param_dtype``, the 16-bit matmul rule as the layer's
    ``dot_general``/``einsum_op``/``conv_general_dilated``, a float32-softmax
    ``attention_fn``); existing parameters are
    cast to their layer's ``param_dtype``; ``BatchStat`` variables stay float32.
    The model's ``__call__`` casts floating inputs to the compute dtype, evaluates
    the call with the policy's rules (sensitive primitives in float32 wherever the
    model calls them; see ``jaxamp.linen.apply_policy``) and casts its outputs
    to the output dtype. The model keeps its class for ``isinstance``
    (it becomes an instance of a subclass), works with ``nnx.Optimizer``,
    ``nnx.jit`` and ``nnx.grad``, and applying a policy again replaces the first.

    Args:
      model: an ``nnx.Module``.
      policy: a ``jaxamp.Policy`` or a spec for ``jaxamp.get_policy``;
        ``None`` picks ``jaxamp.auto_policy``.
      overrides: per-class or per-path policies, e.g. ``{"head": "float32"}``
        (paths are attribute paths such as ``"blocks/0/attn"``).
      residuals: what the backward pass may save; see
        ``jaxamp.linen.apply_policy``.
      rules: the rule table the call is evaluated with; see
        ``jaxamp.linen.apply_policy``.

    Returns:
      ``model`` itself.

    Examples:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> import jaxamp
      >>> model = jaxamp.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), "mixed_bfloat16")
      >>> model.dtype, model(jnp.ones((2, 4))).dtype
      (dtype(bfloat16), dtype('float32'))
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"apply_policy expects a flax.nnx.Module, got {type(model).__name__}: {model!r:.80}. "
            "For flax.linen modules use jaxamp.linen.apply_policy."
        )
    policy = get_policy(auto_policy() if policy is None else policy)
    override_list = layer_plan.normalize_overrides(overrides)
    # An override of the model's own class is the model's policy (its call evaluates with it).
    policy = layer_plan.resolve_policy(policy, override_list, [((), model)])
    residuals = validate_residuals(residuals)
    rules = policy_rules(rules)

    modules = {tuple(path): module for path, module in iter_modules(model)}
    chains = {
        path: [(path[:i], modules[path[:i]]) for i in range(len(path), -1, -1)] for path in modules
    }
    layer_plan.warn_unmatched(override_list, chains.values(), type(model).__name__)
    for path, module in modules.items():
        layer_policy = layer_plan.resolve_policy(policy, override_list, chains[path])
        originals = dict(getattr(module, _ORIGINALS_ATTR, None) or {})
        for name, value in originals.items():  # as before any policy
            setattr(module, name, value)
        plan = layer_plan.plan_layer(module, layer_policy)
        for name, value in plan.attributes:
            originals.setdefault(name, getattr(module, name))
            setattr(module, name, value)
        if originals:
            setattr(module, _ORIGINALS_ATTR, originals)
        wrapper = None
        if plan.cast_output_to is not None:
            setattr(module, _EMBED_DTYPE_ATTR, plan.cast_output_to)
            setattr(
                module, _ATTEND_PLAN_ATTR, layer_plan.plan_layer(module, layer_policy, "attend")
            )
            wrapper = "embed"
        elif layer_plan.runs_as_traced(policy, layer_policy) or layer_plan.leaves_float8(
            policy, layer_policy
        ):
            setattr(module, _SCOPE_ATTR, (policy, layer_policy))
            wrapper = "as_traced"
        elif isinstance(module, nnx.RNNCellBase):
            wrapper = "cell"
        elif plan.attributes:
            wrapper = "planned"
        if _runs_delayed(module, layer_policy):
            fp8_state.attach_nnx_fp8_state(module, layer_policy.fp8)
            wrapper = wrapper or "fp8"
        else:
            fp8_state.detach_nnx_fp8_state(module)
        if module is not model:
            _swap_class(module, wrapper)
        for value in vars(module).values():
            if isinstance(value, nnx.Param):
                _set_value(value, layer_policy.cast_to_param(_get_value(value)))

    setattr(model, _POLICY_ATTR, policy)
    setattr(model, _RESIDUALS_ATTR, residuals)
    setattr(model, _RULES_ATTR, rules)
    setattr(model, _OVERRIDES_ATTR, tuple(p for _, p in override_list))
    _swap_class(model, "policy")
    return model
