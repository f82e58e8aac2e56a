"""The numerics checks ``jaxamp compare`` runs: per-layer divergence from fp32 at the
start, a float16 range check before training, and the first non-finite layer of a
run whose loss stops being finite. Each returns plain records for ``report.json``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxamp._src.numerics.find_nonfinite import find_nonfinite
from jaxamp._src.numerics.numerics_diff import NEAR_ZERO, numerics_diff
from jaxamp._src.numerics.range_report import range_report


def divergence(
    reference: Callable, mixed: Callable, *args: Any, loss_scale: float | None = None
) -> list[dict[str, Any]]:
    """Per layer and pass, how far ``mixed`` departs from ``reference`` (both losses of the
    same arguments, differentiated with respect to the first; ``mixed``'s loss multiplied
    by ``loss_scale`` as its training step does): the fields of
    ``jaxamp.numerics_diff``'s rows (``scale_error`` is the one to read)."""
    diff = numerics_diff(reference, policy=mixed, loss_scale=loss_scale)(*args)
    return [
        {
            "layer": r.layer,
            "phase": r.phase,
            "relative_error": r.relative_error,
            "scale_error": r.scale_error,
            "cosine": r.cosine,
            "near_zero": r.near_zero,
        }
        for r in diff.layers
        if r.relative_error is not None
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
    record = {"initial": float(scale_of(opt_state)), "overflowed": [], "used": None}
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
        lines += ["", _EXPLANATION, *_loss_scale_lines(runs), *_table(runs, limit)]
    return lines


_EXPLANATION = (
    "Per-layer divergence from fp32 at the initial weights, on 4 examples of the first batch "
    "(`jaxamp.numerics_diff`): each layer's output (forward) and the gradients of its "
    "parameters (backward, unscaled), under each variant against the model in true float32. "
    f"Each number is ‖amp − fp32‖ / max(‖fp32‖, {NEAR_ZERO:g} · typical), typical being the "
    "usual size of that pass's fp32 values (the median over the model's layers of their RMS, "
    "times √ of the layer's element count). For a layer of ordinary size this is its relative "
    "error: 0.01 is 1%, and 1 or more means the variant's value differs from fp32's by as much "
    f"as the value itself. A layer whose fp32 RMS is below {NEAR_ZERO:g} of the typical is "
    "marked ≈0 in fp32 (the output of a zero-initialised scale, such as the last BatchNorm of "
    "a ResNet block, and the gradients of the branch it silences; vanishing gradients): its "
    "own relative error would be 0/0 or rounding noise, so it is measured against that floor. "
    "0 means identical to fp32, bit for bit; inf, not finite. A float16 step whose gradients "
    "overflow at its loss scale is skipped in training and the scale backed off; skipped "
    "steps are not compared: a loss-scaled variant is compared at the scale of the first step "
    "its optimizer took on these examples (said below when it is not the initial one). "
    "report.json has every row, with its raw relative error and the cosine similarity of the "
    "two values; divergence.png plots them."
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


def _table(runs: list[dict[str, Any]], limit: int) -> list[str]:
    """The ``limit`` rows that depart most (largest scale error over the variants)."""
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for run in runs:
        for d in run["divergence"]:
            rows.setdefault((d["layer"], d["phase"]), {})[run["variant"]] = d
    worst = sorted(rows, key=lambda k: -max(d["scale_error"] for d in rows[k].values()))
    near_zero = [k for k in rows if any(d["near_zero"] for d in rows[k].values())]
    header = ["layer", "pass", "note", *(_label(r) for r in runs)]
    zeros = "none is ≈0 in fp32"
    if near_zero:
        examples = ", ".join(f"{k[0]} {k[1]}" for k in near_zero[:3])
        zeros = f"{len(near_zero)} are ≈0 in fp32 (e.g. {examples})"
    lines = [
        "",
        f"The {min(limit, len(worst))} rows that depart most, of {len(rows)}; {zeros}:",
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
    value = row["scale_error"]
    if value == 0:
        return "0"
    return "inf" if math.isinf(value) else f"{value:.2e}"


def plot_series(run: dict[str, Any], phase: str) -> dict[str, list[Any]]:
    """What ``divergence.png`` draws of one variant and pass: ``x`` and ``y``, the layers
    (their index in the program's order) and scale errors on the log axis, and the
    indices of the rows it marks instead: ``near_zero`` (≈0 in fp32), ``identical``
    (error 0, fp32 not ≈0) and ``not_finite``."""
    rows = [d for d in run["divergence"] if d["phase"] == phase]
    series: dict[str, list[Any]] = {"x": [], "y": [], "near_zero": [], "identical": []}
    series["not_finite"] = []
    for i, d in enumerate(rows):
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
_MARKS = (("near_zero", "v", "≈0 in fp32"), ("identical", "s", "0: identical"))
_MARKS += (("not_finite", "^", "not finite"),)


def plot(report: dict[str, Any], out: Path, save: Callable) -> None:
    """``divergence.png``: per layer, each variant's scale error, forward and backward;
    rows ≈0 in fp32, identical or not finite are marks along the edge, not values."""
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
        for key, marker, _ in _MARKS:
            height = 0.97 - 0.03 * i if key == "not_finite" else 0.03 + 0.03 * i
            xs = series[key]
            ax.plot(xs, [height] * len(xs), marker, color=color, markersize=4, transform=along)
            marked |= {key} if xs else set()
    for key, marker, text in _MARKS:  # one legend entry per kind of mark, in grey
        if key in marked:
            ax.plot([], [], marker, color="grey", label=text)
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
