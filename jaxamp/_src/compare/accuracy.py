"""How ``jaxamp compare`` scores a variant and reads its accuracy against fp32's: paired by
example and by seed, one-sided, with the interval of the same test."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

# The one-sided level of each verdict.
ALPHA = 0.05
VERDICTS = ("baseline", "worse", "better", "no difference detected")


def classification_metrics(
    labels: np.ndarray, predictions: np.ndarray, num_classes: int
) -> dict[str, float]:
    """Accuracy and macro-averaged precision, recall and F1, as scikit-learn defines them.

    The macro average is over the classes present in ``labels`` or ``predictions``
    (a class absent from both says nothing about the classifier); a precision or
    recall with no example to count is 0 (scikit-learn's ``zero_division=0``), and
    F1 is the mean of the per-class F1 scores.

    Examples:
      >>> m = classification_metrics(np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1]), 10)
      >>> round(m["accuracy"], 2), round(m["precision"], 3), round(m["recall"], 2)
      (0.75, 0.833, 0.75)
    """
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    confusion = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(confusion, (labels, predictions), 1)
    tp = np.diag(confusion).astype(np.float64)
    predicted, actual = confusion.sum(0), confusion.sum(1)
    present = (predicted + actual) > 0
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)

    def macro(values: np.ndarray) -> float:
        return float(values[present].mean()) if present.any() else 0.0

    return {
        "accuracy": float(tp.sum() / max(len(labels), 1)),
        "precision": macro(precision),
        "recall": macro(recall),
        "f1": macro(f1),
    }


def _binomial_tail(k: int, n: int) -> float:
    """``P(X >= k)`` for ``X ~ Binomial(n, 1/2)``, exactly."""
    if k <= 0:
        return 1.0
    return float(Fraction(sum(math.comb(n, i) for i in range(k, n + 1)), 2**n))


@dataclasses.dataclass(frozen=True)
class McNemar:
    """McNemar's exact test of one variant against fp32 on the same examples.

    Attributes:
      only_fp32: examples fp32 gets right and the variant wrong.
      only_variant: examples the variant gets right and fp32 wrong.
      p_worse: one-sided p-value of "the variant is worse" (the chance of at least
        ``only_fp32`` of the discordant examples going fp32's way if neither is better).
      p_better: the same, of "the variant is better".
      p_two_sided: ``min(1, 2 * min(p_worse, p_better))``.
    """

    only_fp32: int
    only_variant: int
    p_worse: float
    p_better: float
    p_two_sided: float


def mcnemar(fp32_correct: Sequence[bool], variant_correct: Sequence[bool]) -> McNemar:
    """McNemar's exact test from the two runs' per-example correctness.

    Examples:
      >>> test = mcnemar([True] * 30 + [False] * 10, [False] * 30 + [False] * 10)
      >>> test.only_fp32, test.only_variant, test.p_worse < 1e-8
      (30, 0, True)
    """
    a = np.asarray(fp32_correct, bool)
    v = np.asarray(variant_correct, bool)
    b, c = int(np.sum(a & ~v)), int(np.sum(~a & v))
    worse, better = _binomial_tail(b, b + c), _binomial_tail(c, b + c)
    return McNemar(b, c, worse, better, min(1.0, 2.0 * min(worse, better)))


@dataclasses.dataclass(frozen=True)
class PairedDifference:
    """A variant's accuracy minus fp32's, read against the noise the runs can measure.

    Attributes:
      difference: mean over seeds of (variant accuracy - fp32 accuracy).
      interval: the two-sided 90% interval of the difference, each side a one-sided 95%
        bound from the same test as the verdict (``ALPHA`` on each side).
      p_worse: one-sided p-value of "the variant is worse than fp32".
      p_better: one-sided p-value of "the variant is better than fp32".
      test: the test the p-values come from.
      noise: which noises the test accounts for, and which it cannot.
      discordant: per seed, ``(only_fp32, only_variant)``: the examples only fp32
        gets right, and those only the variant does.
      verdict: one of ``VERDICTS`` (not ``"baseline"``).
    """

    difference: float
    interval: tuple[float, float]
    p_worse: float
    p_better: float
    test: str
    noise: str
    discordant: tuple[tuple[int, int], ...]
    verdict: str


ONE_SEED_TEST = (
    "McNemar's exact test on the discordant test examples (its interval: Clopper-Pearson "
    "bounds on the share of them going fp32's way and on their rate, combined)"
)
ONE_SEED_NOISE = (
    "test-set sampling, paired by example; not training's seed-to-seed spread, which one "
    "seed cannot measure (--seeds 3 measures it)"
)
SEEDS_TEST = (
    "t-test of the mean paired difference (seeds' spread and test-set sampling combined, "
    "the seeds' degrees of freedom)"
)
ALIKE_NOISE = (
    "test-set sampling, paired by example, on the first seed: every seed's paired "
    "differences were alike, so there was no spread between seeds to measure"
)
SEEDS_NOISE = (
    "training's seed-to-seed spread, paired by seed, and test-set sampling, paired by example"
)


def paired_difference(
    fp32_correct: Sequence[Sequence[bool]], variant_correct: Sequence[Sequence[bool]]
) -> PairedDifference:
    """Reads a variant's accuracy against fp32's, paired by example and by seed.

    Args:
      fp32_correct: per seed, whether fp32 got each test example right.
      variant_correct: the same for the variant, seeds and examples in the same order.

    Returns:
      The ``PairedDifference``: with one seed, from McNemar's exact test; with
      several, from the seeds' t-test (the jaxamp compare guide, "Accuracy verdicts").

    Examples:
      >>> fp32 = [[True] * 60 + [False] * 40]
      >>> same = paired_difference(fp32, fp32)
      >>> same.verdict, same.difference
      ('no difference detected', 0.0)
    """
    from scipy import stats  # scikit-learn's dependency, in the compare extra

    f = np.asarray(fp32_correct, bool)
    v = np.asarray(variant_correct, bool)
    if f.shape != v.shape or f.ndim != 2 or f.shape[1] == 0:
        raise ValueError(
            f"paired_difference needs (seeds, examples) arrays of one shape, got {f.shape} "
            f"and {v.shape}."
        )
    seeds, n = f.shape
    tests = [mcnemar(a, b) for a, b in zip(f, v, strict=True)]
    discordant = tuple((t.only_fp32, t.only_variant) for t in tests)
    deltas = v.astype(np.float64) - f  # per seed and example: -1, 0 or 1
    per_example = deltas.mean(0)  # D_i, averaged over seeds
    per_seed = deltas.mean(1)  # d_s
    difference = float(per_seed.mean())
    if seeds > 1:
        residual = deltas - per_seed[:, None] - per_example[None, :] + difference
        flips = float(np.sum(residual**2)) / max((seeds - 1) * (n - 1), 1)  # within a seed
        # the seeds' term: their spread, never below what the example flips within each
        # seed alone would give (two or three seeds can show no spread by chance)
        se_seeds2 = max(float(per_seed.var(ddof=1)), flips / n) / seeds
        se_test2 = float(per_example.var(ddof=1)) / n if n > 1 else 0.0
        se = math.sqrt(se_seeds2 + se_test2)
    if seeds > 1 and se > 0:
        df = seeds - 1  # the fewer of the two terms' (Welch-Satterthwaite's: overconfident)
        p_worse = float(stats.t.cdf(difference / se, df))
        p_better = float(stats.t.sf(difference / se, df))
        half = float(stats.t.ppf(1.0 - ALPHA, df)) * se
        interval = (difference - half, difference + half)
        name, noise = SEEDS_TEST, SEEDS_NOISE
    else:  # one seed, or seeds with no spread to measure (every seed alike): the exact test
        test = tests[0]
        p_worse, p_better = test.p_worse, test.p_better
        interval = _exact_interval(test.only_fp32, test.only_variant, n)
        name, noise = ONE_SEED_TEST, ONE_SEED_NOISE if seeds == 1 else ALIKE_NOISE
    verdict = "no difference detected"
    if p_worse < ALPHA:
        verdict = "worse"
    elif p_better < ALPHA:
        verdict = "better"
    return PairedDifference(
        difference, interval, p_worse, p_better, name, noise, discordant, verdict
    )


def _clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """One-sided ``1 - ALPHA`` lower and upper bounds of a binomial proportion, exact."""
    from scipy import stats

    low = 0.0 if k == 0 else float(stats.beta.ppf(ALPHA, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1.0 - ALPHA, k + 1, n - k))
    return low, high


def _exact_interval(only_fp32: int, only_variant: int, n: int) -> tuple[float, float]:
    """The interval of ``(only_variant - only_fp32) / n`` that matches McNemar's exact test.

    The difference is ``q * (1 - 2 p)``: ``q`` the rate of discordant examples, ``p`` the
    share of them going fp32's way. Each gets its exact one-sided bounds (Clopper-Pearson;
    ``p`` of none discordant is anywhere in [0, 1]), and the interval spans their
    corners. The upper end is below 0 exactly when ``p``'s lower bound is above one half,
    which is when the exact test finds the variant worse (the same for better).
    """
    m = only_fp32 + only_variant
    q_low, q_high = _clopper_pearson(m, n)
    p_low, p_high = _clopper_pearson(only_fp32, m) if m else (0.0, 1.0)
    low_slope, high_slope = 1.0 - 2.0 * p_high, 1.0 - 2.0 * p_low
    low = low_slope * (q_high if low_slope < 0 else q_low)
    high = high_slope * (q_high if high_slope > 0 else q_low)
    return low, high


def accuracy_against_fp32(runs: list[dict[str, Any]]) -> None:
    """Adds accuracy mean, spread and the paired verdict against fp32 to each run record.

    Args:
      runs: one record per variant, fp32's among them, each with
        ``test_accuracy_seeds`` and ``test_correct_seeds`` (per seed, per test
        example, 1 where the prediction is right).

    Raises:
      ValueError: without an fp32 run, the baseline every verdict is read against.
    """
    baseline = next((r for r in runs if r["variant"] == "fp32"), None)
    if baseline is None:
        raise ValueError(
            "The accuracy verdicts need the fp32 run, the baseline; variants: "
            f"{', '.join(r['variant'] for r in runs)}."
        )
    for r in runs:
        accs = r["test_accuracy_seeds"]
        r["test_accuracy"] = statistics.mean(accs)
        r["test_accuracy_sd"] = statistics.stdev(accs) if len(accs) > 1 else None
        r["test_accuracy_min"], r["test_accuracy_max"] = min(accs), max(accs)
        if r is baseline:
            r.update(accuracy_vs_fp32=None, accuracy_verdict="baseline")
            continue
        paired = paired_difference(baseline["test_correct_seeds"], r["test_correct_seeds"])
        r.update(
            accuracy_vs_fp32=paired.difference,
            accuracy_interval=list(paired.interval),
            accuracy_p_worse=paired.p_worse,
            accuracy_p_better=paired.p_better,
            accuracy_test=paired.test,
            accuracy_noise_from=paired.noise,
            discordant=[list(d) for d in paired.discordant],
            accuracy_verdict=paired.verdict,
        )


def merge_seeds(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from the per-seed reports: the first seed's records, accuracy over all.

    Step times are the median of the seeds' medians; the curves and memory are
    the first seed's.
    """
    report = per_seed[0]
    for i, run in enumerate(report["runs"]):
        runs = [r["runs"][i] for r in per_seed]
        run["test_accuracy_seeds"] = [r["test_accuracy"] for r in runs]
        run["test_correct_seeds"] = [r["test_correct"] for r in runs]
        run["final_loss_seeds"] = [r["final_loss"] for r in runs]
        run["nonfinite_steps"] = sum(r.get("nonfinite_steps", 0) for r in runs)
        run["step_time_median_s"] = statistics.median(r["step_time_median_s"] for r in runs)
        run["examples_per_s"] = report["config"]["batch_size"] / run["step_time_median_s"]
        del run["test_correct"]
    baseline = next(r for r in report["runs"] if r["variant"] == "fp32")
    for r in report["runs"]:
        r["speedup_vs_fp32"] = baseline["step_time_median_s"] / r["step_time_median_s"]
    accuracy_against_fp32(report["runs"])
    report["seeds"] = [r["config"]["seed"] for r in per_seed]
    fp32 = baseline["test_accuracy_seeds"]
    pairs = [abs(a - b) for i, a in enumerate(fp32) for b in fp32[i + 1 :]]
    report["fp32_seed_spread"] = statistics.mean(pairs) if pairs else None
    return report
