"""The numerics checks ``jaxamp compare`` runs: per-layer divergence from fp32 at the
start, a float16 range check before training, and the first non-finite layer of a
run whose loss stops being finite. Each returns plain records for ``report.json``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxamp._src.autocast.api import autocast
from jaxamp._src.autocast.rules import (
    COMPUTE_PRIMITIVES,
    FLOAT32_PRIMITIVES,
    PROMOTE_PRIMITIVES,
    AutocastRules,
    primitive_names,
)
from jaxamp._src.numerics.find_nonfinite import find_nonfinite
from jaxamp._src.numerics.numerics_diff import NEAR_ZERO, Measured, compare_runs, measure
from jaxamp._src.numerics.range_report import range_report
from jaxamp._src.ops.fp8_scaling import quantize
from jaxamp._src.policy import Policy

# A layer is flagged when the variant's error exceeds FLAG_RATIO times its floor (the
# error of the variant's ideal recipe, whose only rounding is what no recipe avoids: see
# ``with_floor``) and is at least FLAG_MINIMUM (an error below 1% is no fault to chase).
# Healthy variants of the CPU default models sit at or below 1.6 times their floor where
# the error is 1% or more; planted precision faults (tests/compare/planted_faults_test.py)
# at 8 times or more.
FLAG_RATIO = 4.0
# A value of ordinary size whose norm the variant shrinks below this fraction of fp32's
# is flagged as flushed to zero (an underflow), whatever its floor.
LOST_SIZE = 0.5
FLAG_MINIMUM = 0.01


def divergence(
    reference: Callable | Measured,
    mixed: Callable,
    *args: Any,
    loss_scale: float | None = None,
) -> list[dict[str, Any]]:
    """Per layer and pass, how far ``mixed`` departs from ``reference`` (both losses of the
    same arguments, differentiated with respect to the first; ``mixed``'s loss multiplied
    by ``loss_scale`` as its training step does): the fields of
    ``jaxamp.numerics_diff``'s rows (``scale_error`` is the one to read). ``reference``
    may be measured once (``numerics_diff.measure(reference, args)``) for many variants."""
    if not isinstance(reference, Measured):
        reference = measure(reference, args)
    diff = compare_runs(reference, measure(mixed, args, loss_scale=loss_scale))
    return [
        {
            "layer": r.layer,
            "phase": r.phase,
            "relative_error": r.relative_error,
            "scale_error": r.scale_error,
            "cosine": r.cosine,
            "near_zero": r.near_zero,
            "size_ratio": r.size_ratio,
        }
        for r in diff.layers
        if r.relative_error is not None
    ]


def rounding_dtype(policy: Any) -> Any:
    """The dtype ``input_sensitivity`` rounds a variant's params and inputs to: its compute
    dtype, or under a float8 policy the float8 GEMMs' forward operand dtype (e4m3)."""
    if policy.fp8 is not None:
        return np.dtype(jnp.float8_e4m3fn)
    return np.dtype(policy.compute_dtype)


def _rounded(x: Any, dtype: Any) -> Any:
    """``x`` rounded to ``dtype`` and back; to a float8 dtype with a per-tensor scale that
    maps its largest magnitude to the dtype's largest, as a float8 GEMM scales it."""
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    if jnp.finfo(dtype).bits != 8:
        return x.astype(dtype).astype(jnp.float32)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)
    return quantize(x, dtype, scale).astype(jnp.float32) * scale


def rounded_inputs(reference: Callable, dtype: Any) -> Callable:
    """``reference`` with its floating arguments (params, inputs) rounded to ``dtype`` and
    back to float32 first (``_rounded``): the model's own sensitivity to one rounding of
    what it is given, with no low-precision arithmetic inside (a floor of ``with_floor``)."""

    def perturbed(*args: Any) -> Any:
        return reference(*jax.tree.map(lambda x: _rounded(x, dtype), args))

    return perturbed


def input_sensitivity(
    reference: Callable, dtype: Any, *args: Any, measured: Measured | None = None
) -> dict[tuple[str, str], float]:
    """Per (layer, pass), the ``scale_error`` of the float32 ``reference`` with its params and
    inputs rounded to ``dtype`` (``rounded_inputs``) against ``reference`` (``measured``:
    ``reference`` on ``args`` measured already)."""
    rounded = rounded_inputs(reference, dtype)
    return _by_key(divergence(measured or reference, rounded, *args))


# What the floor's run computes in float32: every arithmetic primitive the rule table would
# run in the dtype that arrives, beside those it keeps in float32 (exact ones, a copy, a
# reshape, a max, are left as they arrive: they round nothing).
_ARITHMETIC = primitive_names(
    "add_p", "sub_p", "mul_p", "div_p", "rem_p", "atan2_p", "tanh_p", "sin_p", "cos_p", "atan_p"
) | {"add_any"}
GEMMS_ONLY = AutocastRules(
    compute=COMPUTE_PRIMITIVES,
    float32=FLOAT32_PRIMITIVES | _ARITHMETIC,
    promote=PROMOTE_PRIMITIVES - _ARITHMETIC,
)
"""The floor's rule table: matmuls and convolutions under the matmul rule (operands in the
compute dtype, float32 sums, results in the compute dtype), all other arithmetic in float32."""


def ideal_recipe(reference: Callable, policy: Any) -> Callable:
    """``reference`` as the ideal recipe of ``policy`` runs it: its matmuls and
    convolutions at ``policy``'s precision (``GEMMS_ONLY``: operands and results in the
    compute dtype, or float8 operands with current per-tensor scaling under a float8
    policy, sums in float32); the inputs of each Flax Linen layer stored at the compute
    dtype's precision (``lax.reduce_precision`` to its mantissa, in float32's range: the
    activations a recipe keeps in 16 bits, rounded inside the layer, so that its output
    stays its last value); every norm, reduction, softmax and elementwise operation in
    float32. The rounding no mixed-precision recipe avoids, and no more (a floor of
    ``with_floor``)."""
    fp8 = policy.fp8 and dataclasses.replace(policy.fp8, scaling="current")
    ideal = Policy(jnp.float32, policy.compute_dtype, jnp.float32, fp8=fp8)
    mantissa = int(jnp.finfo(policy.compute_dtype).nmant)

    def stored(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=mantissa)
        return x

    def inputs_stored(next_fun: Callable, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name == "__call__":  # in the layer's scope, before its first op
            args, kwargs = jax.tree.map(stored, (args, kwargs))
        return next_fun(*args, **kwargs)

    def rounded(*args: Any) -> Any:
        with nn.intercept_methods(inputs_stored):
            return reference(*args)

    return autocast(rounded, ideal, rules=GEMMS_ONLY)


def ideal_rounding(
    reference: Callable,
    policy: Any,
    *args: Any,
    loss_scale: float | None = None,
    measured: Measured | None = None,
) -> dict[tuple[str, str], float]:
    """Per (layer, pass), the ``scale_error`` of ``ideal_recipe(reference, policy)``
    against the float32 ``reference`` (its loss times ``loss_scale``, as the variant's;
    ``measured``: ``reference`` on ``args`` measured already)."""
    ideal = ideal_recipe(reference, policy)
    return _by_key(divergence(measured or reference, ideal, *args, loss_scale=loss_scale))


def with_floor(
    rows: list[dict[str, Any]],
    inputs: dict[tuple[str, str], float],
    ideal: dict[tuple[str, str], float],
) -> list[dict[str, Any]]:
    """``divergence``'s rows of a variant, each beside its floor and whether it is
    ``flagged``.

    Two floors, each a ``scale_error`` of the float32 model with only rounding no
    mixed-precision recipe avoids:

    * ``floor_inputs`` (``input_sensitivity``): its params and inputs rounded once to
      the variant's dtype: what the model makes of one rounding of what it is given,
      nonlinear effects (a ReLU or a max-pool that flips) included.
    * ``floor_ideal`` (``ideal_rounding``): the variant's ideal recipe
      (``ideal_recipe``): GEMMs at its precision, each layer's inputs stored at its
      compute dtype's, everything else in float32: what that rounding does downstream,
      amplified as the model amplifies it (a BatchNorm whose backward pass cancels, a
      LayerNorm of values far from 0). Where it is not finite (a GEMM overflowing
      float16) it is left out.

    ``floor`` is the larger. Neither computes a norm, a reduction, a softmax or any
    elementwise operation below float32, so a variant that does (a precision fault)
    stands above the floor at that layer by the error the fault adds; a recipe that
    keeps them in float32 rounds little more than the floor (some elementwise
    operations in 16 bits) and stays within ``FLAG_RATIO`` of it. A row is ``flagged``, with the
    ``fault`` that says why, when its value is not finite while the floor is (overflow,
    a NaN), when the norm of a value of ordinary size shrinks below ``LOST_SIZE`` of
    fp32's (an underflow), or when its error is at least ``FLAG_MINIMUM`` and more than
    ``FLAG_RATIO`` times the floor.
    """
    for row in rows:
        key = (row["layer"], row["phase"])
        row["floor_inputs"], row["floor_ideal"] = inputs.get(key), ideal.get(key)
        floors = (row["floor_inputs"], row["floor_ideal"])
        known = [f for f in floors if f is not None and math.isfinite(f)]
        row["floor"] = max(known) if known else None
        row["fault"] = _fault(row)
        row["flagged"] = row["fault"] is not None
    return rows


def _by_key(rows: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    return {(r["layer"], r["phase"]): r["scale_error"] for r in rows}


def _fault(row: dict[str, Any]) -> str | None:
    """Why a row with a floor is flagged, or ``None``: ``"not finite"`` where the floor is
    finite; ``"lost ...% of its size"``, a value of fp32's ordinary size whose norm the
    variant shrinks below ``LOST_SIZE`` of fp32's (an underflow no floor stands for:
    rounding noise, however amplified, adds to a value's size, it does not erase it);
    ``"above its floor"``."""
    error, floor = row["scale_error"], row["floor"]
    if floor is None or not math.isfinite(floor):
        return None
    if not math.isfinite(error):
        return "not finite"
    size = row.get("size_ratio")
    if not row.get("near_zero") and size is not None and size < LOST_SIZE:
        return f"lost {1 - size:.0%} of its size: flushed to zero"
    if error >= FLAG_MINIMUM and error > FLAG_RATIO * floor:
        return "above its floor"
    return None


def first_step_taken(
    step: Callable[[Any], tuple[Any, Any, Any]],
    opt_state: Any,
    scale_of: Callable[[Any], Any],
    limit: int = 32,
) -> dict[str, Any]:
    """The loss scale of the first step a loss-scaled optimizer takes on one batch.

    A float16 step whose scaled gradients are not finite is skipped, and the scale backed
    off; the same batch is tried again at the new scale, up to ``limit`` times, and not
    at all when the loss itself is not finite (no scale makes it finite).

    Args:
      step: ``step(opt_state) -> (loss_finite, took_step, new_opt_state)``: one jitted
        training step, the optimizer's update included (its own finiteness check and
        back-off rule decide).
      opt_state: the optimizer state before training.
      scale_of: the loss scale of an optimizer state.
      limit: the most steps tried.

    Returns:
      ``initial`` (the scale of the first try), ``overflowed`` (the scales whose step
      was skipped, in order), ``used`` (the scale of the first step taken, ``None`` when
      none was) and ``loss_finite``.
    """
    record: dict[str, Any] = {"initial": float(scale_of(opt_state)), "overflowed": [], "used": None}
    for _ in range(limit):
        scale = float(scale_of(opt_state))
        loss_finite, took_step, opt_state = step(opt_state)
        if bool(took_step):
            record["used"] = scale
            break
        record["overflowed"].append(scale)
        if not bool(loss_finite):
            break
    return {**record, "loss_finite": bool(loss_finite)}


def float16_check(reference: Callable, mixed: Callable, *args: Any) -> dict[str, Any]:
    """Whether the values ``mixed`` (the float16 variant's loss) computes in 16 bits fit
    float16, from one batch, each computed in float32 so that its size shows."""
    report = range_report(reference, policy=mixed)(*args)
    advice = report.recommend()
    overflowing = sorted({r.layer or "(no layer)" for r in report.overflows("float16")})
    return {"dtype": advice.dtype, "reason": advice.reason, "overflowing_layers": overflowing}


def first_nonfinite(loss: Callable, *args: Any, loss_scale: Any = None) -> dict[str, Any] | None:
    """Where a step's loss or gradient first became non-finite, as a record."""
    fault = find_nonfinite(loss, loss_scale=loss_scale)(*args)
    if fault is None:
        return None
    return {
        "phase": fault.phase,
        "layer": fault.layer,
        "primitive": fault.primitive,
        "source": fault.source,
        "description": str(fault),
    }


def markdown(report: dict[str, Any], limit: int = 12) -> list[str]:
    """The report.md lines of the checks: the float16 check, first non-finite layers,
    and the per-layer divergence table (the ``limit`` layers that depart most)."""
    lines: list[str] = []
    check = report.get("float16_check")
    if check:
        lines += [
            "",
            "Float16 range check before training (the values the float16 variant computes "
            f"in 16 bits, on one batch): {check['reason']}",
        ]
    for run in report["runs"]:
        fault = run.get("first_nonfinite")
        if fault:
            lines += [
                "",
                f"{run['variant']}: the loss became non-finite at step {fault['step']}; first "
                f"non-finite value: {fault['phase']} {fault['primitive']} in "
                f"{fault['layer'] or '(no layer)'}"
                + (f" ({fault['source']})" if fault["source"] else ""),
            ]
    runs = [r for r in report["runs"] if r.get("divergence")]
    if runs:
        lines += ["", _EXPLANATION]
        if any("floor" in d for r in runs for d in r["divergence"]):
            lines += ["", _FLOOR, *_floor_lines(runs)]
        lines += ["", _SKIPPED, *_loss_scale_lines(runs), *_table(runs, limit)]
    return lines


_EXPLANATION = (
    "Per-layer divergence from fp32 at the initial weights, on the first training batch as "
    "training sees it (a BatchNorm normalising over that batch; "
    "`jaxamp.numerics_diff`): each layer's output (forward) and the gradients of its "
    "parameters (backward, unscaled), under each variant against the model in true float32. "
    f"Each error is ‖amp − fp32‖ / max(‖fp32‖, {NEAR_ZERO:g} · typical), typical being the "
    "usual size of that pass's fp32 values (the median over the model's layers of their RMS, "
    "times √ of the layer's element count): for a layer of ordinary size, its relative error "
    f"(0.01 is 1%). A layer whose fp32 RMS is below {NEAR_ZERO:g} of the typical is marked ≈0 "
    "in fp32 (the output of a zero-initialised scale and the gradients of the branch it "
    "silences): it is measured against that floor instead of its own size. 0 means identical "
    "to fp32, bit for bit; inf, not finite."
)
_FLOOR = (
    "Beside each error, its floor: the error of the rounding no mixed-precision recipe "
    "avoids, and no more. It is the larger of two, each the float32 model's error against "
    "itself: with its params and inputs rounded once to the variant's dtype, and as the "
    "variant's ideal recipe runs it (its matmuls and convolutions at the variant's "
    "precision, each layer's inputs stored at the compute dtype's, every norm, reduction, "
    "softmax and elementwise operation in float32; at the variant's loss scale). A float8 "
    "variant's floor is made at its GEMMs' precision: inputs rounded to e4m3 with a "
    "per-tensor scale, and its ideal recipe's GEMMs in float8. A layer whose floor is high "
    "(a BatchNorm over few values, a backward pass that cancels) amplifies the rounding of "
    "its GEMMs, and its error there is the model's sensitivity, not the variant's fault. "
    "A norm, reduction or softmax computed in 16 bits is rounding the ideal recipe does "
    "not do: it stands above the floor at its layer. "
    f"A row is flagged (⚠) when its error is at least {FLAG_MINIMUM:g} and more than "
    f"{FLAG_RATIO:g} times its floor, when it is not finite where the floor is, or when "
    f"the variant shrinks a value of ordinary size below {LOST_SIZE:g} of fp32's norm (an "
    "underflow: rounding noise adds to a value's size, it does not erase it)."
)
_SKIPPED = (
    "A float16 step whose gradients overflow at its loss scale is skipped in training and "
    "the scale backed off; skipped steps are not compared: a loss-scaled variant is compared "
    "at the scale of the first step its optimizer took on these examples (said below when it "
    "is not the initial one). report.json has every row, with its raw relative error, its "
    "two floors and the cosine similarity of the two values; divergence.png plots them."
)


def _loss_scale_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Per loss-scaled variant, the steps skipped before the one compared."""
    lines = []
    for run in runs:
        taken = run.get("divergence_loss_scale")
        if not taken or not taken["overflowed"]:
            continue
        skipped = taken["overflowed"]
        if len(skipped) == 1:
            what = f"the first step at loss scale {skipped[0]:g} overflows"
        else:
            what = (
                f"the first {len(skipped)} steps, at loss scales {skipped[0]:g} down to "
                f"{skipped[-1]:g}, overflow"
            )
        what += f" (skipped, as training skips {'it' if len(skipped) == 1 else 'them'})"
        if taken["used"] is not None:
            what += f"; compared at {taken['used']:g}, the first step the optimizer took."
        elif not taken["loss_finite"]:
            what += (
                "; the loss itself is not finite, so no scale helps: compared at "
                f"{taken['initial']:g}, its values not finite."
            )
        else:
            what += f"; no step was taken: compared at {taken['initial']:g}, not finite."
        lines += ["", f"{run['variant']}: on these examples, {what}"]
    return lines


def _ratio(row: dict[str, Any]) -> float:
    """A row's error over its floor (0 without a floor, inf for a floor of 0)."""
    floor, error = row.get("floor"), row["scale_error"]
    if floor is None or error == 0:
        return 0.0
    return error / floor if floor > 0 else math.inf


def _floor_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Per variant with floors: how its errors stand against them, and what is flagged."""
    lines = []
    for run in runs:
        rows = [d for d in run["divergence"] if d.get("floor") is not None]
        if not rows:
            continue
        ratios = sorted(_ratio(d) for d in rows if not d["near_zero"])
        large = [_ratio(d) for d in rows if not d["near_zero"] and d["scale_error"] >= FLAG_MINIMUM]
        flagged = [d for d in rows if d["flagged"]]
        summary = f"{run['variant']}: {len(flagged)} of {len(rows)} rows flagged"
        if ratios:
            summary += (
                f"; error over floor: median {ratios[len(ratios) // 2]:.2g} over the "
                f"{len(ratios)} rows not ≈0 in fp32"
            )
            summary += (
                f", largest {max(large):.2g} among the {len(large)} errors of "
                f"{FLAG_MINIMUM:g} or more"
                if large
                else f"; no error reaches {FLAG_MINIMUM:g}"
            )
        if flagged:
            named = ", ".join(
                f"{d['layer'] or '(no layer)'} {d['phase']} ({d['fault']})" for d in flagged[:5]
            )
            summary += f". Flagged: {named}" + (" ..." if len(flagged) > 5 else "")
        lines += ["", summary + "."]
    return lines


def _table(runs: list[dict[str, Any]], limit: int) -> list[str]:
    """The ``limit`` rows that stand highest over their floor (largest over the variants;
    without floors, the largest errors)."""
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for run in runs:
        for d in run["divergence"]:
            rows.setdefault((d["layer"], d["phase"]), {})[run["variant"]] = d

    def order(key: tuple[str, str]) -> tuple[float, float]:
        cells = rows[key].values()
        return (-max(_ratio(d) for d in cells), -max(d["scale_error"] for d in cells))

    worst = sorted(rows, key=order)
    near_zero = [k for k in rows if any(d["near_zero"] for d in rows[k].values())]
    header = ["layer", "pass", "note", *(_label(r) for r in runs)]
    zeros = "none is ≈0 in fp32"
    if near_zero:
        examples = ", ".join(f"{k[0]} {k[1]}" for k in near_zero[:3])
        zeros = f"{len(near_zero)} are ≈0 in fp32 (e.g. {examples})"
    floors = any("floor" in d for r in runs for d in r["divergence"])
    what = "stand highest over their floor" if floors else "depart most"
    lines = [
        "",
        f"The {min(limit, len(worst))} rows that {what}, of {len(rows)}; {zeros}"
        + ("; each cell is error (floor):" if floors else ":"),
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for key in worst[:limit]:
        cells = [rows[key].get(r["variant"]) for r in runs]
        mark = "≈0 in fp32" if key in near_zero else ""
        lines.append(
            f"| {key[0] or '(no layer)'} | {key[1]} | {mark} | "
            + " | ".join(_fmt(d) for d in cells)
            + " |"
        )
    return [*lines, ""]  # a blank line ends the table


def _label(run: dict[str, Any]) -> str:
    taken = run.get("divergence_loss_scale")
    if taken and taken["used"] is not None:
        return f"{run['variant']} (loss scale {taken['used']:g})"
    return run["variant"]


def _fmt(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    text = _number(row["scale_error"])
    if row.get("floor") is not None:
        text += f" ({_number(row['floor'])})" + (" ⚠" if row["flagged"] else "")
    return text


def _number(value: float) -> str:
    if value == 0:
        return "0"
    return "inf" if math.isinf(value) else f"{value:.2e}"


def plot_series(run: dict[str, Any], phase: str) -> dict[str, list[Any]]:
    """What ``divergence.png`` draws of one variant and pass: ``x`` and ``y``, the layers
    (their index in the program's order) and scale errors on the log axis, and the
    indices of the rows it marks instead: ``near_zero`` (≈0 in fp32), ``identical``
    (error 0, fp32 not ≈0) and ``not_finite``; ``floor_x`` and ``floor_y``, the floors
    (positive ones: the log axis), and ``flagged``, the indices of flagged rows."""
    rows = [d for d in run["divergence"] if d["phase"] == phase]
    series: dict[str, list[Any]] = {"x": [], "y": [], "near_zero": [], "identical": []}
    series.update(not_finite=[], floor_x=[], floor_y=[], flagged=[])
    for i, d in enumerate(rows):
        if d.get("floor"):
            series["floor_x"].append(i)
            series["floor_y"].append(d["floor"])
        if d.get("flagged"):
            series["flagged"].append(i)
        error = d["scale_error"]
        if not math.isfinite(error):
            series["not_finite"].append(i)
        elif d["near_zero"]:
            series["near_zero"].append(i)
        elif error == 0:
            series["identical"].append(i)
        else:
            series["x"].append(i)
            series["y"].append(error)
    return series


# the rows plot_series marks, drawn along the bottom (and not finite: the top) of the axes
_MARKS: tuple[tuple[str, str, str], ...] = (
    ("near_zero", "v", "≈0 in fp32"),
    ("identical", "s", "0: identical"),
)
_MARKS += (("not_finite", "^", "not finite"),)


def plot(report: dict[str, Any], out: Path, save: Callable) -> None:
    """``divergence.png``: per layer, each variant's scale error, forward and backward, and
    its floor (dashed); flagged rows crossed in red; rows ≈0 in fp32, identical or not
    finite are marks along the edge, not values."""
    import matplotlib.pyplot as plt

    runs = [  # the variant that is float32 itself is the reference: 0 everywhere
        r for r in report["runs"] if any(d["scale_error"] != 0 for d in r.get("divergence") or [])
    ]
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        _plot_phase(ax, runs, phase)
    axes[0].set_ylabel(f"‖amp − fp32‖ / max(‖fp32‖, {NEAR_ZERO:g} · typical)")
    save(fig, "divergence.png")


def _plot_phase(ax: Any, runs: list[dict[str, Any]], phase: str) -> None:
    from matplotlib.transforms import blended_transform_factory

    along = blended_transform_factory(ax.transData, ax.transAxes)  # x: layer, y: 0-1
    marked = set()
    for i, run in enumerate(runs):
        series, color = plot_series(run, phase), f"C{i}"
        ax.plot(series["x"], series["y"], "o-", ms=3, lw=1, color=color, label=_label(run))
        if series["floor_x"]:
            floor = f"{run['variant']}: floor (its ideal recipe)"
            ax.plot(series["floor_x"], series["floor_y"], "--", lw=1, color=color, label=floor)
        flagged = [(x, y) for x, y in zip(series["x"], series["y"], strict=True)]
        flagged = [p for p in flagged if p[0] in series["flagged"]]
        if flagged:
            xs, ys = zip(*flagged, strict=True)
            ax.plot(xs, ys, "x", color="red", ms=8, mew=2)
            marked.add("flagged")
        for key, marker, _ in _MARKS:
            height = 0.97 - 0.03 * i if key == "not_finite" else 0.03 + 0.03 * i
            at = series[key]
            ax.plot(at, [height] * len(at), marker, color=color, markersize=4, transform=along)
            marked |= {key} if at else set()
    for key, marker, text in _MARKS:  # one legend entry per kind of mark, in grey
        if key in marked:
            ax.plot([], [], marker, color="grey", label=text)
    if "flagged" in marked:
        ax.plot([], [], "x", color="red", mew=2, label=f"flagged: > {FLAG_RATIO:g}x its floor")
    what = (
        "in the order the program runs them (their outputs)"
        if phase == "forward"
        else "in the params' order (the gradients of their parameters)"
    )
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(
        yscale="log",
        xlabel=f"layers, {what}",
        title=f"{phase}: divergence from fp32 at the initial weights",
    )
    ax.legend(fontsize=8)
