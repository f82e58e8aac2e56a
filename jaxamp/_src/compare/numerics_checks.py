"""The numerics checks ``jaxamp compare`` runs: per-layer divergence from fp32 at the
start against its floor (``jaxamp._src.numerics.floors``, re-exported here), a float16
range check before training, and the first non-finite layer of a run whose loss stops
being finite. Each returns plain records for ``report.json``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxamp._src.numerics.divergence_view import (
    divergence_table,
    error_over_floor,
    plot,
    plot_series,
)
from jaxamp._src.numerics.find_nonfinite import find_nonfinite
from jaxamp._src.numerics.floors import (
    FLAG_MINIMUM,
    FLAG_RATIO,
    GEMMS_ONLY,
    LOST_SIZE,
    divergence,
    ideal_recipe,
    ideal_rounding,
    input_sensitivity,
    rounded_inputs,
    rounding_dtype,
    with_floor,
)
from jaxamp._src.numerics.numerics_diff import NEAR_ZERO
from jaxamp._src.numerics.range_report import range_report

__all__ = [  # the floors and their view, as compare's report and tests reach them
    "FLAG_MINIMUM",
    "FLAG_RATIO",
    "GEMMS_ONLY",
    "LOST_SIZE",
    "divergence",
    "divergence_table",
    "first_nonfinite",
    "first_step_taken",
    "float16_check",
    "ideal_recipe",
    "ideal_rounding",
    "input_sensitivity",
    "markdown",
    "plot",
    "plot_series",
    "rounded_inputs",
    "rounding_dtype",
    "with_floor",
]


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
        lines += ["", _SKIPPED, *_loss_scale_lines(runs), *divergence_table(runs, limit)]
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


def _floor_lines(runs: list[dict[str, Any]]) -> list[str]:
    """Per variant with floors: how its errors stand against them, and what is flagged."""
    lines = []
    for run in runs:
        rows = [d for d in run["divergence"] if d.get("floor") is not None]
        if not rows:
            continue
        ratios = sorted(error_over_floor(d) for d in rows if not d["near_zero"])
        large = [
            error_over_floor(d)
            for d in rows
            if not d["near_zero"] and d["scale_error"] >= FLAG_MINIMUM
        ]
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
