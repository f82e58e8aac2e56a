"""What ``jaxamp compare`` runs by default, and how it reads accuracy against its noise.

Two decisions a reader of the comparison should not have to make alone:

* **Which model shows AMP on this machine, in minutes.** 16-bit GEMMs pay on GPUs,
  TPUs and on CPUs with bf16 units (``avx512_bf16``, ``amx_bf16``); 16-bit
  convolutions pay on GPUs and TPUs but on no CPU measured here. With
  ``model="auto"`` the comparison runs the reference ResNet50 on accelerators; on a
  CPU with bf16 units, a BERT-shaped transformer (width 768, the shape whose GEMMs
  the units run); on a CPU without them, a ResNet18 of width 32, which shows in
  a minute or two what ResNet50 shows in a quarter of an hour on 2 cores: 16-bit
  compute saves activation memory there and no time. The report says which and
  why; ``--model resnet50`` is the reference experiment anywhere.
* **Whether an accuracy difference is a difference.** A short run on a few
  hundred test examples moves by points from seed to seed. Each variant's test
  accuracy is reported with its spread over seeds, and a difference from fp32
  is called one only when it lies outside the noise: two standard errors of the
  difference, from the seeds' spread when there are several, else from the
  test set's sampling error alone (which understates the seed-to-seed spread;
  the report says so).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import jax

from jaxamp._src.backend import cpu_16bit_units

# The transformer ``model="auto"`` trains on a CPU with bf16 units: BERT's width (the
# GEMM shapes the units run fast), few layers and short sequences (a run of minutes).
CPU_TRANSFORMER = {"layers": 2, "hidden": 768, "heads": 12, "seq_len": 64, "vocab_size": 8192}
# The convnet it trains on a CPU without bf16 units: ResNet50 took 0.6 s a step there
# (AMD EPYC, AVX2 only, 2 cores: 12-13 minutes for the default run); a ResNet18 of width
# 32 has about a tenth of its FLOPs and shows the same: memory saved, no time.
CPU_CONVNET = {"model": "resnet18", "width": 32}


def choose_model(config: Any) -> tuple[Any, str]:
    """Resolves ``model="auto"``; returns the config to run and the reason, for the report."""
    if config.model != "auto":
        return config, f"model {config.model!r} as asked"
    if jax.default_backend() == "cpu" and cpu_16bit_units("bfloat16"):
        reason = (
            "auto: this CPU has bf16 GEMM units (/proc/cpuinfo), which speed up matmuls but "
            "not convolutions, so a BERT-shaped transformer (width 768) shows what AMP buys "
            "here; on GPUs the reference experiment is ResNet50 (--model resnet50)"
        )
        return _auto_shape(config, {"model": "bert", **CPU_TRANSFORMER}, reason)
    if jax.default_backend() == "cpu":
        reason = (
            f"auto: a ResNet18 of width {CPU_CONVNET['width']}; this CPU lists no bf16 "
            "units, so 16-bit compute "
            "saves activation memory here but no time, which a small convnet shows in "
            "minutes (the reference experiment, ResNet50: --model resnet50)"
        )
        return _auto_shape(config, CPU_CONVNET, reason)
    return _auto_shape(config, {"model": "resnet50"}, "auto: ResNet50, the reference experiment")


def _auto_shape(config: Any, shape: dict[str, Any], reason: str) -> tuple[Any, str]:
    """``config`` with ``shape``'s values for the options left at their defaults.

    A shape option the user set (``--width 16``) is kept, and the reason says so; one
    set to its default value is not told apart from one left alone.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    kept = {k: getattr(config, k) for k in shape if getattr(config, k) != defaults[k]}
    config = dataclasses.replace(config, **{k: v for k, v in shape.items() if k not in kept})
    if kept:
        reason += "; kept as given: " + ", ".join(f"{k}={v}" for k, v in kept.items())
    return config, reason


def _standard_error_of_difference(a: list[float], b: list[float], n_test: int) -> tuple[float, str]:
    if len(a) >= 2 and len(b) >= 2:
        return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b)), "seeds"
    p = min(max(statistics.mean(a + b), 1.0 / n_test), 1.0 - 1.0 / n_test)
    return math.sqrt(2.0 * p * (1.0 - p) / n_test), "test-set sampling"


def accuracy_against_noise(runs: list[dict[str, Any]], n_test: int) -> None:
    """Adds accuracy mean, spread, noise and a verdict against fp32 to each run record.

    Args:
      runs: one record per variant, each with ``test_accuracy_seeds``.
      n_test: test examples per evaluation.
    """
    baseline = next((r for r in runs if r["variant"] == "fp32"), runs[0])
    base = baseline["test_accuracy_seeds"]
    for r in runs:
        accs = r["test_accuracy_seeds"]
        r["test_accuracy"] = statistics.mean(accs)
        r["test_accuracy_sd"] = statistics.stdev(accs) if len(accs) > 1 else None
        r["test_accuracy_min"], r["test_accuracy_max"] = min(accs), max(accs)
        if r is baseline:
            r["accuracy_vs_fp32"] = None
            r["accuracy_verdict"] = "baseline"
            continue
        se, source = _standard_error_of_difference(accs, base, n_test)
        diff = r["test_accuracy"] - statistics.mean(base)
        r["accuracy_vs_fp32"] = diff
        r["accuracy_noise"] = 2.0 * se
        r["accuracy_noise_from"] = source
        within = abs(diff) <= 2.0 * se
        r["accuracy_verdict"] = "within noise" if within else ("better" if diff > 0 else "worse")


def merge_seeds(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the per-seed reports: the first seed's records, accuracy over all.

    Step times are the median of the seeds' medians; the curves and memory are
    the first seed's.
    """
    report = per_seed[0]
    for i, run in enumerate(report["runs"]):
        runs = [r["runs"][i] for r in per_seed]
        run["test_accuracy_seeds"] = [r["test_accuracy"] for r in runs]
        run["final_loss_seeds"] = [r["final_loss"] for r in runs]
        run["step_time_median_s"] = statistics.median(r["step_time_median_s"] for r in runs)
        run["examples_per_s"] = report["config"]["batch_size"] / run["step_time_median_s"]
    baseline = next((r for r in report["runs"] if r["variant"] == "fp32"), report["runs"][0])
    for r in report["runs"]:
        r["speedup_vs_fp32"] = baseline["step_time_median_s"] / r["step_time_median_s"]
    accuracy_against_noise(report["runs"], report["dataset"]["test_examples"])
    report["seeds"] = [r["config"]["seed"] for r in per_seed]
    return report
