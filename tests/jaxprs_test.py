"""Tests for jaxamp/_src/jaxprs.py: bind, open_jaxpr, eqn_context and the float32 scope."""

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp._src.jaxprs import (
    FLOAT32_SCOPE,
    bind,
    eqn_context,
    in_backward_pass,
    in_float32_scope,
    is_backward_name,
    open_jaxpr,
    varying_axes,
)

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
TOLERANCE = {jnp.float32: 1e-6, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
W = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)


def evaluate(closed, *args, context=False):
    """``closed`` evaluated one equation at a time with ``bind`` (inside ``eqn_context``
    when ``context``), as ``jax.core.eval_jaxpr`` evaluates it."""
    jaxpr, consts = open_jaxpr(closed)
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda atom: atom.val if isinstance(atom, jex.core.Literal) else env[atom]
    for eqn in jaxpr.eqns:
        invals = [read(a) for a in eqn.invars]
        if context:
            with eqn_context(eqn):
                outs = bind(eqn, invals)
        else:
            outs = bind(eqn, invals)
        assert len(outs) == len(eqn.outvars), eqn
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(a) for a in jaxpr.outvars]


def f(x):
    """A matmul, a reduction over one axis, a cast, a nested jit (a jaxpr-valued param),
    a cond and a scan: equations whose params decide what they compute."""
    h = jnp.tanh(x @ W.astype(x.dtype))
    s = jnp.sum(h, axis=1, keepdims=True).astype(jnp.float32)
    g = jax.jit(lambda a: jnp.cumsum(a * 2.0, axis=0))(h.astype(jnp.float32))
    c = jax.lax.cond(s[0, 0] > 0, lambda a: a + 1.0, lambda a: a - 1.0, g)
    total, _ = jax.lax.scan(lambda t, row: (t + row, None), jnp.zeros(3), c)
    return (c * s + total).astype(x.dtype), s


@pytest.mark.parametrize("dtype", DTYPES)
def test_bind_of_each_equation_reproduces_the_jitted_function(dtype):
    x = jnp.linspace(-2.0, 2.0, 8, dtype=jnp.float32).reshape(2, 4).astype(dtype)
    closed = jax.make_jaxpr(f)(x)
    assert isinstance(closed, jex.core.ClosedJaxpr)
    primitives = {eqn.primitive.name for eqn in closed.jaxpr.eqns}
    assert {"dot_general", "reduce_sum", "convert_element_type", "jit", "cond", "scan"} <= (
        primitives
    ), primitives
    # jax's own evaluation of the same jaxpr, one primitive at a time: bit for bit
    exact = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)
    # the jitted function fuses 16-bit elementwise chains, rounding less often
    jitted = jax.jit(f)(x)
    for context in (False, True):
        ours = evaluate(closed, x, context=context)
        assert [o.dtype for o in ours] == [e.dtype for e in jitted]
        assert [o.shape for o in ours] == [e.shape for e in jitted]
        for o, e, j in zip(ours, exact, jitted, strict=True):
            np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(e, np.float32))
            np.testing.assert_allclose(
                np.asarray(o, np.float32), np.asarray(j, np.float32), rtol=TOLERANCE[dtype]
            )


def test_open_jaxpr_takes_a_closed_or_an_open_jaxpr():
    closed = jax.make_jaxpr(lambda x: x * jnp.arange(3.0))(jnp.ones(3))
    jaxpr, consts = open_jaxpr(closed)
    assert jaxpr is closed.jaxpr and list(consts) == list(closed.consts)
    again, none = open_jaxpr(jaxpr)
    assert again is jaxpr and tuple(none) == ()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bind_takes_the_params_it_is_given(dtype):
    x = jnp.ones((2, 4), dtype)
    target = jnp.float16 if dtype != jnp.float16 else jnp.float32
    closed = jax.make_jaxpr(lambda x: (x @ W.astype(dtype)).astype(target))(x)
    convert = closed.jaxpr.eqns[-1]  # the cast of the matmul's result
    assert convert.primitive.name == "convert_element_type", closed
    h = jnp.ones((2, 3), dtype)
    (out,) = bind(convert, [h])
    assert out.dtype == target
    (same,) = bind(convert, [h], {**convert.params, "new_dtype": jnp.dtype(dtype)})
    assert same.dtype == dtype
    sums = jax.make_jaxpr(lambda x: jnp.sum(x, axis=1))(x).jaxpr.eqns
    reduce = next(e for e in sums if e.primitive.name == "reduce_sum")
    (row,) = bind(reduce, [x])
    (col,) = bind(reduce, [x], {**reduce.params, "axes": (0,), "out_sharding": None})
    assert row.shape == (2,) and col.shape == (4,)


def test_eqn_context_keeps_the_name_stack_of_each_equation():
    def g(x):
        with jax.named_scope("layer"):
            y = jnp.exp(x)
        return y * 2.0

    x = jnp.ones(3)
    closed = jax.make_jaxpr(g)(x)
    with_context = jax.make_jaxpr(lambda x: evaluate(closed, x, context=True))(x)
    without = jax.make_jaxpr(lambda x: evaluate(closed, x))(x)
    stack = lambda jaxpr, name: next(
        str(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns if e.primitive.name == name
    )
    assert "layer" in stack(closed, "exp")
    assert "layer" in stack(with_context, "exp")
    assert "layer" not in stack(without, "exp")
    assert "layer" not in stack(with_context, "mul")


def test_the_float32_scope_and_the_backward_pass_are_read_from_the_name_stack():
    def g(x):
        h = jnp.sin(x)
        with jax.named_scope(FLOAT32_SCOPE):
            h = jnp.exp(h)
        return jnp.sum(h * h)

    eqns = jax.make_jaxpr(g)(jnp.ones(3)).jaxpr.eqns
    scoped = {e.primitive.name for e in eqns if in_float32_scope(e)}
    assert scoped == {"exp"}, scoped
    assert not any(in_backward_pass(e) for e in eqns)
    grad_eqns = jax.make_jaxpr(jax.grad(g))(jnp.ones(3)).jaxpr.eqns
    backward = [e for e in grad_eqns if in_backward_pass(e)]
    assert backward and not all(in_backward_pass(e) for e in grad_eqns)
    assert any(in_float32_scope(e) for e in backward)  # exp's derivative, in its scope


def test_varying_axes_reads_a_shard_map_bodys_types():
    """Inside ``shard_map`` a sharded value varies over its mesh axis and a replicated one
    over none; outside, types say nothing."""
    mesh = jax.make_mesh((2,), ("d",))
    seen = {}

    def body(x, w):
        seen["x"], seen["w"] = varying_axes(jax.typeof(x)), varying_axes(jax.typeof(w))
        return x * w.sum()

    sharded = jax.device_put(jnp.ones(4), jax.NamedSharding(mesh, jax.P("d")))
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(jax.P("d"), jax.P()), out_specs=jax.P("d"))
    jax.jit(mapped)(sharded, jnp.ones(3))
    assert seen == {"x": frozenset({"d"}), "w": frozenset()}
    assert not varying_axes(jax.typeof(jnp.ones(2)))


def test_is_backward_name_tells_the_transposed_equations():
    jaxpr = jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))))(W, jnp.ones((2, 4)))
    stacks = {str(e.source_info.name_stack) for e in jaxpr.jaxpr.eqns}
    assert any(is_backward_name(s) for s in stacks) and not is_backward_name("jit(f)/Dense_0")
