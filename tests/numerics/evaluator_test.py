"""Tests for jaxamp/_src/numerics/evaluator.py and shards.py: zero-length scans, shard_maps."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp


def scan_bf16(w, xs):
    c, ys = lax.scan(lambda c, x: (c + x * w, (x * w).astype(jnp.bfloat16)), w, xs)
    return c + jnp.sum(ys + jnp.bfloat16(1.0)).astype(jnp.float32)


def scan_int(w, xs):
    c, ys = lax.scan(lambda c, x: (c + x * w, jnp.int32(1)), w, xs)
    return c + jnp.sum(ys | jnp.int32(2)).astype(jnp.float32)


@pytest.mark.parametrize("loss", [scan_bf16, scan_int], ids=["bfloat16", "int32"])
def test_zero_length_scan_of_non_float32_outputs(loss):
    w, xs = jnp.float32(1.0), jnp.zeros((0,), jnp.float32)
    assert jaxamp.find_nonfinite(loss)(w, xs) is None
    report = jaxamp.range_report(loss)(w, xs)
    assert not report.nonfinite
    assert jaxamp.find_nonfinite(loss)(w, jnp.ones((3,))) is None  # and not empty


def sharded_loss(mesh, axes):
    def loss(w, x):
        def local(w, x):
            with jax.named_scope("layer"):
                h = jnp.log(x @ w)
            return lax.psum(jnp.sum(h), axes)

        spec = P(axes)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=P())(w, x)

    return loss


def mesh_of(n, shape, names):
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


@pytest.mark.parametrize(
    "n,shape,names,axes",
    [(1, (1,), ("d",), "d"), (8, (8,), ("d",), "d"), (4, (2, 2), ("a", "b"), ("a", "b"))],
    ids=["1-device", "8-devices", "2x2"],
)
def test_find_nonfinite_enters_shard_map(n, shape, names, axes):
    mesh = mesh_of(n, shape, names)
    loss = sharded_loss(mesh, axes)
    w = jnp.eye(2)
    x = jnp.ones((8, 2))
    assert jaxamp.find_nonfinite(loss)(w, x) is None
    fault = jaxamp.find_nonfinite(loss)(w, x.at[5, 0].set(0.0))
    assert (fault.phase, fault.layer, fault.primitive) == ("forward", "layer", "log"), fault
    text = pathlib.Path(__file__).read_text().splitlines()
    line = next(i for i, t in enumerate(text, 1) if "h = jnp.log(x @ w)" in t)
    assert (
        fault.source
        == f"tests/numerics/evaluator_test.py:{line} (sharded_loss.<locals>.loss.<locals>.local)"
    )
    # the shards' values, stacked along the mesh's axes: the zero is in shard 5 // (8 / n)
    assert fault.inputs[0].shape == (*shape, 8 // n, 2) and fault.output.infs == 1
    # a fault of the gradient only: d log(u)/du at u = 0 is made in the backward pass
    # when the forward one is harmless (sqrt(0) = 0)

    def sqrt_loss(w, x):
        def local(w, x):
            with jax.named_scope("root"):
                h = jnp.sqrt(x @ w)
            return lax.psum(jnp.sum(h), axes)

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P())(w, x)

    fault = jaxamp.find_nonfinite(sqrt_loss)(w, x.at[5, 0].set(0.0))
    assert (fault.phase, fault.layer) == ("backward", "root"), fault
    # the values and gradient are the program's
    out = jaxamp.range_report(loss)(w, x)
    assert {(r.layer, r.phase) for r in out.layers} >= {("layer", "forward"), ("layer", "backward")}


def test_shard_map_evaluated_per_shard_matches_jax():
    """Collectives across shards (psum, all_gather, ppermute, axis_index) and specs that
    split an array over two mesh axes: numerics_diff's float32 run computes the loss and
    gradient JAX computes."""
    mesh = mesh_of(4, (2, 2), ("a", "b"))

    def loss(w, x):
        def local(w, x):
            i = lax.axis_index("b").astype(jnp.float32)
            h = jnp.tanh(x @ w) * (1.0 + i)
            g = lax.all_gather(h, "a", tiled=True)
            s = lax.ppermute(h, "b", [(0, 1), (1, 0)])
            return lax.psum(jnp.sum(g**2) + jnp.sum(s * h), ("a", "b")), h

        out, h = jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(("a", "b"))), out_specs=(P(), P(("b", "a")))
        )(w, x)
        return out + jnp.sum(h[:2] ** 3)

    w = jax.random.normal(jax.random.key(0), (3, 3))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    value, grad = jax.value_and_grad(loss)(w, x)
    from jaxamp._src.numerics import evaluator, tracing

    traced = tracing.trace(loss, 0, (w, x), {})
    outs, _ = evaluator.run(traced.jaxpr, traced.args, lambda *_: None, traced.primal_outputs)
    np.testing.assert_allclose(outs[0], value, rtol=1e-5)
    np.testing.assert_allclose(outs[1], grad, rtol=1e-5, atol=1e-6)
    seen = []
    evaluator.run(
        traced.jaxpr,
        traced.args,
        lambda site, i, o: seen.append((site.primitive, site.phase)),
        traced.primal_outputs,
    )
    assert ("all_gather", "forward") in seen and ("ppermute", "forward") in seen
    assert "shard_map" not in {p for p, _ in seen}


def test_shard_map_control_flow_per_shard():
    """Inside the body: a scan, a cond every shard takes alike (entered), a cond and a
    while loop whose shards differ (each run whole, per shard)."""
    mesh = mesh_of(4, (4,), ("d",))

    def loss(w, x):
        def local(w, x):
            def step(c, row):
                with jax.named_scope("cell"):
                    c = jnp.tanh(c * w + row)
                return c, c * 2.0

            c, ys = lax.scan(step, jnp.zeros_like(x[0]), x)
            total = lax.psum(jnp.sum(ys), "d")
            alike = lax.cond(total > 0, lambda v: v * 3.0, lambda v: v - 1.0, c)
            i = lax.axis_index("d")
            differ = lax.cond(i % 2 == 0, lambda v: jnp.sin(v), lambda v: jnp.cos(v), c)
            count = jnp.sum(x > 0).astype(jnp.int32) + i  # how far each shard counts
            steps = lax.while_loop(lambda k: k < count, lambda k: k + 1, jnp.int32(0))
            out = jnp.sum(alike * differ) * steps.astype(jnp.float32)
            return lax.psum(out, "d")

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(w, x)

    w = jnp.float32(0.7) * jnp.ones(3)
    x = jax.random.normal(jax.random.key(2), (12, 3))
    value, grad = jax.value_and_grad(loss)(w, x)
    from jaxamp._src.numerics import evaluator, tracing

    traced = tracing.trace(loss, 0, (w, x), {})
    seen = []

    def visit(site, inputs, outputs):
        seen.append((site.primitive, site.layer, site.iteration, site.phase))

    outs, _ = evaluator.run(traced.jaxpr, traced.args, visit, traced.primal_outputs)
    np.testing.assert_allclose(outs[0], value, rtol=1e-5)
    np.testing.assert_allclose(outs[1], grad, rtol=1e-5, atol=1e-6)
    assert ("tanh", "cell", (2,), "forward") in seen  # the scan, iteration by iteration
    assert ("sin", "", (), "forward") not in seen  # the differing cond runs whole
    assert {p for p, *_ in seen} >= {"cond", "while", "mul"}
    assert jaxamp.find_nonfinite(loss)(w, x) is None
