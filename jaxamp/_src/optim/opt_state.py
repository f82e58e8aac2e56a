"""Reading an optimizer state: the loss-scaled state anywhere in an optax chain, the
fields that never hold per-parameter statistics, and the gradients recorded non-finite."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxamp._src.optim.loss_scaled import LossScaledState


def is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


# State fields that never hold per-parameter statistics, whatever their shapes (``None``:
# every field of the state). Looked up by name: some are in optax.contrib, or missing
# from older optax versions.
_NEVER_CAST_NAMES = (
    ("InjectHyperparamsState", ("hyperparams",)),
    ("InjectStatefulHyperparamsState", ("hyperparams", "hyperparams_states")),
    ("ScheduleFreeState", ("b1", "weight_sum", "step_count", "max_lr")),
    ("ReduceLROnPlateauState", None),
    ("ScaleByBacktrackingLinesearchState", ("learning_rate", "value", "info")),
    ("ScaleByZoomLinesearchState", ("learning_rate", "value", "info")),
)
_NEVER_CAST: dict[type, tuple[str, ...] | None] = {
    getattr(module, name): fields
    for name, fields in _NEVER_CAST_NAMES
    for module in (optax, getattr(optax, "contrib", None))
    if isinstance(getattr(module, name, None), type)
}


class _Hidden:
    """Stands in for a leaf of a never-cast field while the statistics are looked for."""


_HIDDEN = _Hidden()


def hide_never_cast(state: Any) -> Any:
    """``state`` with every leaf of a never-cast field (``_NEVER_CAST``) replaced by
    ``_HIDDEN``: the same tree structure, with those leaves no longer floating arrays."""
    kinds = tuple(_NEVER_CAST)
    is_kind = lambda x: isinstance(x, kinds)

    def hide(node: Any) -> Any:
        if not is_kind(node):
            return node
        fields = next(f for kind, f in _NEVER_CAST.items() if isinstance(node, kind))
        return node._replace(
            **{
                name: (
                    jax.tree.map(lambda _: _HIDDEN, value)
                    if fields is None or name in fields
                    else hide_never_cast(value)
                )
                for name, value in zip(node._fields, node, strict=True)
            }
        )

    return jax.tree.map(hide, state, is_leaf=is_kind)


def _value(x: Any) -> Any:
    """Unwraps ``nnx.Variable`` leaves (``nnx.Optimizer`` wraps its state in them)."""
    get_value = getattr(x, "get_value", None)
    if callable(get_value):
        return get_value()
    return getattr(x, "value", x)


def _loss_scaled_states(tree: Any) -> list[LossScaledState]:
    is_state = lambda x: isinstance(x, LossScaledState)
    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]


def _is_variable(x: Any) -> bool:
    return x is not None and hasattr(x, "get_value")


_OUTERMOST = (
    "Make jaxamp.loss_scaled the whole optimizer, around everything else, e.g. "
    "jaxamp.loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))) "
    "or jaxamp.loss_scaled(optax.multi_transform({...}, labels))."
)


# What users call the transformations whose states may hold a loss-scaled state.
_WRAPPER_NAMES = {
    "PartitionState": "optax.multi_transform (optax.partition)",
    "MultiTransformState": "optax.multi_transform",
    "MaskedState": "optax.masked",
    "LookaheadState": "optax.lookahead",
    "SAMState": "optax.contrib.sam",
    "ScheduleFreeState": "optax.contrib.schedule_free",
}


def _why_not(wrapper: Any, where: str) -> str:
    """Why ``loss_scaled`` cannot sit inside ``wrapper`` (found at ``where`` of the
    optimizer state), and the order that works."""
    if isinstance(wrapper, optax.MultiStepsState):
        return (
            "jaxamp.loss_scaled is inside optax.MultiSteps: MultiSteps accumulates the "
            "scaled gradients, and after one overflow its accumulator stays NaN (it "
            "resets it with (1 - emit) * acc, and 0 * inf is NaN), so training stops "
            "for good. Put the loss scaling outside: "
            "jaxamp.loss_scaled(optax.MultiSteps(inner, every_k_schedule=k))."
        )
    kind = type(wrapper).__name__
    if kind == "StateDtypeState":
        return (
            "jaxamp.loss_scaled is inside jaxamp.with_state_dtype, which would store its "
            "float32 master copy of 16-bit params in 16 bits. Put with_state_dtype inside: "
            "jaxamp.loss_scaled(jaxamp.with_state_dtype(inner, dtype))."
        )
    if kind in ("InjectHyperparamsState", "InjectStatefulHyperparamsState"):
        return (
            "jaxamp.loss_scaled is inside optax.inject_hyperparams, whose step count (and "
            "so any schedule) advances on the steps loss_scaled skips, as float32 optax's "
            "would not. Put inject_hyperparams inside: jaxamp.loss_scaled("
            "optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)); its "
            "hyperparameters are then at state.inner_state.hyperparams."
        )
    if kind == "ApplyIfFiniteState":
        return (
            "jaxamp.loss_scaled is inside optax.apply_if_finite, which skips non-finite "
            "steps without the loss scale seeing them, so the scale never backs off. "
            "loss_scaled skips non-finite steps itself: use jaxamp.loss_scaled(inner), or "
            "jaxamp.loss_scaled(optax.apply_if_finite(inner, n)) to also count them."
        )
    if isinstance(wrapper, (tuple, list)) and not hasattr(wrapper, "_fields"):
        what = f"an optax.chain (at {where} of its state)"
    elif isinstance(wrapper, dict):
        what = f"an optax.named_chain or a dict of states (at {where} of its state)"
    else:
        name = _WRAPPER_NAMES.get(kind, f"{type(wrapper).__module__.split('.')[0]}.{kind}")
        what = f"{name} (at {where} of its state)"
    return (
        f"jaxamp.loss_scaled is inside {what}. Only the transformations inside "
        "loss_scaled see true gradients: one ahead of it or beside it sees the scaled "
        "gradients (a clip ahead of it clips gradients 65536 times too large, a param "
        "group beside it takes them as they are), and one after it changes the updates "
        "that land 16-bit params on their float32 master. " + _OUTERMOST
    )


def _check_outermost(opt_state: Any) -> None:
    """Raises unless the ``LossScaledState`` is the whole state."""
    if not isinstance(opt_state, LossScaledState):
        raise ValueError(_why_not(opt_state, "the top"))


def find_loss_scaled_state(opt_state: Any) -> LossScaledState:
    """Finds the ``LossScaledState`` of a loss-scaled optimizer.

    ``jaxamp.loss_scaled`` must be the whole optimizer: everything else goes inside it
    (``optax.chain``, ``optax.multi_transform``, ``optax.MultiSteps``, clipping,
    ``jaxamp.with_state_dtype``, ``optax.inject_hyperparams``). It may sit in an
    ``nnx.Optimizer`` or a ``TrainState`` (pass it, or its ``opt_state``).

    Args:
      opt_state: an optimizer state, or an object with an ``opt_state`` attribute.

    Returns:
      The ``LossScaledState`` (its leaves unwrapped from NNX variables).

    Raises:
      ValueError: if there is none, or more than one; or if it sits inside another
        transformation, which would see the scaled gradients (a clip ahead of it, a
        param group of ``optax.multi_transform`` beside it), hide overflows from it
        (``optax.MultiSteps``, ``optax.apply_if_finite``), round its float32 master
        (``jaxamp.with_state_dtype``) or change its updates after it. The message
        names the order that works.

    Examples:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = optax.chain(optax.clip(1.0), jaxamp.loss_scaled(optax.sgd(0.1)))
      >>> try:
      ...     find_loss_scaled_state(tx.init(jnp.ones(2)))
      ... except ValueError as e:
      ...     print(str(e).split(" (")[0])
      jaxamp.loss_scaled is inside an optax.chain
    """
    if not isinstance(opt_state, tuple):  # an nnx.Optimizer, a TrainState; a state
        opt_state = getattr(opt_state, "opt_state", opt_state)  # may name a field so (SAM)
    found = _loss_scaled_states(opt_state)
    if not found:
        raise ValueError(
            "No jaxamp loss-scaling state in this optimizer state: build the optimizer "
            "with jaxamp.loss_scaled(...), e.g. jaxamp.loss_scaled(optax.adamw(1e-3))."
        )
    if len(found) > 1:
        raise ValueError(
            f"Found {len(found)} jaxamp.loss_scaled states; wrap the optimizer only once, "
            "outermost."
        )
    _check_outermost(opt_state)
    return jax.tree.map(_value, found[0], is_leaf=_is_variable)


def nonfinite_gradients(opt_state: Any) -> list[str]:
    """The gradient leaves that were non-finite at the last skipped step, as paths.

    Needs ``jaxamp.loss_scaled(..., record_nonfinite=True)`` somewhere in the optimizer
    (found as ``jaxamp.optim.get_loss_scale`` finds it). Reads the state on the host.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxamp
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1), record_nonfinite=True)
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}, state, params)
      >>> jaxamp.optim.nonfinite_gradients(state)
      ["['b']"]
    """
    state = find_loss_scaled_state(opt_state)
    if state.nonfinite_grads is None:
        raise ValueError(
            "This optimizer state does not record non-finite gradients: build it with "
            "jaxamp.loss_scaled(..., record_nonfinite=True)."
        )
    leaves = jax.tree_util.tree_flatten_with_path(state.nonfinite_grads)[0]
    return [jax.tree_util.keystr(path) for path, bad in leaves if bool(bad)]
