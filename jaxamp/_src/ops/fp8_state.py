"""FP8 state: one float8 GEMM's scales and amax histories, their checks, their max-combined form."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.interpreters import ad as _ad  # JVPTracer: is a value being differentiated

from jaxamp._src.dtypes import FLOAT32, is_floating
from jaxamp._src.errors import guide
from jaxamp._src.ops.fp8_max32 import MAX32
from jaxamp._src.policy import recipe_integer

STATE_COLLECTION = "_overwrite_with_gradient"
"""The Linen collection that holds the FP8 state: Flax's ``fp8_ops.OVERWRITE_WITH_GRADIENT``,
whose gradient is the state's next value."""


class Fp8State(NamedTuple):
    """The FP8 state of one float8 GEMM under delayed scaling, named as Flax's
    ``Fp8DotGeneralBase`` names its variables: a scale (``amax / max``) and an amax history
    per operand."""

    input_amax_history: jax.Array
    kernel_amax_history: jax.Array
    output_grad_amax_history: jax.Array
    input_scale: jax.Array
    kernel_scale: jax.Array
    output_grad_scale: jax.Array


def init_gemm_fp8_state(amax_history_length: int = 1024) -> Fp8State:
    """A fresh FP8 state for one GEMM: amax histories of zeros and scales of one, as Flax
    initialises them (``jaxamp.init_fp8_state`` makes an autocast function's, one per GEMM).

    Examples:
      >>> state = init_gemm_fp8_state(4)
      >>> state.input_amax_history.shape, state.input_scale.shape
      ((4,), (1,))
    """
    n = recipe_integer("amax_history_length", amax_history_length, 1)
    history = jnp.zeros((n,), FLOAT32)
    scale = jnp.ones((1,), FLOAT32)
    return Fp8State(history, history, history, scale, scale, scale)


def as_fp8_state(state: Any) -> Fp8State:
    """An ``Fp8State`` from one, a mapping of its six names (as Orbax restores it without a
    target) or a sequence of its six values."""
    if isinstance(state, Mapping):
        missing = sorted(set(Fp8State._fields) - set(state))
        if missing:
            raise ValueError(f"an FP8 state without {missing}; it holds {sorted(state)}.")
        return Fp8State(**{name: state[name] for name in Fp8State._fields})
    return Fp8State(*state)


def _check_state_dtype(dtype: Any, what: str) -> None:
    """Refuses a floating state value that is neither float32 nor float64."""
    if dtype == MAX32 or not is_floating(dtype):
        return
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(
            f"{what} is {np.dtype(dtype).name}; the state is float32 (its scales and amaxes "
            "rounded to 16 bits would scale wrongly, and its next value would stay "
            "rounded). Keep it float32 when casting or saving the model's variables."
        )


def checked_fp8_state(state: Fp8State, history_length: int | None, where: str) -> Fp8State:
    """``state``, refused by name where it is not one GEMM's state: amax histories of one
    length (``history_length``, the policy's ``fp8_history``, where given) and scales of one
    element, all float32 (float64 under ``jax_enable_x64``). A state made under another
    ``fp8_history``, a stack's state given to one layer, or one cast to 16 bits (its
    scales rounded, its next state kept in 16 bits) would otherwise run as it is."""
    histories = Fp8State._fields[:3]
    for name, value in zip(Fp8State._fields, state, strict=True):
        array: Any = value if hasattr(value, "dtype") else np.asarray(value)  # or a number
        shape, dtype = np.shape(array), array.dtype
        is_history = name in histories
        if (len(shape) != 1) if is_history else (int(np.prod(shape)) != 1):
            want = "(history length,)" if is_history else "(1,)"
            raise ValueError(
                f"{where}: its FP8 state's {name} has shape {shape}, and one GEMM's state "
                f"holds {want}. A stack's state ((layers, ...), from nn.scan, nn.vmap or "
                "nnx.vmap) belongs to the stack, and each layer of it gets its own slice."
            )
        _check_state_dtype(dtype, f"{where}: its FP8 state's {name}")
    lengths = sorted({np.shape(getattr(state, name))[0] for name in histories})
    if len(lengths) > 1:
        raise ValueError(
            f"{where}: its FP8 state has amax histories of different lengths {lengths}: "
            "not one GEMM's state. Make a fresh one under the policy."
        )
    if history_length is not None and lengths != [history_length]:
        raise ValueError(
            f"{where}: its FP8 state has amax histories of length {lengths[0]}, and the "
            f"policy's fp8_history is {history_length}. A state made under another "
            "fp8_history (restored from a checkpoint, say) needs that policy "
            f"(fp8_history={lengths[0]}), or a fresh state made under this one."
        )
    return state


def state_paths(tree: Any) -> list[str]:
    """Paths of ``tree`` that hold FP8 state: under the ``_overwrite_with_gradient`` collection
    (Linen), or a layer's full set of ``Fp8State`` fields (NNX)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    keys = [path_names(path) for path, _ in flat]
    # An NNX State's leaves sit under their Variable's value: input_scale/value.
    keys = [k[:-1] if len(k) > 1 and k[-1] in ("value", "raw_value") else k for k in keys]
    by_parent: dict[tuple[str, ...], set[str]] = {}
    for key in keys:
        if key:
            by_parent.setdefault(key[:-1], set()).add(key[-1])
    found = []
    for key in keys:
        in_collection = STATE_COLLECTION in key
        in_layer = bool(key) and set(Fp8State._fields) <= by_parent.get(key[:-1], set())
        if in_collection or (in_layer and key[-1] in Fp8State._fields):
            found.append("/".join(key))
    return found


def path_names(path: tuple) -> tuple:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


# ------------------------------------------------------------- max-combined state


def _unused_kept(old: list[jax.Array], new: list[jax.Array], paths: list[tuple]) -> list:
    """The next state, with the old values kept where no float8 GEMM's backward pass wrote
    one: a layer left out of the loss (an auxiliary output, ``stop_gradient``) gets a zero
    or ``-inf`` gradient, and a scale of 0 would zero the layer's outputs from then on.
    A used operand's next scale is always positive; its history goes with it."""
    new = [jnp.where(n == -jnp.inf, o, n) for o, n in zip(old, new, strict=True)]
    index = {path: i for i, path in enumerate(paths)}
    for path, i in index.items():
        name = path[-1] if path else ""
        if not name.endswith("_scale"):
            continue
        unused = jnp.all(new[i] <= 0)
        history = index.get((*path[:-1], name[: -len("scale")] + "amax_history"))
        for j in (i, history):
            if j is not None:
                new[j] = jnp.where(unused, old[j], new[j])
    return new


def max_combined(tree: Any) -> Any:
    """FP8 state as values whose gradients combine by ``max`` instead of sum
    where a value is used more than once (a layer called twice, a loop body).

    The policies convert the state they are given; convert it yourself before a loop
    that calls the model several times in one differentiated step (micro-batches
    accumulated in a ``lax.scan``), so that the loop's uses combine by max too. The
    gradient of a state that reaches the loss but that no float8 GEMM used is the state
    itself; a state the differentiated function never reads gets JAX's zero gradient,
    which the next step treats as a fresh state (scales of 1).

    Examples:
      >>> state = max_combined(init_gemm_fp8_state(4))
      >>> state.input_scale.dtype
      fp8_max32
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [path_names(p) for p, _ in flat]
    for path, (_, x) in zip(paths, flat, strict=True):
        if hasattr(x, "dtype"):
            _check_state_dtype(x.dtype, f"the FP8 state at {'/'.join(path) or 'the root'}")
    done = [getattr(x, "dtype", None) == MAX32 for _, x in flat]
    values = [x if d else jnp.asarray(x, FLOAT32) for (_, x), d in zip(flat, done, strict=True)]
    todo = [v for v, d in zip(values, done, strict=True) if not d]
    todo_paths = [p for p, d in zip(paths, done, strict=True) if not d]

    # A custom_vjp of arrays, not of a list: see _as_custom_vjp.
    @jax.custom_vjp
    def convert(*xs: Any) -> tuple[Any, ...]:
        return tuple(lax.convert_element_type(x, MAX32) for x in xs)

    def fwd(*xs: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return convert(*xs), xs

    def bwd(xs: tuple[Any, ...], cts: Any) -> tuple[Any, ...]:
        cts = [lax.convert_element_type(c, FLOAT32) for c in cts]
        return tuple(_unused_kept(list(xs), cts, todo_paths))

    convert.defvjp(fwd, bwd)
    converted = iter(convert(*todo) if todo else [])
    out = [v if d else next(converted) for v, d in zip(values, done, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


# --------------------------------------------------------- a state left undifferentiated

_DIFFERENTIATING = tuple(
    t for t in (getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)) if t
)


def _differentiated(x: Any) -> bool:
    return isinstance(x, _DIFFERENTIATING)


def warn_if_state_is_not_differentiated(params: Any, state: Any) -> None:
    """Warns where params are being differentiated and the FP8 state is not:
    its next value is its gradient, so it would never move from its first scale of 1
    (values above 448 clipped, small ones flushed to zero, every step)."""
    leaves = jax.tree.leaves(state)
    if not leaves or any(map(_differentiated, leaves)):
        return
    if any(map(_differentiated, jax.tree.leaves(params))):
        warnings.warn(
            "Delayed float8 scaling: the params are being differentiated but the FP8 "
            "state is not, so it will never update (its gradient is its next value). "
            "Differentiate it too and keep its gradient: Linen, jax.grad(loss, argnums=(0, 1))"
            "(params, variables['_overwrite_with_gradient']); NNX, nnx.grad(loss, argnums="
            "nnx.DiffState(0, (nnx.Param, jaxamp.nnx.OverwriteWithGradient))) and "
            "jaxamp.nnx.update_fp8_state; autocast, jax.grad(lambda p, s: f(p, x, "
            f"fp8_state=s), argnums=(0, 1)) ({guide('fp8.md')}).",
            stacklevel=4,
        )
