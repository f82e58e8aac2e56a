"""Under ``jax_enable_x64`` a policy leaves float64 as written: autocast, the Linen and NNX
policies, the policy's casts and ``loss_scaled``. References: the function or model alone
(bit for bit) and float64 optax (step for step).

Each test turns x64 on for its own body (``jax.enable_x64``), before it makes an array.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxamp
from jaxamp.optim import DynamicLossScale, NoOpLossScale, StaticLossScale
from tests.helpers.promotion import FLAX, OPTAX, SUBJECT

F64 = np.dtype(np.float64)
POLICIES = ["float32", "mixed_bfloat16", "mixed_float16", "bfloat16", "float16"]
AUTOCAST_POLICIES = [*POLICIES, "mixed_float8"]


def assert_bitwise(got, want):
    """The same tree, dtypes and bits (a NaN or a signed zero included)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        np.testing.assert_array_equal(g, w)
        assert g.tobytes() == w.tobytes()


def assert_float64_close(got, want):
    """The same dtype, and values within ``2**-46`` of the largest: far below float32's
    ``2**-24``, and above what XLA's compilation of one program or another changes."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == F64, (got.dtype, want.dtype)
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-46 * np.max(np.abs(want)))


def _values(seed, shape, scale=1.0):
    """float64 values float32 cannot hold (each has bits below float32's 24)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.normal(0.0, scale, shape) * (1 + 2.0**-40), jnp.float64)


# --- autocast ---------------------------------------------------------------------------------


def _conv(x, w):
    """A 1-D convolution: ``x`` as a batch of one-channel signals, ``w``'s rows as taps."""
    lhs, rhs = x[:, :, None], w[:3, None, :]
    return jax.lax.conv_general_dilated(
        lhs, rhs, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    )


FUNCTIONS = {
    # a matmul, a float32-rule softmax, a second matmul
    "mlp": lambda x, w: jax.nn.log_softmax(jnp.tanh(x @ w) @ w.T).sum(),
    "einsum": lambda x, w: jnp.exp(jnp.einsum("nk,km->nm", x, w) / 8).sum(),
    "conv": lambda x, w: jnp.sum(_conv(x, w) ** 2),
    "vector dot": lambda x, w: jnp.dot(x[0], w[:, 0]),
    # a float32 operand jnp promotes to float64 before the matmul
    "promoted": lambda x, w: jnp.sum(jnp.sin(x @ w.astype(jnp.float32))),
    # float32 operands, a float64 result asked for: float64 products and sums
    "float64 result": lambda x, w: jnp.sum(
        jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), preferred_element_type=jnp.float64)
    ),
}


@functools.cache
def _value_and_grad(name, policy):
    """The jitted value and gradients of a function (under ``policy``, or alone for
    ``None``), made once: hypothesis's examples then compile once per shape."""
    f = FUNCTIONS[name] if policy is None else jaxamp.autocast(FUNCTIONS[name], policy)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))


@pytest.mark.standard_promotion(SUBJECT)
@pytest.mark.parametrize("name", list(FUNCTIONS))
@pytest.mark.parametrize("policy", AUTOCAST_POLICIES)
@hypothesis.settings(max_examples=4, deadline=None)
@hypothesis.given(
    seed=st.integers(0, 2**32 - 1), n=st.sampled_from([1, 4]), scale=st.sampled_from([1.0, 1e3])
)
def test_autocast_leaves_float64_as_written(name, policy, seed, n, scale):
    """A float64 matmul ran in the compute dtype and came back typed float64 (relative
    error 2.1e-7 under "float32", 4.2e-3 under mixed_bfloat16)."""
    with jax.enable_x64(True):
        x, w = _values(seed, (n, 6), scale), _values(seed + 1, (6, 5))
        want = _value_and_grad(name, None)(x, w)
        got = _value_and_grad(name, policy)(x, w)
        assert want[0].dtype == F64
        assert_bitwise(got, want)


# --- the policy's casts -------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_a_policy_casts_no_float64_leaf_down(policy):
    """cast_to_param/compute/output/reduce leave a float64 leaf as it is under x64 (a
    16-bit or float32 one is cast); cast_floating, the explicit cast, casts it."""
    p = jaxamp.get_policy(policy)
    with jax.enable_x64(True):
        tree = {"d": jnp.ones(2, jnp.float64), "s": jnp.ones(2), "n": np.ones(2)}
        assert tree["s"].dtype == F64 and tree["n"].dtype == F64
        for cast, dtype in [
            (p.cast_to_param, p.param_dtype),
            (p.cast_to_compute, p.compute_dtype),
            (p.cast_to_output, p.output_dtype),
            (p.cast_to_reduce, p.grad_reduce_dtype),
        ]:
            out = cast({**tree, "f": jnp.ones(2, jnp.float32), "i": jnp.arange(2)})
            assert {out["d"].dtype, out["s"].dtype, out["n"].dtype} == {F64}
            assert out["f"].dtype == dtype and out["i"].dtype == jnp.int64
        assert jaxamp.cast_floating(tree, jnp.bfloat16)["d"].dtype == jnp.bfloat16
        assert (
            jaxamp.get_policy("p=f64,c=f64").cast_to_compute(jnp.ones(2, jnp.float32)).dtype == F64
        )


def test_without_x64_a_float64_numpy_leaf_is_cast_as_jmp_casts_it():
    """Without x64 JAX takes a float64 NumPy array as float32, and so does a policy."""
    out = jaxamp.get_policy("mixed_bfloat16").cast_to_compute({"n": np.ones(2)})
    assert out["n"].dtype == jnp.bfloat16


# --- Linen and NNX ------------------------------------------------------------------------------


class Float64Net(nn.Module):
    """Layers written in float64."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, param_dtype=jnp.float64)(x)
        h = nn.gelu(nn.LayerNorm(param_dtype=jnp.float64)(h))
        h = h + nn.Embed(3, 16, param_dtype=jnp.float64)(jnp.arange(h.shape[0]) % 3)
        return nn.Dense(4, param_dtype=jnp.float64)(h)


class Float32Net(nn.Module):
    """Flax's default float32 params; float64 inputs make every layer compute in float64."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.LayerNorm()(nn.Dense(16)(x)))
        return jax.nn.log_softmax(nn.Dense(4)(h))


@functools.cache
def _linen(module, policy):
    """``(init, jitted value and gradients)`` of a Linen model (under ``policy``, or
    alone for ``None``), made once."""
    model = module() if policy is None else jaxamp.linen.apply_policy(module(), policy)
    loss = lambda v, x: jnp.sum(model.apply(v, x) ** 2)
    return model.init, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("module", [Float64Net, Float32Net])
@pytest.mark.parametrize("policy", POLICIES)
@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**32 - 1))
def test_linen_policy_leaves_float64_layers_as_written(module, policy, seed):
    """Under x64 the policy cast float64 inputs to the compute dtype and gave float64
    layers its dtype and param_dtype."""
    with jax.enable_x64(True):
        x = _values(seed, (3, 8))
        (init, alone), (init_ours, ours) = _linen(module, None), _linen(module, policy)
        variables = init(jax.random.key(0), x)
        assert_bitwise(init_ours(jax.random.key(0), x), variables)
        want = alone(variables, x)
        assert want[0].dtype == F64
        assert_bitwise(ours(variables, x), want)


class NnxFloat64Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(8, 16, param_dtype=jnp.float64, rngs=rngs)
        self.norm = nnx.LayerNorm(16, param_dtype=jnp.float64, rngs=rngs)
        self.embed = nnx.Embed(3, 16, param_dtype=jnp.float64, rngs=rngs)
        self.head = nnx.Linear(16, 4, param_dtype=jnp.float64, rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.norm(self.dense(x)))
        return self.head(h + self.embed(jnp.arange(h.shape[0]) % 3))


class NnxFloat32Net(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return jax.nn.log_softmax(self.head(nnx.gelu(self.norm(self.dense(x)))))


@nnx.jit
def _nnx_step(model, x):
    return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)


@functools.cache
def _nnx(module, policy):
    """``(model under policy, the model alone with the params the policy stores)``, made
    once under x64. The params are the policy's business: a bfloat16 policy stores the
    float32 params of NnxFloat32Net in bfloat16 before it knows its inputs are float64."""
    with jax.enable_x64(True):
        alone, ours = module(nnx.Rngs(0)), jaxamp.nnx.apply_policy(module(nnx.Rngs(0)), policy)
        stored = jaxamp.get_policy(policy).cast_to_param(nnx.state(alone, nnx.Param))
        assert_bitwise(nnx.state(ours, nnx.Param), stored)  # float64 params kept
        nnx.update(alone, stored)
        return ours, alone


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("module", [NnxFloat64Net, NnxFloat32Net])
@pytest.mark.parametrize("policy", POLICIES)
@hypothesis.settings(max_examples=3, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**32 - 1))
def test_nnx_policy_leaves_float64_layers_as_written(module, policy, seed):
    """As for Linen; and apply_policy cast float64 params to its param_dtype."""
    with jax.enable_x64(True):
        x = _values(seed, (3, 8))
        ours, alone = _nnx(module, policy)
        want = _nnx_step(alone, x)
        assert want[0].dtype == F64
        assert_bitwise(_nnx_step(ours, x), want)


# --- loss_scaled --------------------------------------------------------------------------------

INNERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "sgd momentum": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "rmsprop": lambda: optax.rmsprop(1e-2),
}
SCALES = {
    "dynamic": lambda: DynamicLossScale(init_scale=2.0**12),
    "static": lambda: StaticLossScale(2.0**-3),
    "none": NoOpLossScale,
}


@functools.cache
def _loss_scaled_steps(inner, scale, master_weights, skip_with):
    """``(tx, one step, three steps in a fori_loop)``, jitted, made once per setting."""
    tx = jaxamp.loss_scaled(
        INNERS[inner](), SCALES[scale](), master_weights=master_weights, skip_with=skip_with
    )

    def step(params, state, g):
        factor = state.loss_scale.scale.astype(jnp.float64)  # a power of 2: exact
        scaled = {"d": g * factor, "h": jnp.ones(4, jnp.bfloat16)}
        updates, state = tx.update(scaled, state, params)
        return optax.apply_updates(params, updates), state, updates["d"]

    def loop(params, state, grads):
        body = lambda i, c: step(*c, grads[i])[:2]
        return jax.lax.fori_loop(0, len(grads), body, (params, state))

    return tx, jax.jit(step), jax.jit(loop)


@pytest.mark.standard_promotion(OPTAX)
@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(
    inner=st.sampled_from(list(INNERS)),
    scale=st.sampled_from(list(SCALES)),
    master_weights=st.sampled_from(["float32", "kahan", "stochastic", "none"]),
    skip_with=st.sampled_from(["select", "cond"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_float64_param_beside_a_16bit_one_steps_as_float64_optax(
    inner, scale, master_weights, skip_with, seed
):
    """A float64 param beside a bfloat16 one got float32 Adam state (1.6e-8 off float64
    optax), and a fori_loop carrying the state failed with a TypeError (float32 moments
    in, float64 out)."""
    with jax.enable_x64(True):
        tx, step, loop = _loss_scaled_steps(inner, scale, master_weights, skip_with)
        params = {"d": _values(seed, (5,)), "h": jnp.linspace(-1, 1, 4, dtype=jnp.bfloat16)}
        grads = jnp.stack([_values(seed + 1 + i, (5,), 10.0 ** (i - 1)) for i in range(3)])
        state = tx.init(params)
        ref = INNERS[inner]()
        ref_update = jax.jit(ref.update)
        ref_params, ref_state = params["d"], ref.init(params["d"])
        ours_params, ours_state = params, state
        # Not bit for bit: XLA compiles optax's own update differently beside another leaf
        # (plain float64 optax on {"d", "h"} is 1 ulp off optax on "d" alone; with
        # momentum's cancellations, up to 6 ulps of a result over three steps).
        for g in grads:
            updates, ref_state = ref_update(g, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, updates)
            ours_params, ours_state, ours_updates = step(ours_params, ours_state, g)
            assert_float64_close(ours_updates, updates)
        assert_float64_close(ours_params["d"], ref_params)
        looped_params, looped_state = loop(params, state, grads)
        assert_float64_close(looped_params["d"], ref_params)
        assert jax.tree.structure(looped_state) == jax.tree.structure(state)
        for new, old in zip(jax.tree.leaves(looped_state), jax.tree.leaves(state), strict=True):
            assert new.dtype == old.dtype
        moments = [x for x in jax.tree.leaves(looped_state.inner_state) if np.shape(x) == (5,)]
        assert moments and {x.dtype for x in moments} == {F64}
