"""Tests for jaxamp/_src/audit.py and program_walk.py: sensitive ops, executions, problems."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxamp

SIXTEEN = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


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
    with pytest.raises(jaxamp.PrecisionError, match=f"exp computed in {dtype} at HandSoftmax"):
        report.check()
    # The max reduction is listed but is not a problem: it is exact in any dtype.
    assert any(op.primitive == "reduce_max" and op.dtype == dtype for op in report.sensitive)
    assert not any(p.primitive == "reduce_max" for p in problems)


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


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_flags_a_silent_float32_matmul(policy):
    model = jaxamp.linen.apply_policy(SilentUpcast(), policy)
    x = jnp.ones((2, 4))
    params = model.init(jax.random.key(0), x)
    report = jaxamp.precision_report(lambda p: model.apply(p, x))(params)
    compute = model.policy.compute_dtype
    problems = report.problems(compute)
    assert [(p.kind, p.dtype, p.layer) for p in problems] == [
        ("float32_matmul", "float32", "SilentUpcast")
    ]
    assert report.problems() == []  # without a compute dtype, float32 matmuls are fine
    assert report.problems(compute, ignore=["SilentUpcast"]) == []
    with pytest.raises(jaxamp.PrecisionError) as error:
        report.check(compute)
    assert error.value.problems == problems
    assert "SilentUpcast" in str(error.value)


@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_flags_16bit_accumulation(dtype):
    x = jnp.ones((4, 4), SIXTEEN[dtype])
    plain = jaxamp.precision_report(jnp.dot)(x, x).problems()
    assert [(p.kind, p.dtype) for p in plain] == [("16bit_accumulation", dtype)]
    wide = jaxamp.precision_report(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))(
        x, x
    )
    assert wide.problems() == []


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_executions_count_scan_steps_and_repeated_calls(dtype):
    """A length-12 scan's matmul runs 12 times; a nested jit called 3 times, 3 times."""
    inner = jax.jit(lambda x: jnp.exp(x) @ x)

    def f(x):
        def body(c, _):
            return jnp.tanh(c @ c), None

        c, _ = jax.lax.scan(body, x, None, length=12)
        return inner(inner(inner(c)))

    x = jnp.ones((4, 4), dtype)
    report = jaxamp.precision_report(f)(x)
    assert sorted(op.executions for op in report.ops) == [3, 12]
    assert [op.executions for op in report.sensitive if op.primitive == "exp"] == [3]
    assert report.executed() == 15 and len(report.ops) == 2
    grad_report = jaxamp.precision_report(jax.grad(lambda x: f(x).astype(jnp.float32).sum()))(x)
    backward = [op for op in grad_report.ops if op.direction == "backward"]
    assert sorted(op.executions for op in backward) == [3, 3, 12, 12]


def test_a_loop_of_unknown_length_has_unknown_executions():
    def f(x):
        return jax.lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c @ c + 1.0, x)

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [None]
    assert report.executed() is None


def test_fori_loop_trip_count():
    def f(x):
        return jax.lax.fori_loop(2, 7, lambda i, c: jnp.exp(c) @ c, x)

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [5]
