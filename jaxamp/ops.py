"""The ops under the policy: the 16-bit and float8 matmul rules, attention, residuals."""

from jaxamp._src.ops.attention import dot_product_attention, softmax_float32
from jaxamp._src.ops.forms import FORMS as MATMUL_FORMS
from jaxamp._src.ops.forms import MatmulForm, matmul_form, use_matmul_form
from jaxamp._src.ops.fp8 import fp8_dot_general
from jaxamp._src.ops.fp8_scaling import dequantize, quantize
from jaxamp._src.ops.fp8_state import STATE_COLLECTION as FP8_STATE_COLLECTION
from jaxamp._src.ops.fp8_state import Fp8State, init_gemm_fp8_state, max_combined
from jaxamp._src.ops.residuals import activation_bytes, checkpoint_residuals, saved_residuals

__all__ = (
    "FP8_STATE_COLLECTION",
    "MATMUL_FORMS",
    "Fp8State",
    "MatmulForm",
    "activation_bytes",
    "checkpoint_residuals",
    "dequantize",
    "dot_product_attention",
    "fp8_dot_general",
    "init_gemm_fp8_state",
    "matmul_form",
    "max_combined",
    "quantize",
    "saved_residuals",
    "softmax_float32",
    "use_matmul_form",
)
