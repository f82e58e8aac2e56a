"""The ops under the policy: the 16-bit matmul rule and its forms, attention, residuals."""

from jaxamp._src.ops.attention import dot_product_attention, softmax_float32
from jaxamp._src.ops.forms import FORMS as MATMUL_FORMS
from jaxamp._src.ops.forms import MatmulForm, matmul_form, use_matmul_form
from jaxamp._src.ops.residuals import activation_bytes, checkpoint_residuals, saved_residuals

__all__ = (
    "MATMUL_FORMS",
    "MatmulForm",
    "activation_bytes",
    "checkpoint_residuals",
    "dot_product_attention",
    "matmul_form",
    "saved_residuals",
    "softmax_float32",
    "use_matmul_form",
)
