"""Scaling the loss: finding the scaler's state anywhere in an optimizer state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.loss_scaled import LossScaledState
from jaxamp._src.policy import is_floating_array


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
    from jaxamp._src.state_dtype import _hide_never_cast

    accumulators = (optax.MultiStepsState, optax.ApplyEvery)
    is_accumulator = lambda x: isinstance(x, accumulators)
    found = jax.tree_util.tree_flatten_with_path(
        _hide_never_cast(jax.tree.map(_value, state, is_leaf=_is_variable)),
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
    """Finds the :class:`LossScaledState` inside an optimizer state.

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


def get_loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32 scalar) of a :func:`jaxamp.loss_scaled` optimizer state.

    Example:
      >>> import optax, jax.numpy as jnp, jaxamp
      >>> state = jaxamp.loss_scaled(optax.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> get_loss_scale(state)
      Array(65536., dtype=float32)
    """
    return jnp.asarray(find_loss_scaled_state(opt_state).loss_scale.scale)


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale; use inside ``jax.grad`` and friends.

    A 16-bit loss is first cast to float32, so that the scaled value cannot
    overflow (float16's largest value, 65504, is below the default scale).

    Args:
      loss: a scalar loss.
      opt_state: an optimizer state containing a :func:`jaxamp.loss_scaled` state,
        or an ``nnx.Optimizer``.

    Returns:
      ``loss * scale`` in float32 (or the loss's dtype when that is wider).
    """
    loss = jnp.asarray(loss)
    if loss.dtype.itemsize < 4:
        loss = loss.astype(jnp.float32)
    return loss * get_loss_scale(opt_state).astype(loss.dtype)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    transform: Callable[..., Any] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, for a loss-scaled optimizer.

    The returned function takes ``fun``'s arguments plus a keyword-only
    ``opt_state`` (as ``optax.value_and_grad_from_state`` does) and returns the
    unscaled value (and aux) with the *scaled* gradients, ready for the
    optimizer's ``update``, which unscales them.

    Args:
      fun: the loss function.
      argnums: which positional arguments to differentiate.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      transform: the ``value_and_grad`` to build on: ``jax.value_and_grad``
        (default), ``nnx.value_and_grad`` for NNX modules, or any function with
        the same signature.

    Returns:
      ``f(*args, opt_state, **kwargs) -> (value, scaled_grads)``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxamp
      >>> tx = jaxamp.loss_scaled(optax.sgd(1.0))
      >>> params = jnp.ones(2)
      >>> state = tx.init(params)
      >>> loss, grads = jaxamp.value_and_grad(lambda p: jnp.sum(p**2))(params, opt_state=state)
      >>> float(loss), grads  # gradients are scaled by 2**16
      (2.0, Array([131072., 131072.], dtype=float32))
    """

    def wrapped(*args: Any, opt_state: Any, **kwargs: Any) -> tuple[Any, Any]:
        scale = get_loss_scale(opt_state)

        def scaled(*a: Any, **k: Any):
            out = fun(*a, **k)
            loss, aux = out if has_aux else (out, None)
            loss_f32 = jnp.asarray(loss)
            if loss_f32.dtype.itemsize < 4:
                loss_f32 = loss_f32.astype(jnp.float32)
            return loss_f32 * scale.astype(loss_f32.dtype), (loss, aux)

        vg = transform(scaled, argnums=argnums, has_aux=True)
        (_, (loss, aux)), grads = vg(*args, **kwargs)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped
