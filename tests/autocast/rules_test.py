"""The rule table against PyTorch's autocast op lists: what runs in float32, what promotes.

Each case is a value that 16-bit arithmetic gets wrong, checked through ``jax.jit`` under
``autocast`` (a float32 model) and ``apply_policy`` (a model whose layers emit 16 bits).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp
from jaxamp._src.jaxprs import equations as _equations
from tests.helpers.promotion import FLAX, SUBJECT

F16, BF16 = jnp.float16, jnp.bfloat16


def _autocast(fun, dtype):
    """``fun`` on a 16-bit value under autocast, its result read in float32."""
    policy = f"p=f32,c={np.dtype(dtype).name},o=f32"
    return jax.jit(jaxamp.autocast(lambda x: fun(x.astype(dtype)).astype(jnp.float32), policy))


class _Apply(nn.Module):
    fun: object

    @nn.compact
    def __call__(self, x):
        return self.fun(x).astype(jnp.float32)


def _apply_policy(fun, dtype):
    """``fun`` inside a Linen model under a policy: its input arrives in ``dtype``."""
    model = jaxamp.linen.apply_policy(_Apply(fun), f"p=f32,c={np.dtype(dtype).name},o=f32")
    return jax.jit(lambda x: model.apply({}, x))


def _plain(fun, dtype):
    return jax.jit(lambda x: fun(x.astype(dtype)).astype(jnp.float32))


RUNS = {"autocast": _autocast, "apply_policy": _apply_policy}

# (function, input, its exact value, the 16-bit dtype that gets it wrong)
CASES = {
    # a square written out: 300**2 overflows float16 (PyTorch: norm, normalize, dist)
    "norm": (jnp.linalg.norm, jnp.full((16,), 300.0), 1200.0, F16),
    "distance": (lambda x: jnp.linalg.norm(x - 1.0), jnp.full((4,), 301.0), 600.0, F16),
    "normalize": (
        lambda x: (x / jnp.linalg.norm(x, axis=-1, keepdims=True))[0],
        jnp.full((4,), 300.0),
        0.5,
        F16,
    ),
    # a constant divided by a tensor (PyTorch's rdiv): 1 / 2**-16 overflows float16
    "reciprocal": (lambda x: (1.0 / x)[0], jnp.full((2,), 2.0**-16), 65536.0, F16),
    # 16-bit sums: PyTorch's sum and cumsum, and its pooling in float32
    "avg_pool": (
        lambda x: nn.avg_pool(x, (16, 16)).reshape(()),
        jnp.full((1, 16, 16, 1), 1.015625),
        1.015625,
        BF16,
    ),
    "segment_sum": (
        lambda x: jax.ops.segment_sum(x, jnp.zeros(x.shape, jnp.int32), 1)[0],
        jnp.full((4096,), 1 + 2**-7),
        4096 * (1 + 2**-7),
        BF16,
    ),
}


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("case", CASES)
def test_float32_ops_are_exact_where_16_bits_are_not(case, run):
    fun, x, exact, dtype = CASES[case]
    assert float(_plain(fun, dtype)(x)) != pytest.approx(exact, rel=1e-4)  # 16 bits fail
    assert float(RUNS[run](fun, dtype)(x)) == pytest.approx(exact, rel=1e-6)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_cumsum_runs_in_float32(dtype, run):
    """XLA:CPU computes a 16-bit cumsum in float32 itself (so no value fails here); other
    backends need not, so the program asks for float32."""
    fun = RUNS[run](lambda x: jax.lax.cumsum(x)[-1], dtype)
    assert _dtypes_of(fun, jnp.ones(8), "cumsum") == {"float32"}
    x = jnp.full((4096,), 1 + 2**-7)
    assert float(fun(x)) == 4128.0


def _dtypes_of(fun, x, primitive):
    eqns = [e for e in _equations(jax.make_jaxpr(fun)(x), hi=True) if e.primitive.name == primitive]
    assert eqns, primitive
    return {str(v.aval.dtype) for e in eqns for v in (*e.invars, *e.outvars)}


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_division_and_products_of_two_tensors_stay_in_their_dtype(dtype):
    """Only the forms PyTorch lists run in float32: ``x / 2`` and ``x * y`` do not."""
    name = np.dtype(dtype).name
    assert _dtypes_of(_autocast(lambda x: x / 2.0, dtype), jnp.ones(4), "div") == {name}
    assert _dtypes_of(_autocast(lambda x: x * (x + 1), dtype), jnp.ones(4), "mul") == {name}
    assert _dtypes_of(_autocast(lambda x: 1.0 / x, dtype), jnp.ones(4), "div") == {"float32"}


def test_psum_of_16_bit_values_sums_in_float32():
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    x = jnp.ones(8).at[0].set(256.0)  # 256 + 7 ones: bfloat16 holds 256 + 1 as 256

    def total(x):
        s = jax.lax.psum(x.astype(BF16), "d")
        return s.astype(jnp.float32)

    mapped = jax.shard_map(total, mesh=mesh, in_specs=P("d"), out_specs=P())
    assert float(jax.jit(mapped)(x)[0]) != 263.0
    assert float(jax.jit(jaxamp.autocast(mapped, "mixed_bfloat16"))(x)[0]) == 263.0


def test_vector_dot_promotes_to_the_widest_operand():
    def fun(w, x):
        h = x @ w  # a 16-bit activation under the rule
        return jnp.dot(h[0], w[0])  # a vector dot of a 16-bit and a float32 vector

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    dots = [e for e in _equations(jax.make_jaxpr(jaxamp.autocast(fun))(w, x), hi=True)]
    vector = [e for e in dots if e.primitive.name == "dot_general"]
    assert vector and {str(v.aval.dtype) for v in vector[0].invars} == {"float32"}


def test_outer_products_are_not_rounded_to_16_bits():
    """Rotary embeddings' ``positions x frequencies`` (an einsum that only multiplies)."""

    def angles(positions, frequencies):
        return jnp.einsum("i,j->ij", positions, frequencies)

    positions, frequencies = jnp.arange(2048.0), 1.0 / 10000 ** (jnp.arange(0, 64, 2) / 64)
    ours = jax.jit(jaxamp.autocast(angles))(positions, frequencies)
    np.testing.assert_array_equal(ours, angles(positions, frequencies))


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("fun", [jax.nn.softplus, jax.nn.mish, lambda x: jnp.logaddexp(x, -x)])
def test_custom_jvp_functions_compute_in_float32_inside(fun):
    """softplus, mish and logaddexp are ``jax.custom_jvp`` functions: their exp and log1p
    run in float32 under a policy too, and their gradients stay right."""
    model = jaxamp.linen.apply_policy(_Apply(fun), "mixed_bfloat16")
    x = jnp.linspace(-4.0, 4.0, 16)
    report = jaxamp.precision_report(jax.grad(lambda x: model.apply({}, x).sum()))(x)
    found = {(op.primitive, op.dtype) for op in report.sensitive}
    assert ("exp", "float32") in found and ("log1p", "float32") in found, found
    report.check()
    grad = jax.jit(jax.grad(lambda x: model.apply({}, x).sum()))(x)
    expected = jax.grad(lambda x: fun(x).sum())(x)
    np.testing.assert_allclose(grad, expected, atol=2e-2)


def test_relu_lets_a_16_bit_value_through_without_a_cast():
    def fun(w, x):
        return jax.nn.relu(x @ w) @ w

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    report = jaxamp.precision_report(jaxamp.autocast(fun))(w, x)
    plain = jaxamp.precision_report(jaxamp.autocast(lambda w, x: jnp.maximum(x @ w, 0) @ w))(w, x)
    assert report.converts == plain.converts


@pytest.mark.parametrize("field", ["compute", "float32", "promote"])
def test_a_misspelt_primitive_name_is_refused_with_the_close_ones(field):
    rules = jaxamp.AUTOCAST_RULES
    with pytest.raises(ValueError, match=r"'tanhh'.*Valid choices: 'tanh'"):
        dataclasses.replace(rules, **{field: getattr(rules, field) | {"tanhh"}})
    with pytest.raises(ValueError, match="No primitive has a close name"):
        dataclasses.replace(rules, **{field: getattr(rules, field) | {"zzqqxx"}})


def test_known_names_and_primitives_of_ones_own_are_taken():
    """A name JAX defines (``jax.lax.tanh_p``'s), and a primitive object of the caller's
    own whose name JAX does not know."""
    own = jex.core.Primitive("my_own_op")
    rules = dataclasses.replace(
        jaxamp.AUTOCAST_RULES, float32=jaxamp.AUTOCAST_RULES.float32 | {"tanh", own}
    )
    assert rules.rule_for("tanh") == rules.rule_for("my_own_op") == "float32"


@jax.custom_jvp
def _centred_softmax(x):
    e = jnp.exp(x - jnp.max(x, -1, keepdims=True))
    return e / jnp.sum(e, -1, keepdims=True)


@_centred_softmax.defjvp
def _centred_softmax_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    y = _centred_softmax(x)
    return y, y * (t - jnp.sum(y * t, -1, keepdims=True))  # softmax's own rule


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("fun", ["own_rule", "jax_softmax_custom_jvp"])
def test_a_custom_jvp_rule_sums_its_tangents_in_float32(fun, dtype):
    """A JVP rule that sums its tangent (softmax's, which jax.nn.softmax uses under the
    next JAX's jax_softmax_custom_jvp) gets its 16-bit tangents in float32: no sum of
    the backward pass runs in 16 bits. Reference: the gradient of the float32 function."""
    if fun == "jax_softmax_custom_jvp" and not hasattr(jax.config, fun):
        pytest.skip(f"this jax has no {fun}")
    softmax = _centred_softmax if fun == "own_rule" else jax.nn.softmax
    loss = lambda x: jnp.sum(softmax(x) ** 2 * jnp.arange(16.0))
    x = jax.random.normal(jax.random.key(0), (4, 16)) * 3
    previous = getattr(jax.config, "jax_softmax_custom_jvp", False)
    if fun != "own_rule":
        jax.config.update(fun, True)
    try:
        grad = jax.grad(jaxamp.autocast(loss))
        jaxamp.precision_report(grad)(x.astype(dtype)).check()
        got = jax.jit(grad)(x.astype(dtype))
    finally:
        if fun != "own_rule":
            jax.config.update(fun, previous)
    want = jax.grad(loss)(x.astype(dtype).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.05, atol=0.05)


def test_a_primitive_of_a_jax_module_not_yet_imported_is_taken():
    """``bcoo_dot_general`` (``jax.experimental.sparse``) and ``pallas_call`` are JAX's
    primitives though ``import jax`` does not define them: taken in a fresh process that
    never imported their modules."""
    code = (
        "import dataclasses, sys, jaxamp\n"
        "assert 'jax.experimental.sparse' not in sys.modules\n"
        "r = jaxamp.AUTOCAST_RULES\n"
        "for name in ('bcoo_dot_general', 'pallas_call'):\n"
        "    rules = dataclasses.replace(r, float32=r.float32 | {name})\n"
        "    assert rules.rule_for(name) == 'float32'\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
