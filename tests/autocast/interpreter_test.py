"""The interpreter behind autocast and apply_policy: what it reads through, what it rebuilds."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from tests.helpers.promotion import FLAX, OPTAX, SUBJECT

SIXTEEN = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _scatters(report):
    return [op for op in report.sensitive if op.primitive == "scatter_add"]


@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_an_embedding_cast_before_its_lookup_gets_a_float32_gradient_sum(dtype):
    """Flax's Embed with ``dtype=`` casts its table, then gathers: the rows are gathered
    from the float32 table instead, and the table's gradient is summed in float32."""

    class Embeds(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Embed(64, 8, dtype=SIXTEEN[dtype])(ids)

    model = jaxamp.linen.apply_policy(Embeds(), f"p=f32,c={dtype},o=f32")
    ids = jnp.zeros((4, 512), jnp.int32)  # one row looked up 2048 times
    params = model.init(jax.random.key(0), ids)["params"]
    grad = jax.grad(lambda p: model.apply({"params": p}, ids).astype(jnp.float32).sum())
    report = jaxamp.precision_report(grad)(params)
    assert {op.dtype for op in _scatters(report)} == {"float32"}
    report.check()
    table_grad = jax.jit(grad)(params)["Embed_0"]["embedding"]
    assert float(table_grad[0, 0]) == 2048.0  # a 16-bit sum stops at 256 (bfloat16)


def test_a_hand_written_lookup_of_a_cast_table_under_autocast():
    def embed(table, ids):
        return table.astype(jnp.bfloat16)[ids].astype(jnp.float32).sum()

    table, ids = jnp.ones((16, 4)), jnp.zeros((4096,), jnp.int32)
    plain = jax.jit(jax.grad(embed))(table, ids)
    ours = jax.jit(jax.grad(jaxamp.autocast(embed)))(table, ids)
    assert float(plain[0, 0]) != 4096.0  # JAX sums the 16-bit cotangents in 16 bits
    assert float(ours[0, 0]) == 4096.0


class Rotary(nn.Module):
    """Attention whose queries and keys the model itself promotes to float32 (rotary
    embeddings applied in float32, as several transformers models do)."""

    @nn.compact
    def __call__(self, x):
        q, k = nn.Dense(8, name="q")(x), nn.Dense(8, name="k")(x)
        angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] / 10.0
        q32, k32 = (t.astype(jnp.float32) * jnp.cos(angle) for t in (q, k))
        weights = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q32, k32), axis=-1)
        return nn.Dense(4, name="out")(jnp.einsum("bts,bsd->btd", weights, x))


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_apply_policy_agrees_with_autocast_on_matmuls_the_model_writes(dtype):
    policy = f"p=f32,c={dtype},o=f32"
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    params = Rotary().init(jax.random.key(0), x)["params"]
    model = jaxamp.linen.apply_policy(Rotary(), policy)
    ours = jaxamp.precision_report(jax.grad(lambda p: model.apply({"params": p}, x).sum()))
    theirs = jaxamp.precision_report(
        jax.grad(jaxamp.autocast(lambda p: Rotary().apply({"params": p}, x).sum(), policy))
    )
    a, b = ours(params), theirs(params)
    assert [op.operand_dtype for op in a.ops] == [op.operand_dtype for op in b.ops]
    assert {op.operand_dtype for op in a.ops} == {dtype}
    a.check(dtype)


@pytest.mark.standard_promotion(SUBJECT)
def test_a_float32_override_keeps_the_matmuls_a_layer_writes_in_float32():
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Rotary(name="head")(nn.Dense(8)(x))

    model = jaxamp.linen.apply_policy(Model(), "mixed_bfloat16", overrides={"head": "float32"})
    params = model.init(jax.random.key(0), x)["params"]
    report = jaxamp.precision_report(lambda p: model.apply({"params": p}, x))(params)
    by_layer = {op.layer: op.operand_dtype for op in report.ops}
    assert by_layer["Model/Dense_0"] == "bfloat16"
    assert {d for layer, d in by_layer.items() if layer.startswith("Model/head")} == {"float32"}
    assert np.isfinite(np.asarray(model.apply({"params": params}, x))).all()


# ------------------------------------------------------- found by review, with their repros


@pytest.mark.standard_promotion(SUBJECT)
def test_a_gradient_taken_inside_of_a_maximum_of_a_cast_value():
    """max must equal one of the 16-bit elements that flow on (its JVP compares them), so it
    reads the 16-bit value, not the float32 one the cast came from."""
    x = jnp.array([1.001, 0.3, -2.0], jnp.float32)  # 1.001 is not a bfloat16 value

    def f(x):
        return jnp.max(x.astype(jnp.bfloat16)).astype(jnp.float32)

    np.testing.assert_array_equal(jax.jit(jaxamp.autocast(jax.grad(f)))(x), jax.grad(f)(x))

    def is_max(x):
        x16 = x.astype(jnp.bfloat16)
        return (x16 == jnp.max(x16)).astype(jnp.float32)

    np.testing.assert_array_equal(jaxamp.autocast(is_max)(x), [1.0, 0.0, 0.0])


@pytest.mark.standard_promotion(SUBJECT)
def test_a_custom_jvp_function_with_an_integer_output():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x), jnp.argmax(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), (jnp.cos(x) * t, np.zeros((), jax.dtypes.float0))

    x = jnp.array([0.1, 0.5, 0.2])
    loss = lambda x: f(x)[0].sum() * f(x)[1]
    expected = jax.grad(loss)(x)
    np.testing.assert_allclose(jax.grad(jaxamp.autocast(loss))(x), expected, rtol=1e-6)
    np.testing.assert_allclose(jaxamp.autocast(jax.grad(loss))(x), expected, rtol=1e-6)


@pytest.mark.standard_promotion(SUBJECT)
def test_a_gradient_taken_inside_keeps_float32_weight_gradients():
    """``jaxamp.autocast(train_step)`` where the step calls ``jax.grad``: the backward GEMMs
    in the traced program keep their float32 result."""
    x = jax.random.normal(jax.random.key(0), (64, 32))
    w = 0.2 * jax.random.normal(jax.random.key(1), (32, 16))
    loss = lambda w: (jnp.tanh(x @ w) ** 2).mean()
    inside = jax.jit(jaxamp.autocast(jax.grad(loss)))(w)
    as_bf16 = inside.astype(jnp.bfloat16).astype(jnp.float32)
    assert not bool(jnp.all(as_bf16 == inside))  # not a bfloat16 value in disguise
    reference = jax.grad(loss)(w)
    assert float(jnp.abs(inside - reference).max() / jnp.abs(reference).max()) < 2e-2
    report = jaxamp.precision_report(jaxamp.autocast(jax.grad(loss)))(w)
    backward = [op for op in report.ops if op.direction == "backward"]
    assert backward and all(op.result_dtype == "float32" for op in backward)
    report.check("bfloat16")


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_export_with_a_symbolic_batch(policy):
    (batch,) = jax.export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((batch, 8), jnp.float32)
    dense = nn.Dense(3)
    variables = dense.init(jax.random.key(0), jnp.ones((2, 8)))
    for apply in (
        jaxamp.linen.apply_policy(nn.Dense(3), policy).apply,
        jaxamp.autocast(dense.apply, policy),
    ):
        exported = jax.export.export(jax.jit(apply))(variables, x)
        out = exported.call(variables, jnp.ones((5, 8)))
        assert out.shape == (5, 3) and out.dtype == jnp.float32


def test_a_float32_override_does_not_name_a_layer():
    x = jnp.ones((2, 8))

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="head")(nn.Dense(8, name="body")(x))

    model = jaxamp.linen.apply_policy(Net(), "mixed_bfloat16", overrides={"head": "float32"})
    params = model.init(jax.random.key(0), x)["params"]
    report = jaxamp.precision_report(lambda p: model.apply({"params": p}, x))(params)
    assert {op.layer for op in report.ops} == {"Net/body", "Net/head"}
    assert report.problems("bfloat16", ignore=["head"]) == []


@pytest.mark.standard_promotion(OPTAX)
def test_a_lookup_in_a_16_bit_activation_runs_in_the_traced_dtype():
    """A loss's ``take_along_axis`` of logits a 16-bit matmul made (under autocast): its
    gradient, a scatter-add, sums in the dtype the program had, float32."""
    import optax

    def loss(w, x, labels):
        logits = x @ w
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    w, x = jnp.ones((8, 5)), jnp.ones((4, 8))
    labels = jnp.array([0, 1, 2, 3])
    report = jaxamp.precision_report(jax.grad(jaxamp.autocast(loss)))(w, x, labels)
    assert _scatters(report) and {op.dtype for op in _scatters(report)} == {"float32"}
    report.check("bfloat16")


def _matmul_dtypes(fn, *args):
    report = jaxamp.precision_report(fn)(*args)
    return sorted({(op.lhs_dtype, op.direction) for op in report.ops})


W, XS = jnp.ones((8, 8)), jnp.ones((4, 8))


def _checkpointed(w, x):
    inner = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
    return jnp.sum(inner(w, x).astype(jnp.float32))


@pytest.mark.parametrize("jax_flag", ["jax_remat3"], indirect=True)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_checkpoint_is_entered_under_remat3(jax_flag, dtype):
    """Under jax_remat3 autocast passed the checkpoint through: its matmuls stayed
    float32 under mixed_bfloat16, and nothing warned."""
    assert "call_hi_primitive" in str(jax.make_jaxpr(_checkpointed)(W, XS))
    policy = "mixed_bfloat16" if dtype == jnp.bfloat16 else "mixed_float16"
    name = np.dtype(dtype).name
    fwd = jax.jit(jaxamp.autocast(_checkpointed, policy))
    assert _matmul_dtypes(fwd, W, XS) == [(name, "forward")]
    assert {d for d, _ in _matmul_dtypes(jax.grad(fwd), W, XS)} == {name}
    np.testing.assert_allclose(fwd(W, XS), _checkpointed(W, XS), rtol=1e-2)


@jax.custom_vjp
def _matmul_with_own_vjp(x, w):
    return x @ w


_matmul_with_own_vjp.defvjp(
    lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g)
)


def test_a_custom_vjp_forward_is_entered_and_its_backward_runs_as_written():
    """A jax.custom_vjp function was passed through whole: its forward matmul stayed
    float32 under mixed_bfloat16. (Under jax_custom_vjp3 it is a "hi" primitive,
    ``CustomVJPTraced``, entered the same way.)"""
    loss = lambda w, x: jnp.sum(_matmul_with_own_vjp(x, w).astype(jnp.float32))
    fwd = jaxamp.autocast(loss, "mixed_bfloat16")
    assert _matmul_dtypes(fwd, W, XS) == [("bfloat16", "forward")]
    # the backward rule is the user's, in the dtypes it was written for
    assert {d for d, _ in _matmul_dtypes(jax.grad(fwd), W, XS) if _ == "backward"} == {"float32"}
    np.testing.assert_allclose(jax.grad(fwd)(W, XS), jax.grad(loss)(W, XS), rtol=1e-2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _scaled_matmul_with_own_vjp(x, w, scale):
    return (x @ w) * scale


_scaled_matmul_with_own_vjp.defvjp(
    lambda x, w, scale: ((x @ w) * scale, (x, w)),
    lambda scale, res, g: (g @ res[1].T * scale, res[0].T @ g * scale),
)


@pytest.mark.xfail(
    bool(getattr(jax.config, "jax_custom_vjp3", False))
    and not bool(getattr(jax.config, "jax_remat3", False)),
    reason="under jax_custom_vjp3 without jax_remat3, JAX cannot differentiate a custom_vjp "
    "with nondiff_argnums inside jax.checkpoint (plain jax.grad(jax.checkpoint(loss)) fails "
    "the same way: safe_zip lengths), and autocast's residuals are a checkpoint",
    raises=ValueError,
    strict=True,
)
def test_a_custom_vjp_with_static_arguments_is_entered():
    """``nondiff_argnums`` (static under jax_custom_vjp3): the forward matmul runs in
    bfloat16 and the gradient matches the function alone's."""
    loss = lambda w, x: jnp.sum(_scaled_matmul_with_own_vjp(x, w, 0.5).astype(jnp.float32))
    fwd = jaxamp.autocast(loss, "mixed_bfloat16")
    assert _matmul_dtypes(fwd, W, XS) == [("bfloat16", "forward")]
    got = jax.jit(jax.grad(fwd))(W, XS)
    np.testing.assert_allclose(got, jax.grad(loss)(W, XS), rtol=1e-2)


def test_a_higher_order_primitive_it_does_not_enter_is_refused_by_name():
    """lax.custom_linear_solve holds programs of its own (the matvec and the solve): it
    was passed through with every matmul inside in its traced dtype; now refused."""

    def solve(w, b):
        matvec = lambda v: w @ v
        return lax.custom_linear_solve(matvec, b, lambda mv, b: b / jnp.diag(w))

    with pytest.raises(NotImplementedError, match="higher-order primitive 'custom_linear_solve'"):
        jaxamp.autocast(solve, "mixed_bfloat16")(W + jnp.eye(8), XS[0])


class _Gated(nn.Module):
    """A learnable gate the model casts to its activations' dtype (Flax's idiom)."""

    shape: tuple

    @nn.compact
    def __call__(self, x):
        gate = self.param("gate", nn.initializers.constant(0.7), self.shape)
        y = nn.Dense(16)(x)
        return y * gate.astype(y.dtype)


@pytest.mark.parametrize("dtype", list(SIXTEEN))
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_a_gate_of_any_rank_gets_its_gradient_summed_in_float32(dtype, shape):
    """A 16-bit rank-0 operand of an elementwise product is broadcast over 8192 x 16
    values; the transpose sums them, which must happen in float32 as for shape (1,)."""
    x = jax.random.normal(jax.random.key(0), (8192, 8))
    model = _Gated(shape)
    variables = model.init(jax.random.key(1), x)
    mixed = jaxamp.linen.apply_policy(model, f"p=f32,c={dtype},o=f32")

    def loss(module):
        return lambda v: module.apply(v, x).astype(jnp.float32).mean()

    jaxamp.precision_report(jax.grad(loss(mixed)))(variables).check()
    ours = jax.jit(jax.grad(loss(mixed)))(variables)["params"]["gate"]
    reference = jax.jit(jax.grad(loss(model)))(variables)["params"]["gate"]
    # The gradient is the mean of the Dense's outputs. The 16-bit Dense rounds each
    # of them (its inputs and its result: a few ulps); summed in float32 the error stays
    # within that of the mean of their magnitudes. A 16-bit sum of 8192 terms is off by
    # far more (bfloat16: 0.04 of the gradient).
    y = jax.jit(lambda v: model.apply(v, x, capture_intermediates=True))(variables)
    magnitude = float(jnp.mean(jnp.abs(y[1]["intermediates"]["Dense_0"]["__call__"][0])))
    eps = float(jnp.finfo(SIXTEEN[dtype]).eps)
    assert float(jnp.max(jnp.abs(ours - reference))) <= 4 * eps * magnitude


class _Gathered(nn.Module):
    """A gather from a layer's output, with indices that repeat (BigBird's random blocks)."""

    @nn.compact
    def __call__(self, x, idx):
        return jnp.take(nn.Dense(4)(x), idx, axis=1)


@pytest.mark.parametrize("path", ["apply_policy", "autocast"])
@pytest.mark.parametrize("dtype", list(SIXTEEN))
def test_a_gather_from_a_16_bit_activation_sums_its_gradient_in_float32(dtype, path):
    """Each of the Dense's 4 outputs is gathered ~1024 times; the gradient sums the copies.
    Under apply_policy the Dense's output is traced in 16 bits and the sum ran in 16 bits
    (bfloat16: 0.19 off a bias gradient of 0.25); it runs in float32 as under autocast."""
    x = jax.random.normal(jax.random.key(0), (8, 8))
    idx = jax.random.randint(jax.random.key(2), (4096,), 0, 4)
    model = _Gathered()
    variables = model.init(jax.random.key(1), x, idx)
    policy = f"p=f32,c={dtype},o=f32"
    loss = lambda module: lambda v: module.apply(v, x, idx).astype(jnp.float32).mean()
    if path == "apply_policy":
        mixed = loss(jaxamp.linen.apply_policy(model, policy))
    else:
        mixed = jaxamp.autocast(loss(model), policy)
    jaxamp.precision_report(jax.grad(mixed))(variables).check()
    ours = jax.jit(jax.grad(mixed))(variables)["params"]["Dense_0"]["bias"]
    reference = jax.jit(jax.grad(loss(model)))(variables)["params"]["Dense_0"]["bias"]
    eps = float(jnp.finfo(SIXTEEN[dtype]).eps)  # the summed cotangent is rounded once
    np.testing.assert_allclose(ours, reference, rtol=eps, atol=0)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_custom_vjp_function_of_a_16_bit_value_runs_as_the_function_alone(policy):
    """A custom_vjp function whose input the rules made 16-bit (a matmul's output), its
    body multiplying by a Python float: bound with the 16-bit value, its float32 primal
    failed (lax.mul: bfloat16 and float32). Value and gradients against the function
    alone in float32."""

    @jax.custom_vjp
    def scale(x):
        return x * 2.0

    scale.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))

    def f(x, w):
        return jnp.sum(jnp.tanh(scale(x @ w)))

    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jax.random.normal(jax.random.key(1), (8, 8)) / 4
    want = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    got = jax.jit(jax.value_and_grad(jaxamp.autocast(f, policy), argnums=(0, 1)))(x, w)
    assert got[0].dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in got[1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0.05, atol=0.05)
