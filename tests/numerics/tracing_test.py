"""Tests for jaxamp/_src/numerics/tracing.py: NNX layers, nested ones named once."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxamp
from tests.helpers.promotion import FLAX


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


@pytest.mark.standard_promotion(FLAX)
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


@pytest.mark.standard_promotion(FLAX)
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
