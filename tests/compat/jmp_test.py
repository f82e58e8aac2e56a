"""jmp's own test cases, run against jaxamp.

``tests/compat/jmp_tests/`` holds jmp's ``policy_test.py`` and ``loss_scale_test.py``
as upstream wrote them (absltest/parameterized), importing
``tests/compat/jmp_adapter.py`` (jmp's API on top of jaxamp) instead of jmp. The
classes below are jmp's test classes: pytest runs every case (72 policy cases, 25
loss-scale cases). A case that fails because jaxamp differs from jmp on purpose
is a strict xfail whose reason says how and why (see docs/guides/jmp_compatibility.md);
one that starts passing fails the run, so the list stays exact. ``raises`` pins
the failure each case is expected to show, so a different failure is reported.
"""

from __future__ import annotations

import functools
import unittest

import jmp
import pytest

import jaxamp
from tests.compat.jmp_tests import loss_scale_test, policy_test
from tests.helpers.promotion import OTHER_LIBRARY

# Deliberate differences, each the reason of the cases it fails.
ERROR_WORDING = (
    "jaxamp's get_policy error names the bad part and lists the valid choices "
    "(\"Invalid policy 'compute_float16': 'compute_float16' is neither a preset nor a "
    "dtype name. Did you mean 'mixed_float16'? Valid choices: ...\"); jmp's reads "
    "\"Unknown dtype 'compute_float16' ...\". Same ValueError, other words: in jaxamp a "
    "bare name may also be a preset."
)
STR_FORMAT = (
    "str(jaxamp.Policy) is 'params=float32,compute=bfloat16,output=float32' (the "
    "grammar's long keys, NumPy dtype names); jmp's is 'p=full,c=bf16,o=full'. Each "
    "string parses back to the same policy in both libraries."
)
STATIC_ZERO = (
    "jaxamp.StaticLossScale requires a positive, finite scale; jmp takes "
    "StaticLossScale(0), which zeroes every gradient. (The NoOpLossScale case of this "
    "test passes: static scales are leafless pytrees, as in jmp.)"
)
THREE_LEAVES = (
    "jaxamp's LossScaleState has three arrays, scale, growth_tracker and "
    "hysteresis_left (overflows still tolerated, for DeepSpeed/Megatron-style "
    "hysteresis), so a dynamic scale flattens to three leaves; jmp's to "
    "[loss_scale, counter]. Every setting is static in jaxamp (jmp 0.0.4's round trip "
    "drops min_loss_scale)."
)
INTEGER_PERIOD_POSITIVE_FLOOR = (
    "(period=5.0, factor=2.0, min_loss_scale=0.0): jaxamp requires growth_interval to "
    "be an integer (5.0 is refused, as 1.5 is) and min_scale to be positive, or None "
    "for no floor; jmp takes a float period and a floor of 0."
)
NO_WARNING = (
    "jaxamp takes any real scalar, integers included, as a setting and keeps the "
    "scale in float32, so there is nothing to warn about; jmp keeps the dtype it is "
    "given and warns 'Expected floating type for ...'."
)
NO_SELECT_TREE = (
    "jaxamp has no select_tree (the adapter leaves it out): jaxamp.loss_scaled keeps "
    "or discards a step itself, on device (jnp.where, or lax.cond with "
    "skip_with='cond')."
)

POLICY_XFAILS = {
    "test_get_policy_almost_dtype": (ERROR_WORDING, AssertionError),
    **{f"test_str{i}": (STR_FORMAT, AssertionError) for i in range(5)},
}
LOSS_SCALE_XFAILS = {
    "test_static_empty_trees_StaticLossScale": (STATIC_ZERO, ValueError),
    "test_dynamic_loss_scale_tree": (THREE_LEAVES, AssertionError),
    "test_dynamic_loss_scale_explicit_min_loss_scale2": (
        INTEGER_PERIOD_POSITIVE_FLOOR,
        ValueError,
    ),
    "test_dynamic_loss_scale_raises_type_error_on_int_loss_scale": (NO_WARNING, AssertionError),
    "test_dynamic_loss_scale_raises_type_error_on_int_min_loss_scale": (
        NO_WARNING,
        AssertionError,
    ),
    "test_select_tree": (NO_SELECT_TREE, AttributeError),
    "test_select_tree_rejects_non_scalar": (NO_SELECT_TREE, AttributeError),
}


def _mark_xfails(cls: type, xfails: dict[str, tuple[str, type[BaseException]]]) -> type:
    """Marks jmp's cases in ``xfails`` on ``cls`` (a copy each: jmp's methods stay unmarked)."""
    for name, (reason, raises) in xfails.items():
        case = getattr(cls, name)  # AttributeError here: a case was renamed upstream

        @functools.wraps(case)
        def copy(self, _case=case):
            return _case(self)

        setattr(cls, name, pytest.mark.xfail(strict=True, raises=raises, reason=reason)(copy))
    return cls


# jmp's test_cast_to_half compares a float32 array with a 16-bit one
@pytest.mark.standard_promotion(OTHER_LIBRARY)
class TestJmpPolicy(policy_test.PolicyTest):
    """jmp's PolicyTest on jaxamp.Policy and jaxamp.get_policy."""


# jmp's own expected values overflow NumPy float32 (np.float32(10) / 3**100); jmp warns the same.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
class TestJmpLossScale(loss_scale_test.LossScaleTest):
    """jmp's LossScaleTest on jaxamp's loss scales, through the adapter."""


_mark_xfails(TestJmpPolicy, POLICY_XFAILS)
_mark_xfails(TestJmpLossScale, LOSS_SCALE_XFAILS)


@pytest.mark.parametrize(
    ("cls", "cases", "xfails"),
    [(TestJmpPolicy, 72, POLICY_XFAILS), (TestJmpLossScale, 25, LOSS_SCALE_XFAILS)],
)
def test_all_of_jmps_cases_run(cls, cases, xfails):
    """Every case of jmp's test class runs here, and each xfail names one of them."""
    names = unittest.TestLoader().getTestCaseNames(cls)
    assert len(names) == cases
    assert set(xfails) <= set(names)


@pytest.mark.parametrize("spec", ["p=f32,c=bf16,o=f32", "c=f16", "bf16", "p=f16,c=f32"])
def test_str_parses_back_in_both_libraries(spec):
    """What STR_FORMAT says: the two spellings differ, the policies they name do not."""
    ours, theirs = jaxamp.get_policy(spec), jmp.get_policy(spec)
    assert jaxamp.get_policy(str(theirs)) == ours
    assert jaxamp.get_policy(jmp.get_policy(str(ours))) == ours
