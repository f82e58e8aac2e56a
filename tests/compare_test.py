"""Tests for jaxamp/_src/compare.py: the runner, its report, and accuracy parity on real data."""

import dataclasses

import numpy as np
import pytest

from jaxamp._src import data
from jaxamp._src.compare import CompareConfig, classification_metrics, compare

TINY_BERT = dict(
    model="bert",
    layers=1,
    hidden=32,
    heads=2,
    seq_len=16,
    vocab_size=512,
    batch_size=16,
    epochs=1,
    train_examples=64,
    test_examples=48,
)
REQUIRED = (
    "variant",
    "step_time_median_s",
    "test_accuracy",
    "f1",
    "activation_bytes",
    "skipped_steps",
    "compile_s",
    "epoch_time_s",
    "examples_per_s",
    "speedup_vs_fp32",
    "temp_bytes",
    "final_loss",
    "precision",
    "recall",
    "final_loss_scale",
)


@pytest.fixture(scope="module")
def bert_report():
    config = CompareConfig(variants=("fp32", "bf16", "fp16"), data="embedded", **TINY_BERT)
    return compare(config)


def test_report_has_one_complete_record_per_variant(bert_report):
    runs = bert_report["runs"]
    assert [r["variant"] for r in runs] == ["fp32", "bf16", "fp16"]
    steps = bert_report["steps"]
    assert steps == 64 // 16
    for r in runs:
        assert all(key in r for key in REQUIRED), r.keys()
        assert len(r["losses"]) == steps and len(r["underflow"]) == steps
        assert 0.0 <= r["test_accuracy"] <= 1.0 and 0.0 <= r["f1"] <= 1.0
        assert r["step_time_median_s"] > 0 and r["compile_s"] > 0
        assert np.isfinite(r["final_loss"])
    fp32, bf16, fp16 = runs
    assert fp32["speedup_vs_fp32"] == 1.0
    assert fp32["loss_scales"] is None and fp32["final_loss_scale"] is None
    assert len(fp16["loss_scales"]) == steps and fp16["final_loss_scale"] > 0
    assert bf16["activation_bytes"] < fp32["activation_bytes"]
    assert bert_report["dataset"]["name"] == "python_docs"
    assert bert_report["environment"]["backend"]


def test_same_initialisation_and_data_for_every_variant(bert_report):
    first_losses = [r["losses"][0] for r in bert_report["runs"]]
    # the first step's loss is computed from the same initial params on the same batch
    assert max(first_losses) - min(first_losses) < 0.05


def test_resnet_with_batch_norm_recalibration():
    dataset = data.load_digits_28x28().subset(64, 32)
    config = CompareConfig(
        model="resnet18",
        width=8,
        variants=("fp32", "fp16"),
        batch_size=16,
        epochs=1,
        bn_recalibration=3,
    )
    report = compare(config, dataset=dataset)
    assert [r["variant"] for r in report["runs"]] == ["fp32", "fp16"]
    assert report["dataset"]["test_examples"] == 32
    # the running statistics were recomputed at the final weights: they moved
    assert all(r["bn_recalibration_change"] > 1e-3 for r in report["runs"])
    plain = compare(dataclasses.replace(config, bn_recalibration=0), dataset=dataset)
    assert all(r["bn_recalibration_change"] is None for r in plain["runs"])


def test_optimizer_state_recipes_run_as_variants_with_their_bytes_per_parameter():
    config = CompareConfig(
        variants=("fp32", "bf16_float32_master", "bf16_kahan", "bf16_stochastic", "bf16_naive"),
        data="embedded",
        **TINY_BERT,
    )
    report = compare(config)
    runs = {r["variant"]: r for r in report["runs"]}
    # params + optimizer state per parameter; the loss scaler's few scalars add a little
    expected = {
        "fp32": 12,
        "bf16_float32_master": 14,
        "bf16_kahan": 12,
        "bf16_stochastic": 6,
        "bf16_naive": 10,
    }
    for name, value in expected.items():
        assert value <= runs[name]["bytes_per_param"] < value + 0.05, (name, runs[name])
        assert np.isfinite(runs[name]["final_loss"]) and runs[name]["skipped_steps"] == 0
        assert runs[name]["final_loss_scale"] is None  # no loss scaling in these recipes
    assert runs["bf16_kahan"]["policy"] == "params=bfloat16,compute=bfloat16,output=float32"
    from jaxamp._src.report import format_markdown

    assert "bytes/param" in format_markdown(report)


def test_default_variants_and_config_errors():
    assert CompareConfig().variants is None
    with pytest.raises(ValueError, match=r"Unknown model 'vgg'\. Valid choices: auto, resnet50"):
        CompareConfig(model="vgg")
    with pytest.raises(ValueError, match="Unknown variant 'fp8'"):
        CompareConfig(variants=("fp32", "fp8"))
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        CompareConfig(epochs=0)
    with pytest.raises(ValueError, match="divisible"):
        CompareConfig(hidden=100, heads=12)
    with pytest.raises(ValueError, match="Unknown data source"):
        CompareConfig(data="web")
    with pytest.raises(ValueError, match="batch_size 128 exceeds the 64"):
        compare(
            CompareConfig(
                batch_size=128,
                data="embedded",
                **{k: v for k, v in TINY_BERT.items() if k != "batch_size"},
            )
        )


def test_classification_metrics():
    labels = np.array([0, 0, 0, 1, 1, 2])
    predictions = np.array([0, 0, 1, 1, 1, 1])  # class 2 never predicted
    m = classification_metrics(labels, predictions, 3)
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["precision"] == pytest.approx((2 / 2 + 2 / 4 + 0) / 3)
    assert m["recall"] == pytest.approx((2 / 3 + 2 / 2 + 0) / 3)
    f1 = [2 * 1 * (2 / 3) / (1 + 2 / 3), 2 * 0.5 * 1 / 1.5, 0.0]
    assert m["f1"] == pytest.approx(sum(f1) / 3)


def _digits_half_split() -> data.Dataset:
    """Real digits, split half and half: 899 test images, so 1 point is 9 images."""
    d = data.load_digits_28x28()
    x, y = np.concatenate([d.train_x, d.test_x]), np.concatenate([d.train_y, d.test_y])
    half = len(x) // 2
    return dataclasses.replace(
        d, train_x=x[:half], train_y=y[:half], test_x=x[half:], test_y=y[half:]
    )


def _parity(config: CompareConfig, dataset, seeds):
    accuracy = {}
    for seed in seeds:
        report = compare(dataclasses.replace(config, seed=seed), dataset=dataset)
        for r in report["runs"]:
            accuracy.setdefault(r["variant"], []).append(r["test_accuracy"])
    return {k: float(np.mean(v)) for k, v in accuracy.items()}


def test_accuracy_parity_on_real_data():
    """bf16 and fp16 with loss scaling reach fp32's test accuracy within 1 point.

    CI-sized: a narrow ResNet18 on real handwritten digits, same seed and steps for
    every variant, accuracy averaged over three seeds.
    """
    config = CompareConfig(
        model="resnet18",
        width=16,
        variants=("fp32", "bf16", "fp16"),
        epochs=5,
        batch_size=32,
        train_examples=None,
        test_examples=None,
    )
    accuracy = _parity(config, _digits_half_split(), seeds=(0, 1, 2))
    assert accuracy["fp32"] > 0.95, accuracy
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01, accuracy
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.01, accuracy


@pytest.mark.slow
def test_accuracy_parity_full_size():
    """The reference experiment's shape: ResNet50, FashionMNIST (when it can be had), 10 epochs."""
    config = CompareConfig(
        model="resnet50",
        variants=("fp32", "bf16", "fp16"),
        epochs=10,
        batch_size=64,
        train_examples=None,
        test_examples=None,
    )
    report = compare(config)
    accuracy = {r["variant"]: r["test_accuracy"] for r in report["runs"]}
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01, accuracy
    assert abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.01, accuracy
