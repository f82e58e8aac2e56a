"""Scaling the loss: finding the scaler's state anywhere in an optimizer state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxamp._src.loss_scaled import LossScaledState


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
        gradients it accumulates (``jaxamp.loss_scaled(optax.MultiSteps(...))`` can).
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
    return jax.tree.map(
        _value, found[0], is_leaf=lambda x: x is not None and hasattr(x, "get_value")
    )


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
