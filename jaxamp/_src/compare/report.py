"""The comparison's report: a table on the terminal, ``report.json``, ``report.md`` and plots."""

from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path
from typing import Any

from jaxamp._src.compare import numerics_checks
from jaxamp._src.compare.accuracy import ALPHA, ONE_SEED_NOISE
from jaxamp._src.compare.config import OptionError
from jaxamp._src.compare.environment import describe_hardware

# (record key, header, format)
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("variant", "variant", "{}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("step_time_median_s", "step ms", "{:.1f}"),
    ("epoch_time_s", "epoch s", "{:.1f}"),
    ("examples_per_s", "examples/s", "{:.0f}"),
    ("speedup_vs_fp32", "speed-up", "{:.2f}x"),
    ("temp_bytes", "compiled temp MB", "{:.0f}"),
    ("activation_bytes", "activations MB", "{:.1f}"),
    ("bytes_per_param", "bytes/param", "{:.2f}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("test_accuracy", "test acc", "{:.4f}"),
    ("test_accuracy_sd", "sd over seeds", "{:.4f}"),
    ("accuracy_vs_fp32", "vs fp32", "{:+.4f}"),
    ("accuracy_interval", "90% interval", "[{:+.4f}, {:+.4f}]"),
    ("accuracy_p_worse", "p (worse)", "{:.2g}"),
    ("discordant", "only fp32 / only it right", "{}"),
    ("accuracy_verdict", "accuracy", "{}"),
    ("precision", "precision", "{:.4f}"),
    ("recall", "recall", "{:.4f}"),
    ("f1", "F1", "{:.4f}"),
    ("skipped_steps", "skipped", "{}"),
    ("nonfinite_steps", "non-finite", "{}"),
    ("final_loss_scale", "loss scale", "{:g}"),
)
_SCALED = {"step_time_median_s": 1e3, "temp_bytes": 1e-6, "activation_bytes": 1e-6}


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None:
        return "-"
    if key == "discordant":  # per seed (only fp32 right, only the variant right), summed
        return f"{sum(d[0] for d in value)} / {sum(d[1] for d in value)}"
    if key == "accuracy_verdict":  # seeds alone that say otherwise: shown beside it
        alone = record.get("accuracy_seed_verdicts") or []
        if len(alone) > 1 and any(v != value for v in alone):
            return f"{value} (seeds alone: {', '.join(alone)})"
        return str(value)
    if isinstance(value, list):
        return fmt.format(*value)
    return fmt.format(value * _SCALED.get(key, 1))


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    """Header and one row per variant, formatted."""
    rows = [[header for _, header, _ in COLUMNS]]
    rows += [[_cell(r, k, f) for k, _, f in COLUMNS] for r in report["runs"]]
    return rows


def format_table(report: dict[str, Any]) -> str:
    """The side-by-side table for the terminal."""
    rows = table_rows(report)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def format_markdown(report: dict[str, Any]) -> str:
    """``report.md``: what ran, on what, and the table."""
    env, data, config = report["environment"], report["dataset"], report["config"]
    rows = table_rows(report)
    lines = [
        f"# jaxamp compare: {report['model']}",
        "",
        f"- Hardware: {describe_hardware(env)}; backend {env['backend']}; "
        f"jax {env['jax']}, flax {env['flax']}, optax {env['optax']}; {env['date']}",
        f"- Data: {data['source']}; {data['train_examples']} training and "
        f"{data['test_examples']} test examples",
        f"- Training: {report['steps']} steps of batch {config['batch_size']} "
        f"({config['epochs']} epochs), Adam, same initialisation and batch order for every "
        "variant; the variants' steps interleaved",
    ]
    if report.get("model_choice"):
        lines.append(f"- Model: {report['model_choice']}")
    if report.get("auto_policy"):
        picked = report["auto_policy"]
        lines.append(f"- `jaxamp.auto_policy()` picks `{picked['policy']}`: {picked['reason']}")
    lines += accuracy_lines(report)
    if config.get("bn_recalibration") and report["model"].startswith("resnet"):
        lines.append(
            "- Evaluation: BatchNorm statistics recomputed on "
            f"{config['bn_recalibration']} training batches at the final weights"
        )
    if data.get("note"):
        lines.append(f"- Note: {data['note']}")
    lines += suggestion_lines(report)
    lines += [
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
        *("| " + " | ".join(r) + " |" for r in rows[1:]),
        "",
        "Step time is the median over all steps, compile time excluded. Compiled temp is "
        "XLA's temporary buffer size for the training step; activations are the bytes saved "
        "for the backward pass, read from the jaxpr (see `jaxamp.ops.activation_bytes`); "
        "bytes/param "
        "counts the params and the optimizer state (master, compensation, moments) per "
        "parameter, read from the arrays. Skipped counts the steps loss scaling skipped; "
        "non-finite, the steps (over all seeds) whose loss or applied gradients were not "
        "finite.",
    ]
    if any("fp8=" in r.get("policy", "") for r in report["runs"]):
        lines += ["", FP8_NOTE]
    lines += numerics_checks.markdown(report)
    if env["backend"] == "cpu" and env.get("cpu_bf16_units"):
        lines.append(
            "This CPU has bf16 GEMM units: bfloat16 matmuls run on them (jaxamp's matmul rule "
            "lays the GEMMs out for them); float16 matmuls and all 16-bit convolutions are "
            "computed in float32 by XLA:CPU, so they gain no time here."
        )
    elif env["backend"] == "cpu":
        lines.append(
            "This CPU lists no bf16 units: XLA computes 16-bit matmuls and convolutions in "
            "float32, so neither time nor compiled memory shows what mixed precision buys on "
            "a GPU."
        )
    return "\n".join(lines) + "\n"


def suggestion_lines(report: dict[str, Any]) -> list[str]:
    """The ``auto`` variant's suggestion: the policy, each layer kept in float32 and why,
    and each candidate's verdict."""
    run = next((r for r in report["runs"] if r.get("suggestion")), None)
    if run is None:
        return []
    suggestion = run["suggestion"]
    lines = [
        f"- `auto`: `jaxamp.suggest_policy` on the first batch suggests `{suggestion['policy']}`"
        + ("" if suggestion["overrides"] else ", no layer kept in float32")
    ]
    lines += [
        f"  - `{layer}` kept in float32: {why}" for layer, why in suggestion["reasons"].items()
    ]
    lines += [f"  - {name}: {verdict}" for name, verdict in suggestion["verdicts"].items()]
    return lines


FP8_NOTE = (
    "The float8 variants quantize each matmul's operands to float8_e4m3fn (output gradients "
    "to float8_e5m2) with per-tensor scales, current (from the tensor itself) or delayed (from "
    "an amax history carried beside the params and overwritten with its gradient each step, "
    "never through the optimizer); a delayed variant's per-layer divergence before training is "
    "its first step's, at the initial scales of one. Where the device has no float8 GEMMs (a "
    "CPU, GPUs before Hopper and Ada) XLA converts the float8 operands back and multiplies "
    "them in a wider type: the numerics are float8's, the time is not what float8 buys."
)


def accuracy_lines(report: dict[str, Any]) -> list[str]:
    """What the accuracy verdicts account for, and what they cannot know."""
    seeds = report.get("seeds") or [report["config"].get("seed", 0)]
    n = report["dataset"]["test_examples"]
    lines = [
        f"- Seeds: {', '.join(str(x) for x in seeds)}. Test accuracy is the mean over seeds, "
        f"every variant scored on the same {n} test examples. Each variant is read against "
        "fp32 paired: by example (only the examples one gets right and the other wrong, the "
        "discordant ones, tell them apart)"
        + (
            " and by seed (a seed fixes the initialisation and the batch order)."
            if len(seeds) > 1
            else "."
        )
        + f" The verdict asks one-sided whether the variant is worse than fp32 (p < {ALPHA:g}: "
        f"worse; the opposite question's p < {ALPHA:g}: better; else no difference detected). "
        f"The {100 * (1 - 2 * ALPHA):g}% interval of the difference comes from the same test, "
        f"each side a one-sided {100 * (1 - ALPHA):g}% bound: worse exactly when it lies wholly "
        "below 0, better exactly when wholly above.",
    ]
    tests: dict[tuple[str, str], list[str]] = {}
    for r in report["runs"]:
        if r.get("accuracy_test"):
            tests.setdefault((r["accuracy_test"], r["accuracy_noise_from"]), []).append(
                r["variant"]
            )
    for (test, noise), variants in tests.items():
        line = f"- Test ({', '.join(variants)}): {test}. It accounts for {noise}."
        if noise == ONE_SEED_NOISE:
            line += (
                " With one seed a difference it calls real may still be training's own "
                "spread, which fp32 shows against itself from another seed."
            )
        lines.append(line)
    spread = report.get("fp32_seed_spread")
    if len(seeds) > 1:
        lines.append(
            (
                f"- fp32 against fp32 of another seed differs by {spread:.4f} on average. "
                if spread is not None
                else "- "
            )
            + "Final loss, precision, recall, F1, memory, compile and epoch times and the "
            "curves are the first seed's; step time is the median of the seeds' medians."
        )
    return lines


def _plots(report: dict[str, Any], out: Path) -> list[Path]:
    """Draws each plot of the report into ``out`` (PNG); returns their paths."""
    import matplotlib  # the compare extra's: only a report with plots needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)

    for name, draw in _PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, report)
        save(fig, name)
    numerics_checks.plot(report, out, save)
    return paths


def _plot_loss(ax: Any, report: dict[str, Any]) -> None:
    for r in report["runs"]:
        ax.plot(r["losses"], label=r["variant"])
    ax.set(xlabel="step", ylabel="training loss", title=f"{report['model']}: loss")
    ax.legend()


def _plot_loss_scale(ax: Any, report: dict[str, Any]) -> None:
    scaled = [r for r in report["runs"] if r.get("loss_scales")]
    for r in scaled:
        ax.plot(r["loss_scales"], label=r["variant"])
    ax.set(xlabel="step", ylabel="loss scale", yscale="log", title="dynamic loss scale")
    if scaled:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no loss-scaled variant", ha="center", transform=ax.transAxes)


def _plot_underflow(ax: Any, report: dict[str, Any]) -> None:
    for r in report["runs"]:
        steps = [u["step"] for u in r["underflow"]]
        unscaled = [100 * u["unscaled"] for u in r["underflow"]]
        ax.plot(steps, unscaled, label=f"{r['variant']}: unscaled")
        if r.get("loss_scales"):
            scaled = [100 * u["scaled"] for u in r["underflow"]]
            ax.plot(steps, scaled, linestyle="--", label=f"{r['variant']}: after loss scaling")
    ax.set(
        xlabel="step",
        ylabel="% of gradient elements",
        title="gradients below 2$^{-24}$ (zero in float16)",
    )
    ax.legend()


def _plot_time(ax: Any, report: dict[str, Any]) -> None:
    runs = report["runs"]
    times = [1e3 * r["step_time_median_s"] for r in runs]
    ax.bar([r["variant"] for r in runs], times, color="tab:blue")
    for i, r in enumerate(runs):
        ax.annotate(f"{r['speedup_vs_fp32']:.2f}x", (i, times[i]), ha="center", va="bottom")
    ax.set(
        ylabel="median step time (ms)",
        title=f"time per step on {describe_hardware(report['environment'])}",
    )


def _plot_accuracy(ax: Any, report: dict[str, Any]) -> None:
    runs = report["runs"]
    base = next(r for r in runs if r["variant"] == "fp32")["test_accuracy"]
    for i, r in enumerate(runs):
        seeds = r.get("test_accuracy_seeds") or [r["test_accuracy"]]
        ax.scatter([i] * len(seeds), seeds, color="tab:gray", s=12, zorder=3)
        ci = r.get("accuracy_interval")
        yerr = None
        if ci is not None:  # the interval of the difference, drawn around fp32 + difference
            yerr = [[r["accuracy_vs_fp32"] - ci[0]], [ci[1] - r["accuracy_vs_fp32"]]]
        ax.errorbar(
            i, r["test_accuracy"], yerr=yerr, fmt="o", color="tab:blue", capsize=6, zorder=4
        )
        verdict = r.get("accuracy_verdict", "")
        if r.get("accuracy_p_worse") is not None:
            verdict += f"\np(worse) {r['accuracy_p_worse']:.2g}"
        point = (i, r["test_accuracy"])
        ax.annotate(verdict, point, textcoords="offset points", xytext=(8, 0), va="center")
    ax.axhline(base, color="tab:blue", lw=0.8, ls=":", label="fp32 (mean over seeds)")
    ax.set_xticks(range(len(runs)), [r["variant"] for r in runs])
    ax.set_xlim(-0.5, len(runs) - 0.5 + 0.9)  # room for the last verdict, to its right
    ax.set(
        ylabel="test accuracy",
        title="test accuracy: each seed (grey), the mean (blue)\n"
        "and the 90% interval of its paired difference from fp32",
    )
    ax.legend(fontsize=8, loc="lower left")


# The report's plots, each drawn on its own axes, by file name.
_PLOTS = {
    "loss.png": _plot_loss,
    "loss_scale.png": _plot_loss_scale,
    "underflow.png": _plot_underflow,
    "time.png": _plot_time,
    "accuracy.png": _plot_accuracy,
}


def check_writable(out: str | Path) -> None:
    """Checks that ``out`` can be made and written, making nothing: the nearest folder on
    its path that exists takes a file (made and removed at once, never named), so that a
    run whose report could not be saved stops before it starts, and one refused after
    this check leaves nothing behind. ``write_report`` makes the folder.

    Raises:
      OptionError: naming the folder and why it cannot be written.
    """
    if not str(out).strip():
        raise OptionError("--out is empty; give the folder to write the report to.")
    out = Path(out)
    existing = next(p for p in (out, *out.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise OptionError(
            f"--out {str(out)!r} cannot be written ({e.strerror or e}); "
            "give a folder you can write."
        ) from None


def write_report(report: dict[str, Any], out: str | Path) -> list[Path]:
    """Writes ``report.json``, ``report.md`` and the PNG plots into ``out``; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(format_markdown(report))
    return [out / "report.json", out / "report.md", *_plots(report, out)]
