"""Tests for jaxamp/_src/compare/numerics_checks.py: the divergence table and its plot."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.helpers.gated_net import GatedNet, X
from tests.helpers.promotion import FLAX, OPTAX, SUBJECT


def _gated_divergence_report():
    """compare's divergence records of fp32 and bf16 for a tiny model with a zero-init gate
    (tests/helpers/gated_net.py): its output and its branch's gradients are 0."""
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


@pytest.mark.standard_promotion(FLAX)
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


class _Attention(nn.Module):
    """Scores of up to about 14, then a softmax: by hand (``exp / sum``, as a float16
    fault: exp(14) overflows float16) or ``jax.nn.softmax`` (which jaxamp keeps in
    float32)."""

    by_hand: bool

    @nn.compact
    def __call__(self, x, attention_mask=None, train: bool = True):  # compare's text signature
        scores = 4.0 * nn.Dense(16, name="scores")(x)
        if self.by_hand:
            e = jnp.exp(scores)
            weights = e / jnp.sum(e, axis=-1, keepdims=True)
        else:
            weights = jax.nn.softmax(scores, axis=-1)
        return nn.Dense(3, name="head")(weights)


def _divergence_of(module, variants):
    from jaxamp._src.compare import app as compare_lib
    from jaxamp._src.compare.config import CompareConfig
    from jaxamp._src.compare.run import Run
    from jaxamp._src.compare.task import Task
    from jaxamp._src.compare.variants import get_variant

    x = 0.8 * jax.random.normal(jax.random.key(1), (32, 8))
    sample = (x, jnp.arange(32) % 3)
    task = Task(module, False, 1e-3)
    variables = task.module.init(jax.random.key(0), x)
    config = CompareConfig(variants=("fp32", *variants), batch_size=32)
    runs = [Run(get_variant(v), task, variables, config, sample) for v in variants]
    compare_lib._numerics_before_training(runs, task, variables, sample, config, print)
    return {r.variant.name: r.divergence for r in runs}


@pytest.mark.standard_promotion(SUBJECT)
def test_a_hand_written_float16_softmax_is_flagged_above_its_floor():
    from jaxamp._src.compare import numerics_checks as in_compare

    faulty = _divergence_of(_Attention(by_hand=True), ("fp16", "bf16"))
    rows = {(d["layer"], d["phase"]): d for d in faulty["fp16"]}
    fault = rows[("_Attention", "forward")]  # the softmax's output, outside the Dense layers
    assert fault["flagged"] and fault["scale_error"] > 0.05, fault
    assert np.isfinite(fault["floor"]) and fault["floor"] < 0.005, fault
    assert not rows[("_Attention/scores", "forward")]["flagged"]  # before the fault: fine
    assert not any(d["flagged"] for d in faulty["bf16"]), faulty["bf16"]  # bf16's range holds
    report = {"runs": [{"variant": name, "divergence": rows} for name, rows in faulty.items()]}
    text = "\n".join(in_compare.markdown(report))
    assert "fp16: 4 of 6 rows flagged" in text, text  # the softmax, the head, both gradients
    assert "Flagged: _Attention forward" in text and "⚠" in text, text

    healthy = _divergence_of(_Attention(by_hand=False), ("fp16", "bf16"))
    for name, rows in healthy.items():
        assert not any(d["flagged"] for d in rows), (name, rows)
        # every layer within its floor (the loss itself, below 1%, is no layer)
        layers = [d for d in rows if d["layer"] and d["floor"] and not d["near_zero"]]
        ratios = [d["scale_error"] / d["floor"] for d in layers]
        assert len(ratios) == 5 and max(ratios) < in_compare.FLAG_RATIO, (name, ratios)


def test_floors_need_no_16bit_arithmetic_but_the_gemms_and_flag_by_the_stated_rule():
    from jaxamp._src.compare import numerics_checks as in_compare

    model = GatedNet(1.0)
    params = model.init(jax.random.key(0), X)
    loss = lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)
    # rounding to float32 changes nothing: a float32 policy has no floor of its own
    assert all(v == 0 for v in in_compare.input_sensitivity(loss, jnp.float32, params, X).values())
    same = in_compare.ideal_rounding(loss, jaxamp.get_policy("float32"), params, X)
    assert same and all(v == 0 for v in same.values()), same
    bf16 = in_compare.input_sensitivity(loss, jnp.bfloat16, params, X)
    assert all(v < 0.05 for v in bf16.values()) and any(v > 1e-4 for v in bf16.values()), bf16
    ideal = in_compare.ideal_rounding(loss, jaxamp.get_policy("mixed_bfloat16"), params, X)
    assert all(v < 0.05 for v in ideal.values()) and any(v > 1e-4 for v in ideal.values()), ideal

    def row(error, floor_inputs, floor_ideal):
        rows = [{"layer": "a", "phase": "forward", "scale_error": error}]
        inputs, ideal = {("a", "forward"): floor_inputs}, {("a", "forward"): floor_ideal}
        return in_compare.with_floor(rows, inputs, ideal)[0]

    assert row(0.05, 0.01, 0.002)["floor"] == pytest.approx(0.01)
    assert row(0.05, 0.001, 0.004)["floor"] == pytest.approx(0.004)  # as measured: no factor
    assert row(0.05, 0.01, 0.002)["flagged"]  # 5 times its floor, above 1%
    assert not row(0.03, 0.01, 0.002)["flagged"]  # 3 times: within the model's sensitivity
    assert not row(0.009, 0.001, 0.0)["flagged"]  # under 1%: no fault to chase
    assert row(float("inf"), 0.01, 0.002)["flagged"]  # not finite where the floor is
    # an ideal recipe that overflows (a float16 GEMM) says nothing: the inputs' floor stands
    overflow = row(float("inf"), 0.01, float("inf"))
    assert overflow["floor"] == pytest.approx(0.01) and overflow["fault"] == "not finite"
    assert not row(float("inf"), float("inf"), float("inf"))["flagged"]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "mixed_float8"])
def test_the_ideal_recipe_rounds_its_gemms_alone(policy):
    """The floor's run, read from its lowered program (``jaxamp.precision_report``): its
    matmuls at the policy's precision, forward and backward; every exponential, sum and
    square root (a softmax written by hand, the loss) in float32."""
    from jaxamp._src.compare import numerics_checks as in_compare

    model = _Attention(by_hand=True)
    x = 0.8 * jax.random.normal(jax.random.key(1), (8, 8))
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)
    ideal = in_compare.ideal_recipe(loss, jaxamp.get_policy(policy))
    for fun in (ideal, jax.grad(ideal)):
        report = jaxamp.precision_report(fun)(params, x)
        assert report.sensitive and not report.problems(), report.problems()
        assert {s.dtype for s in report.sensitive} == {"float32"}, report.sensitive
        assert report.ops, report
        if policy == "mixed_float8":
            assert report.float8_gemms()[0] == len(report.ops), report.ops
        else:
            wanted = str(jnp.dtype(jaxamp.get_policy(policy).compute_dtype))
            assert all(op.lhs_dtype == op.rhs_dtype == wanted for op in report.ops), report.ops


@pytest.mark.standard_promotion(FLAX)
def test_gradients_flushed_to_zero_are_flagged_whatever_the_floor():
    """A float16 loss scale so small that the gradients underflow: each backward row loses
    most of its size, and is flagged as such, though its floor is as high as a badly
    conditioned model's; at an ordinary scale, none is."""
    from jaxamp._src.compare import numerics_checks as in_compare

    model = GatedNet(1.0)
    params = model.init(jax.random.key(0), X)
    loss = lambda p, x: jnp.mean(model.apply(p, x).astype(jnp.float32) ** 2)
    mixed = jaxamp.autocast(loss, "mixed_float16")
    inputs = in_compare.input_sensitivity(loss, jnp.float16, params, X)
    ideal = {k: 1.0 for k in inputs}  # a floor as high as a badly conditioned model's
    for scale, flushed in ((2.0**-30, True), (1024.0, False)):
        rows = in_compare.divergence(loss, mixed, params, X, loss_scale=scale)
        rows = in_compare.with_floor(rows, inputs, ideal)
        backward = [d for d in rows if d["phase"] == "backward" and not d["near_zero"]]
        assert backward, rows
        for d in backward:
            assert d["flagged"] == flushed, (scale, d)
            if flushed:
                assert d["fault"].endswith("of its size: flushed to zero"), d
                assert d["size_ratio"] < 0.5, d
            else:
                assert d["fault"] is None and 0.9 < d["size_ratio"] < 1.1, d


@pytest.mark.standard_promotion(OPTAX)
def test_float8_variants_get_a_float8_floor_and_a_healthy_model_is_not_flagged():
    """A float8 variant's floor is made at its GEMMs' precision (float8 operands with
    current per-tensor scaling; inputs rounded to e4m3 with a per-tensor scale): a healthy
    model's rows sit within it. Against a bfloat16 floor most rows were flagged for
    float8's own rounding."""
    from jaxamp._src.compare import numerics_checks as in_compare

    runs = _divergence_of(_Attention(by_hand=False), ("bf16", "fp8", "fp8-delayed"))
    bf16 = {(d["layer"], d["phase"]): d["floor"] for d in runs["bf16"]}
    for name in ("fp8", "fp8-delayed"):
        rows = [d for d in runs[name] if d["floor"] is not None]
        assert len(rows) == len(runs[name]) > 4, (name, runs[name])
        for d in rows:
            assert d["floor"] > bf16[(d["layer"], d["phase"])], (name, d)
        assert not any(d["flagged"] for d in rows), (name, rows)
    # rounding to float8 scales first: a tensor of small values is not flushed to zero
    x = jnp.full((4,), 1e-4)
    loss = lambda x: jnp.sum(x)
    assert in_compare.input_sensitivity(loss, jnp.float8_e4m3fn, x)[("", "forward")] < 0.07


@pytest.mark.standard_promotion(SUBJECT)
def test_block_scaled_variants_get_their_formats_floor_and_a_healthy_model_is_not_flagged():
    """An MXFP8 or NVFP4 variant's floor is made at its format's precision (inputs rounded
    block by block to e4m3 or e2m1; the ideal recipe's GEMMs block-scaled): a healthy
    model's rows sit within it, and NVFP4's floor sits above per-tensor FP8's."""
    from jaxamp._src.compare import numerics_checks as in_compare

    assert in_compare.rounding_dtype(jaxamp.get_policy("mixed_mxfp8")) == "mxfp8"
    # block by block: small values beside a block of large ones keep their precision (per
    # tensor, scaled by 1e3's amax, they fell among e4m3's subnormals)
    x = jnp.concatenate([jnp.full((32,), 1.01e-4), jnp.full((32,), 1e3)])  # two blocks
    loss = lambda x: jnp.sum(x[:32])
    error = in_compare.input_sensitivity(loss, "mxfp8", x)[("", "forward")]
    per_tensor = in_compare.input_sensitivity(loss, jnp.float8_e4m3fn, x)[("", "forward")]
    assert error < 0.07 < per_tensor, (error, per_tensor)
    runs = _divergence_of(_Attention(by_hand=False), ("fp8", "mxfp8", "nvfp4"))
    fp8 = {(d["layer"], d["phase"]): d["floor"] for d in runs["fp8"]}
    for name in ("mxfp8", "nvfp4"):
        rows = [d for d in runs[name] if d["floor"] is not None]
        assert len(rows) == len(runs[name]) > 4, (name, runs[name])
        assert not any(d["flagged"] for d in rows), (name, rows)
    nvfp4 = {(d["layer"], d["phase"]): d["floor"] for d in runs["nvfp4"]}
    assert sum(nvfp4[k] > fp8[k] for k in fp8) > len(fp8) / 2, (nvfp4, fp8)
