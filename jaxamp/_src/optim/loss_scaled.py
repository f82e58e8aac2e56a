"""``loss_scaled``: loss scaling as an optax transformation, with on-device skips."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxamp._src.dtypes import (
    float32_tree,
    is_floating_array,
    is_inexact_array,
    is_narrow_array,
    upcast,
)
from jaxamp._src.errors import guide, invalid_choice
from jaxamp._src.ops.fp8 import state_paths
from jaxamp._src.optim import master_weights as masters
from jaxamp._src.optim.scales import DynamicLossScale, LossScale, LossScaleState


class LossScaledState(NamedTuple):
    """State of ``loss_scaled`` (every leaf an array).

    Attributes:
      loss_scale: the scale and its counters.
      inner_state: the wrapped transformation's state.
      master_params: float32 copy of 16-bit params (a float32 scalar placeholder for
        each other leaf), or ``None`` when no param is 16-bit.
      skipped_steps: steps skipped since ``init``, int32, saturating.
      consecutive_skips: steps skipped since the last finite one, int32, saturating.
      last_finite: whether the last step's gradients were finite, bool.
      scale_history: the scale after each of the last ``history_length`` steps
        (a ring buffer; entries not yet written hold 0).
      step: updates applied or skipped since ``init``, int32, saturating.
      compensation: the Kahan compensation of 16-bit params (``master_weights="kahan"``),
        in the params' dtypes, else ``None``.
      rounding_key: raw ``uint32`` PRNG key data (``master_weights="stochastic"``), else
        ``None``; the rounding noise of a step is a function of it and ``step``.
      nonfinite_grads: with ``record_nonfinite=True``, a tree shaped like the gradients
        of boolean scalars: which leaves were non-finite at the last skipped step (all
        ``False`` before any skip); else ``None``. Read it with
        ``jaxamp.optim.nonfinite_gradients``. ``init`` sees only the params, so it takes
        the gradients' structure from them (see ``_gradient_structure``).
      sixteen_bit_leaves: one ``False`` per 16-bit param leaf ``init`` saw, and one
        more (only its length is read; Orbax cannot save an empty array):
        ``jaxamp.value_and_grad`` checks that the gradients it makes have as many,
        which a transformation around ``loss_scaled`` that changes the
        params it sees (``optax.flatten`` joining mixed dtypes into float32) breaks.
    """

    loss_scale: LossScaleState
    inner_state: Any
    master_params: Any
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    last_finite: jax.Array
    scale_history: jax.Array
    step: jax.Array
    compensation: Any = None
    rounding_key: Any = None
    nonfinite_grads: Any = None
    sixteen_bit_leaves: Any = None


def _gradient_structure(params: Any) -> Any:
    """``params`` as the gradients of ``update`` are shaped: each
    ``optax.LookaheadParams(fast, slow)`` replaced by its ``fast`` params (lookahead
    takes gradients of the fast params only). Every other tree is its own gradients'
    shape; ``update`` checks it (see ``_record_nonfinite``)."""
    is_lookahead = lambda x: isinstance(x, optax.LookaheadParams)
    return jax.tree.map(lambda x: x.fast if is_lookahead(x) else x, params, is_leaf=is_lookahead)


def count_16bit(tree: Any) -> int:
    """How many leaves of ``tree`` are 16-bit floating arrays."""
    return sum(is_narrow_array(x) for x in jax.tree.leaves(tree))


def _record_nonfinite(checks: Any, finite: jax.Array, record: Any) -> Any:
    """The new record: on a skipped step, which gradient leaves were not finite; on a
    finite one, the record as it was. ``checks`` holds the per-leaf results, shaped
    like the gradients; the record was shaped at ``init``, from the params."""
    if jax.tree.structure(checks) != jax.tree.structure(record):  # type: ignore[operator]
        raise ValueError(
            "loss_scaled(record_nonfinite=True) keeps one flag per gradient leaf, in a tree "
            "shaped like the gradients, which init took from the params (optax.LookaheadParams "
            "as its fast params); these gradients are shaped "
            f"{jax.tree.structure(checks)}, the record {jax.tree.structure(record)}. Pass "
            "update gradients shaped like the params given to init."
        )
    return jax.tree.map(lambda ok, old: jnp.where(finite, old, ~ok), checks, record)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating or complex element of ``tree`` is finite (one reduction under jit).

    Examples:
      >>> import jax.numpy as jnp
      >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
      False
    """
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        # a Python float or complex leaf is checked too (an int cannot be non-finite)
        if is_inexact_array(x) or (isinstance(x, (float, complex)) and not isinstance(x, bool))
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack(leaves).all()


def _unscale(g: Any, inv_scale: jax.Array) -> Any:
    """A scaled gradient leaf unscaled: a real floating one in float32, a complex one in
    its own complex dtype (both parts multiplied by ``inv_scale``); any other leaf (an
    integer's float0 gradient, a ``None``) as it is."""
    if is_floating_array(g):
        # float32 for every narrower float (float8 too), float64 kept; the scale named in
        # that dtype, not promoted: strict dtype promotion refuses bfloat16 with float32
        wide = upcast(g)
        return wide * inv_scale.astype(wide.dtype)
    if is_inexact_array(g):  # complex: each part scaled (no complex * real promotion)
        part = jnp.finfo(g.dtype).dtype
        return lax.complex(g.real * inv_scale.astype(part), g.imag * inv_scale.astype(part))
    return g


def _unscaled_finite(grads: Any, inv_scale: jax.Array) -> jax.Array:
    """Whether every element of ``g.astype(float32) * inv_scale`` is finite, for every
    floating or complex leaf ``g`` of the scaled gradients.

    Per leaf, ``all(isfinite(g * inv_scale))``: XLA fuses the unscale into the check,
    which reads each gradient once and writes one boolean per element (for Adam, the
    update reads and writes 12.5 gradient sizes against plain optax's 10). The form
    holds where others do not: XLA's fast math (``--xla_cpu_enable_fast_math``, in
    ``XLA_FLAGS`` or a jit's ``compiler_options``) folds ``sum(u - u)`` and ``u * 0`` to
    0, and fast min/max may drop NaNs, but ``isfinite`` reads the exponent bits; no NaN
    is made from an ``inf`` gradient (``jax_debug_nans`` stays quiet on a step it
    skips); and no value is promoted (``jax_numpy_dtype_promotion="strict"``).
    ``benchmarks/loss_scaling.py --model mlp`` times it beside the other forms.
    """
    checks = jax.tree.leaves(_finite_leaves(grads, inv_scale))
    if not checks:
        return jnp.asarray(True)
    return jnp.stack(checks).all()


def _finite_leaves(grads: Any, inv_scale: jax.Array) -> Any:
    """Per gradient leaf, whether it is finite once unscaled (see ``_unscaled_finite``):
    a tree of boolean scalars, ``True`` for leaves that are not floating or are empty."""

    def check(g: Any) -> jax.Array:
        if not is_inexact_array(g) or g.size == 0:
            return jnp.asarray(True)
        return jnp.all(jnp.isfinite(_unscale(g, inv_scale)))

    return jax.tree.map(check, grads)


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | None = None,
    *,
    axis_name: str | None = None,
    history_length: int = 32,
    skip_with: str = "select",
    master_weights: str = "float32",
    seed: int = 0,
    record_nonfinite: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer with loss scaling, on-device skipping and float32 master params.

    Scale the loss with ``jaxamp.scale_loss`` (or take gradients with
    ``jaxamp.value_and_grad``) and pass the scaled gradients to ``update``.

    Args:
      inner: the optimizer, e.g. ``optax.chain(optax.clip_by_global_norm(1.0),
        optax.adamw(1e-3))``; it sees float32, unscaled gradients (a float64 param's
        in float64 under ``jax_enable_x64``, with the float64 param). Its result is
        used only when they are all finite: under ``skip_with="select"`` it also
        runs on a step with non-finite gradients, and that step's updates and new
        state are discarded; under ``"cond"`` it does not run on such a step.
      loss_scale: ``jaxamp.DynamicLossScale`` (default),
        ``jaxamp.StaticLossScale`` or ``jaxamp.NoOpLossScale``.
      axis_name: a mapped axis (``shard_map``, ``pmap``) over which gradients
        differ per device; the step is skipped everywhere if any device sees a
        non-finite gradient. Not needed under ``jit`` with sharded arrays.
      history_length: how many recent scales the state keeps for diagnostics.
      skip_with: how a non-finite step is skipped. ``"select"`` (default)
        computes the inner update and keeps the old state with ``jnp.where``,
        fused into the update's own kernels; the program has no conditional
        (XLA:GPU reads a conditional's predicate on the host). On XLA:CPU the
        params' update then reads the old moments again (Adam: 12.5 gradient
        sizes read and written against plain optax's 10), and with donated
        buffers XLA copies the moments before updating them in place.
        ``"cond"`` runs the inner update under ``lax.cond`` and does no inner
        work on a skipped step, for inner transformations whose work is
        large or data-dependent (line searches, matrix roots); on a CPU with
        donated buffers it can cost less. The Loss scaling guide
        (guides/loss-scaling.md) gives what each costs over a plain optax
        step, measured by ``benchmarks/loss_scaling.py``.

      master_weights: how updates reach 16-bit params (float32 params are updated
        as they are): ``"float32"`` (default) keeps a float32 master copy;
        ``"kahan"`` a 16-bit compensation buffer that carries each step's rounding
        error into the next; ``"stochastic"`` no master, the params rounded
        stochastically (unbiased); ``"none"`` no master, rounded to nearest (the
        naive baseline, which stalls on updates below half a 16-bit ulp). See the
        Optimizer state guide (guides/optimizer-state.md) for the bytes each keeps.
      seed: the seed of the stochastic rounding noise (``master_weights="stochastic"``).
      record_nonfinite: keep, in the state, which gradient leaves were non-finite at
        the last skipped step (one boolean per leaf, from the finiteness check's own
        per-leaf results); ``jaxamp.optim.nonfinite_gradients`` lists them, and
        ``jaxamp.find_nonfinite`` then finds the operation that made them. The
        record is shaped like the params given to ``init``, ``optax.LookaheadParams``
        taken as their fast params (the params ``optax.lookahead``'s gradients are
        of); ``update`` raises a ``ValueError`` for gradients of another shape.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; extra keyword arguments of
      ``update`` are passed to ``inner``, ``grad=`` (the gradient optax's line
      searches take, as ``optax.lbfgs`` does) unscaled as the updates are; ``value=``
      is the loss unscaled, as ``jaxamp.value_and_grad`` returns it.

    ``loss_scaled`` must be the whole optimizer: everything that sees gradients or
    changes updates goes inside it (see ``jaxamp.optim.find_loss_scaled_state``, which
    ``scale_loss`` and ``value_and_grad`` call, and which refuses any other order).

    Examples:
      >>> import jax, jax.numpy as jnp, optax
      >>> import jaxamp
      >>> tx = jaxamp.loss_scaled(optax.sgd(0.1))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> loss = lambda p: jnp.sum(p["w"] ** 2)
      >>> grads = jax.grad(lambda p: jaxamp.scale_loss(loss(p), state))(params)
      >>> updates, state = tx.update(grads, state, params)
      >>> updates["w"]  # -0.1 * 2w: the scale is gone
      Array([-0.2, -0.2, -0.2], dtype=float32)
    """
    config = _Config(
        inner=optax.with_extra_args_support(_validated_inner(inner)),
        loss_scale=_validated_loss_scale(loss_scale),
        master_weights=masters.validate_master_weights(master_weights),
        skip_with=_validated_skip_with(skip_with),
        axis_name=axis_name,
        record_nonfinite=_validated_flag("record_nonfinite", record_nonfinite),
        history_length=_validated_history_length(history_length),
        seed=_validated_seed(seed),
    )
    return optax.GradientTransformationExtraArgs(
        functools.partial(_init, config), functools.partial(_update, config)
    )


# --- loss_scaled, step by step ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
    """The settings of one ``loss_scaled`` transformation, validated."""

    inner: optax.GradientTransformationExtraArgs
    loss_scale: LossScale
    master_weights: str
    skip_with: str
    axis_name: str | None
    record_nonfinite: bool
    history_length: int
    seed: int


def settings_of(tx: Any) -> _Config | None:
    """The settings of a ``loss_scaled`` transformation, ``None`` for any other."""
    init = getattr(tx, "init", None)
    if isinstance(init, functools.partial) and init.func is _init:
        return cast(_Config, init.args[0])
    return None


def _validated_inner(inner: Any) -> Any:
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(
            "loss_scaled expects an optax.GradientTransformation (e.g. optax.adam(1e-3)) as "
            f"inner, got {inner!r} ({type(inner).__name__})."
        )
    return inner


def _validated_loss_scale(loss_scale: Any) -> LossScale:
    loss_scale = DynamicLossScale() if loss_scale is None else loss_scale
    if isinstance(loss_scale, type) or not hasattr(loss_scale, "adjust"):
        raise TypeError(
            "loss_scale must be an instance of jaxamp.NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale (e.g. DynamicLossScale()), got {loss_scale!r} "
            f"({type(loss_scale).__name__})."
        )
    return loss_scale


def _validated_skip_with(skip_with: Any) -> str:
    if skip_with not in ("select", "cond"):
        raise invalid_choice("skip_with", skip_with, ("select", "cond"), quote=True)
    return skip_with


def _validated_history_length(history_length: Any) -> int:
    if isinstance(history_length, bool) or not isinstance(history_length, (int, np.integer)):
        raise ValueError(f"history_length must be an integer >= 1, got {history_length!r}.")
    if history_length < 1:
        raise ValueError(f"history_length must be an integer >= 1, got {history_length!r}.")
    return int(history_length)


def _validated_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


def _validated_seed(seed: Any) -> Any:
    if isinstance(seed, bool) or not (
        isinstance(seed, (int, np.integer))
        or (isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key))
    ):
        raise TypeError(f"seed must be an integer or a jax.random.key, got {seed!r}.")
    return seed


def _refuse_fp8_state(tree: Any, what: str) -> None:
    """Delayed scaling's FP8 state is replaced by its gradient, never stepped or unscaled."""
    paths = state_paths(tree)
    if paths:
        raise ValueError(
            f"loss_scaled got FP8 state among the {what} ({paths[0]}"
            f"{f' and {len(paths) - 1} more' if len(paths) > 1 else ''}). Its gradient is "
            "its next value: unscaling or stepping it would corrupt it. Differentiate params "
            "and state apart and set the state to its gradient: Linen, "
            "jax.grad(loss, argnums=(0, 1))(params, variables['_overwrite_with_gradient']); "
            "NNX, grads = jaxamp.nnx.update_fp8_state(model, grads) before the optimizer "
            f"({guide('fp8.md')})."
        )


def _init(config: _Config, params: Any) -> LossScaledState:
    _refuse_fp8_state(params, "params")
    has_16_bit = any(is_narrow_array(x) for x in jax.tree.leaves(params))
    master, compensation, key = masters.init(params, config.master_weights, config.seed)
    inner_params = float32_tree(params) if has_16_bit else params
    return LossScaledState(
        loss_scale=config.loss_scale.init(),
        inner_state=config.inner.init(inner_params),
        master_params=master,
        skipped_steps=jnp.zeros([], jnp.int32),
        consecutive_skips=jnp.zeros([], jnp.int32),
        last_finite=jnp.asarray(True),
        scale_history=jnp.zeros([config.history_length], jnp.float32),
        step=jnp.zeros([], jnp.int32),
        compensation=compensation,
        rounding_key=key,
        nonfinite_grads=(
            jax.tree.map(lambda _: jnp.asarray(False), _gradient_structure(params))
            if config.record_nonfinite
            else None
        ),
        # one more than the count: a checkpointer (Orbax) cannot save an empty array
        sixteen_bit_leaves=jnp.zeros([count_16bit(_gradient_structure(params)) + 1], jnp.bool_),
    )


def _update(
    config: _Config, updates: Any, state: LossScaledState, params: Any = None, **extra_args: Any
) -> tuple[Any, LossScaledState]:
    """One step: check finiteness, apply the inner update or skip it, the next state."""
    _refuse_fp8_state(updates, "gradients")
    has_master = state.master_params is not None
    rounds = state.compensation is not None or state.rounding_key is not None
    if (has_master or rounds) and params is None:
        raise ValueError(
            f"loss_scaled(master_weights={config.master_weights!r}) updates 16-bit params "
            "itself, so update() needs the current params: tx.update(grads, state, params)."
        )
    if "grad_fn" in extra_args:
        raise ValueError(
            "loss_scaled got grad_fn=, a function that computes gradients inside the "
            "optimizer (optax.contrib.sam's opaque mode): loss_scaled can neither unscale "
            "nor check what it returns. Use optax.contrib.sam(..., opaque_mode=False) "
            "inside loss_scaled, and pass it each step's gradients."
        )
    if config.master_weights == "stochastic" and "value_fn" in extra_args and rounds:
        raise ValueError(
            "loss_scaled(master_weights='stochastic') got value_fn=, a line search's: its "
            "curvature and step sizes come from the params it evaluates, which stochastic "
            "rounding then moves by random fractions of a unit in the last place (20 "
            "bfloat16 ulps off float32 optax's lbfgs in 6 steps). Use "
            "master_weights='float32' or 'kahan' with a line search."
        )
    inv_scale = 1.0 / state.loss_scale.scale
    finite, nonfinite_grads = _check_finite(config, updates, state, inv_scale)
    grads = jax.tree.map(lambda g: _unscale(g, inv_scale), updates)
    if extra_args.get("grad") is not None:  # optax's line searches take the gradient again
        extra_args = {
            **extra_args,
            "grad": jax.tree.map(lambda g: _unscale(g, inv_scale), extra_args["grad"]),
        }
    new_updates, inner_state, master, compensation = _apply_or_skip(
        config, finite, grads, state, params, extra_args
    )
    return new_updates, _next_state(
        config, state, finite, inner_state, master, compensation, nonfinite_grads
    )


def _check_finite(
    config: _Config, updates: Any, state: LossScaledState, inv_scale: jax.Array
) -> tuple[jax.Array, Any]:
    """Whether every unscaled gradient is finite, on every device of ``axis_name``; and
    the record of the non-finite leaves (with ``record_nonfinite``)."""

    def every_device(ok: jax.Array) -> jax.Array:
        if config.axis_name is None:
            return ok
        return lax.pmin(ok.astype(jnp.int32), config.axis_name) > 0

    if not config.record_nonfinite:
        return every_device(_unscaled_finite(updates, inv_scale)), state.nonfinite_grads
    # the per-leaf checks are the check: computed once, kept and combined
    per_leaf, treedef = jax.tree.flatten(_finite_leaves(updates, inv_scale))
    checks = every_device(jnp.stack(per_leaf)) if per_leaf else jnp.ones([0], jnp.bool_)
    finite = checks.all()  # global, as the record is: the same on every device
    leaves_ok = jax.tree.unflatten(treedef, list(checks))
    return finite, _record_nonfinite(leaves_ok, finite, state.nonfinite_grads)


def _apply_or_skip(
    config: _Config,
    finite: jax.Array,
    grads: Any,
    state: LossScaledState,
    params: Any,
    extra_args: dict[str, Any],
) -> tuple[Any, Any, Any, Any]:
    """``(updates, inner_state, master_params, compensation)``: the inner transformation's
    step where ``finite``, zero updates and the old state where not."""
    has_master = state.master_params is not None
    rounds = state.compensation is not None or state.rounding_key is not None
    master_params = masters.adopt_changes(state.master_params, params) if has_master else None
    if has_master or rounds or any(is_narrow_array(x) for x in jax.tree.leaves(params)):
        # float32, as init saw them (master_weights="none" has neither master nor state)
        inner_params = masters.inner_params(params, master_params, state.compensation)
    else:
        inner_params = params

    def apply(_: None) -> tuple[Any, Any, Any, Any]:
        new_updates, inner_state = config.inner.update(
            grads, state.inner_state, inner_params, **extra_args
        )
        if has_master:
            landing, new_master = masters.step_master(master_params, new_updates, params)
            return landing, inner_state, new_master, state.compensation
        if rounds:
            new_updates, compensation = masters.apply(
                config.master_weights,
                new_updates,
                params,
                state.compensation,
                state.rounding_key,
                state.step,
            )
            return new_updates, inner_state, None, compensation
        return new_updates, inner_state, None, None

    if config.skip_with == "cond":
        update_shapes = jax.eval_shape(apply, None)[0]

        def skip(_: None) -> tuple[Any, Any, Any, Any]:
            zeros = jax.tree.map(lambda s: _no_change(s.shape, s.dtype), update_shapes)
            return zeros, state.inner_state, master_params, state.compensation

        return lax.cond(finite, apply, skip, None)
    new_updates, inner_state, master, compensation = apply(None)
    keep = lambda new, old: jnp.where(finite, new, old)
    new_updates = jax.tree.map(
        lambda u: jnp.where(finite, u, _no_change(u.shape, u.dtype)), new_updates
    )
    inner_state = jax.tree.map(keep, inner_state, state.inner_state)
    master = jax.tree.map(keep, master, master_params)
    compensation = jax.tree.map(keep, compensation, state.compensation)
    return new_updates, inner_state, master, compensation


def _no_change(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A skipped step's update: ``-0.0`` where ``dtype`` is inexact, which leaves every
    value bit for bit (``-0.0 + -0.0`` is ``-0.0``, where ``-0.0 + 0.0`` is ``+0.0``),
    else ``0``."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return jnp.full(shape, complex(-0.0, -0.0), dtype)
    return jnp.full(shape, -0.0 if jnp.issubdtype(dtype, jnp.floating) else 0, dtype)


def _next_state(
    config: _Config,
    state: LossScaledState,
    finite: jax.Array,
    inner_state: Any,
    master: Any,
    compensation: Any,
    nonfinite_grads: Any,
) -> LossScaledState:
    """The state after a step: the loss scale adjusted, the step counted (as skipped if
    not ``finite``), the scale history advanced."""
    new_scale_state = config.loss_scale.adjust(state.loss_scale, finite)
    at = state.step % config.history_length
    return LossScaledState(
        loss_scale=new_scale_state,
        inner_state=inner_state,
        master_params=master,
        skipped_steps=jnp.where(
            finite, state.skipped_steps, optax.safe_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(finite, 0, optax.safe_increment(state.consecutive_skips)),
        last_finite=finite,
        scale_history=state.scale_history.at[at].set(new_scale_state.scale),
        step=optax.safe_increment(state.step),
        compensation=compensation,
        rounding_key=state.rounding_key,
        nonfinite_grads=nonfinite_grads,
        sixteen_bit_leaves=state.sixteen_bit_leaves,
    )
