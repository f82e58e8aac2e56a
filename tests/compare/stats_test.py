"""Tests for jaxamp/_src/compare/stats.py: the model ``auto`` picks, accuracy against noise."""

import copy

import pytest

from jaxamp._src import backend
from jaxamp._src.compare.app import CompareConfig, compare
from jaxamp._src.compare.stats import (
    CPU_CONVNET,
    CPU_TRANSFORMER,
    accuracy_against_noise,
    choose_model,
    merge_seeds,
)
from tests.compare.app_test import TINY_BERT


@pytest.mark.parametrize("units", [True, False])
def test_auto_picks_a_transformer_on_a_cpu_with_bf16_units(units, monkeypatch):
    flags = {"avx", "avx2", "fma", "f16c", *(["avx512f", "avx512_bf16"] if units else [])}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    config, reason = choose_model(CompareConfig())
    if units:
        assert config.model == "bert" and "bf16 GEMM units" in reason
        assert {k: getattr(config, k) for k in CPU_TRANSFORMER} == CPU_TRANSFORMER
    else:
        assert config.model == "resnet18" and config.width == 32 and "no bf16 units" in reason
        assert {k: getattr(config, k) for k in CPU_CONVNET} == CPU_CONVNET
    asked, reason = choose_model(CompareConfig(model="resnet18"))
    assert asked.model == "resnet18" and "as asked" in reason


def _runs(**accuracies):
    return [{"variant": v, "test_accuracy_seeds": list(a)} for v, a in accuracies.items()]


def test_a_difference_is_one_only_outside_the_seeds_noise():
    runs = _runs(fp32=(0.90, 0.91, 0.89), bf16=(0.905, 0.895, 0.90), fp16=(0.80, 0.81, 0.79))
    accuracy_against_noise(runs, n_test=360)
    fp32, bf16, fp16 = runs
    assert fp32["accuracy_verdict"] == "baseline"
    assert bf16["accuracy_verdict"] == "within noise" and bf16["accuracy_noise_from"] == "seeds"
    assert fp16["accuracy_verdict"] == "worse"
    assert fp16["accuracy_vs_fp32"] == pytest.approx(-0.10)
    assert fp32["test_accuracy_sd"] == pytest.approx(0.01)


def test_one_seed_reads_against_the_test_sets_sampling_error():
    # 2 standard errors of a difference of two accuracies of about 0.885 on 360 examples.
    runs = _runs(fp32=(0.90,), bf16=(0.87,), fp16=(0.84,))
    accuracy_against_noise(runs, n_test=360)
    _, bf16, fp16 = runs
    assert bf16["accuracy_noise"] == pytest.approx(2 * (2 * 0.885 * 0.115 / 360) ** 0.5)
    assert bf16["accuracy_verdict"] == "within noise"
    assert fp16["accuracy_verdict"] == "worse"
    assert bf16["accuracy_noise_from"] == "test-set sampling" and bf16["test_accuracy_sd"] is None


def test_merge_seeds():
    def report(seed, accuracy, step):
        runs = [
            {
                "variant": "fp32",
                "test_accuracy": accuracy,
                "final_loss": 1.0,
                "step_time_median_s": 2 * step,
            },
            {
                "variant": "bf16",
                "test_accuracy": accuracy,
                "final_loss": 1.0,
                "step_time_median_s": step,
            },
        ]
        return {
            "config": {"seed": seed, "batch_size": 8},
            "runs": runs,
            "dataset": {"test_examples": 100},
        }

    merged = merge_seeds([report(0, 0.5, 1.0), report(1, 0.7, 3.0), report(2, 0.6, 2.0)])
    assert merged["seeds"] == [0, 1, 2]
    fp32, bf16 = merged["runs"]
    assert bf16["test_accuracy_seeds"] == [0.5, 0.7, 0.6]
    assert bf16["test_accuracy"] == pytest.approx(0.6)
    assert bf16["step_time_median_s"] == 2.0 and fp32["step_time_median_s"] == 4.0
    assert bf16["speedup_vs_fp32"] == pytest.approx(2.0)


def test_compare_over_seeds():
    config = CompareConfig(variants=("fp32", "bf16"), data="embedded", seeds=2, **TINY_BERT)
    report = compare(copy.deepcopy(config), log=lambda _: None)
    assert report["seeds"] == [0, 1]
    for run in report["runs"]:
        assert len(run["test_accuracy_seeds"]) == 2
        assert run["accuracy_verdict"] in ("baseline", "within noise", "better", "worse")
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        CompareConfig(seeds=0)


@pytest.mark.parametrize("units", [True, False])
def test_auto_keeps_the_shape_a_user_gave(units, monkeypatch):
    flags = {"avx", "avx2", "fma", *(["avx512f", "avx512_bf16"] if units else [])}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    given = {"layers": 1, "seq_len": 32} if units else {"width": 16}
    config, reason = choose_model(CompareConfig(**given))
    assert {k: getattr(config, k) for k in given} == given
    for k, v in (CPU_TRANSFORMER if units else CPU_CONVNET).items():
        if k not in given:
            assert getattr(config, k) == v, k
    assert "as given: " + ", ".join(f"{k}={v}" for k, v in given.items()) in reason
