"""Tests for jaxamp/_src/ops/attention.py: equal to Flax's attention, with 16-bit matmuls."""

import functools

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp

KEY = jax.random.key(0)
Q, K, V = (jax.random.normal(k, (2, 5, 4, 8)) for k in jax.random.split(KEY, 3))
MASK = jax.random.bernoulli(jax.random.key(1), 0.8, (2, 1, 5, 5)).at[..., 0].set(True)
BIAS = jax.random.normal(jax.random.key(2), (2, 4, 5, 5))


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_matches_flax_in_float32(dtype):
    expected = nn.dot_product_attention(Q, K, V, bias=BIAS, mask=MASK)
    got = jax.jit(jaxamp.dot_product_attention, static_argnames="dtype")(
        Q, K, V, bias=BIAS, mask=MASK, dtype=dtype
    )
    assert got.dtype == dtype
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 5e-2, jnp.float16: 1e-2}[dtype]
    np.testing.assert_allclose(got.astype(jnp.float32), expected, atol=tol, rtol=tol)


def test_causal_and_grouped_query():
    expected = nnx.dot_product_attention(Q, K, V, is_causal=True)
    np.testing.assert_allclose(
        jaxamp.dot_product_attention(Q, K, V, is_causal=True), expected, atol=1e-5
    )
    k2, v2 = K[:, :, :2], V[:, :, :2]  # two key/value heads for four query heads
    expected = nnx.dot_product_attention(Q, jnp.repeat(k2, 2, -2), jnp.repeat(v2, 2, -2))
    np.testing.assert_allclose(jaxamp.dot_product_attention(Q, k2, v2), expected, atol=1e-5)
    with pytest.raises(ValueError, match="multiple"):
        jaxamp.dot_product_attention(Q, K[:, :, :3], V[:, :, :3])


def test_softmax_in_float32_and_matmuls_in_compute_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in (Q, K, V))
    report = jaxamp.precision_report(
        jax.grad(lambda q: jaxamp.dot_product_attention(q, k, v).astype(jnp.float32).sum())
    )(q)
    assert report.all_operands_in("bfloat16")
    jaxpr = jax.make_jaxpr(jaxamp.dot_product_attention)(q, k, v)
    exps = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "exp"]
    assert exps and all(e.invars[0].aval.dtype == jnp.float32 for e in exps)


def test_dropout():
    out = jaxamp.dot_product_attention(Q, K, V, dropout_rng=KEY, dropout_rate=0.5)
    same = jaxamp.dot_product_attention(Q, K, V, dropout_rng=KEY, dropout_rate=0.5)
    plain = jaxamp.dot_product_attention(Q, K, V)
    np.testing.assert_array_equal(out, same)
    assert not np.allclose(out, plain)
    det = jaxamp.dot_product_attention(
        Q, K, V, dropout_rng=KEY, dropout_rate=0.5, deterministic=True
    )
    np.testing.assert_array_equal(det, plain)


def test_sows_weights_in_linen():
    module = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=jaxamp.dot_product_attention)
    x = jnp.ones((1, 5, 8))
    variables = module.init(KEY, x)
    _, state = module.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    (weights,) = state["intermediates"]["attention_weights"]
    assert weights.shape == (1, 4, 5, 5)


_LENGTHS = dict(
    q_len=st.integers(1, 6),
    kv_len=st.integers(1, 6),
    is_causal=st.booleans(),
    with_mask=st.booleans(),
    with_bias=st.booleans(),
    depth=st.sampled_from([3, 4, 8]),
)


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(**_LENGTHS)
def test_float32_is_flaxs_attention_on_any_lengths(
    q_len, kv_len, is_causal, with_mask, with_bias, depth
):
    """Flax aligns the causal mask top left (query i sees keys 0..i); jaxamp aligned it
    bottom right, which differs whenever the query is shorter than the keys. (Flax
    scales the logits, jaxamp the query: equal to float32 rounding.)"""
    _check_against_flax(q_len, kv_len, is_causal, with_mask, with_bias, depth)


@pytest.mark.slow
@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(**_LENGTHS)
def test_float32_is_flaxs_attention_on_any_lengths_slow(
    q_len, kv_len, is_causal, with_mask, with_bias, depth
):
    _check_against_flax(q_len, kv_len, is_causal, with_mask, with_bias, depth)


def _check_against_flax(q_len, kv_len, is_causal, with_mask, with_bias, depth):
    keys = jax.random.split(jax.random.key(q_len * 7 + kv_len), 5)
    q = jax.random.normal(keys[0], (2, q_len, 3, depth))
    k, v = (jax.random.normal(key, (2, kv_len, 3, depth)) for key in keys[1:3])
    mask = jax.random.bernoulli(keys[3], 0.7, (2, 1, q_len, kv_len)) if with_mask else None
    bias = jax.random.normal(keys[4], (2, 3, q_len, kv_len)) if with_bias else None
    flax_fn = functools.partial(nnx.dot_product_attention, is_causal=is_causal)
    ours = functools.partial(jaxamp.dot_product_attention, is_causal=is_causal)
    want = jax.jit(flax_fn)(q, k, v, bias=bias, mask=mask)
    got = jax.jit(ours)(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_causal_multi_head_attention_under_policies_sees_flaxs_keys():
    """nnx.MultiHeadAttention with is_causal and a query shorter than the keys moved by
    up to 1.31 under apply_policy, under the float32 policy too."""
    layer = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    xq = jax.random.normal(jax.random.key(1), (2, 2, 8))
    xkv = jax.random.normal(jax.random.key(2), (2, 5, 8))
    want = layer(xq, xkv, is_causal=True)
    jaxamp.nnx.apply_policy(layer, "float32")
    np.testing.assert_array_equal(layer(xq, xkv, is_causal=True), want)
    jaxamp.nnx.apply_policy(layer, "mixed_bfloat16")
    np.testing.assert_allclose(layer(xq, xkv, is_causal=True), want, atol=5e-2, rtol=5e-2)
