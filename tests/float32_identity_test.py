"""A ``"float32"`` policy is the identity, bit for bit against the function or model alone,
on code that rounds to 16 bits itself: outputs, gradients, and the matmuls' result types."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxamp
from tests.helpers.promotion import SUBJECT

bf16, f16, f32 = jnp.bfloat16, jnp.float16, jnp.float32


def assert_bitwise(got, want):
    """The same tree, dtypes and bits (NaNs where the reference has them)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w)
        nan = np.isnan(g.astype(np.float32))
        assert np.where(nan, 0, g).tobytes() == np.where(nan, 0, w).tobytes()


# Each takes float32 x [n, 6] and w [6, 5], rounds to 16 bits itself, returns a float32 sum.
FUNCTIONS = {
    "bfloat16 matmuls": lambda x, w: jnp.sum(
        (jnp.tanh(x.astype(bf16) @ w.astype(bf16)) @ w.T.astype(bf16)).astype(f32)
    ),
    "preferred bfloat16": lambda x, w: jnp.sum(
        jnp.dot(x, w, preferred_element_type=bf16).astype(f32) ** 2
    ),
    "preferred bfloat16 on 16-bit operands": lambda x, w: jnp.sum(
        jnp.dot(x.astype(bf16), w.astype(bf16), preferred_element_type=bf16).astype(f32)
    ),
    "preferred float32 on 16-bit operands": lambda x, w: jnp.sum(
        jnp.dot(x.astype(f16), w.astype(f16), preferred_element_type=f32) ** 2
    ),
    "bfloat16 softmax": lambda x, w: jnp.sum(
        (jax.nn.softmax(x.astype(bf16) @ w.astype(bf16)) * 3).astype(f32)
    ),
    "float16 norm": lambda x, w: jnp.sum(jnp.sqrt(jnp.mean(jnp.square(x.astype(f16)), -1))),
    "bfloat16 exp": lambda x, w: jnp.sum((jnp.exp(x.astype(bf16)) * 3).astype(f32)),
    "bfloat16 sum": lambda x, w: jnp.sum(x.astype(bf16)).astype(f32),
    "bfloat16 bias": lambda x, w: jnp.sum((x.astype(bf16) + w[:, 0].astype(bf16)).astype(f32) ** 2),
    "bfloat16 lookup": lambda x, w: jnp.sum(
        w.astype(bf16)[jnp.zeros(300, jnp.int32)].astype(f32) * x[0, 0]
    ),
    "float16 constant": lambda x, w: jnp.sum(jax.nn.softmax(x.astype(f16) + 1e5).astype(f32)),
    "float16 mask fill": lambda x, w: jnp.sum(
        jax.nn.softmax(jnp.where(x > 0, x.astype(f16), -1e9)).astype(f32)
    ),
    "bfloat16 vector dot": lambda x, w: jnp.dot(x[0].astype(bf16), w[:, 0].astype(bf16)).astype(
        f32
    ),
}


@functools.cache
def _value_and_grad(name, policy):
    """The jitted value and gradients of a function (under ``policy``, or alone for
    ``None``), made once: hypothesis's examples then compile once per shape."""
    f = FUNCTIONS[name] if policy is None else jaxamp.autocast(FUNCTIONS[name], policy)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


def _inputs(seed, n, scale):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(0.0, scale, (n, 6)), f32)
    return x, jnp.asarray(rng.normal(0.0, 1.0, (6, 5)), f32)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 1e5 in float16
@pytest.mark.parametrize("name", list(FUNCTIONS))
@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 4]), scale=st.sampled_from([1.0, 300.0])
)
def test_autocast_float32_is_the_function_alone(name, seed, n, scale):
    """Under "float32" the rules ran anyway: the float32 rule took the function's own
    16-bit exp, softmax and norm into float32, a 16-bit bias's and lookup's gradients
    were summed in float32, a float16 constant kept its value (the function alone
    makes inf), and a requested preferred_element_type=bfloat16 was dropped."""
    x, w = _inputs(seed, n, scale)
    assert_bitwise(_value_and_grad(name, "float32")(x, w), _value_and_grad(name, None)(x, w))


def _dot_types(f, *args):
    """The operand and result types of each ``dot_general`` in ``f``'s lowered program."""
    text = jax.jit(f).lower(*args).as_text()
    return sorted(re.findall(r"stablehlo\.dot_general.*?: (\(.*?\) -> tensor<[^>]*>)", text))


@pytest.mark.parametrize("name", [n for n in FUNCTIONS if n.startswith("preferred")])
def test_autocast_float32_keeps_a_requested_result_type(name):
    """XLA:CPU computes a bfloat16-result dot in float32 and rounds, so the values alone
    cannot show a dropped preferred_element_type; the lowered program does."""
    f, (x, w) = FUNCTIONS[name], _inputs(0, 4, 1.0)
    want = _dot_types(jax.grad(f, argnums=(0, 1)), x, w)
    assert (
        want and _dot_types(jax.grad(jaxamp.autocast(f, "float32"), argnums=(0, 1)), x, w) == want
    )


class OwnRounding(nn.Module):
    """A model whose own code rounds to 16 bits (no 16-bit layer setting)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6)(x).astype(bf16)
        w = self.param("w", nn.initializers.normal(1.0), (6, 6))
        scores = jnp.dot(h, w.astype(bf16), preferred_element_type=bf16)
        h = jax.nn.softmax(scores + self.param("b", nn.initializers.ones, (6,)).astype(bf16))
        return nn.Dense(3)(jnp.exp(h).astype(f32) + jnp.sum(h.astype(f16), -1, keepdims=True))


class NnxOwnRounding(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(6, 6, rngs=rngs)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (6, 6)))
        self.b = nnx.Param(jnp.ones(6))
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        h = self.dense(x).astype(bf16)
        scores = jnp.dot(h, self.w[...].astype(bf16), preferred_element_type=bf16)
        h = jax.nn.softmax(scores + self.b[...].astype(bf16))
        return self.head(jnp.exp(h).astype(f32) + jnp.sum(h.astype(f16), -1, keepdims=True))


@functools.cache
def _linen(policy):
    model = OwnRounding() if policy is None else jaxamp.linen.apply_policy(OwnRounding(), policy)
    loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
    return model.init, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@nnx.jit
def _nnx_step(model, x):
    return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)


@functools.cache
def _nnx(policy):
    model = NnxOwnRounding(nnx.Rngs(0))
    return model if policy is None else jaxamp.nnx.apply_policy(model, policy)


@pytest.mark.standard_promotion(SUBJECT)
@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([1.0, 300.0]))
def test_apply_policy_float32_is_the_model_alone(seed, scale):
    """The policies evaluate the model with the same rules: Linen and NNX alike."""
    x = _inputs(seed, 4, scale)[0]
    (init, alone), (init_ours, ours) = _linen(None), _linen("float32")
    variables = init(jax.random.key(0), x)
    assert_bitwise(init_ours(jax.random.key(0), x), variables)
    assert_bitwise(ours(variables, x), alone(variables, x))
    assert_bitwise(_nnx_step(_nnx("float32"), x), _nnx_step(_nnx(None), x))
