"""Tests for jaxamp/_src/compare/numerics_checks.py: the divergence table and its plot."""

import jax.numpy as jnp
import pytest

import jaxamp
from tests.gated_net import GatedNet, X


def _gated_divergence_report():
    """compare's divergence records of fp32 and bf16 for a tiny model with a zero-init gate
    (tests/gated_net.py): its output and its branch's gradients are 0."""
    import jax

    from jaxamp._src.compare import numerics_checks as in_compare

    model, x = GatedNet(0.0), X
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)
    runs = [
        {"variant": name, "divergence": in_compare.divergence(loss, mixed, params, x)}
        for name, mixed in (("fp32", loss), ("bf16", jaxamp.autocast(loss, "mixed_bfloat16")))
    ]
    return {"runs": runs}


def test_divergence_table_marks_near_zero_rows_and_identical_values_and_explains_itself():
    from jaxamp._src.compare import numerics_checks as in_compare

    lines = in_compare.markdown(_gated_divergence_report())
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in lines if "| " in line}
    for key in (("GatedNet/gate", "forward"), ("GatedNet/branch", "backward")):
        assert "≈0 in fp32" in rows[key], rows[key]  # not an error of 0 (nor 0/0)
    header = next(line for line in lines if line.startswith("| layer |"))
    columns = [c.strip() for c in header.split("|")[1:-1]]
    cell = lambda key, name: rows[key].split("|")[1:-1][columns.index(name)].strip()
    fp32, bf16 = (cell(("GatedNet/head", "backward"), name) for name in ("fp32", "bf16"))
    assert fp32 == "0" and 1e-4 < float(bf16) < 0.05, rows  # identical: exactly 0
    text = "\n".join(lines)
    # the paragraph above the table says what the numbers, ≈0 and skipped steps mean
    paragraph = text[: text.index("| layer |")]
    for phrase in ("max(‖fp32‖", "≈0 in fp32", "identical", "skipped", "cosine"):
        assert phrase in paragraph, (phrase, paragraph)


def test_divergence_plot_has_no_made_up_values_and_labels_what_it_shows(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxamp._src.compare import numerics_checks as in_compare

    report = _gated_divergence_report()
    figures = []
    in_compare.plot(report, tmp_path, lambda fig, name: figures.append((fig, name)))
    [(fig, name)] = figures
    assert name == "divergence.png"
    bf16 = {(d["layer"], d["phase"]): d for d in report["runs"][1]["divergence"]}
    for ax, phase in zip(fig.axes, ("forward", "backward"), strict=True):
        data_lines = [ln for ln in ax.get_lines() if ln.get_transform() == ax.transData]
        plotted = [y for line in data_lines for y in line.get_ydata()]
        assert plotted and min(plotted) > 1e-6, (phase, plotted)  # no 1e-12 stand-ins for 0
        rows = [d for d in bf16.values() if d["phase"] == phase]
        errors = sorted(d["scale_error"] for d in rows if not d["near_zero"])
        assert sorted(plotted) == pytest.approx(errors), (phase, plotted)
        labels = ax.get_legend_handles_labels()[1]
        assert "bf16" in labels and "≈0 in fp32" in labels, labels
        assert "fp32" in ax.get_title() and phase in ax.get_title()
    assert "max(‖fp32‖" in fig.axes[0].get_ylabel()
    plt.close(fig)
