"""``convert_state``: params and optimizer state saved under one recipe, for another."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.checkpoint.report import (
    ConversionReport,
    LossyConversionError,
    Rows,
    errors,
)
from jaxamp._src.dtypes import FLOAT32, is_floating, is_narrow
from jaxamp._src.errors import invalid_choice
from jaxamp._src.optim import master_weights as masters
from jaxamp._src.optim.loss_scaled import LossScaledState, settings_of
from jaxamp._src.optim.rounding import round_in_float32
from jaxamp._src.optim.scales import DynamicLossScale
from jaxamp._src.optim.state_dtype import StateDtypeState

LOSS_SCALE_CHOICES = ("auto", "saved", "fresh")


class ConvertedState(NamedTuple):
    """``convert_state``'s result: the params, the optimizer state and the report."""

    params: Any
    opt_state: Any
    report: ConversionReport


def _is_variable(x: Any) -> bool:
    """An ``nnx.Variable`` (``nnx.Optimizer`` wraps its state's leaves in them)."""
    return callable(getattr(x, "get_value", None))


def _plain(tree: Any) -> Any:
    """``tree`` with each ``nnx.Variable`` replaced by its array (the containers, such as
    ``nnx.State``, kept): NNX's params and optimizer state read as Linen's are."""
    return jax.tree.map(
        lambda x: x.get_value() if _is_variable(x) else x, tree, is_leaf=_is_variable
    )


_UNTYPED = (
    "the saved optimizer state is plain dicts and lists (an Orbax restore without a "
    "template?): restore it with the saved recipe's state as the template, e.g. "
    "ckpt.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, {'params': params, "
    "'opt_state': saved_tx.init(params)})), and convert that."
)


def _normalised(tree: Any) -> set[str]:
    """Leaf paths with attribute and key steps written alike (``.mu`` and ``['mu']``)."""
    return {re.sub(r"\['([^']*)'\]|\.(\w+)|\[(\d+)\]", r"/\1\2\3", p) for p in _paths(tree)}


def _split(state: Any, where: str) -> tuple[LossScaledState | None, StateDtypeState | None, Any]:
    """``(loss_scaled's state, with_state_dtype's state, the optax state inside them)``."""
    if isinstance(state, Mapping) and {"loss_scale", "inner_state"} <= set(state):
        raise ValueError(f"convert_state: {_UNTYPED}")
    ls = state if isinstance(state, LossScaledState) else None
    inner = ls.inner_state if ls is not None else state
    sd = inner if isinstance(inner, StateDtypeState) else None
    core = sd.inner_state if sd is not None else inner
    nested = jax.tree.leaves(
        core, is_leaf=lambda x: isinstance(x, (LossScaledState, StateDtypeState))
    )
    for node in nested:
        if isinstance(node, (LossScaledState, StateDtypeState)):
            raise ValueError(
                f"convert_state reads the {where} state as jaxamp builds it: loss_scaled "
                "outermost, with_state_dtype directly inside it; it found a "
                f"{type(node).__name__} deeper in the optax state."
            )
    return ls, sd, core


def _f64(x: Any) -> np.ndarray:
    """``x`` in float64 (a signalling NaN's cast raises numpy's invalid flag: ignored)."""
    with np.errstate(invalid="ignore"):
        return np.asarray(jnp.asarray(x).astype(FLOAT32) if _is_16bit(x) else x, np.float64)


def _is_16bit(x: Any) -> bool:
    return hasattr(x, "dtype") and is_narrow(x.dtype)


def _weights(saved_params: Any, ls: LossScaledState | None) -> Any:
    """Each saved param's weight in float64: its master, or the param plus its valid Kahan
    compensation, or the param."""
    master = ls.master_params if ls is not None else None
    compensation = ls.compensation if ls is not None else None
    if master is not None:
        master = masters.adopt_changes(master, saved_params)
        return jax.tree.map(lambda m, p: _f64(m) if _is_16bit(p) else _f64(p), master, saved_params)
    if compensation is not None:
        compensation = masters.valid_compensation(saved_params, compensation)
        return jax.tree.map(
            lambda c, p: _f64(p) + _f64(c) if _is_16bit(p) else _f64(p), compensation, saved_params
        )
    return jax.tree.map(_f64, saved_params)


def _same_structure(saved: Any, like: Any, what: str) -> None:
    a, b = _paths(saved), _paths(like)
    if a != b:
        only_saved, only_like = sorted(a - b)[:3], sorted(b - a)[:3]
        raise ValueError(
            f"convert_state needs the saved {what} and the target's to have the same leaves: "
            f"only saved {only_saved}, only in the target {only_like}."
        )


def convert_state(
    saved_params: Any,
    saved_opt_state: Any,
    params: Any,
    tx: Any,
    *,
    loss_scale: str = "auto",
    allow_lossy: bool = False,
) -> ConvertedState:
    """Params and optimizer state saved under one precision recipe, for another.

    The saved state is read for what it means: each param's weight (its float32
    master, or the param plus its Kahan compensation, or the param), the inner
    optimizer's statistics, the loss scale and its counters. The target's state is
    ``tx.init`` of the converted params, filled with those meanings: the weight rounded to
    the target's param dtype (and kept whole in a float32 master, or its rounding error
    kept in a Kahan compensation, where the target has one), the statistics cast to the
    dtypes the target stores them in, the loss scale kept where the target's scale is
    dynamic. Every leaf not kept bit for bit is a row of the report, with the largest
    error a cast introduced; a conversion that changes a value is refused unless
    ``allow_lossy``.

    Args:
      saved_params: the params as saved.
      saved_opt_state: their optimizer state as saved (restore it with the saved
        recipe's template, as the guides restore any optax state), or ``None``.
      params: the target's params or their ``jax.ShapeDtypeStruct`` (only the dtypes
        are read): the new policy's ``param_dtype``.
      tx: the target's optimizer (``optimizer_recipe``'s, ``loss_scaled``, any optax
        transformation); its inner optimizer must be the saved one's.
      loss_scale: where the target's scale is dynamic, ``"saved"`` keeps the saved
        scale (clipped to the target's bounds), ``"fresh"`` starts the target's, and
        ``"auto"`` keeps it only where it moved (a growth count, or a history that is not
        the scale throughout: a dynamic scale at work), else starts fresh: a no-op or
        static scale of 1 kept under a dynamic one would start float16 gradients 16
        doublings low.
      allow_lossy: accept a conversion that changes a value (a float32 weight rounded
        to bfloat16 params with no master, statistics rounded to 16 bits).

    Returns:
      ``ConvertedState(params, opt_state, report)``.

    Raises:
      LossyConversionError: a value would change and ``allow_lossy`` is false.
      ValueError: the params or the inner optimizers' states do not match.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> import jaxamp
      >>> params = {"w": jnp.full((3,), 1.0 + 2.0**-12)}  # float32, no master
      >>> saved = optax.adam(1e-3).init(params)
      >>> _, tx = jaxamp.optimizer_recipe("bf16_float32_master", optax.adam(1e-3))
      >>> like = {"w": jnp.zeros((3,), jnp.bfloat16)}
      >>> new = jaxamp.checkpoint.convert_state(params, saved, like, tx)
      >>> new.params["w"].dtype, new.report.lossless  # the master keeps the float32 weight
      (dtype(bfloat16), True)
    """
    if loss_scale not in LOSS_SCALE_CHOICES:
        raise invalid_choice("loss_scale", loss_scale, LOSS_SCALE_CHOICES, quote=True)
    saved_params, saved_opt_state, params = _plain((saved_params, saved_opt_state, params))
    _same_structure(saved_params, params, "params")
    ls, sd, core = _split(saved_opt_state, "saved")
    rows = Rows()
    provisional = jax.tree.map(
        lambda w, like: jnp.asarray(w.astype(np.float32)).astype(like.dtype),
        _weights(saved_params, ls),
        params,
    )
    template = tx.init(provisional)  # its structure and dtypes; every value is replaced
    t_ls, t_sd, t_core = _split(template, "target")
    new_params, master, comp = _params(rows, saved_params, params, ls, t_ls, provisional)
    prefix = "opt_state" + ".inner_state" * ((t_ls is not None) + (t_sd is not None))
    inner = _convert_core(rows, core, t_core, prefix)
    if t_sd is not None:
        inner = _state_dtype(rows, sd, t_sd, inner, ls, core)
    elif sd is not None:
        rows.add("opt_state.inner_state", "dropped", "with_state_dtype's key and count")
    if t_ls is None:
        if ls is not None:
            rows.add("opt_state", "dropped", "loss_scaled's scale and counters")
        opt_state = inner
    else:
        opt_state = _loss_scaled(rows, ls, t_ls, tx, inner, master, comp, loss_scale)
    report = ConversionReport(tuple(rows.rows), rows.kept)
    if not allow_lossy and not report.lossless:
        raise LossyConversionError(report)
    return ConvertedState(new_params, opt_state, report)


def _same_tree(a: Any, b: Any) -> bool:
    # jaxlib ships PyTreeDef in a compiled module without a stub: mypy sees no __eq__
    return bool(jax.tree.structure(a) == jax.tree.structure(b))  # type: ignore[operator]


def _leaves_with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _paths(tree: Any) -> set[str]:
    return {path for path, _ in _leaves_with_paths(tree)}


def _kind(state: LossScaledState | None, param: Any) -> str:
    """How a recipe holds a param's weight: ``"master"``, ``"kahan"`` or ``"param"``."""
    if state is None or not _is_16bit(param):
        return "param"
    if state.master_params is not None:
        return "master"
    return "kahan" if state.compensation is not None else "param"


_HOLDS = {
    "master": "; its float32 master derived",
    "kahan": "; its Kahan rest derived",
    "param": "",
}
_FROM = {
    "master": "the saved float32 master",
    "kahan": "the saved param plus its Kahan compensation",
    "param": "the saved param",
}


def _param(
    w: np.ndarray, p: Any, like: Any, kind: str, master: Any, comp: Any
) -> tuple[jax.Array, Any, Any]:
    """``(param, master, compensation)`` holding the weight ``w`` as a recipe of ``kind``
    does in ``like``'s dtype (the master and the compensation ``None`` where unused): the
    param the weight rounded to nearest (as ``adopt_changes`` reads a master's param);
    the saved param's bits where it is that value already (a NaN's payload too); the
    rest, where finite, in a compensation."""
    dtype = np.dtype(like.dtype)
    wide = dtype if dtype.itemsize > 4 else np.dtype(np.float32)
    new_master = new_comp = None
    if kind == "master":
        new_master = jnp.asarray(w.astype(np.float32))
        new_p = round_in_float32(new_master, dtype).astype(dtype)
    else:
        new_p = jnp.asarray(w.astype(wide)).astype(dtype)
    if np.dtype(p.dtype) == dtype and _same_values(_f64(p), _f64(new_p)):
        new_p = jnp.asarray(p)
    if kind == "kahan":
        rest = w - _f64(new_p)
        rest = np.where(np.isfinite(rest), rest, 0.0)
        new_comp = jnp.asarray(rest.astype(np.float32)).astype(dtype)
    sharding = getattr(like, "sharding", None)
    if sharding is not None:  # where the target's params are laid out
        new_p = jax.device_put(new_p, sharding)
        new_master = None if new_master is None else jax.device_put(new_master, sharding)
        new_comp = None if new_comp is None else jax.device_put(new_comp, sharding)
    return (
        new_p,
        (master if new_master is None else new_master),
        (comp if new_comp is None else new_comp),
    )


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


def _params(
    rows: Rows,
    saved: Any,
    like: Any,
    ls: LossScaledState | None,
    target: LossScaledState | None,
    provisional: Any,
) -> tuple[Any, Any, Any]:
    """The target's params, master and compensation (each ``None`` where its recipe has
    none), one row per param whose weight, dtype or companion changed."""
    weights = _weights(saved, ls)
    t_master = target.master_params if target is not None else None
    t_comp = target.compensation if target is not None else None
    n = len(jax.tree.leaves(saved))
    s_masters = (
        jax.tree.leaves(ls.master_params)
        if ls is not None and ls.master_params is not None
        else [None] * n
    )
    s_comps = (
        jax.tree.leaves(ls.compensation)
        if ls is not None and ls.compensation is not None
        else [None] * n
    )
    t_masters = jax.tree.leaves(t_master) if t_master is not None else [None] * n
    t_comps = jax.tree.leaves(t_comp) if t_comp is not None else [None] * n
    new_p, new_m, new_c = [], [], []
    for (path, p), w, lk, q0, sm, sc, tm, tc in zip(
        _leaves_with_paths(saved),
        jax.tree.leaves(weights),
        jax.tree.leaves(like),
        jax.tree.leaves(provisional),
        s_masters,
        s_comps,
        t_masters,
        t_comps,
        strict=True,
    ):
        s_kind, t_kind = _kind(ls, p), _kind(target, q0)
        if np.dtype(p.dtype) == np.dtype(lk.dtype) and s_kind == t_kind:  # as saved, bit for bit
            rows.kept += 1
            new_p.append(jnp.asarray(p))
            new_m.append(tm if sm is None or t_kind != "master" else jnp.asarray(sm))
            new_c.append(tc if sc is None or t_kind != "kahan" else jnp.asarray(sc))
            continue
        q, m, c = _param(w, p, lk, t_kind, tm, tc)
        new_p.append(q)
        new_m.append(m)
        new_c.append(c)
        represented = _f64(q) + (_f64(c) if t_kind == "kahan" else 0.0)
        if t_kind == "master":  # the master, where the param could hold its rounding
            represented = np.where(np.isfinite(represented) | ~np.isfinite(w), _f64(m), represented)
        change = f"{np.dtype(p.dtype).name} -> {np.dtype(q.dtype).name}"
        action = "cast" if np.dtype(p.dtype) != np.dtype(q.dtype) else "derived"
        detail = f"{change}, from {_FROM[s_kind]}{_HOLDS[t_kind]}"
        rows.add(f"params{path}", action, detail, errors(w, represented))
    structure = jax.tree.structure(saved)
    master = None if t_master is None else jax.tree.unflatten(structure, new_m)
    comp = None if t_comp is None else jax.tree.unflatten(structure, new_c)
    return jax.tree.unflatten(structure, new_p), master, comp


def _convert_core(rows: Rows, saved: Any, target: Any, prefix: str) -> Any:
    """The inner optimizer's state: each saved leaf in the target's dtype."""
    if saved is None:
        for path, _ in _leaves_with_paths(target):
            rows.add(f"{prefix}{path}", "created", "no saved optimizer state")
        return target
    if not _same_tree(saved, target):
        if _normalised(saved) == _normalised(target):
            raise ValueError(f"convert_state: {_UNTYPED}")
        a, b = _paths(saved), _paths(target)
        raise ValueError(
            "convert_state converts what jaxamp's wrappers hold, not one optax optimizer "
            "into another: the saved inner optimizer's state and the target's differ (only "
            f"saved {sorted(a - b)[:3]}, only in the target {sorted(b - a)[:3]}; structures "
            f"{jax.tree.structure(saved)} and {jax.tree.structure(target)})."
        )
    leaves = []
    for (path, s), t in zip(_leaves_with_paths(saved), jax.tree.leaves(target), strict=True):
        s = jnp.asarray(s)
        if np.shape(s) != np.shape(t):
            raise ValueError(
                f"convert_state: the saved inner state's {path} has shape {np.shape(s)}, the "
                f"target's {np.shape(t)}."
            )
        if s.dtype == t.dtype:
            rows.kept += 1
            leaves.append(s)
            continue
        cast = s.astype(t.dtype)
        error = errors(_f64(s), _f64(cast)) if is_floating(s.dtype) else (0.0, 0.0)
        name = f"{np.dtype(s.dtype).name} -> {np.dtype(t.dtype).name}"
        rows.add(f"{prefix}{path}", "cast", name, error)
        leaves.append(cast)
    return jax.tree.unflatten(jax.tree.structure(target), leaves)


def _state_dtype(
    rows: Rows,
    saved: StateDtypeState | None,
    target: StateDtypeState,
    inner: Any,
    ls: Any,
    core: Any,
) -> StateDtypeState:
    if saved is not None:
        rows.kept += 2
        return StateDtypeState(inner, jnp.asarray(saved.rounding_key), jnp.asarray(saved.count))
    applied, detail = target.count, "no count saved: 0"
    counts = [x for path, x in _leaves_with_paths(core) if path.endswith(".count")]
    if ls is not None:  # the updates applied: steps less those skipped
        applied = jnp.asarray(ls.step - ls.skipped_steps, target.count.dtype)
        detail = "the updates the saved state applied"
    elif counts:  # the inner optimizer's own count (Adam's)
        applied = jnp.asarray(max(int(c) for c in counts), target.count.dtype)
        detail = "the updates the saved optimizer counted"
    rows.add("opt_state.inner_state.rounding_key", "created", "the target's seed")
    rows.add("opt_state.inner_state.count", "created", detail)
    return StateDtypeState(inner, target.rounding_key, applied)


def _history(saved: Any, step: Any, length: int) -> jax.Array:
    """The saved ring buffer of scales re-laid for ``length`` entries (entry ``s % length``
    the scale after step ``s``), the steps both can hold; the rest 0."""
    old = np.asarray(saved)
    new = np.zeros([length], old.dtype)
    step = int(step)
    for s in range(max(0, step - min(len(old), length)), step):
        new[s % length] = old[s % len(old)]
    return jnp.asarray(new)


def _moved(ls: LossScaledState) -> bool:
    """Whether the saved loss scale shows dynamic scaling at work: a growth count, or a
    written history entry other than the scale (no-op and static scales never move)."""
    scale = np.asarray(ls.loss_scale.scale)
    history = np.asarray(ls.scale_history)
    written = history[history != 0]
    return bool(int(ls.loss_scale.growth_tracker) > 0 or np.any(written != scale))


def _scale(rows: Rows, ls: Any, target: Any, tx: Any, choice: str) -> Any:
    config = settings_of(tx)
    dynamic = config is not None and config.loss_scale.dynamic
    if choice == "auto" and ls is not None and not _moved(ls):
        choice = "fresh"
        auto = True
    else:
        auto = False
    if ls is None or choice == "fresh" or not dynamic:
        why = (
            "no saved loss scale"
            if ls is None
            else "the target's loss scale is not dynamic"
            if not dynamic
            else "the saved scale never moved (no dynamic scaling): fresh"
            if auto
            else "fresh, as asked"
        )
        rows.add("opt_state.loss_scale", "created", why)
        return target.loss_scale
    rule = config.loss_scale if config is not None else None
    assert isinstance(rule, DynamicLossScale)  # the only dynamic one
    scale = float(ls.loss_scale.scale)
    clipped = float(np.clip(scale, rule.min_scale or 0.0, rule.max_scale or np.inf))
    hysteresis = jnp.minimum(jnp.asarray(ls.loss_scale.hysteresis_left), rule.hysteresis)
    if clipped != scale:
        rows.add("opt_state.loss_scale.scale", "cast", f"{scale:g} clipped to {clipped:g}")
    else:
        rows.kept += 1
    saved_hysteresis = int(ls.loss_scale.hysteresis_left)
    if int(hysteresis) != saved_hysteresis:
        rows.add(
            "opt_state.loss_scale.hysteresis_left",
            "cast",
            f"{saved_hysteresis} lowered to the target's hysteresis {int(hysteresis)}",
        )
    else:
        rows.kept += 1
    rows.kept += 1
    return target.loss_scale._replace(
        scale=jnp.asarray(clipped, jnp.float32),
        growth_tracker=jnp.asarray(ls.loss_scale.growth_tracker),
        hysteresis_left=hysteresis.astype(jnp.int32),
    )


def _loss_scaled(
    rows: Rows,
    ls: LossScaledState | None,
    target: LossScaledState,
    tx: Any,
    inner: Any,
    master: Any,
    comp: Any,
    choice: str,
) -> LossScaledState:
    """The target's ``loss_scaled`` state: its scale, counters and history from the saved
    one where there is one, its master and compensation derived from the weights."""
    fields: dict[str, Any] = {"inner_state": inner, "master_params": master, "compensation": comp}
    fields["loss_scale"] = _scale(rows, ls, target, tx, choice)
    counters = ("skipped_steps", "consecutive_skips", "last_finite", "step")
    if ls is None:
        rows.add("opt_state.step", "created", "no saved loss_scaled state: its counters start at 0")
    else:
        fields.update({name: jnp.asarray(getattr(ls, name)) for name in counters})
        rows.kept += len(counters)
        length = target.scale_history.shape[0]
        if ls.scale_history.shape[0] == length:
            fields["scale_history"] = jnp.asarray(ls.scale_history)
            rows.kept += 1
        else:
            fields["scale_history"] = _history(ls.scale_history, ls.step, length)
            rows.add(
                "opt_state.scale_history",
                "resized",
                f"{ls.scale_history.shape[0]} -> {length} entries (a record, not a state)",
            )
    key = target.rounding_key
    if key is not None and ls is not None and ls.rounding_key is not None:
        fields["rounding_key"] = jnp.asarray(ls.rounding_key)
        rows.kept += 1
    elif key is not None:
        rows.add("opt_state.rounding_key", "created", "stochastic rounding from the target's seed")
    elif ls is not None and ls.rounding_key is not None:
        rows.add("opt_state.rounding_key", "dropped", "the target rounds to nearest")
    if ls is not None:
        for name, now in (("master_params", master), ("compensation", comp)):
            if getattr(ls, name) is not None and now is None:
                rows.add(f"opt_state.{name}", "dropped", "its weight is in the params' rows")
        saved_record, fresh = ls.nonfinite_grads, target.nonfinite_grads
        if fresh is not None and saved_record is not None and _same_tree(saved_record, fresh):
            fields["nonfinite_grads"] = saved_record
            rows.kept += len(jax.tree.leaves(saved_record))
        elif saved_record is not None:
            rows.add("opt_state.nonfinite_grads", "dropped", "the target records no skipped step")
    return target._replace(**fields)
