"""Tests for jaxamp/_src/numerics/numerics_diff.py: per-layer error against float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from tests.helpers.gated_net import gated_setup
from tests.helpers.promotion import FLAX
from tests.numerics.nets import LinenNet, NnxNet, X, nnx_loss


@pytest.mark.standard_promotion(FLAX)
def test_numerics_diff_per_layer_under_autocast():
    """Each row is the relative error one computes by hand: the layer's output captured
    under autocast against float32, and the layer's parameter gradients."""
    model = LinenNet()
    params = jax.tree.map(jnp.abs, model.init(jax.random.key(0), X))
    x = jnp.abs(X) + 0.1

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    same = jaxamp.numerics_diff(loss, policy="float32")(params, x)
    assert all(r.relative_error == 0.0 for r in same.layers if r.relative_error is not None)
    assert same.loss[0] == same.loss[1]
    bf16 = jaxamp.numerics_diff(jax.jit(loss), policy="mixed_bfloat16")(params, x)
    rows = {(r.layer, r.phase): r.relative_error for r in bf16.layers}

    def relative(a, r):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        return np.linalg.norm(a - r) / np.linalg.norm(r)

    inter = lambda p, x: model.apply(p, x, capture_intermediates=True)[1]["intermediates"]
    # by hand under jit too, as numerics_diff is given ``jax.jit(loss)``: a CPU without
    # bfloat16 units (AVX2 only) fuses bfloat16 arithmetic in float32 under jit, and the
    # eager program's extra roundings moved a row by 3e-6 of itself
    ref = jax.jit(inter)(params, x)
    amp = jax.jit(jaxamp.autocast(inter, "mixed_bfloat16"))(params, x)
    g_ref = jax.jit(jax.grad(loss))(params, x)["params"]
    g_amp = jax.jit(jax.grad(jaxamp.autocast(loss, "mixed_bfloat16")))(params, x)["params"]
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(tree)])
    for name in ("embed", "amplify", "root", "head"):
        expected = relative(amp[name]["__call__"][0], ref[name]["__call__"][0])
        assert 1e-4 < expected < 0.05
        assert rows[(f"LinenNet/{name}", "forward")] == pytest.approx(expected, rel=1e-6)
    for name in ("embed", "amplify", "head"):
        expected = relative(flat(g_amp[name]), flat(g_ref[name]))
        assert rows[(f"LinenNet/{name}", "backward")] == pytest.approx(expected, rel=1e-6)
    # worst: every comparable row, largest error first, and by phase
    errors = sorted((e for e in rows.values() if e is not None), reverse=True)
    assert [r.relative_error for r in bf16.worst(len(rows))] == errors
    assert [r.relative_error for r in bf16.worst(2)] == errors[:2]
    backward = bf16.worst(10, "backward")
    assert {r.layer for r in backward} == {f"LinenNet/{n}" for n in ("embed", "amplify", "head")}
    assert "activation rel. error" in bf16.table()
    f16 = jaxamp.numerics_diff(loss, policy="mixed_float16")(params, x)
    # float16 keeps 3 more mantissa bits than bfloat16: smaller errors, layer for layer
    for (layer, phase), error in {(r.layer, r.phase): r.relative_error for r in f16.layers}.items():
        if layer.startswith("LinenNet/"):
            assert error < rows[(layer, phase)], (layer, phase)


@pytest.mark.standard_promotion(FLAX)
def test_numerics_diff_joins_nnx_gradients_to_their_layer():
    model = NnxNet(nnx.Rngs(0))
    diff = jaxamp.numerics_diff(nnx_loss, policy="mixed_bfloat16")(model, jnp.abs(X) + 0.1)
    backward = {r.layer for r in diff.layers if r.phase == "backward"}
    forward = {r.layer for r in diff.layers if r.phase == "forward"}
    assert backward == {f"NnxNet/{n}" for n in ("embed", "amplify", "norm", "head")}, backward
    assert backward <= forward  # one row of the table per layer, both columns filled
    table = diff.table()
    amplify = next(line for line in table.splitlines() if line.startswith("NnxNet/amplify "))
    assert "-" not in amplify.split()[1:], table
    assert dict(diff.gradients)["[0]['amplify']['kernel'].value"] > 0  # leaves keep their paths


def test_numerics_diff_with_a_policy_applied_to_the_model():
    model = LinenNet()
    params = jax.tree.map(jnp.abs, model.init(jax.random.key(0), X))
    amp = jaxamp.linen.apply_policy(model, "mixed_bfloat16")
    ref = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    mixed = lambda p, x: jnp.mean(amp.apply(p, x).astype(jnp.float32) ** 2)
    diff = jaxamp.numerics_diff(ref, policy=mixed)(params, jnp.abs(X) + 0.1)
    paths = dict(diff.gradients)
    assert "[0]['params']['amplify']['kernel']" in paths
    assert all(0 < e < 0.1 for e in paths.values())


@pytest.mark.standard_promotion(FLAX)
def test_numerics_diff_marks_rows_whose_float32_value_is_near_zero():
    """A zero gate: the gate's output and the branch's gradients are exactly 0 in both
    runs (identical: error 0, marked near zero). A gate of 1e-6: float16 flushes the
    branch's gradients (a raw relative error of tens of %), but they are a millionth of
    the typical gradient, so their scale error is small and the rows are marked."""
    loss, params = gated_setup(0.0)
    diff = jaxamp.numerics_diff(loss, policy="mixed_bfloat16")(params, X)
    rows = {(r.layer, r.phase): r for r in diff.layers}
    for key in (("GatedNet/gate", "forward"), ("GatedNet/branch", "backward")):
        assert rows[key].near_zero and rows[key].scale_error == 0.0, rows[key]
        assert rows[key].relative_error == 0.0 and rows[key].cosine is None
    for key in (("GatedNet/embed", "forward"), ("GatedNet/head", "backward")):
        r = rows[key]
        assert not r.near_zero and 1e-4 < r.scale_error < 0.05, r
        assert r.scale_error == pytest.approx(r.relative_error)  # normal rows: the same number
        assert 0.99 < r.cosine <= 1.0, r
    same = jaxamp.numerics_diff(loss, policy="float32")(params, X)
    assert all(r.scale_error == 0.0 for r in same.layers), same.layers

    loss, params = gated_setup(1e-6)
    diff = jaxamp.numerics_diff(loss, policy="mixed_float16")(params, X)
    rows = {(r.layer, r.phase): r for r in diff.layers}
    for key in (("GatedNet/gate", "forward"), ("GatedNet/branch", "backward")):
        assert rows[key].near_zero and 0 < rows[key].scale_error < 1e-3, rows[key]
    # float16 flushes most of the branch's gradients (1e-6 times the usual) to zero: the
    # raw relative error, kept as it was, reads 46%
    assert rows[("GatedNet/branch", "backward")].relative_error > 0.1
    assert not rows[("GatedNet/gate", "backward")].near_zero  # the gate's own gradient


def test_numerics_diff_says_when_the_policy_is_missing():
    loss = lambda p, x: jnp.mean(jnp.tanh(x * p["w"]))
    with pytest.raises(ValueError, match="numerics_diff needs the policy"):
        jaxamp.numerics_diff(loss)


def test_numerics_tools_take_a_jmp_policy():
    import jmp

    params, x = {"w": jnp.full((4,), 0.3)}, jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    loss = lambda p, x: jnp.mean(jnp.tanh(x * p["w"]) ** 2)
    ours, theirs = "p=f32,c=bf16,o=f32", jmp.get_policy("p=f32,c=bf16,o=f32")
    assert jaxamp.numerics_diff(loss, policy=theirs)(params, x) == jaxamp.numerics_diff(
        loss, policy=ours
    )(params, x)
    assert jaxamp.find_nonfinite(loss, policy=theirs)(params, x) is None
    report = jaxamp.range_report(loss, policy=theirs)(params, x)
    assert report == jaxamp.range_report(loss, policy=ours)(params, x)


def test_numerics_diff_forward_only_with_grad_false():
    x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
    out = lambda w, x: jnp.tanh(x * w)  # not a scalar: activations only
    diff = jaxamp.numerics_diff(out, policy="mixed_bfloat16", grad=False)(jnp.ones(4), x)
    assert diff.gradients == () and diff.loss is None
    assert diff.layers and {r.phase for r in diff.layers} == {"forward"}
    assert all(r.relative_error is not None and r.relative_error < 1e-2 for r in diff.layers)


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("control", ["none", "cond"])
def test_layer_values_are_the_jitted_models_whether_staged_or_eager(policy, control):
    """``measure`` evaluates a program under one jit where it can (no control flow that
    reads values) and one primitive at a time where it holds a ``cond``: either way each
    layer's value is Flax's captured output of the jitted model under the policy."""
    from jaxamp._src.numerics import evaluator, tracing
    from jaxamp._src.numerics.numerics_diff import measure

    model = LinenNet()
    params = jax.tree.map(jnp.abs, model.init(jax.random.key(0), X))
    x = jnp.abs(X) + 0.1

    def loss(params, x):
        out = model.apply(params, x)
        if control == "cond":  # always true: the model's own value, behind a cond
            out = jax.lax.cond(jnp.all(x > -1.0), lambda o: o, lambda o: -o, out)
        return jnp.mean(out**2)

    fun = jaxamp.autocast(loss, policy)
    traced = tracing.trace(fun, 0, (params, x), {})
    assert evaluator.stageable(traced.jaxpr) == (control == "none")
    measured = measure(fun, (params, x))
    inter = lambda p, x: model.apply(p, x, capture_intermediates=True)[1]["intermediates"]
    ref = jax.jit(jaxamp.autocast(inter, policy))(params, x)
    for name in ("embed", "amplify", "root", "head"):
        np.testing.assert_array_equal(measured.last[f"LinenNet/{name}"], ref[name]["__call__"][0])
    value, grads = jax.jit(jax.value_and_grad(fun))(params, x)
    np.testing.assert_allclose(measured.outputs[0], value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(measured.outputs[1]), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("control", ["none", "cond"])
def test_forward_rows_come_in_the_order_the_program_makes_the_layers_outputs(control):
    """Staged (one jit, whose outputs would sort a dict's keys) and eager alike: layers
    named against the alphabet, and the loss's own code ("") last, where its value is."""

    def loss(w, x):
        with jax.named_scope("zeta"):
            h = jnp.tanh(x @ w)
        with jax.named_scope("alpha"):
            h = jnp.tanh(h @ w)
        if control == "cond":  # the eager path
            h = jax.lax.cond(jnp.all(x > -10.0), lambda o: o, lambda o: -o, h)
        with jax.named_scope("mid"):
            h = h * 2.0
        return jnp.mean(h**2)

    diff = jaxamp.numerics_diff(loss, policy="mixed_bfloat16")(jnp.eye(4) / 2, X[:, :4])
    forward = [r.layer for r in diff.layers if r.phase == "forward"]
    assert forward == ["zeta", "alpha", "mid", ""], forward


def test_a_long_scan_is_evaluated_eagerly_and_a_short_one_staged():
    from jaxamp._src.numerics import evaluator

    def body(c, _):
        return jnp.tanh(c) * 0.5, c

    short = jax.make_jaxpr(lambda c: jax.lax.scan(body, c, length=4))(1.0)
    long = jax.make_jaxpr(lambda c: jax.lax.scan(body, c, length=evaluator.STAGED_EQUATIONS))(1.0)
    assert evaluator.stageable(short) and not evaluator.stageable(long)
    looped = jax.make_jaxpr(lambda c: jax.lax.while_loop(lambda c: c > 0.1, jnp.tanh, c))(1.0)
    assert not evaluator.stageable(looped)


def test_compare_runs_refuses_runs_measured_differently():
    from jaxamp._src.numerics.numerics_diff import compare_runs, measure

    loss = lambda w, x: jnp.mean((x @ w) ** 2)
    args = (jnp.ones((6, 2)), X)
    with pytest.raises(ValueError, match="has_aux, grad"):
        compare_runs(measure(loss, args), measure(loss, args, grad=False))
