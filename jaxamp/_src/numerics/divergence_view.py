"""Divergence rows with their floors (``floors.with_floor``) as people read them: a markdown
table of the layers that stand highest over their floor, and a plot per pass."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxamp._src.numerics.floors import FLAG_RATIO
from jaxamp._src.numerics.numerics_diff import NEAR_ZERO


def error_over_floor(row: dict[str, Any]) -> float:
    """A row's error over its floor (0 without a floor, inf for a floor of 0)."""
    floor, error = row.get("floor"), row["scale_error"]
    if floor is None or error == 0:
        return 0.0
    return error / floor if floor > 0 else math.inf


def divergence_table(runs: list[dict[str, Any]], limit: int) -> list[str]:
    """The markdown lines of the ``limit`` rows that stand highest over their floor
    (largest over the variants; without floors, the largest errors)."""
    rows: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for run in runs:
        for d in run["divergence"]:
            rows.setdefault((d["layer"], d["phase"]), {})[run["variant"]] = d

    def order(key: tuple[str, str]) -> tuple[float, float]:
        cells = rows[key].values()
        return (-max(error_over_floor(d) for d in cells), -max(d["scale_error"] for d in cells))

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


_NAMED_TICKS = 24  # the most layers a plot names along its axis

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
    names = [d["layer"] or "(no layer)" for d in runs[0]["divergence"] if d["phase"] == phase]
    if len(names) <= _NAMED_TICKS:  # few enough layers to name each
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set(
        yscale="log",
        xlabel=f"layers, {what}",
        title=f"{phase}: divergence from fp32 at the initial weights",
    )
    ax.legend(fontsize=8)
