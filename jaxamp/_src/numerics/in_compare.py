"""The numerics checks ``jaxamp compare`` runs: per-layer divergence from fp32 at the
start, a float16 range check before training, and the first non-finite layer of a
run whose loss stops being finite. Each returns plain records for ``report.json``."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxamp._src.numerics.find_nonfinite import find_nonfinite
from jaxamp._src.numerics.numerics_diff import numerics_diff
from jaxamp._src.numerics.range_report import range_report


def divergence(
    reference: Callable, mixed: Callable, *args: Any, loss_scale: float | None = None
) -> list[dict[str, Any]]:
    """Per layer and pass, the relative error of ``mixed`` against ``reference`` (both
    losses of the same arguments, differentiated with respect to the first; ``mixed``'s
    loss multiplied by ``loss_scale`` as its training step does)."""
    diff = numerics_diff(reference, mixed, loss_scale=loss_scale)(*args)
    return [
        {"layer": r.layer, "phase": r.phase, "relative_error": r.relative_error}
        for r in diff.layers
        if r.relative_error is not None
    ]


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
    if not runs:
        return lines
    errors: dict[tuple[str, str], dict[str, float]] = {}
    for run in runs:
        for d in run["divergence"]:
            errors.setdefault((d["layer"], d["phase"]), {})[run["variant"]] = d["relative_error"]
    worst = sorted(errors, key=lambda k: -max(errors[k].values()))[:limit]
    header = ["layer", "pass", *(r["variant"] for r in runs)]
    lines += [
        "",
        "Per-layer divergence from fp32 at the initial weights, first batch: relative error "
        "of each layer's output (forward) and of the gradients of its parameters "
        "(backward; float16 variants with their initial loss scale), "
        f"the {len(worst)} largest (`jaxamp.numerics_diff`; all in report.json, plot "
        "divergence.png):",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for key in worst:
        cells = [_fmt(errors[key].get(r["variant"])) for r in runs]
        lines.append(f"| {key[0] or '(no layer)'} | {key[1]} | " + " | ".join(cells) + " |")
    return [*lines, ""]  # a blank line ends the table


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2e}"


def plot(report: dict[str, Any], out: Path, save: Callable) -> None:
    """``divergence.png``: per layer, each variant's relative error, forward and backward."""
    import matplotlib.pyplot as plt

    runs = [  # the variant that is float32 itself is the reference: 0 everywhere
        r for r in report["runs"] if any(d["relative_error"] > 0 for d in r.get("divergence") or [])
    ]
    if not runs:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for run in runs:
            rows = [d for d in run["divergence"] if d["phase"] == phase]
            values = [max(d["relative_error"], 1e-12) for d in rows]
            ax.plot(range(len(rows)), values, marker="o", markersize=3, label=run["variant"])
        ax.set(
            yscale="log",
            xlabel="layer, in the order the program runs them",
            title=f"{phase}: relative error vs fp32",
        )
        ax.legend(fontsize=8)
    axes[0].set_ylabel("||amp - fp32|| / ||fp32||")
    save(fig, "divergence.png")
