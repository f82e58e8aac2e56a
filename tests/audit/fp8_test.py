"""The audit tells a float8 GEMM's lowered intent from its compiled execution."""

import jax
import jax.numpy as jnp

import jaxamp


def _step():
    x = jax.random.normal(jax.random.key(0), (16, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    return jax.grad(jaxamp.autocast(loss, "mixed_float8")), (w, x)


def test_lowered_report_shows_float8_operands_forward_and_backward():
    step, args = _step()
    report = jaxamp.precision_report(step)(*args)
    assert report.source == "stablehlo" and "lowered" in report.reads
    ops = {(op.direction, op.operand_dtype) for op in report.ops}
    assert ("forward", "float8_e4m3fn") in ops
    assert any(d == "backward" and "float8_e5m2" in t for d, t in ops), ops
    assert all(op.float8 and op.accumulation_dtype == "float32" for op in report.ops)
    assert report.float8_gemms() == (len(report.ops), len(report.ops))
    assert "float8 GEMMs" in str(report)
    assert report.problems("bfloat16") == []


def test_compiled_report_says_which_program_it_read():
    """On XLA:CPU the compiled dots are float32 (converts before them); the report still
    knows them as float8 GEMMs by their scope, says it read the compiled program, and
    does not call them float32 matmuls under a 16-bit compute dtype."""
    step, args = _step()
    report = jaxamp.precision_report(step, compiled=True)(*args)
    assert report.source == "hlo" and "compiled" in report.reads
    float8, on_float8 = report.float8_gemms()
    assert float8 >= 2
    if jax.default_backend() == "cpu":
        assert on_float8 == 0
        assert {op.operand_dtype for op in report.ops if op.float8} == {"float32"}
    assert report.problems("bfloat16") == []
    assert report.summary()["float8_gemms"] == float8


def test_a_plain_float32_matmul_is_still_a_problem_beside_float8_ones():
    x = jnp.ones((4, 8))

    def f(w, v):
        return jaxamp.autocast(lambda w: x @ w, "mixed_float8")(w) + x @ v

    report = jaxamp.precision_report(f)(jnp.ones((8, 2)), jnp.ones((8, 2)))
    kinds = [p.kind for p in report.problems("bfloat16")]
    assert kinds == ["float32_matmul"]
