"""``jaxamp.autocast``'s ``overrides`` (jaxamp/_src/autocast/api.py, jaxprs.in_scopes): named
scopes kept in float32, forward and backward, against the function itself in float32."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp._src.jaxprs import in_scopes

W = jax.random.normal(jax.random.key(0), (8, 8)) / 3
X = jax.random.normal(jax.random.key(1), (4, 8))


def _two_layers(w, x):
    with jax.named_scope("body"):
        h = jnp.tanh(x @ w)
    with jax.named_scope("head"):
        return jnp.mean((h @ w) ** 2)


def _dtypes(fun, *args):
    """(scope, lhs dtype) of every matmul the compiled program runs."""
    ops = jaxamp.precision_report(jax.jit(fun))(*args).ops
    return {(("head" if "head" in op.name else "body"), op.direction, op.lhs_dtype) for op in ops}


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_an_overridden_scope_runs_in_float32_forward_and_backward(policy):
    kept = jaxamp.autocast(_two_layers, policy, overrides={"head": "float32"})
    narrow = str(jaxamp.get_policy(policy).compute_dtype)
    assert _dtypes(jax.grad(kept), W, X) == {
        ("body", "forward", narrow),
        ("body", "backward", narrow),
        ("head", "forward", "float32"),
        ("head", "backward", "float32"),
    }


def test_every_scope_overridden_is_the_function_in_float32_bit_for_bit():
    every = jaxamp.autocast(
        _two_layers, "mixed_bfloat16", overrides={"body": "float32", "head": "float32"}
    )
    want = jax.jit(jax.value_and_grad(_two_layers))(W, X)
    got = jax.jit(jax.value_and_grad(every))(W, X)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_a_scope_pattern_covers_the_scopes_below_it_and_matches_whole_names():
    assert in_scopes("f/encoder/layer_0/attention/q", ["encoder/*/attention"])
    assert in_scopes("f/Net/head/dense", ["head"])
    assert in_scopes("f/Net/block_3", ["block_*"])
    assert not in_scopes("f/Net/header", ["head"])
    assert not in_scopes("f/Net/subhead/x", ["head"])


def test_overrides_that_narrow_or_are_not_scopes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'head': 'bfloat16'.*apply_policy"):
        jaxamp.autocast(_two_layers, overrides={"head": "bfloat16"})
    with pytest.raises(TypeError, match="scope pattern"):
        jaxamp.autocast(_two_layers, overrides={jnp.ndarray: "float32"})
    with pytest.raises(TypeError, match="must map scope patterns"):
        jaxamp.autocast(_two_layers, overrides=["head"])


def test_an_override_that_matches_no_scope_warns_naming_the_scopes():
    with pytest.warns(UserWarning, match=r"'nrom' matched no named scope.*'body', 'head'"):
        jaxamp.autocast(_two_layers, "mixed_bfloat16", overrides={"nrom": "float32"})(W, X)


def test_a_scope_inside_a_jitted_or_scanned_function_is_matched():
    def scanned(w, x):
        def body(h, _):
            with jax.named_scope("inner"):
                return jnp.tanh(h @ w), None

        with jax.named_scope("outer"):
            h, _ = jax.lax.scan(body, x, length=2)
        return jnp.mean(jax.jit(lambda h: h @ w)(h) ** 2)

    kept = jaxamp.autocast(scanned, "mixed_bfloat16", overrides={"outer/inner": "float32"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops = jaxamp.precision_report(jax.jit(kept))(W, X).ops
    assert {op.lhs_dtype for op in ops if "inner" in op.name} == {"float32"}, ops
    assert {op.lhs_dtype for op in ops if "inner" not in op.name} == {"bfloat16"}, ops
