"""Tests for jaxamp/_src/audit/checks.py: sensitive ops, their dtypes and layers, problems."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.helpers.promotion import FLAX, SUBJECT

SIXTEEN = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}
DTYPES = {**SIXTEEN, "float32": jnp.float32}
SEGMENTS = jnp.array([0, 0, 1, 1, 2, 2, 3, 3])


class HandSoftmax(nn.Module):
    """A softmax written out by hand, in the layer's dtype."""

    dtype: jnp.dtype | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, dtype=self.dtype, name="proj")(x)
        e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
        return e / jnp.sum(e, axis=-1, keepdims=True, dtype=x.dtype)


class SilentUpcast(nn.Module):
    """A custom layer whose matmul meets a float32 param: JAX promotes it to float32."""

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(), (x.shape[-1], 4))
        return nn.Dense(4, name="dense")(x) + x @ w


@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_flags_a_hand_written_16bit_softmax(dtype):
    model = HandSoftmax(dtype=SIXTEEN[dtype])
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(jax.grad(lambda p: model.apply(p, x).sum()))(params)
    problems = report.problems()
    flagged = {(p.kind, p.primitive, p.dtype, p.layer) for p in problems}
    assert ("sensitive_in_16bit", "exp", dtype, "HandSoftmax") in flagged
    assert ("sensitive_in_16bit", "reduce_sum", dtype, "HandSoftmax") in flagged
    with pytest.raises(
        jaxamp.debug.PrecisionError, match=f"exp computed in {dtype} at HandSoftmax"
    ):
        report.check()
    # The max reduction is listed but is not a problem: it is exact in any dtype.
    assert any(op.primitive == "reduce_max" and op.dtype == dtype for op in report.sensitive)
    assert not any(p.primitive == "reduce_max" for p in problems)


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16", "float32"])
def test_the_same_softmax_under_a_policy_is_clean(policy):
    model = jaxamp.linen.apply_policy(HandSoftmax(), policy)
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    grad = jax.jit(jax.grad(lambda p: model.apply(p, x).sum()))
    report = jaxamp.precision_report(grad)(params).check(model.policy.compute_dtype)
    exps = [op for op in report.sensitive if op.primitive == "exp"]
    assert exps and all(op.dtype == "float32" for op in exps)
    assert {op.layer for op in exps} == {"HandSoftmax"}


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_flags_a_silent_float32_matmul(dtype):
    """A 16-bit layer beside a hand-written matmul on a float32 param: JAX promotes the
    latter to float32, and the audit says so when told the compute dtype."""

    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (x.shape[-1], 4))
            return nn.Dense(4, dtype=SIXTEEN[dtype], name="dense")(x) + x @ w

    model, x = Mixed(), jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(lambda p: model.apply(p, x))(params)
    problems = report.problems(dtype)
    assert {(p.kind, p.dtype, p.layer) for p in problems} == {
        ("float32_matmul", "float32", "Mixed"),
        ("16bit_accumulation", dtype, "Mixed/dense"),  # plain Flax: a 16-bit result, no more
    }
    # without a compute dtype, float32 matmuls are fine
    assert [p.kind for p in report.problems()] == ["16bit_accumulation"]
    assert report.problems(dtype, ignore=["Mixed"]) == []
    with pytest.raises(jaxamp.debug.PrecisionError) as error:
        report.check(dtype)
    assert error.value.problems == problems
    assert "Mixed" in str(error.value)


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_policy_runs_a_hand_written_matmul_in_the_compute_dtype(policy):
    """As autocast does: ``x @ self.param(...)`` under apply_policy is a 16-bit matmul."""
    model = jaxamp.linen.apply_policy(SilentUpcast(), policy)
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(lambda p: model.apply(p, x))(params)
    compute = model.policy.compute_dtype
    report.check(compute)
    assert [op.operand_dtype for op in report.ops] == [compute.name] * 2


@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_flags_16bit_accumulation(dtype):
    x = jnp.ones((4, 4), SIXTEEN[dtype])
    plain = jaxamp.precision_report(jnp.dot)(x, x).problems()
    assert [(p.kind, p.dtype) for p in plain] == [("16bit_accumulation", dtype)]
    wide = jaxamp.precision_report(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(
        x, x
    )
    assert wide.problems() == []


@pytest.mark.standard_promotion(SUBJECT)
def test_sensitive_operations_carry_dtype_layer_pass_and_executions():
    model = jaxamp.linen.apply_policy(HandSoftmax(), "mixed_bfloat16")
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    loss = jax.value_and_grad(lambda p: jnp.log(model.apply(p, x)).sum())
    report = jaxamp.precision_report(loss)(params)
    logs = [op for op in report.sensitive if op.primitive == "log"]
    assert [(op.dtype, op.direction, op.executions) for op in logs] == [("float32", "forward", 1)]
    exp = next(op for op in report.sensitive if op.primitive == "exp")
    assert exp.shape == (2, 8) and exp.layer == "HandSoftmax"
    # The policy's residuals recompute the softmax's exponential in the backward pass.
    assert {op.direction for op in report.sensitive if op.primitive == "exp"} == {
        "forward",
        "backward",
    }


def _across_devices(collective):
    """``collective`` over the 8 CPU devices, inside ``jax.shard_map``."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    return jax.shard_map(lambda a: collective(a, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())


# primitive -> the function whose program computes it, on an (8, 4, 4, 2) input.
ACCUMULATIONS = {
    "reduce_window_sum": lambda: lambda x: nn.avg_pool(x, (2, 2)),
    "scatter_add": lambda: lambda x: jax.ops.segment_sum(x, SEGMENTS, 4),
    "cumsum": lambda: lambda x: jax.lax.cumsum(x, axis=1),
    "psum": lambda: _across_devices(jax.lax.psum),
}
EXACT_ACCUMULATIONS = {
    "reduce_window_max": lambda: lambda x: nn.max_pool(x, (2, 2)),
    "scatter_max": lambda: lambda x: jax.ops.segment_max(x, SEGMENTS, 4),
    "cummax": lambda: lambda x: jax.lax.cummax(x, axis=1),
    "pmax": lambda: _across_devices(jax.lax.pmax),
}


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("primitive", list(ACCUMULATIONS))
def test_flags_16bit_sums_outside_reduce(primitive, dtype):
    """avg_pool, segment_sum, cumsum and psum accumulate: in 16 bits they are problems."""
    fun = ACCUMULATIONS[primitive]()
    report = jaxamp.precision_report(jax.jit(fun))(jnp.ones((8, 4, 4, 2), DTYPES[dtype]))
    assert [(op.primitive, op.dtype, op.executions) for op in report.sensitive] == [
        (primitive, dtype, 1)
    ]
    flagged = [(p.kind, p.primitive, p.dtype) for p in report.problems()]
    if dtype == "float32":
        assert flagged == []
        report.check()
    else:
        assert flagged == [("sensitive_in_16bit", primitive, dtype)]
        with pytest.raises(jaxamp.debug.PrecisionError, match=f"{primitive} computed in {dtype}"):
            report.check()


@pytest.mark.parametrize("dtype", list(SIXTEEN))
@pytest.mark.parametrize("primitive", list(EXACT_ACCUMULATIONS))
def test_max_pooling_and_maxima_are_listed_not_flagged(primitive, dtype):
    fun = EXACT_ACCUMULATIONS[primitive]()
    report = jaxamp.precision_report(jax.jit(fun))(jnp.ones((8, 4, 4, 2), SIXTEEN[dtype]))
    assert [(op.primitive, op.dtype) for op in report.sensitive] == [(primitive, dtype)]
    assert report.check() is report


# cumsum's lowering for GPUs with a scan kernel (``chlo.scan``; JAX 0.10 keeps it off).
CHLO_SCAN_CUMSUM = """
module @jit_f {
  func.func public @main(%arg0: tensor<6x3xDTYPE>) -> tensor<6x3xDTYPE> {
    %cst = stablehlo.constant dense<0.000000e+00> : tensor<DTYPE>
    %0 = stablehlo.broadcast_in_dim %cst, dims = [] : (tensor<DTYPE>) -> tensor<3xDTYPE>
    %1:2 = chlo.scan(%arg0) inits (%0) dimension=0
        attributes {is_associative = true, is_reverse = false} {
    ^bb0(%input: tensor<3xDTYPE>, %carry: tensor<3xDTYPE>):
      %2 = stablehlo.add %input, %carry : tensor<3xDTYPE>
      stablehlo.return %2, %2 : tensor<3xDTYPE>, tensor<3xDTYPE>
    } : (tensor<6x3xDTYPE>, tensor<3xDTYPE>) -> (tensor<6x3xDTYPE>, tensor<3xDTYPE>)
    return %1#0 : tensor<6x3xDTYPE>
  }
}
"""


@pytest.mark.parametrize(("element", "dtype"), [("bf16", "bfloat16"), ("f32", "float32")])
def test_reads_cumsum_lowered_as_a_chlo_scan(element, dtype):
    try:  # parsing MLIR text needs JAX's dialects, registered by an internal helper
        from jax._src.interpreters.mlir import make_ir_context
        from jax._src.lib.mlir import ir
    except ImportError:
        pytest.skip("this JAX has no make_ir_context")
    from jaxamp._src.audit.checks import read_lowered

    with make_ir_context():
        module = ir.Module.parse(CHLO_SCAN_CUMSUM.replace("DTYPE", element))
        _, sensitive, _ = read_lowered(module)
    assert [(op.primitive, op.dtype, op.shape) for op in sensitive] == [("cumsum", dtype, (6, 3))]


def test_check_takes_any_spelling_of_the_compute_dtype_and_refuses_typos():
    """problems("BF16") and check("mixed_bfloat16") named no known dtype, so the
    float32-matmul check was silently off; a typo passed too."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    report = jaxamp.precision_report(lambda x, w: x @ w)(x, w)
    for spec in ("BF16", "bf16", "bfloat16", "mixed_bfloat16", jnp.bfloat16, "p=f32,c=bf16"):
        assert [p.kind for p in report.problems(spec)] == ["float32_matmul"], spec
    assert report.problems("float32") == []
    with pytest.raises(ValueError, match="Did you mean 'bfloat16'"):
        report.problems("bfloat61")
    with pytest.raises(jaxamp.debug.PrecisionError):
        report.check("mixed_bfloat16")


def test_a_vector_dot_autocast_keeps_in_float32_is_not_a_problem():
    """autocast runs jnp.dot of two vectors in the widest operand dtype (as PyTorch
    does); check() called that a float32 matmul."""
    v = jnp.ones(8)
    report = jaxamp.precision_report(jaxamp.autocast(lambda v: jnp.dot(v, v), "mixed_bfloat16"))(v)
    assert report.ops and report.check("bfloat16") is report
