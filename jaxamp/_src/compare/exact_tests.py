"""McNemar's exact tests of a variant's correctness against fp32's on the same test
examples: one seed, and several seeds pooled by example, with the exact bounds their
intervals are made of (``jaxamp._src.compare.accuracy`` reads the verdicts)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import numpy.typing as npt

# The one-sided level of each verdict.
ALPHA = 0.05


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


def _tail(counts: dict[int, int], at_least: int, share: float) -> float:
    """``P(W >= at_least)`` for ``W`` the sum of ``w`` times ``Binomial(counts[w], share)``
    over the weights ``w``, independent; exact at ``share`` one half with one weight."""
    if at_least <= 0:
        return 1.0
    if len(counts) == 1 and share == 0.5:
        [(w, m)] = counts.items()
        return _binomial_tail(-(-at_least // w), m)
    from scipy import stats

    pmf = np.ones(1)
    for w, m in counts.items():
        spread = np.zeros(w * m + 1)
        spread[::w] = stats.binom.pmf(np.arange(m + 1), m, share)
        pmf = np.convolve(pmf, spread)
    return float(min(1.0, pmf[at_least:].sum()))


@dataclasses.dataclass(frozen=True)
class SeedsMcNemar:
    """McNemar's exact test over the seeds of one test set, paired by example.

    Each example's paired difference is summed over the seeds: ``k`` = the seeds in which
    only the variant gets it right, minus those in which only fp32 does. Under the null
    (fp32 and the variant exchangeable on every example) each nonzero ``k`` is as likely
    negative as positive, independently: the test flips their signs, exactly. With one
    seed it is McNemar's exact test; where every nonzero ``|k|`` is alike (copies of one
    seed, or seeds whose discordant examples differ) a binomial test of the examples.

    Attributes:
      against: the summed ``|k|`` of the examples going fp32's way.
      towards: the summed ``k`` of those going the variant's way.
      weights: ``{|k|: how many examples}``, over the examples with ``k != 0``.
      p_worse: one-sided p-value of "the variant is worse" (``P(against >= observed)``).
      p_better: the same, of "the variant is better".
    """

    against: int
    towards: int
    weights: dict[int, int]
    p_worse: float
    p_better: float

    def share_bounds(self) -> tuple[float, float]:
        """One-sided ``1 - ALPHA`` bounds on the chance that a discordant example goes
        fp32's way: the shares at which the test's tails are ``ALPHA`` (Clopper-Pearson's
        with one weight). The lower is above one half exactly when ``p_worse < ALPHA``."""
        from scipy import optimize

        if len(self.weights) <= 1:
            m = sum(self.weights.values())
            w = next(iter(self.weights), 1)
            return _clopper_pearson(self.against // w, m) if m else (0.0, 1.0)
        worse = lambda share: _tail(self.weights, self.against, share) - ALPHA
        better = lambda share: _tail(self.weights, self.towards, 1.0 - share) - ALPHA
        low = 0.0 if self.against == 0 else optimize.brentq(worse, 0.0, 1.0, xtol=1e-14)
        high = 1.0 if self.towards == 0 else optimize.brentq(better, 0.0, 1.0, xtol=1e-14)
        return float(low), float(high)


def seeds_mcnemar(fp32_correct: npt.ArrayLike, variant_correct: npt.ArrayLike) -> SeedsMcNemar:
    """``SeedsMcNemar`` from per seed, per example correctness (seeds first).

    Examples:
      >>> fp32 = [True] * 30 + [False] * 10
      >>> test = seeds_mcnemar([fp32, fp32], [[False] * 40, [False] * 40])
      >>> test.weights, test.p_worse == mcnemar(fp32, [False] * 40).p_worse
      ({2: 30}, True)
    """
    f = np.asarray(fp32_correct, bool)
    v = np.asarray(variant_correct, bool)
    k = v.sum(0, dtype=np.int64) - f.sum(0, dtype=np.int64)
    values, counts = np.unique(np.abs(k[k != 0]), return_counts=True)
    weights = {int(w): int(c) for w, c in zip(values, counts, strict=True)}
    against, towards = int(-k[k < 0].sum()), int(k[k > 0].sum())
    p_worse = _tail(weights, against, 0.5)
    p_better = _tail(weights, towards, 0.5)
    return SeedsMcNemar(against, towards, weights, p_worse, p_better)


def _clopper_pearson(k: int, n: int) -> tuple[float, float]:
    """One-sided ``1 - ALPHA`` lower and upper bounds of a binomial proportion, exact."""
    from scipy import stats

    low = 0.0 if k == 0 else float(stats.beta.ppf(ALPHA, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1.0 - ALPHA, k + 1, n - k))
    return low, high


def exact_interval(test: SeedsMcNemar, seeds: int, n: int) -> tuple[float, float]:
    """The interval of the difference, ``(towards - against) / (seeds n)``, that matches
    the exact test.

    The difference is ``q * (1 - 2 p)``: ``q`` the rate of discordance (the summed ``|k|``
    over ``seeds n``), ``p`` the share of it going fp32's way. ``p`` gets the test's exact
    one-sided bounds (``SeedsMcNemar.share_bounds``; anywhere in [0, 1] with none
    discordant); ``q``, Clopper-Pearson's on the discordant examples among the ``n``,
    times their mean ``|k| / seeds``. The interval spans the corners. Its upper end is
    below 0 exactly when ``p``'s lower bound is above one half, which is when the exact
    test finds the variant worse (the same for better).
    """
    m = sum(test.weights.values())
    size = (test.against + test.towards) / (seeds * m) if m else 1.0
    q_low, q_high = (size * b for b in _clopper_pearson(m, n))
    p_low, p_high = test.share_bounds()
    low_slope, high_slope = 1.0 - 2.0 * p_high, 1.0 - 2.0 * p_low
    low = low_slope * (q_high if low_slope < 0 else q_low)
    high = high_slope * (q_high if high_slope > 0 else q_low)
    return low, high
