"""Checkpoints across precisions: params, optimizer state and FP8 state saved under one
recipe or policy, restored under another, with a report of every value changed."""

from jaxamp._src.checkpoint.fp8 import convert_fp8_state
from jaxamp._src.checkpoint.report import Conversion, ConversionReport, LossyConversionError
from jaxamp._src.checkpoint.state import ConvertedState, convert_state

__all__ = (
    "Conversion",
    "ConversionReport",
    "ConvertedState",
    "LossyConversionError",
    "convert_fp8_state",
    "convert_state",
)
