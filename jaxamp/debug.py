"""Proof and debugging: the precision audit, the non-finite locator, range reports, and
the records they return."""

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
    "PrecisionError",
    "PrecisionReport",
    "Problem",
    "RangeReport",
    "Recommendation",
    "SensitiveOp",
    "ValueRange",
    "find_nonfinite",
    "numerics_diff",
    "precision_report",
    "range_report",
)
