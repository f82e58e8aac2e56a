"""Tests for jaxamp/_src/precision_report.py: parsing lowered and compiled programs."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp
from jaxamp._src.precision_report import PrecisionReport

STABLEHLO = """
module @jit_f {
  func.func public @main(%arg0: tensor<4x8xbf16>, %arg1: tensor<8x3xbf16>) -> tensor<4x3xbf16> {
    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [DEFAULT, DEFAULT], algorithm = <lhs_precision_type = bf16, rhs_precision_type = bf16, accumulation_type = f32, lhs_component_count = 1, rhs_component_count = 1, num_primitive_operations = 1, allow_imprecise_accumulation = false> : (tensor<4x8xbf16>, tensor<8x3xbf16>) -> tensor<4x3xbf16> loc(#loc7)
    %1 = stablehlo.convert %0 : (tensor<4x3xbf16>) -> tensor<4x3xf32> loc(#loc8)
    %2 = stablehlo.convert %1 : tensor<4x3xf32> loc(#loc8)
    %3 = stablehlo.convert %arg2 : (tensor<4xi32>) -> tensor<4xf32> loc(#loc8)
    %4 = stablehlo.convolution(%a, %b) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64, feature_group_count = 1 : i64} : (tensor<2x8x8x3xf16>, tensor<3x3x3x4xf16>) -> tensor<2x8x8x4xf32> loc(#loc9)
    return %0 : tensor<4x3xbf16>
  }
}
#loc7 = loc("jit(f)/jvp(Model)/Dense_0/dot_general"(#loc1))
#loc8 = loc("jit(f)/convert_element_type"(#loc1))
#loc9 = loc("jit(f)/transpose(jvp(Model))/Conv_0/conv_general_dilated"(#loc1))
"""

HLO = """
HloModule jit_f, entry_computation_layout={(bf16[512,1024]{1,0})->bf16[512,1024]{1,0}}

%fused_computation (param_0: f32[512,1024], param_1: f32[1024,1024]) -> f32[512,1024] {
  ROOT %dot.0 = f32[512,1024]{1,0} dot(f32[512,1024]{1,0} %param_0, f32[1024,1024]{1,0} %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, algorithm=dot_bf16_bf16_f32, metadata={op_name="jit(f)/jvp(M)/Dense_0/dot_general"}
}

ENTRY %main (a: bf16[512,1024], b: bf16[1024,1024]) -> bf16[512,1024] {
  %convert.3 = f32[512,1024]{1,0} convert(bf16[512,1024]{1,0} %a)
  %custom-call.1 = (bf16[64,32]{1,0}, s8[4194304]{0}) custom-call(bf16[64,128]{1,0} %p0, bf16[128,32]{1,0} %p1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(f)/transpose(jvp(M))/Dense_1/dot_general"}
  %cudnn-conv = (bf16[2,8,8,4]{3,2,1,0}, u8[0]{0}) custom-call(bf16[2,8,8,3]{3,2,1,0} %x, bf16[3,3,3,4]{3,2,1,0} %w), window={size=3x3}, custom_call_target="__cudnn$convForward"
  ROOT %convert.5 = bf16[512,1024]{1,0} convert(f32[512,1024]{1,0} %fusion)
}
"""


def test_parse_stablehlo():
    report = PrecisionReport.from_text(STABLEHLO)
    assert report.source == "stablehlo"
    dot, conv = report.ops
    assert (dot.kind, dot.operand_dtype, dot.result_dtype, dot.accumulation_dtype) == (
        "dot_general",
        "bfloat16",
        "bfloat16",
        "float32",
    )
    assert dot.lhs_shape == (4, 8) and dot.rhs_shape == (8, 3)
    assert dot.direction == "forward" and "Dense_0" in dot.name
    assert (conv.kind, conv.operand_dtype, conv.result_dtype, conv.accumulation_dtype) == (
        "convolution",
        "float16",
        "float32",
        "float32",
    )
    assert conv.direction == "backward"
    assert report.converts == 1  # bf16->f32; same-type and int->float converts do not count
    assert report.by_dtype() == {"bfloat16": 1, "float16": 1}
    assert not report.all_operands_in("bfloat16")
    assert "Model/Dense_0" in str(report)


def test_parse_compiled_hlo():
    report = PrecisionReport.from_text(HLO)
    assert report.source == "hlo"
    kinds = [(op.kind, op.operand_dtype, op.accumulation_dtype) for op in report.ops]
    assert kinds == [
        ("dot", "float32", "float32"),
        ("custom-call", "bfloat16", None),
        ("custom-call", "bfloat16", None),
    ]
    assert report.ops[1].direction == "backward"
    assert report.converts == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_report_of_a_function(dtype):
    def f(x, w, k):
        y = x @ w
        z = lax.conv_general_dilated(
            y[:, None, None, :], k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
        return z.astype(jnp.float32).sum()

    args = (jnp.ones((2, 4), dtype), jnp.ones((4, 3), dtype), jnp.ones((1, 1, 3, 2), dtype))
    report = jaxamp.precision_report(jax.grad(f, argnums=(0, 1, 2)))(*args)
    assert report.all_operands_in(dtype)
    # forward dot (its output feeds the kernel gradient), two backward dots, two
    # backward convolutions; the forward convolution is linear and not needed.
    assert report.count(kind="dot_general") == 3 and report.count(kind="convolution") == 2
    assert report.summary()["matmuls"] == 5


def test_compiled_report_on_this_backend():
    x = jnp.ones((8, 8), jnp.bfloat16)
    report = jaxamp.precision_report(jnp.matmul, compiled=True)(x, x)
    assert report.source == "hlo" and len(report.ops) >= 1


def test_cuda_lowering_states_float32_accumulation():
    """The program a GPU would get, lowered here without one."""
    model = jaxamp.linen.apply_policy(__import__("flax.linen").linen.Dense(4), "mixed_bfloat16")
    x = jnp.ones((2, 8))
    variables = model.init(jax.random.key(0), x)
    lowered = (
        jax.jit(jax.grad(lambda v: model.apply(v, x).sum()))
        .trace(variables)
        .lower(lowering_platforms=("cuda",))
    )
    report = PrecisionReport.from_lowered(lowered)
    assert report.all_operands_in("bfloat16")
    assert {op.accumulation_dtype for op in report.ops} == {"float32"}


def test_static_argnums():
    def f(x, transpose):
        return x.T @ x if transpose else x @ x.T

    report = jaxamp.precision_report(f, static_argnums=1)(jnp.ones((2, 3), jnp.bfloat16), True)
    assert report.ops[0].lhs_shape == (3, 2)
