"""Reading an optimizer state: the loss-scaled state anywhere in an optax chain, the
fields that never hold per-parameter statistics, and the gradients recorded non-finite."""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxamp._src.dtypes import is_floating_array
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

    def hide(node):
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


def _check_not_inside_multi_steps(opt_state: Any) -> None:
    """``optax.MultiSteps(jaxamp.loss_scaled(...))`` never recovers from an overflow:
    MultiSteps accumulates the scaled gradients itself, and resets its accumulator with
    ``(1 - emit) * acc``, which leaves an inf or NaN in place (0 * inf is NaN); its
    ``should_skip_update_fn`` skips without the scaler seeing the overflow, so the
    scale never backs off. The other order accumulates only finite, unscaled steps."""
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)
    for node in jax.tree.leaves(opt_state, is_leaf=is_multi):
        if is_multi(node) and _loss_scaled_states(node.inner_opt_state):
            raise ValueError(
                "jaxamp.loss_scaled is inside optax.MultiSteps: MultiSteps accumulates the "
                "scaled gradients, and after one overflow its accumulator stays NaN (it "
                "resets it with (1 - emit) * acc, and 0 * inf is NaN), so training stops "
                "for good. Put the loss scaling outside: "
                "jaxamp.loss_scaled(optax.MultiSteps(inner, every_k_schedule=k))."
            )


def _children(node: Any) -> list[Any]:
    """The pytree children of ``node`` (one level down)."""
    return jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]


def _is_variable(x: Any) -> bool:
    return x is not None and hasattr(x, "get_value")


def _gradient_statistics(state: Any) -> str | None:
    """What in ``state`` keeps statistics of the gradients its transformation sees (a
    gradient accumulator, or a floating array that is not a scalar: Adam's moments, an
    EMA), for messages; ``None`` if nothing does (stateless transformations, counts,
    scalar hyperparameters)."""
    accumulators = (optax.MultiStepsState, optax.ApplyEvery)
    is_accumulator = lambda x: isinstance(x, accumulators)
    found = jax.tree_util.tree_flatten_with_path(
        hide_never_cast(jax.tree.map(_value, state, is_leaf=_is_variable)),
        is_leaf=is_accumulator,
    )[0]
    for path, leaf in found:
        if is_accumulator(leaf):
            at = f" at {jax.tree_util.keystr(path)} of its state" if path else ""
            return f"a gradient accumulator (an optax.{type(leaf).__name__}{at})"
    for path, leaf in found:
        if is_floating_array(leaf) and leaf.ndim >= 1:
            return (
                "a transformation with statistics of the gradients (the array at "
                f"{jax.tree_util.keystr(path)} of its state)"
            )
    return None


def _check_not_after_gradient_statistics(opt_state: Any) -> None:
    """A transformation ahead of ``loss_scaled`` in a chain sees the scaled gradients.
    One that keeps statistics of them (``optax.apply_every``'s accumulator, Adam's
    moments) takes in the inf or NaN of an overflow and keeps it for good (an
    accumulator resets with ``0 * acc``, a moment decays it but never drops it), while
    the scaler skips every step after and halves the scale forever."""
    node = opt_state
    while not isinstance(node, LossScaledState):
        children = list(node) if type(node) in (tuple, list) else _children(node)
        index = next(i for i, child in enumerate(children) if _loss_scaled_states(child))
        if type(node) in (tuple, list):  # an optax.chain's state: earlier ones run first
            for i, earlier in enumerate(children[:index]):
                what = _gradient_statistics(earlier)
                if what is not None:
                    raise ValueError(
                        f"Transformation {i} of an optax.chain, ahead of jaxamp.loss_scaled "
                        f"(transformation {index}), is {what}: it sees the scaled "
                        "gradients, and after one overflow its state holds an inf or NaN "
                        "for good, while every later step is skipped and the loss scale "
                        "halves forever. Put the loss scaling outermost, around everything "
                        "that sees gradients: jaxamp.loss_scaled(optax.chain(...)), e.g. "
                        "jaxamp.loss_scaled(optax.chain(optax.apply_every(k), inner))."
                    )
        node = children[index]


def find_loss_scaled_state(opt_state: Any) -> LossScaledState:
    """Finds the ``LossScaledState`` inside an optimizer state.

    Looks through any nesting: ``optax.chain``, ``optax.inject_hyperparams``,
    ``optax.multi_transform``, tuples, dicts, and ``nnx.Optimizer`` (pass the
    optimizer or its ``opt_state``). ``optax.MultiSteps`` goes inside
    ``loss_scaled``, not around it (see Raises).

    Args:
      opt_state: an optimizer state, or an object with an ``opt_state`` attribute.

    Returns:
      The one ``LossScaledState`` found (its leaves unwrapped from NNX variables).

    Raises:
      ValueError: if there is none, or more than one; or if it sits inside
        ``optax.MultiSteps``, which cannot recover from an overflow of the scaled
        gradients it accumulates (``jaxamp.loss_scaled(optax.MultiSteps(...))`` can);
        or if it sits in an ``optax.chain`` after a transformation that keeps
        statistics of the (scaled) gradients it sees, such as ``optax.apply_every``
        or ``optax.scale_by_adam`` (``loss_scaled`` goes outermost:
        ``jaxamp.loss_scaled(optax.chain(optax.apply_every(k), inner))``).
        Stateless transformations and scalar state (counts, hyperparameters) ahead
        of it are fine.
    """
    opt_state = getattr(opt_state, "opt_state", opt_state)
    found = _loss_scaled_states(opt_state)
    if not found:
        raise ValueError(
            "No jaxamp loss-scaling state in this optimizer state: build the optimizer "
            "with jaxamp.loss_scaled(...), e.g. jaxamp.loss_scaled(optax.adamw(1e-3))."
        )
    if len(found) > 1:
        raise ValueError(
            f"Found {len(found)} jaxamp.loss_scaled states; wrap the optimizer only once."
        )
    _check_not_inside_multi_steps(opt_state)
    _check_not_after_gradient_statistics(opt_state)
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
