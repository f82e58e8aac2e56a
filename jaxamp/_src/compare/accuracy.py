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

from jaxamp._src.compare.exact_tests import ALPHA, exact_interval, seeds_mcnemar

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
      seed_verdicts: per seed, the verdict of McNemar's exact test on that seed alone.
        Where the seeds spread more than chance (``test`` is the seeds' t-test), every
        seed alone may find the variant worse while the verdict, about the recipe over
        training seeds, finds no difference: two seeds cannot tell a real loss from
        seed-to-seed spread (run more).
    """

    difference: float
    interval: tuple[float, float]
    p_worse: float
    p_better: float
    test: str
    noise: str
    discordant: tuple[tuple[int, int], ...]
    verdict: str
    seed_verdicts: tuple[str, ...] = ()


ONE_SEED_TEST = (
    "McNemar's exact test on the discordant test examples (its interval: Clopper-Pearson "
    "bounds on the share of them going fp32's way and on their rate, combined)"
)
ONE_SEED_NOISE = (
    "test-set sampling, paired by example; not training's seed-to-seed spread, which one "
    "seed cannot measure (--seeds 3 measures it)"
)
POOLED_TEST = (
    "McNemar's exact test over every seed: each test example's paired differences summed "
    "over the seeds, their signs flipped exactly (its interval: exact bounds on the share "
    "of the discordant examples going fp32's way and Clopper-Pearson bounds on their "
    "rate, combined)"
)
POOLED_NOISE = (
    "test-set sampling, paired by example, with every seed's evidence: the seeds' paired "
    "differences spread no more than the examples that flip within each seed explain, so "
    "there was no seed-to-seed spread to add"
)
SEEDS_TEST = (
    "t-test of the mean paired difference (seeds' spread and test-set sampling combined, "
    "the seeds' degrees of freedom)"
)
SEEDS_NOISE = (
    "training's seed-to-seed spread, paired by seed, and test-set sampling, paired by "
    "example: the seeds' paired differences spread more than the examples that flip "
    "within each seed explain"
)


def paired_difference(
    fp32_correct: Sequence[Sequence[bool]], variant_correct: Sequence[Sequence[bool]]
) -> PairedDifference:
    """Reads a variant's accuracy against fp32's, paired by example and by seed.

    Args:
      fp32_correct: per seed, whether fp32 got each test example right.
      variant_correct: the same for the variant, seeds and examples in the same order.

    Returns:
      The ``PairedDifference``: with one seed, from McNemar's exact test; with several
      whose paired differences spread no more than the examples flipping within each
      seed explain, from McNemar's exact test over every seed (``seeds_mcnemar``), so
      that a seed that agrees never makes the verdict less sure; with several that
      spread more, from the seeds' t-test, which adds that spread (the jaxamp compare
      guide, "Accuracy verdicts").

    Examples:
      >>> fp32 = [[True] * 60 + [False] * 40]
      >>> same = paired_difference(fp32, fp32)
      >>> same.verdict, same.difference
      ('no difference detected', 0.0)
    """
    f = np.asarray(fp32_correct, bool)
    v = np.asarray(variant_correct, bool)
    if f.shape != v.shape or f.ndim != 2 or f.shape[1] == 0:
        raise ValueError(
            f"paired_difference needs (seeds, examples) arrays of one shape, got {f.shape} "
            f"and {v.shape}."
        )
    seeds, n = f.shape
    discordant = tuple(
        (int(np.sum(a & ~b)), int(np.sum(~a & b))) for a, b in zip(f, v, strict=True)
    )
    deltas = v.astype(np.float64) - f  # per seed and example: -1, 0 or 1
    difference = float(deltas.mean())
    spread = _seed_spread(deltas) if seeds > 1 else None
    if spread is not None:
        p_worse, p_better, interval = spread
        name, noise = SEEDS_TEST, SEEDS_NOISE
    else:  # one seed, or seeds that spread no more than their flips: the exact test
        test = seeds_mcnemar(f, v)
        p_worse, p_better = test.p_worse, test.p_better
        interval = exact_interval(test, seeds, n)
        name, noise = (ONE_SEED_TEST, ONE_SEED_NOISE) if seeds == 1 else (POOLED_TEST, POOLED_NOISE)
    seed_verdicts = tuple(
        _verdict(t.p_worse, t.p_better)
        for t in (seeds_mcnemar(a[None], b[None]) for a, b in zip(f, v, strict=True))
    )
    return PairedDifference(
        difference,
        interval,
        p_worse,
        p_better,
        name,
        noise,
        discordant,
        _verdict(p_worse, p_better),
        seed_verdicts,
    )


def _verdict(p_worse: float, p_better: float) -> str:
    """The verdict of one-sided p-values at ``ALPHA``."""
    if p_worse < ALPHA:
        return "worse"
    return "better" if p_better < ALPHA else "no difference detected"


def _seed_spread(deltas: np.ndarray) -> tuple[float, float, tuple[float, float]] | None:
    """The seeds' t-test of ``deltas`` (seeds x examples of -1, 0, 1), or ``None`` when the
    seeds' paired differences spread no more than the examples that flip within each seed
    explain: the seed mean square of the two-way (seed x example) analysis of variance no
    larger than its residual mean square, so that the estimate of the seed-to-seed
    variance is 0 (as DerSimonian and Laird's is where the spread is within chance).

    Returns:
      ``(p_worse, p_better, interval)``.
    """
    from scipy import stats  # scikit-learn's dependency, in the compare extra

    seeds, n = deltas.shape
    squares = _mean_squares(deltas)
    if squares is None:
        return None
    between = float(squares[0])  # above the flips': the seeds' spread is the larger term
    per_example = deltas.mean(0)  # D_i: the test set's term is their spread
    difference = float(deltas.mean())
    se_test2 = float(per_example.var(ddof=1)) / n if n > 1 else 0.0
    se = math.sqrt(between / (n * seeds) + se_test2)
    df = seeds - 1  # the fewer of the two terms' (Welch-Satterthwaite's: overconfident)
    half = float(stats.t.ppf(1.0 - ALPHA, df)) * se
    return (
        float(stats.t.cdf(difference / se, df)),
        float(stats.t.sf(difference / se, df)),
        (difference - half, difference + half),
    )


def _mean_squares(deltas: np.ndarray) -> tuple[Fraction, Fraction] | None:
    """The seed and residual mean squares of the two-way (seed x example) analysis of
    variance of ``deltas`` (integers), exactly; ``None`` where the first is no larger."""
    seeds, n = deltas.shape
    d = deltas.astype(np.int64)
    rows, columns, total = d.sum(1), d.sum(0), int(d.sum())
    rows2, columns2 = int(np.sum(rows * rows)), int(np.sum(columns * columns))
    between = Fraction(seeds * rows2 - total * total, seeds * n * (seeds - 1))
    residual = seeds * n * int(np.sum(d * d)) - seeds * rows2 - n * columns2 + total * total
    flips = Fraction(residual, seeds * n * max((seeds - 1) * (n - 1), 1))
    return None if between <= flips else (between, flips)


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
            accuracy_seed_verdicts=list(paired.seed_verdicts),
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
