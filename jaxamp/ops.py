"""The ops under the policy: the 16-bit, float8 and block-scaled matmul rules, attention."""

from jaxamp._src.ops.attention import dot_product_attention, softmax_float32
from jaxamp._src.ops.block_gemm import block_dot_general
from jaxamp._src.ops.block_scaling import (
    BLOCK_FORMATS,
    MXFP8,
    NVFP4,
    BlockFormat,
    Quantized,
    quantize_blocks,
)
from jaxamp._src.ops.forms import FORMS as MATMUL_FORMS
from jaxamp._src.ops.forms import MatmulForm, matmul_form, use_matmul_form
from jaxamp._src.ops.fp8 import fp8_dot_general
from jaxamp._src.ops.fp8_scaling import dequantize, quantize
from jaxamp._src.ops.fp8_state import STATE_COLLECTION as FP8_STATE_COLLECTION
from jaxamp._src.ops.fp8_state import Fp8State, init_gemm_fp8_state, max_combined
from jaxamp._src.ops.residuals import activation_bytes, checkpoint_residuals, saved_residuals

__all__ = (
    "BLOCK_FORMATS",
    "FP8_STATE_COLLECTION",
    "MATMUL_FORMS",
    "MXFP8",
    "NVFP4",
    "BlockFormat",
    "Fp8State",
    "MatmulForm",
    "Quantized",
    "activation_bytes",
    "block_dot_general",
    "checkpoint_residuals",
    "dequantize",
    "dot_product_attention",
    "fp8_dot_general",
    "init_gemm_fp8_state",
    "matmul_form",
    "max_combined",
    "quantize",
    "quantize_blocks",
    "saved_residuals",
    "softmax_float32",
    "use_matmul_form",
)
