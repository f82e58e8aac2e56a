"""Tests for jaxamp/_src/audit/stablehlo.py: how often each operation runs (trip counts)."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp


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


def _counted_loop(lo, hi, step):
    """A ``while_loop`` over ``range(lo, hi, step)`` whose body takes an exp and a matmul."""

    def f(x):
        def body(state):
            i, c = state
            return i + step, jnp.exp(c) @ c

        return jax.lax.while_loop(lambda s: s[0] < hi, body, (lo, x))[1]

    return f


@pytest.mark.parametrize(
    ("lo", "hi", "step", "trips"),
    [(0, 10, 2, 5), (0, 9, 2, 5), (1, 10, 3, 3), (-4, 4, 1, 8), (5, 3, 1, 0)],
)
def test_while_loop_trip_count_follows_the_counter_step(lo, hi, step, trips):
    report = jaxamp.precision_report(_counted_loop(lo, hi, step))(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [trips]
    assert [op.executions for op in report.sensitive if op.primitive == "exp"] == [trips]


def test_a_counted_loop_with_a_data_dependent_exit_has_unknown_executions():
    def f(x):
        def cond(state):
            i, c = state
            return (i < 10) & (c.sum() < 100.0)

        return jax.lax.while_loop(cond, lambda s: (s[0] + 1, s[1] @ s[1]), (0, x))[1]

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [None]
    assert report.executed() is None


def test_a_loop_whose_step_is_not_a_constant_has_unknown_executions():
    def f(x, step):
        body = lambda s: (s[0] + step, s[1] @ s[1])
        return jax.lax.while_loop(lambda s: s[0] < 10, body, (0, x))[1]

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)), 2)
    assert [op.executions for op in report.ops] == [None]


def test_a_loop_whose_counter_is_not_added_to_has_unknown_executions():
    def f(x):
        body = lambda s: (s[0] * 2, s[1] @ s[1])
        return jax.lax.while_loop(lambda s: s[0] < 10, body, (1, x))[1]

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [None]


def test_fori_loop_with_array_bounds_keeps_its_bound_in_the_loop():
    """With array bounds fori_loop is a while loop that carries its (constant) bound."""

    def f(x, n=None):
        upper = jnp.asarray(6) if n is None else n
        return jax.lax.fori_loop(0, upper, lambda i, c: jnp.exp(c) @ c, x)

    report = jaxamp.precision_report(f)(jnp.ones((2, 2)))
    assert [op.executions for op in report.ops] == [6]
    traced = jaxamp.precision_report(f)(jnp.ones((2, 2)), 6)  # a bound the caller passes
    assert [op.executions for op in traced.ops] == [None]
