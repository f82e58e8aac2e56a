"""Tests for jaxamp/_src/audit/report.py: parsing lowered and compiled programs."""

import flax.linen
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp
from jaxamp._src.audit.report import PrecisionReport
from tests.helpers.promotion import FLAX

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


def test_from_text_reads_compiled_hlo_and_points_stablehlo_to_from_lowered():
    # one StableHLO reader: the MLIR walk of from_lowered, not a second one of the text
    with pytest.raises(ValueError, match=r"from_text reads compiled HLO text.*from_lowered"):
        PrecisionReport.from_text(STABLEHLO)


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


def test_the_block_scaled_gemm_call_is_a_matmul_of_its_values():
    """JAX's ``scaled_matmul`` as compiled HLO holds it for a GPU (a custom call of the
    quantized values and their scales; XLA's rewrite then names cuDNN's kernel)."""
    shapes = "f8e4m3fn[1,4,64]{2,1,0} %a, f8e4m3fn[1,8,64]{2,1,0} %b, "
    shapes += "f8e8m0fnu[1,4,2]{2,1,0} %sa, f8e8m0fnu[1,8,2]{2,1,0} %sb"
    for target in ("__op$block_scaled_dot", "__cudnn$blockScaledDot"):
        text = (
            "HloModule jit_f\n\nENTRY %main () -> f32[1,4,8] {\n"
            f"  ROOT %c = f32[1,4,8]{{2,1,0}} custom-call({shapes}), "
            f'custom_call_target="{target}"\n}}\n'
        )
        (op,) = PrecisionReport.from_text(text).ops
        assert (op.kind, op.operand_dtype) == ("custom-call", "float8_e4m3fn"), (target, op)


# Compiled HLO as a backend with 16-bit kernels writes it (a softmax, an all-reduce, a
# segment sum, a cumulative sum), and a combiner that rounds to bfloat16 (XLA:CPU's form).
HLO_SENSITIVE = """
HloModule jit_step, entry_computation_layout={(bf16[4,8]{1,0})->bf16[4,8]{1,0}}

%max_bf16 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  ROOT %maximum.1 = bf16[] maximum(%a, %b)
}

%add_rounded (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  %add.1 = f32[] add(%x, %y), metadata={op_name="jit(step)/reduce_window_sum"}
  %convert.1 = bf16[] convert(%add.1)
  ROOT %convert.2 = f32[] convert(%convert.1)
}

%add_f32 (p: f32[], q: f32[]) -> f32[] {
  %p = f32[] parameter(0)
  %q = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%p, %q)
}

%add_bf16 (m: bf16[], n: bf16[]) -> bf16[] {
  %m = bf16[] parameter(0)
  %n = bf16[] parameter(1)
  ROOT %add.3 = bf16[] add(%m, %n)
}

%fused_softmax (param_0: bf16[4,8]) -> bf16[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  %exp.0 = bf16[4,8]{1,0} exponential(bf16[4,8]{1,0} %param_0), metadata={op_name="jit(step)/jvp(Model)/attention/exp"}
  %log.0 = bf16[4,8]{1,0} log(%exp.0), metadata={op_name="jit(step)/transpose(jvp(Model))/attention/log"}
  %constant.0 = bf16[] constant(-inf)
  %reduce_max.0 = bf16[4]{0} reduce(%log.0, %constant.0), dimensions={1}, to_apply=%max_bf16, metadata={op_name="jit(step)/jvp(Model)/attention/reduce_max"}
  ROOT %rsqrt.0 = bf16[4,8]{1,0} rsqrt(%log.0), metadata={op_name="jit(step)/jvp(Model)/norm/rsqrt"}
}

ENTRY %main (x: bf16[4,8]) -> bf16[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  %fusion = bf16[4,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_softmax, metadata={op_name="jit(step)/jvp(Model)/attention/exp"}
  %convert.3 = f32[4,8]{1,0} convert(%fusion)
  %zero = f32[] constant(0)
  %cumsum.0 = f32[4,8]{1,0} reduce-window(%convert.3, %zero), window={size=1x8 pad=0_0x7_0}, to_apply=%add_rounded, metadata={op_name="jit(step)/Model/reduce_window_sum"}
  %pool.0 = f32[4,4]{1,0} reduce-window(%convert.3, %zero), window={size=1x2 stride=1x2}, to_apply=%add_rounded, metadata={op_name="jit(step)/Model/pool/reduce_window_sum"}
  %all-reduce-start = f32[4,8]{1,0} all-reduce-start(%convert.3), replica_groups={}, to_apply=%add_f32, metadata={op_name="jit(step)/shard_map/psum_invariant"}
  %ids = s32[4,1]{1,0} parameter(1)
  %zeros = bf16[2,8]{1,0} parameter(2)
  %scatter.0 = bf16[2,8]{1,0} scatter(%zeros, %ids, %fusion), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add_bf16, metadata={op_name="jit(step)/Model/segment/scatter-add"}
  ROOT %convert.4 = bf16[4,8]{1,0} convert(%cumsum.0)
}
"""


def test_parse_compiled_hlo_sensitive_operations():
    report = PrecisionReport.from_text(HLO_SENSITIVE)
    found = [(op.primitive, op.dtype, op.shape, op.layer, op.direction) for op in report.sensitive]
    assert found == [
        ("exp", "bfloat16", (4, 8), "Model/attention", "forward"),
        ("log", "bfloat16", (4, 8), "Model/attention", "backward"),
        ("reduce_max", "bfloat16", (4, 8), "Model/attention", "forward"),
        ("rsqrt", "bfloat16", (4, 8), "Model/norm", "forward"),
        # float32 operands, but every partial sum is rounded to bfloat16
        ("cumsum", "bfloat16", (4, 8), "Model", "forward"),
        ("reduce_window_sum", "bfloat16", (4, 8), "Model/pool", "forward"),
        ("psum", "float32", (4, 8), "shard_map", "forward"),
        ("scatter_add", "bfloat16", (2, 8), "Model/segment", "forward"),
    ]
    assert {op.executions for op in report.sensitive} == {None}  # text: loops not read
    flagged = [(p.primitive, p.layer) for p in report.problems()]
    assert flagged == [
        ("exp", "Model/attention"),
        ("log", "Model/attention"),
        ("rsqrt", "Model/norm"),
        ("cumsum", "Model"),
        ("reduce_window_sum", "Model/pool"),
        ("scatter_add", "Model/segment"),
    ]
    with pytest.raises(jaxamp.debug.PrecisionError, match="6 precision problem"):
        report.check()
    assert report.problems(ignore=["Model"]) == []


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


ON_CPU = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="states what XLA:CPU compiles 16-bit programs to"
)


def _sensitive(report):
    return sorted((op.primitive, op.dtype) for op in report.sensitive)


# What XLA:CPU computes a 16-bit softmax's sensitive operations in: float16 elementwise
# math natively, bfloat16 elementwise math in float32 (jax.nn.softmax sums in float32).
COMPILED_SOFTMAX_ON_CPU = {
    "bfloat16": [("exp", "float32"), ("reduce_max", "bfloat16"), ("reduce_sum", "float32")],
    "float16": [("exp", "float16"), ("reduce_max", "float16"), ("reduce_sum", "float32")],
}


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@ON_CPU
@pytest.mark.parametrize("dtype", list(COMPILED_SOFTMAX_ON_CPU))
def test_compiled_report_on_this_backend(dtype):
    """XLA:CPU has no 16-bit GEMM: it converts both operands to float32 and multiplies in
    float32; a float16 exponential stays in float16. The compiled report says so."""
    x, w = jnp.ones((4, 8), dtype), jnp.ones((8, 8), dtype)
    report = jaxamp.precision_report(lambda x, w: jax.nn.softmax(x @ w), compiled=True)(x, w)
    assert report.source == "hlo"
    (dot,) = report.ops
    assert (dot.kind, dot.lhs_dtype, dot.rhs_dtype, dot.result_dtype) == (
        "dot",
        "float32",
        "float32",
        "float32",
    )
    assert (dot.lhs_shape, dot.rhs_shape, dot.direction) == ((4, 8), (8, 8), "forward")
    assert report.converts >= 2  # the operands up to float32 (and values back to 16 bits)
    assert _sensitive(report) == COMPILED_SOFTMAX_ON_CPU[dtype]
    exp = next(op for op in report.sensitive if op.primitive == "exp")
    assert (exp.shape, exp.name, exp.layer) == ((4, 8), "jit(<lambda>)/exp", "")
    if dtype == "float16":
        with pytest.raises(
            jaxamp.debug.PrecisionError, match="exp computed in float16 at <top level>"
        ):
            report.check()
    else:  # the exponential really runs in float32 here: no problem to invent
        assert report.check() is report


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@ON_CPU
def test_compiled_bfloat16_softmax_reads_what_xla_cpu_computes():
    """XLA:CPU computes bfloat16 elementwise math in float32 (the exponential reads a
    bfloat16-rounded input but its float32 output feeds the float32 sum): not a problem
    there. A sum whose combiner rounds each partial sum to bfloat16 is one."""
    x = jnp.ones((4, 8), jnp.bfloat16)
    report = jaxamp.precision_report(jax.nn.softmax, compiled=True)(x)
    assert _sensitive(report) == [
        ("exp", "float32"),
        ("reduce_max", "bfloat16"),
        ("reduce_sum", "float32"),
    ]
    report.check()

    def softmax_summed_in_bfloat16(x):
        e = jnp.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True, dtype=jnp.bfloat16)

    report = jaxamp.precision_report(softmax_summed_in_bfloat16, compiled=True)(x)
    assert ("reduce_sum", "bfloat16") in _sensitive(report)
    with pytest.raises(jaxamp.debug.PrecisionError, match="reduce_sum computed in bfloat16"):
        report.check()


@pytest.mark.standard_promotion(FLAX)
@ON_CPU
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_compiled_pooling_and_cumulative_sums(dtype):
    """XLA:CPU runs a 16-bit reduce-window in float32 but rounds every partial sum to the
    16-bit type: the accumulation is 16-bit. max pooling is exact."""
    x = jnp.ones((2, 6, 6, 3), dtype)

    def f(x):
        return flax.linen.avg_pool(x, (2, 2)), flax.linen.max_pool(x, (2, 2)), jnp.cumsum(x, 1)

    report = jaxamp.precision_report(f, compiled=True)(x)
    assert _sensitive(report) == [
        ("cumsum", dtype),
        ("reduce_window_max", dtype),
        ("reduce_window_sum", dtype),
    ]
    problems = sorted(p.primitive for p in report.problems())
    assert problems == ([] if dtype == "float32" else ["cumsum", "reduce_window_sum"])


def test_cuda_lowering_states_float32_accumulation():
    """The program a GPU would get, lowered here without one."""
    model = jaxamp.linen.apply_policy(flax.linen.Dense(4), "mixed_bfloat16")
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
