"""JAX's transformations through policy and autocast models: forward mode, second order,
explicit sharding. Values are compared with the float32 model's."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxamp
from tests.helpers.promotion import FLAX

POLICIES = ["mixed_bfloat16", "mixed_float16", "float32"]
# Relative error of 16-bit compute against float32, for these small models.
TOLERANCE = {"mixed_bfloat16": 5e-2, "mixed_float16": 1e-2, "float32": 1e-5}


class Block(nn.Module):
    """Dense, LayerNorm, GELU, a 1-D convolution, softmax attention weights: the parts the
    rule and the interpreter touch (matmul, convolution, bias broadcast, float32 sums)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16)(x)
        h = nn.gelu(nn.LayerNorm()(h), approximate=False)
        h = nn.Conv(16, (3,))(h)
        weights = jax.nn.softmax(jnp.einsum("btd,bsd->bts", h, h) / 4.0, axis=-1)
        return nn.Dense(4)(jnp.einsum("bts,bsd->btd", weights, h))


X = jax.random.normal(jax.random.key(1), (2, 6, 8))


def _linen(policy):
    model = jaxamp.linen.apply_policy(Block(), policy)
    params = jax.jit(model.init)(jax.random.key(0), X)["params"]
    return lambda p, x: model.apply({"params": p}, x).astype(jnp.float32), params


def _autocast(policy):
    params = Block().init(jax.random.key(0), X)["params"]
    f = jaxamp.autocast(lambda p, x: Block().apply({"params": p}, x), policy)
    return lambda p, x: f(p, x).astype(jnp.float32), params


def _reference():
    params = Block().init(jax.random.key(0), X)["params"]
    return lambda p, x: Block().apply({"params": p}, x), params


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _leaves_close(ours, theirs, tolerance):
    pairs = list(zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True))
    assert pairs
    for a, b in pairs:
        assert a.shape == b.shape
        assert _rel(a, b) < tolerance, (_rel(a, b), a.shape)


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("build", [_linen, _autocast], ids=["apply_policy", "autocast"])
@pytest.mark.parametrize("policy", POLICIES)
def test_jvp_and_jacfwd(build, policy):
    f, params = build(policy)
    ref, ref_params = _reference()
    tangent = jax.tree.map(lambda p: 0.1 * jnp.ones_like(p), params)

    def push(f, params):
        return jax.jvp(lambda p: f(p, X), (params,), (tangent,))

    push = jax.jit(push, static_argnums=0)
    (y, dy), (y_ref, dy_ref) = push(f, params), push(ref, ref_params)
    _leaves_close((y, dy), (y_ref, dy_ref), TOLERANCE[policy])
    dx = jax.jit(jax.jacfwd(lambda x: f(params, x)[:, -1].sum()))(X)
    dx_ref = jax.jit(jax.jacfwd(lambda x: ref(ref_params, x)[:, -1].sum()))(X)
    _leaves_close(dx, dx_ref, 2 * TOLERANCE[policy])


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("build", [_linen, _autocast], ids=["apply_policy", "autocast"])
@pytest.mark.parametrize("policy", POLICIES)
def test_hessian_vector_product_and_hessian(build, policy):
    f, params = build(policy)
    ref, ref_params = _reference()
    v = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)

    def hvp(f, params):
        grad = jax.grad(lambda p: jnp.mean(f(p, X) ** 2))
        return jax.jvp(grad, (params,), (v,))[1]

    hvp = jax.jit(hvp, static_argnums=0)
    _leaves_close(hvp(f, params), hvp(ref, ref_params), 4 * TOLERANCE[policy])

    def head(f):  # the loss as a function of the last kernel alone
        def loss(kernel):
            layer = {**params["Dense_1"], "kernel": kernel}
            return jnp.mean(f({**params, "Dense_1": layer}, X) ** 2)

        return loss

    kernel = params["Dense_1"]["kernel"]
    hessian = jax.jit(jax.hessian(head(f)))(kernel)
    assert hessian.shape == kernel.shape * 2
    reference = jax.jit(jax.hessian(head(lambda p, x: ref(p, x))))(kernel)
    _leaves_close(hessian, reference, 4 * TOLERANCE[policy])


@pytest.mark.standard_promotion(FLAX)
def test_the_compiled_backward_keeps_the_rule_after_the_change_to_a_primitive():
    """16-bit operands, float32 results and float32 weight gradients, in the backward pass."""
    f, params = _linen("mixed_bfloat16")
    grad = jax.grad(lambda p: jnp.mean(f(p, X) ** 2))
    report = jaxamp.precision_report(grad)(params)
    backward = [op for op in report.ops if op.direction == "backward"]
    assert len(backward) >= 8
    for op in report.ops:
        assert (op.lhs_dtype, op.rhs_dtype, op.accumulation_dtype) == (
            "bfloat16",
            "bfloat16",
            "float32",
        ), op
    assert {g.dtype for g in jax.tree.leaves(jax.jit(grad)(params))} == {jnp.dtype(jnp.float32)}


@pytest.mark.standard_promotion(FLAX)
def test_nnx_model_forward_mode():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 16, rngs=rngs)
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.gelu(self.norm(self.dense(x))))

    reference = Model(nnx.Rngs(0))
    model = jaxamp.nnx.apply_policy(Model(nnx.Rngs(0)), "mixed_bfloat16")
    graphdef, state = nnx.split(model)
    ref_graphdef, ref_state = nnx.split(reference)
    run = lambda g: lambda s, x: nnx.merge(g, s)(x).astype(jnp.float32)
    dx = jax.jit(jax.jacfwd(lambda x: run(graphdef)(state, x).sum()))(X)
    dx_ref = jax.jit(jax.jacfwd(lambda x: run(ref_graphdef)(ref_state, x).sum()))(X)
    _leaves_close(dx, dx_ref, 5e-2)


# ------------------------------------------------------------------- explicit sharding


def _explicit_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_data_parallel_step_on_an_explicit_mesh(policy):
    mesh = _explicit_mesh()
    x = jnp.tile(X, (4, 1, 1))  # batch 8, one example a device
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        f, params = _linen(policy)
        grads = jax.jit(jax.grad(lambda p, x: jnp.mean(f(p, x) ** 2)))(params, xs)
    for g in jax.tree.leaves(grads):
        assert g.dtype == jnp.float32 and all(s is None for s in g.sharding.spec)
    expected = jax.jit(jax.grad(lambda p, x: jnp.mean(f(p, x) ** 2)))(params, x)
    _leaves_close(grads, expected, 1e-2)


def test_out_sharding_is_kept_on_an_explicit_mesh():
    mesh = _explicit_mesh()

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 16, rngs=rngs)
            self.b = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            h = self.a(x, out_sharding=P("data", None, None))
            return self.b(jax.nn.relu(h), out_sharding=P("data", None, None))

    x = jnp.tile(X, (4, 1, 1))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        model = jaxamp.nnx.apply_policy(Model(nnx.Rngs(0)), "mixed_bfloat16")
        loss = lambda m, x: jnp.mean(m(x).astype(jnp.float32) ** 2)
        y = nnx.jit(lambda m, x: m(x))(model, xs)
        grads = nnx.jit(nnx.grad(loss))(model, xs)
        reference = nnx.jit(nnx.grad(loss))(Model(nnx.Rngs(0)), xs)
    assert y.sharding.spec == P("data", None, None) and y.dtype == jnp.float32
    leaves = jax.tree.leaves(nnx.state(grads))
    assert leaves and all(g.dtype == jnp.float32 for g in leaves)
    _leaves_close(nnx.state(grads), nnx.state(reference), 5e-2)


@pytest.mark.standard_promotion(FLAX)
def test_fsdp_step_on_an_explicit_mesh():
    """Params sharded over the mesh (gathered for the matmuls), batch sharded."""
    mesh = _explicit_mesh()
    f, params = _linen("mixed_bfloat16")
    x = jnp.tile(X, (4, 1, 1))

    def shard(p):
        spec = P("data") if p.shape[0] % 8 == 0 else P()
        return jax.device_put(p, NamedSharding(mesh, spec))

    def loss(p, x):
        p = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), p)
        return jnp.mean(f(p, x) ** 2)

    with jax.set_mesh(mesh):
        sharded = jax.tree.map(shard, params)
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        grads = jax.jit(jax.grad(loss))(sharded, xs)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(sharded), strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, g.ndim) and g.dtype == jnp.float32
    expected = jax.jit(jax.grad(lambda p, x: jnp.mean(f(p, x) ** 2)))(params, x)
    _leaves_close(grads, expected, 1e-2)
