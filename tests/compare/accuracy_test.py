"""Tests for jaxamp/_src/compare/accuracy.py and exact_tests.py: metrics against
scikit-learn, the paired verdicts and their exact tests against scipy and against
simulated runs whose truth is known."""

import copy

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import stats
from sklearn.metrics import accuracy_score, precision_recall_fscore_support

from jaxamp._src.compare.accuracy import (
    ALPHA,
    ONE_SEED_NOISE,
    SEEDS_NOISE,
    accuracy_against_fp32,
    classification_metrics,
    merge_seeds,
    paired_difference,
)
from jaxamp._src.compare.exact_tests import mcnemar, seeds_mcnemar
from jaxamp._src.compare.report import table_rows


@st.composite
def label_sets(draw):
    """Labels and predictions over up to 10 classes, some classes absent from both."""
    num_classes = draw(st.integers(2, 10))
    present = draw(st.lists(st.integers(0, num_classes - 1), min_size=1, unique=True))
    n = draw(st.integers(1, 60))
    labels = draw(st.lists(st.sampled_from(present), min_size=n, max_size=n))
    predictions = draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n))
    return np.array(labels), np.array(predictions), num_classes


@settings(max_examples=60, deadline=None)
@given(label_sets())
@example((np.array([0, 1, 2, 3]), np.array([0, 1, 2, 3]), 10))  # 4 of 10 classes, perfect
@example((np.array([0, 0, 1]), np.array([2, 2, 2]), 3))  # only a class never labelled
def test_metrics_are_scikit_learns(case):
    labels, predictions, num_classes = case
    ours = classification_metrics(labels, predictions, num_classes)
    precision, recall, f1, _ = precision_recall_fscore_support(
        labels, predictions, average="macro", zero_division=0
    )
    assert ours["accuracy"] == pytest.approx(accuracy_score(labels, predictions))
    assert ours["precision"] == pytest.approx(precision)
    assert ours["recall"] == pytest.approx(recall)
    assert ours["f1"] == pytest.approx(f1)


def test_a_perfect_classifier_on_four_of_ten_classes_scores_one():
    m = classification_metrics(np.array([0, 1, 2, 3] * 5), np.array([0, 1, 2, 3] * 5), 10)
    assert m == {"accuracy": 1.0, "precision": 1.0, "recall": 1.0, "f1": 1.0}


@st.composite
def paired_correctness(draw):
    n = draw(st.integers(1, 400))
    fp32 = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    variant = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return np.array(fp32), np.array(variant)


@settings(max_examples=60, deadline=None)
@given(paired_correctness())
@example((np.array([True] * 30 + [False] * 970), np.array([False] * 30 + [False] * 970)))
def test_mcnemar_is_scipys_exact_binomial_test(case):
    fp32, variant = case
    test = mcnemar(fp32, variant)
    b, c = int(np.sum(fp32 & ~variant)), int(np.sum(~fp32 & variant))
    assert (test.only_fp32, test.only_variant) == (b, c)
    if b + c == 0:
        assert test.p_worse == test.p_better == test.p_two_sided == 1.0
        return
    greater = stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue
    less = stats.binomtest(b, b + c, 0.5, alternative="less").pvalue
    assert test.p_worse == pytest.approx(greater, rel=1e-9, abs=1e-300)
    assert test.p_better == pytest.approx(less, rel=1e-9, abs=1e-300)
    two_sided = stats.binomtest(b, b + c, 0.5).pvalue
    assert test.p_two_sided == pytest.approx(two_sided, rel=1e-9, abs=1e-300)


def test_thirty_losses_and_no_gains_on_1000_examples_is_worse():
    """The case an unpaired test called "within noise" (0.750 against 0.720)."""
    fp32 = np.array([True] * 750 + [False] * 250)
    variant = fp32.copy()
    variant[:30] = False
    paired = paired_difference([fp32], [variant])
    assert paired.difference == pytest.approx(-0.030)
    assert paired.discordant == ((30, 0),)
    assert paired.p_worse == pytest.approx(0.5**30)  # McNemar, one-sided
    assert paired.verdict == "worse"
    low, high = paired.interval  # all 30 discordant go fp32's way: p's bounds [0.905, 1]
    q_low, q_high = stats.beta.ppf(0.05, 30, 971), stats.beta.ppf(0.95, 31, 970)
    p_low = 0.05 ** (1 / 30)  # Clopper-Pearson, 30 of 30
    assert low == pytest.approx(-q_high) and high == pytest.approx((1 - 2 * p_low) * q_low)
    assert high < 0
    assert paired.noise == ONE_SEED_NOISE


def test_no_discordant_example_is_no_difference_with_an_interval_of_the_unseen_rate():
    fp32 = np.array([True] * 300 + [False] * 102)
    paired = paired_difference([fp32], [fp32])
    assert paired.verdict == "no difference detected"
    assert paired.difference == 0.0 and paired.p_worse == 1.0
    # none of 402 discordant: their rate is below 1 - 0.05 ** (1 / 402) = 0.0074 (95%)
    assert paired.interval == pytest.approx((-(1 - 0.05 ** (1 / 402)), 1 - 0.05 ** (1 / 402)))
    seeds = paired_difference([fp32, fp32], [fp32, fp32])
    assert seeds.verdict == "no difference detected" and seeds.p_worse == 1.0


@settings(max_examples=80, deadline=None)
@given(paired_correctness(), st.integers(1, 3))
@example((np.array([True] * 4 + [False] * 44), np.array([False] * 48)), 1)  # 4 to 0 of 48
@example((np.array([True] * 4 + [False] * 44), np.array([False] * 48)), 2)  # the same twice
@example((np.array([True] * 3), np.array([False] * 3)), 1)
def test_the_interval_says_what_the_verdict_says(case, seeds):
    """Worse exactly when the interval lies below 0, better exactly when above; the
    difference inside it; several identical seeds no surer than one."""
    fp32, variant = case
    paired = paired_difference([fp32] * seeds, [variant] * seeds)
    low, high = paired.interval
    assert low <= paired.difference <= high
    assert (paired.verdict == "worse") == (high < 0), paired
    assert (paired.verdict == "better") == (low > 0), paired
    if seeds > 1:  # copies of one seed are no evidence the one seed was not
        one = paired_difference([fp32], [variant])
        for verdict in ("worse", "better"):
            assert paired.verdict != verdict or one.verdict == verdict, (paired, one)


def test_two_agreeing_seeds_are_no_less_sure_than_one():
    """The loss of 30 examples and no gain, which one seed calls worse (p = 2**-30): two
    seeds that agree call it worse too. A copy of the seed is the same test set's
    evidence again (the same p); a second seed losing 30 other examples doubles it
    (scipy's binomial test of the 60 to 0, about 9e-19). A t-test with one degree of
    freedom called both "no difference detected" (p = 0.057)."""
    fp32 = np.array([True] * 750 + [False] * 250)
    variant, other = fp32.copy(), fp32.copy()
    variant[:30], other[30:60] = False, False
    one = paired_difference([fp32], [variant])
    assert one.verdict == "worse" and one.p_worse == pytest.approx(0.5**30)
    copies = paired_difference([fp32, fp32], [variant, variant])
    assert copies.verdict == "worse", copies
    assert copies.p_worse == one.p_worse and copies.interval == pytest.approx(one.interval)
    two = paired_difference([fp32, fp32], [variant, other])
    assert two.verdict == "worse", two
    pooled = stats.binomtest(60, 60, 0.5, alternative="greater").pvalue
    assert two.p_worse == pytest.approx(pooled, rel=1e-9) and two.p_worse < 1e-18
    assert two.interval[1] < 0 and two.discordant == ((30, 0), (30, 0))


def _seed(n, shared, only_fp32, only_variant):
    """One seed's correctness: ``shared`` examples both get right, then ``only_fp32``
    only fp32 does, then ``only_variant`` only the variant does; the rest neither."""
    fp32, variant = np.zeros(n, bool), np.zeros(n, bool)
    fp32[:shared] = variant[:shared] = True
    fp32[shared : shared + only_fp32] = True
    variant[shared + only_fp32 : shared + only_fp32 + only_variant] = True
    return fp32, variant


def test_seeds_that_spread_keep_each_seeds_own_verdict_beside_the_recipes():
    """Two seeds each worse alone (20 to 2 and 9 to 2 of 118: scipy's binomial tests 1e-4
    and 0.033) whose paired differences spread more than chance: the verdict, about the
    recipe over training seeds, is the seeds' t-test (no difference with one degree of
    freedom), and each seed's own exact verdict is kept beside it and shown in the table:
    nothing one seed would have said is lost."""
    seeds = [_seed(118, 60, 20, 2), _seed(118, 60, 9, 2)]
    fp32, variant = [f for f, _ in seeds], [v for _, v in seeds]
    paired = paired_difference(fp32, variant)
    assert paired.test.startswith("t-test") and paired.verdict == "no difference detected"
    alone = [
        stats.binomtest(b, b + c, 0.5, alternative="greater").pvalue for b, c in ((20, 2), (9, 2))
    ]
    assert max(alone) < ALPHA
    assert paired.seed_verdicts == ("worse", "worse")
    runs = [
        {"variant": "fp32", "test_accuracy_seeds": [0.6, 0.6], "test_correct_seeds": fp32},
        {"variant": "bf16", "test_accuracy_seeds": [0.5, 0.6], "test_correct_seeds": variant},
    ]
    accuracy_against_fp32(runs)
    assert runs[1]["accuracy_seed_verdicts"] == ["worse", "worse"]
    header, _, row = table_rows({"runs": runs})
    row = dict(zip(header, row, strict=True))
    assert row["accuracy"] == "no difference detected (seeds alone: worse, worse)"


@st.composite
def seed_sets(draw, max_examples=10):
    """Per seed (1 to 3), fp32's and a variant's correctness on the same few examples."""
    seeds = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_examples))
    grid = st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=seeds, max_size=seeds)
    return np.array(draw(grid)), np.array(draw(grid))


@settings(max_examples=60, deadline=None)
@given(seed_sets())
@example(
    (np.array([[True, True, False]] * 2), np.array([[False, True, True], [False, False, False]]))
)
def test_the_exact_test_over_seeds_is_scipys_sign_flip_test(case):
    """``seeds_mcnemar`` against scipy's exact permutation test of the per-example sums
    (every sign flip enumerated), and against its binomial test where every example
    weighs alike; with one seed, McNemar's."""
    fp32, variant = case
    test = seeds_mcnemar(fp32, variant)
    k = variant.sum(0).astype(np.int64) - fp32.sum(0)
    assert (test.against, test.towards) == (-k[k < 0].sum(), k[k > 0].sum())
    nonzero = k[k != 0].astype(np.float64)
    if not len(nonzero):
        assert test.p_worse == test.p_better == 1.0
        return
    if len(nonzero) > 1:  # scipy's permutation test needs two observations

        def flips(alternative):
            return stats.permutation_test(
                (nonzero,),
                np.sum,
                permutation_type="samples",
                n_resamples=np.inf,
                alternative=alternative,
            ).pvalue

        assert test.p_worse == pytest.approx(flips("less"), rel=1e-9)
        assert test.p_better == pytest.approx(flips("greater"), rel=1e-9)
    if len(set(np.abs(nonzero))) == 1:
        m, against = len(nonzero), int(np.sum(nonzero < 0))
        for p, alternative in ((test.p_worse, "greater"), (test.p_better, "less")):
            binomial = stats.binomtest(against, m, 0.5, alternative=alternative).pvalue
            assert p == pytest.approx(binomial, rel=1e-9)
    if len(fp32) == 1:
        assert test.p_worse == mcnemar(fp32[0], variant[0]).p_worse


@settings(max_examples=60, deadline=None)
@given(seed_sets(max_examples=40))
@example(
    (np.array([[True] * 6 + [False] * 4] * 2), np.array([[False] * 10, [False] * 3 + [True] * 7]))
)
def test_the_interval_says_what_the_verdict_says_over_seeds(case):
    """Whichever test decides (the exact test over seeds, with examples of unequal
    weight, or the seeds' t-test): worse exactly when the interval lies below 0, better
    exactly when above, the difference inside it."""
    paired = paired_difference(*case)
    low, high = paired.interval
    assert low <= paired.difference + 1e-12 and paired.difference <= high + 1e-12, paired
    assert (paired.verdict == "worse") == (high < 0), paired
    assert (paired.verdict == "better") == (low > 0), paired


_SURE = {"worse": 1, "better": 1, "no difference detected": 0}


@settings(max_examples=60, deadline=None)
@given(paired_correctness(), st.integers(2, 3))
@example((np.array([True] * 30 + [False] * 20), np.array([False] * 50)), 2)  # the issue's
@example((np.array([True] * 4 + [False] * 44), np.array([False] * 48)), 2)  # 4 to 0 of 48
@example((np.array([True] * 3 + [False] * 2), np.array([False] * 3 + [True] * 2)), 3)
def test_more_agreeing_seeds_never_give_a_weaker_verdict(case, seeds):
    """Copies of one seed: exactly the one seed's p-values and verdict (the same test
    set's evidence again). Seeds that agree on other examples (the same paired
    differences on a fresh block of the test set each): the same verdict or a surer one,
    and the p-value of the difference's own direction no larger."""
    fp32, variant = case
    one = paired_difference([fp32], [variant])
    copies = paired_difference([fp32] * seeds, [variant] * seeds)
    assert (copies.p_worse, copies.p_better, copies.verdict) == (
        one.p_worse,
        one.p_better,
        one.verdict,
    )
    # seed s differs from fp32 on block s only, the same way; one seed is block 0 alone
    n = len(fp32)
    blocks_f = np.tile(fp32, seeds)
    rows_v = [
        np.concatenate([variant if b == s else fp32 for b in range(seeds)]) for s in range(seeds)
    ]
    more = paired_difference([blocks_f] * seeds, rows_v)
    alone = paired_difference([blocks_f], rows_v[:1])
    if alone.difference < 0:
        assert more.p_worse <= alone.p_worse * (1 + 1e-9), (more, alone)
    if alone.difference > 0:
        assert more.p_better <= alone.p_better * (1 + 1e-9), (more, alone)
    assert _SURE[more.verdict] >= _SURE[alone.verdict], (more, alone)
    assert alone.verdict == "no difference detected" or more.verdict == alone.verdict
    assert more.difference == pytest.approx(alone.difference) and len(blocks_f) == seeds * n


@pytest.mark.slow
@settings(max_examples=1000, deadline=None)
@given(seed_sets(), seed_sets(max_examples=40), paired_correctness(), st.integers(2, 3))
def test_the_tests_over_seeds_with_a_larger_budget(small, large, one, seeds):
    """The three properties above on 1000 generated cases each (CI runs 60)."""
    test_the_exact_test_over_seeds_is_scipys_sign_flip_test.hypothesis.inner_test(small)
    test_the_interval_says_what_the_verdict_says_over_seeds.hypothesis.inner_test(large)
    test_more_agreeing_seeds_never_give_a_weaker_verdict.hypothesis.inner_test(one, seeds)


def _simulate(rng, seeds, n, deficit):
    """Per seed, fp32's and a variant's correctness on ``n`` shared test examples: each
    example has a difficulty, each seed's training moves every run's accuracy (the runs of
    one seed together, and each on its own), and the variant loses ``deficit``."""
    difficulty = rng.normal(1.5, 1.5, n)  # an easy test set: about 80% right
    fp32, variant = [], []
    for _ in range(seeds):
        shared = rng.normal(0, 0.1)  # what the seed's initialisation and batches do
        for out, shift in ((fp32, 0.0), (variant, deficit)):
            own = rng.normal(0, 0.1)  # what the run's own trajectory does
            logit = difficulty + shared + own - shift + rng.normal(0, 1.0, n)
            out.append(logit > 0)
    return np.array(fp32), np.array(variant)


@pytest.mark.parametrize("seeds", [1, 3])
def test_verdicts_are_calibrated_and_find_a_real_loss(seeds):
    """On simulated runs whose truth is known: with no difference, "worse" comes up at
    most about as often as the level says (the several-seed test accounts for the
    training spread a one-seed McNemar test cannot, so it is the calibrated one); with a
    real loss (about 12 points from 80%, seeds spread by about 2), it comes up."""
    rng = np.random.default_rng(0)
    trials = 200
    null = [
        paired_difference(*_simulate(rng, seeds, 500, 0.0)).verdict == "worse"
        for _ in range(trials)
    ]
    if seeds > 1:
        assert np.mean(null) <= ALPHA + 0.04, np.mean(null)
    loss = [
        paired_difference(*_simulate(rng, seeds, 500, 0.7)).verdict == "worse"
        for _ in range(trials)
    ]
    assert np.mean(loss) >= 0.85, np.mean(loss)


def test_one_seed_misses_the_training_spread_that_several_seeds_account_for():
    """A seed-to-seed spread much larger than the test set's sampling: one seed's McNemar
    test calls differences real that are training's own spread; the seeds' test does not."""
    rng = np.random.default_rng(1)

    def noisy(seeds):
        difficulty = rng.normal(1.5, 1.5, 2000)
        runs = [
            [difficulty + rng.normal(0, 1.2) + rng.normal(0, 0.3, 2000) > 0 for _ in range(seeds)]
            for _ in range(2)
        ]
        return np.array(runs[0]), np.array(runs[1])

    one = np.mean([paired_difference(*noisy(1)).verdict == "worse" for _ in range(100)])
    three = np.mean([paired_difference(*noisy(3)).verdict == "worse" for _ in range(100)])
    assert one > 0.2 and three <= ALPHA + 0.05, (one, three)


def _runs(**correct):
    return [
        {
            "variant": v,
            "test_correct_seeds": [list(map(int, s)) for s in c],
            "test_accuracy_seeds": [float(np.mean(s)) for s in c],
        }
        for v, c in correct.items()
    ]


def test_verdicts_in_the_run_records():
    fp32 = [[1] * 90 + [0] * 10, [1] * 88 + [0] * 12, [1] * 91 + [0] * 9]
    worse = [[0] * 20 + [1] * 70 + [0] * 10, [0] * 20 + [1] * 68 + [0] * 12]
    worse.append([0] * 18 + [1] * 73 + [0] * 9)
    runs = _runs(fp32=fp32, bf16=copy.deepcopy(fp32), fp16=worse)
    accuracy_against_fp32(runs)
    base, same, lost = runs
    assert base["accuracy_verdict"] == "baseline" and base["accuracy_vs_fp32"] is None
    assert same["accuracy_verdict"] == "no difference detected"
    assert same["discordant"] == [[0, 0], [0, 0], [0, 0]]
    assert lost["accuracy_verdict"] == "worse"
    assert lost["accuracy_vs_fp32"] == pytest.approx(-0.58 / 3)
    assert lost["discordant"] == [[20, 0], [20, 0], [18, 0]]
    assert lost["accuracy_noise_from"] == SEEDS_NOISE
    assert lost["accuracy_interval"][1] < 0
    with pytest.raises(ValueError, match="need the fp32 run, the baseline; variants: bf16"):
        accuracy_against_fp32(_runs(bf16=fp32))


def test_merge_seeds():
    def report(seed, correct, step):
        runs = [
            {
                "variant": name,
                "test_accuracy": float(np.mean(correct)),
                "test_correct": correct,
                "final_loss": 1.0,
                "step_time_median_s": factor * step,
            }
            for name, factor in (("fp32", 2), ("bf16", 1))
        ]
        return {
            "config": {"seed": seed, "batch_size": 8},
            "runs": runs,
            "dataset": {"test_examples": 4},
        }

    merged = merge_seeds(
        [report(0, [1, 1, 0, 0], 1.0), report(1, [1, 1, 1, 0], 3.0), report(2, [1, 0, 0, 0], 2.0)]
    )
    assert merged["seeds"] == [0, 1, 2]
    fp32, bf16 = merged["runs"]
    assert bf16["test_accuracy_seeds"] == [0.5, 0.75, 0.25]
    assert bf16["test_correct_seeds"][1] == [1, 1, 1, 0] and "test_correct" not in bf16
    assert bf16["test_accuracy"] == pytest.approx(0.5)
    assert bf16["step_time_median_s"] == 2.0 and fp32["step_time_median_s"] == 4.0
    assert bf16["speedup_vs_fp32"] == pytest.approx(2.0)
    assert merged["fp32_seed_spread"] == pytest.approx((0.25 + 0.25 + 0.5) / 3)


def test_the_report_names_the_test_each_verdict_came_from():
    """Seeds whose paired differences spread no more than their flips leave no spread to
    add: the exact test over every seed decides, and the report says that test; seeds
    that spread more (3 to 0 and 1 to 0 of 48), the seeds' t-test."""
    from jaxamp._src.compare.accuracy import POOLED_NOISE, POOLED_TEST, SEEDS_TEST
    from jaxamp._src.compare.report import accuracy_lines

    fp32 = [[1] * 40 + [0] * 8] * 2
    alike = _runs(fp32=fp32, bf16=copy.deepcopy(fp32))
    varied = [[0] * 3 + [1] * 37 + [0] * 8, [0] * 1 + [1] * 39 + [0] * 8]
    runs = [*alike, _runs(fp32=fp32, fp16=varied)[1]]
    accuracy_against_fp32(runs)
    report = {"runs": runs, "seeds": [0, 1], "config": {}, "dataset": {"test_examples": 48}}
    text = "\n".join(accuracy_lines(report))
    assert (
        runs[1]["accuracy_test"] == POOLED_TEST and runs[1]["accuracy_noise_from"] == POOLED_NOISE
    )
    assert f"Test (bf16): {POOLED_TEST}. It accounts for {POOLED_NOISE}." in text, text
    assert f"Test (fp16): {SEEDS_TEST}. It accounts for {SEEDS_NOISE}." in text, text
