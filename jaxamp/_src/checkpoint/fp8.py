"""``convert_fp8_state``: delayed scaling's FP8 state saved under one policy, for another."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.checkpoint.report import ConversionReport, LossyConversionError, Rows
from jaxamp._src.ops.fp8_state import Fp8State, path_names, state_paths

_HISTORIES = frozenset(Fp8State._fields[:3])
_WRAPPED = ("value", "raw_value")  # an NNX Variable's array, below its path


def _key(path: tuple) -> str:
    names = path_names(path)
    if len(names) > 1 and names[-1] in _WRAPPED:
        names = names[:-1]
    return "/".join(names)


def _fp8_leaves(tree: Any) -> dict[str, Any]:
    """The FP8 state's leaves of ``tree`` by path (``Dense_0/input_amax_history``)."""
    paths = set(state_paths(tree))
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_key(path): leaf for path, leaf in flat if _key(path) in paths}


def resize_history(history: Any, length: int) -> np.ndarray:
    """An amax history re-laid for ``length`` entries along its last axis (leading axes:
    a stack's layers): the newest amax first, as delayed scaling writes it (a roll, then
    index 0), then the most recent of the others, oldest first, zeros as the oldest where
    the new history is longer.

    Examples:
      >>> resize_history(np.array([9.0, 1.0, 2.0, 3.0]), 3).tolist()  # 9 newest, 1 oldest
      [9.0, 2.0, 3.0]
      >>> resize_history(np.array([9.0, 1.0, 2.0]), 5).tolist()
      [9.0, 0.0, 0.0, 1.0, 2.0]
    """
    h = np.asarray(history)
    older = h[..., 1:][..., max(h.shape[-1] - length, 0) :] if length > 1 else h[..., :0]
    pad = np.zeros((*h.shape[:-1], length - 1 - older.shape[-1]), h.dtype)
    return np.concatenate([h[..., :1], pad, older], axis=-1)


def convert_fp8_state(
    saved: Any, like: Any, *, allow_lossy: bool = False
) -> tuple[Any, ConversionReport]:
    """``like`` with the FP8 state of delayed scaling taken from ``saved``, each layer's
    amax histories re-laid for ``like``'s length (``fp8_history``).

    Only the largest amax of a history sets the next step's scale, so a longer history
    (zeros as its oldest entries) changes nothing, and a shorter one changes the scale
    only where it drops the history's largest amax: that is the conversion's error (the
    relative change of the largest amax). A layer whose state ``saved`` lacks keeps
    ``like``'s (fresh: histories of zeros, scales of one, as a run without a checkpoint
    starts); saved state ``like`` has no place for (a policy without delayed scaling) is
    dropped. Every leaf of ``like`` outside its FP8 state is returned as it is.

    Args:
      saved: the saved variables: Linen's (``{"params": ..., "_overwrite_with_gradient":
        ...}``), ``nnx.state(model)``, or ``jaxamp.init_fp8_state``'s dict.
      like: the target's, of the same form (the new policy's, with any params), arrays or
        ``jax.ShapeDtypeStruct`` (``jax.eval_shape`` of its ``init``); its FP8 state is
        filled (fresh where nothing was saved), its other leaves returned as they are.
      allow_lossy: accept a shorter history that drops a history's largest amax.

    Returns:
      ``(like with the converted FP8 state, a ConversionReport)``.

    Raises:
      LossyConversionError: a scale would change and ``allow_lossy`` is false.

    Examples:
      >>> import jax.numpy as jnp
      >>> from jaxamp.ops import init_gemm_fp8_state
      >>> saved = {"gemm": init_gemm_fp8_state(4)._replace(input_amax_history=jnp.arange(4.0))}
      >>> new, report = convert_fp8_state(saved, {"gemm": init_gemm_fp8_state(8)})
      >>> new["gemm"].input_amax_history.tolist(), report.lossless
      ([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0], True)
    """
    old, new = _fp8_leaves(saved), _fp8_leaves(like)
    rows = Rows()
    values: dict[str, Any] = {}
    for key, target in new.items():
        if key in old:
            values[key] = _leaf(rows, key, old[key], target)
            continue
        rows.add(key, "created", "no saved FP8 state: fresh, as a run starts")
        if not hasattr(target, "__array__"):  # a jax.ShapeDtypeStruct: the fresh value
            fresh = jnp.zeros if key.rsplit("/", 1)[-1] in _HISTORIES else jnp.ones
            values[key] = fresh(target.shape, target.dtype)
    for key in sorted(set(old) - set(new)):
        rows.add(key, "dropped", "the target's policy keeps no FP8 state there")
    report = ConversionReport(tuple(rows.rows), rows.kept)
    if not allow_lossy and not report.lossless:
        raise LossyConversionError(report, "convert_fp8_state")
    out = jax.tree_util.tree_map_with_path(lambda path, x: values.get(_key(path), x), like)
    return out, report


def _leaf(rows: Rows, key: str, saved: Any, target: Any) -> jax.Array:
    """One saved FP8 leaf in the target's shape and dtype (the target an array or a
    ``jax.ShapeDtypeStruct``)."""
    s, t_shape, t_dtype = np.asarray(saved), tuple(target.shape), np.dtype(target.dtype)
    name = key.rsplit("/", 1)[-1]
    if name in _HISTORIES and s.shape[:-1] == t_shape[:-1] and s.shape[-1] != t_shape[-1]:
        resized = resize_history(s, t_shape[-1])
        before, after = s.max(axis=-1), resized.max(axis=-1)
        change = np.abs(before - after)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(change == 0, 0.0, change / np.abs(before))
        detail = f"history {s.shape[-1]} -> {t_shape[-1]} entries"
        rows.add(key, "resized", detail, (float(change.max()), float(rel.max())))
        return jnp.asarray(resized, t_dtype)
    if s.shape != t_shape:
        raise ValueError(
            f"convert_fp8_state: the saved {key} has shape {s.shape}, the target's {t_shape} "
            "(another stack of layers, or another model): it converts histories of another "
            "length only."
        )
    if s.dtype != t_dtype:
        rows.add(key, "cast", f"{s.dtype} -> {t_dtype}")
    else:
        rows.kept += 1
    return jnp.asarray(s, t_dtype)
