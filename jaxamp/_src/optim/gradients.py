"""Gradients under a loss scale: scaling the loss, ``value_and_grad``, reducing gradients."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxamp._src.dtypes import is_floating_array, is_narrow
from jaxamp._src.jaxprs import FLOAT32_SCOPE
from jaxamp._src.optim.loss_scaled import count_16bit
from jaxamp._src.optim.opt_state import find_loss_scaled_state
from jaxamp._src.policy import PolicyLike, get_policy


def get_loss_scale(opt_state: Any) -> jax.Array:
    """The current loss scale (float32 scalar) of a ``jaxamp.loss_scaled`` optimizer state.

    Examples:
      >>> import optax, jax.numpy as jnp, jaxamp
      >>> state = jaxamp.loss_scaled(optax.adam(1e-3)).init({"w": jnp.ones(2)})
      >>> get_loss_scale(state)
      Array(65536., dtype=float32)
    """
    return jnp.asarray(find_loss_scaled_state(opt_state).loss_scale.scale)


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """Multiplies ``loss`` by the current loss scale; use inside ``jax.grad`` and friends.

    A 16-bit loss is first cast to float32, so that the scaled value cannot
    overflow (float16's largest value, 65504, is below the default scale). Its
    backward pass still carries the scale in the loss's dtype: a float16 loss
    overflows there at a scale of 65536 (every such step is skipped), so it warns
    (``FLOAT16_LOSS``): compute the loss in float32.

    Args:
      loss: a scalar loss.
      opt_state: an optimizer state containing a ``jaxamp.loss_scaled`` state,
        or an ``nnx.Optimizer``.

    Returns:
      ``loss * scale`` in float32 (or the loss's dtype when that is wider).
    """
    return _times_scale(loss, get_loss_scale(opt_state))


FLOAT16_LOSS = (
    "jaxamp: the loss is float16. Its backward pass carries the loss scale in float16, "
    "whose largest value is 65504: at a scale of 65536 (the default start) every "
    "gradient is inf and the step is skipped, so the scale never stays above 32768. "
    "Compute the loss in float32: a policy with o=f32 returns float32 outputs, or cast "
    "the model's output to float32 before the loss."
)


def _times_scale(loss: Any, scale: jax.Array) -> jax.Array:
    """``loss * scale`` in float32 (or the loss's dtype where wider); warns for a float16
    loss (``FLOAT16_LOSS``)."""
    loss = jnp.asarray(loss)
    if loss.dtype == jnp.float16:
        warnings.warn(FLOAT16_LOSS, stacklevel=4)
    if is_narrow(loss.dtype):
        loss = loss.astype(jnp.float32)
    return loss * scale.astype(loss.dtype)


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
      argnums: which positional arguments to differentiate. The optimizer's params
        are the first of them; others differentiated beside them (a 16-bit input, a
        delayed-scaling FP8 state) may have any dtype.
      has_aux: whether ``fun`` returns ``(loss, aux)``.
      transform: the ``value_and_grad`` to build on: ``jax.value_and_grad``
        (default), ``nnx.value_and_grad`` for NNX modules, or any function with
        the same signature.

    Returns:
      ``f(*args, opt_state, **kwargs) -> (value, scaled_grads)``.

    Raises:
      ValueError: where the params' gradients have another number of 16-bit leaves
        than the params ``jaxamp.loss_scaled`` was initialised on (a transformation
        around it changed the params it sees, as ``optax.flatten`` of mixed dtypes does).

    Examples:
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

        def scaled(*a: Any, **k: Any) -> tuple[Any, tuple[Any, Any]]:
            out = fun(*a, **k)
            loss, aux = out if has_aux else (out, None)
            return _times_scale(loss, scale), (loss, aux)

        vg = transform(scaled, argnums=argnums, has_aux=True)
        (_, (loss, aux)), grads = vg(*args, **kwargs)
        seen = getattr(find_loss_scaled_state(opt_state), "sixteen_bit_leaves", None)
        if seen is not None:
            written = _written(fun, argnums, has_aux, transform)
            _check_params_seen(grads, argnums, seen.shape[0] - 1, written)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _written(fun: Any, argnums: Any, has_aux: bool, transform: Any) -> str:
    """The call as the user wrote it, for messages."""
    args = [getattr(fun, "__name__", None) or type(fun).__name__]
    args += [f"argnums={argnums!r}"] if argnums != 0 else []
    args += ["has_aux=True"] if has_aux else []
    if transform is not jax.value_and_grad:
        args.append(f"transform={getattr(transform, '__name__', type(transform).__name__)}")
    return f"jaxamp.value_and_grad({', '.join(args)})"


def _check_params_seen(grads: Any, argnums: Any, there: int, written: str) -> None:
    """Raises if ``loss_scaled`` was initialised on params with ``there`` 16-bit leaves
    and the params' gradients (the first of several ``argnums``; or all of them, params
    split across arguments) have another number: something around it changed the params
    it sees, and its float32 master would not cover the 16-bit params (read from shapes,
    so it holds under ``jit``). Other differentiated arguments may have any dtype."""
    if isinstance(argnums, int):
        here = count_16bit(grads)
        if here == there:
            return
        which = f"the params' gradients (argument {argnums}) have {here}"
    else:
        here = count_16bit(grads[0])
        if here == there or count_16bit(grads) == there:
            return
        counts = ", ".join(
            f"argument {a}: {count_16bit(g)}" for a, g in zip(argnums, grads, strict=True)
        )
        which = (
            f"the params' gradients (argument {argnums[0]}, the first of argnums) have "
            f"{here} ({counts})"
        )
    raise ValueError(
        f"{written}: the jaxamp.loss_scaled in opt_state was initialised on params with "
        f"{there} 16-bit leaves, and {which}. Differentiate the params the optimizer was "
        "initialised on, first in argnums (other arguments differentiated beside them, a "
        "16-bit input say, may have any dtype). If they are those params, a transformation "
        "around loss_scaled changes the params it sees: optax.flatten, for one, joins mixed "
        "float32 and 16-bit params into one float32 vector, which leaves no float32 master "
        "for the 16-bit ones; put it inside: jaxamp.loss_scaled(optax.flatten(inner))."
    )


def reduce_gradients(
    grads: Any, axis_name: str, policy: PolicyLike = "mixed_bfloat16", mean: bool = True
) -> Any:
    """All-reduces gradients over a mapped axis in the policy's reduction dtype.

    For use inside ``jax.shard_map`` (or ``pmap``), where each device holds the
    gradients of its own examples. Floating leaves are cast to
    ``policy.grad_reduce_dtype`` (float32 under mixed policies unless the policy's
    ``reduce_dtype`` says otherwise), summed (or averaged) across ``axis_name``, and
    returned in that dtype; under ``jaxamp.autocast`` too (the reduction runs as
    traced there, so ``reduce=bf16`` is kept rather than widened to float32).

    Args:
      grads: the per-device gradients.
      axis_name: the mapped axis.
      policy: the policy (or spec) that gives the reduction dtype.
      mean: average instead of sum.

    Returns:
      The reduced gradients, identical on every device.
    """
    policy = get_policy(policy)
    dtype = policy.grad_reduce_dtype
    reduce = lax.pmean if mean else lax.psum

    def one(g: Any) -> Any:
        if not is_floating_array(g):
            return g
        with jax.named_scope(FLOAT32_SCOPE):  # as traced under autocast: the dtype asked for
            return reduce(g.astype(dtype), axis_name)

    return jax.tree.map(one, grads)
