"""Edge cases of the numerics tools (find_nonfinite, range_report, numerics_diff): a
float32 mask fill, nested NNX modules, zero-length scans of 16-bit and integer outputs,
and ``shard_map`` inside the loss."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxamp

# --- RangeReport.overflows and a float32 -inf mask ------------------------------------------


def masked_attention(w, x, mask):
    with jax.named_scope("attn"):
        s = jnp.where(mask, x @ w, -jnp.inf)  # float32's -inf, meant: every row keeps some
        p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(p * 2.0)


MASK = jnp.array([[1, 1, 0], [1, 0, 1]], bool)


def test_report_overflows_leaves_out_a_float32_mask_fill_as_its_rows_do():
    w, x = jnp.eye(3), jnp.ones((2, 3))
    assert jaxamp.find_nonfinite(masked_attention)(w, x, MASK) is None
    report = jaxamp.range_report(masked_attention)(w, x, MASK)
    attn = next(r for r in report.layers if (r.layer, r.phase) == ("attn", "forward"))
    assert attn.nonfinite == attn.nonfinite_float32 > 0  # the fill, made in float32
    assert not attn.overflows("float16")
    assert report.overflows("float16") == [] and report.overflows("bfloat16") == []
    assert report.recommend().dtype == "float16"
    # the rows' own rule, for every dtype
    for dtype in ("float16", "bfloat16"):
        assert report.overflows(dtype) == [r for r in report.layers if r.overflows(dtype)]


def test_report_overflows_still_lists_a_float16_overflow():
    def loss(w):
        with jax.named_scope("big"):
            return jnp.sum((w * 1e5).astype(jnp.float16).astype(jnp.float32))

    report = jaxamp.range_report(loss)(jnp.ones(3))
    assert ("big", "forward") in [(r.layer, r.phase) for r in report.overflows("float16")]
    for dtype in ("float16", "bfloat16"):  # infs made in float16: neither type holds them
        assert report.overflows(dtype) == [r for r in report.layers if r.overflows(dtype)]


# --- nested NNX modules: one name per layer -------------------------------------------------


class Inner(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
        return jnp.log(self.fc(x))


class Outer(nnx.Module):
    def __init__(self, rngs):
        self.enc = Inner(rngs)

    def __call__(self, x):
        return self.enc(x)


class Block(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(4, 4, rngs=rngs)
        self.ln = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.ln(self.fc(x))


class Stage(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs), Block(rngs)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Deep(nnx.Module):  # three levels: Deep/stage/blocks/<i>/fc
    def __init__(self, rngs):
        self.stage = Stage(rngs)
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.head(self.stage(x))


def outer_with_a_log_fault():
    model = Outer(nnx.Rngs(0))
    model.enc.fc.kernel.set_value(-jnp.eye(2))
    model.enc.fc.bias.set_value(jnp.zeros(2))
    return model


def deep_loss(model, x):
    return jnp.mean(model(x) ** 2)


X4 = jax.random.normal(jax.random.key(1), (8, 4))
DEEP_LAYERS = {
    "Deep/head",
    *(f"Deep/stage/blocks/{i}/{name}" for i in range(2) for name in ("fc", "ln")),
}


def test_nested_nnx_layers_are_named_once_by_range_report():
    rr = jaxamp.range_report(lambda m, x: jnp.sum(m(x) ** 2))(
        outer_with_a_log_fault(), jnp.ones((1, 2))
    )
    assert {r.layer for r in rr.layers} - {""} == {"Outer/enc", "Outer/enc/fc"}, rr.layers
    report = jaxamp.range_report(deep_loss)(Deep(nnx.Rngs(0)), X4)
    named = {r.layer for r in report.layers} - {""}
    assert named >= DEEP_LAYERS and all(n.count("Deep") == 1 for n in named), named
    for layer in DEEP_LAYERS:
        assert {r.phase for r in report.layers if r.layer == layer} == {"forward", "backward"}


def test_nested_nnx_fault_is_named_once_by_find_nonfinite():
    model = outer_with_a_log_fault()
    fault = jaxamp.find_nonfinite(lambda m, x: jnp.sum(m(x)))(model, jnp.ones((1, 2)))
    assert (fault.phase, fault.layer, fault.primitive) == ("forward", "Outer/enc", "log")

    deep = Deep(nnx.Rngs(0))
    deep.stage.blocks[1].fc.kernel.set_value(jnp.full((4, 4), 1e30))  # LayerNorm squares 4e30
    fault = jaxamp.find_nonfinite(deep_loss)(deep, X4)
    assert fault.layer == "Deep/stage/blocks/1/ln", fault
    assert fault.primitive == "square" and fault.phase == "forward"


@pytest.mark.parametrize("policy", [None, "mixed_bfloat16"])
def test_nested_nnx_numerics_diff_has_one_row_per_layer(policy):
    model = Deep(nnx.Rngs(0))
    if policy is not None:  # a policy applied to the model: its call is evaluated again
        jaxamp.nnx.apply_policy(model, policy)
        diff = jaxamp.numerics_diff(deep_loss, policy="float32")(model, X4)
    else:
        diff = jaxamp.numerics_diff(deep_loss, policy="mixed_bfloat16")(model, X4)
    rows = {}
    for r in diff.layers:
        rows.setdefault(r.layer, set()).add(r.phase)
    assert set(rows) >= DEEP_LAYERS, rows
    for layer in DEEP_LAYERS:
        assert rows[layer] == {"forward", "backward"}, (layer, rows)
    assert all(n.count("Deep") <= 1 for n in rows), rows
    table = diff.table()
    assert "Deep/stage/blocks/0/fc " in table and "Deep/stage/Deep" not in table


def test_nested_nnx_two_levels_numerics_diff():
    model = Outer(nnx.Rngs(0))
    model.enc.fc.kernel.set_value(jnp.eye(2) + 0.1)
    model.enc.fc.bias.set_value(jnp.ones(2))
    diff = jaxamp.numerics_diff(lambda m, x: jnp.sum(m(x)), policy="mixed_bfloat16")(
        model, jnp.ones((3, 2))
    )
    rows = {}
    for r in diff.layers:
        rows.setdefault(r.layer, set()).add(r.phase)
    assert rows["Outer/enc/fc"] == {"forward", "backward"}, rows
    assert all(n.count("Outer") <= 1 for n in rows), rows


def test_a_module_called_outside_its_parent_keeps_its_path():
    """``Outer.__call__`` reaching past ``enc`` to ``enc.fc``, and a loss calling a
    submodule directly: each named by its own path."""

    class Reach(nnx.Module):
        def __init__(self, rngs):
            self.enc = Inner(rngs)

        def __call__(self, x):
            return self.enc.fc(x)

    model = Reach(nnx.Rngs(0))
    report = jaxamp.range_report(lambda m, x: jnp.sum(m(x) ** 2 + m.enc(x)))(
        model, jnp.ones((1, 2))
    )
    named = {r.layer for r in report.layers} - {""}
    assert named == {"Reach/enc", "Reach/enc/fc"}, named


# --- a zero-length scan whose stacked outputs are not float32 -------------------------------


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


# --- shard_map inside the loss --------------------------------------------------------------


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
        == f"tests/numerics/edges_test.py:{line} (sharded_loss.<locals>.loss.<locals>.local)"
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
