"""Proof and debugging: the precision audit, the non-finite locator, range reports, and
the records they return."""

from jaxamp._src.advisor.suggest import PolicySuggestion, Trial, suggest_policy
from jaxamp._src.audit.checks import PrecisionError, Problem, SensitiveOp
from jaxamp._src.audit.report import MatmulOp, PrecisionReport, precision_report
from jaxamp._src.numerics.find_nonfinite import NonFinite, ValueRange, find_nonfinite
from jaxamp._src.numerics.numerics_diff import LayerDiff, NumericsDiff, numerics_diff
from jaxamp._src.numerics.range_report import range_report
from jaxamp._src.numerics.ranges import LayerRange, RangeReport, Recommendation

__all__ = (
    "LayerDiff",
    "LayerRange",
    "MatmulOp",
    "NonFinite",
    "NumericsDiff",
    "PolicySuggestion",
    "PrecisionError",
    "PrecisionReport",
    "Problem",
    "RangeReport",
    "Recommendation",
    "SensitiveOp",
    "Trial",
    "ValueRange",
    "find_nonfinite",
    "numerics_diff",
    "precision_report",
    "range_report",
    "suggest_policy",
)
