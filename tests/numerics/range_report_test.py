"""Tests for jaxamp/_src/numerics/range_report.py: per-layer value ranges of a step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.helpers.promotion import SUBJECT
from tests.numerics.nets import DTYPES, X, dense_loss, linen_setup


def test_range_report_flags_a_model_beyond_float16_and_passes_one_that_fits():
    loss, params = linen_setup(None, scale_amplify=1e5)
    big = jaxamp.range_report(loss)(jax.tree.map(jnp.abs, params), jnp.abs(X) + 1.0)
    flagged = {(r.layer.split("/")[-1], r.phase) for r in big.overflows("float16")}
    assert ("amplify", "forward") in flagged, big.table()
    assert ("embed", "forward") not in flagged  # before the large layer
    assert ("embed", "backward") in flagged  # its gradient flows back through amplify
    advice = big.recommend()
    assert advice.dtype == "bfloat16" and "amplify" in advice.reason
    assert big.overflows("bfloat16") == []

    small = jaxamp.range_report(loss)(*_fitting(linen_setup()[1]))
    assert small.overflows("float16") == []
    assert small.recommend().dtype == "float16"
    amplify = next(r for r in small.layers if r.layer.endswith("amplify") and r.phase == "forward")
    assert 0 < amplify.max_abs < 100 and amplify.headroom() > 600
    assert "max |act|" in small.table()


def _fitting(params):
    return jax.tree.map(jnp.abs, params), jnp.abs(X) + 0.1


def test_range_report_sees_gradients_that_flush_to_zero_in_float16():
    def loss(w, x):
        with jax.named_scope("tiny"):
            return jnp.sum(x @ w) * 1e-9

    report = jaxamp.range_report(loss)(jnp.ones((6, 2)), X)
    tiny = next(r for r in report.layers if r.layer == "tiny" and r.phase == "backward")
    assert tiny.below_subnormal > 0.5 and tiny.below_normal >= tiny.below_subnormal
    advice = report.recommend()
    assert advice.dtype == "float16" and advice.loss_scaling
    scaled = jaxamp.range_report(loss, loss_scale=2.0**24)(jnp.ones((6, 2)), X)
    tiny = next(r for r in scaled.layers if r.layer == "tiny" and r.phase == "backward")
    assert tiny.below_subnormal == 0.0  # the loss scale lifts them into range


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_report_does_not_count_the_loss_scale_multiply(dtype):
    """The loss times 65536 is not a value of the model: at jaxamp's default scale
    every model would otherwise be told to use bfloat16."""
    w, x = jnp.full((4, 4), 0.5), jnp.abs(X[:2, :4]) + 0.5
    state = jaxamp.loss_scaled(optax.sgd(0.1)).init(w)  # loss scale 65536
    plain = jaxamp.range_report(jax.jit(dense_loss(dtype)))(w, x)
    scaled = jaxamp.range_report(jax.jit(dense_loss(dtype)), loss_scale=state)(w, x)
    assert scaled.loss_scale == 65536.0
    forward = lambda r: {(row.layer, row.max_abs) for row in r.layers if row.phase == "forward"}
    assert forward(scaled) == forward(plain)  # the scaled loss (1e5) is not among them
    assert [r for r in scaled.overflows() if r.phase == "forward"] == []
    advice = scaled.recommend()
    assert advice.dtype == "float16" and "activations" not in advice.reason, advice


@pytest.mark.parametrize("dtype", DTYPES)
def test_range_report_leaves_out_a_mask_fill_of_the_dtype_s_lowest(dtype):
    def loss(w, keep):
        with jax.named_scope("attn"):
            s = jnp.where(keep, w.astype(dtype) * 2, jnp.finfo(dtype).min)
        return jnp.sum(jax.nn.softmax(s).astype(jnp.float32))

    report = jaxamp.range_report(jax.jit(loss))(jnp.arange(4.0), jnp.arange(4) < 2)
    attn = next(r for r in report.layers if r.layer == "attn" and r.phase == "forward")
    assert attn.max_abs == 6.0, attn  # 2w, not the fill: finfo(dtype).min is a sentinel


def test_range_report_flush_to_zero_boundary_is_float16_rounding():
    """float16 rounds 2**-25 (half its smallest subnormal, a tie) to 0, and a value just
    below its smallest normal up to that normal."""
    c = jnp.array([2.0**-25, 2.0**-25 * (1 + 2.0**-20), 2.0**-26, 2.0**-14 - 2.0**-26])
    assert list(np.asarray(c.astype(jnp.float16), np.float64) == 0) == [1, 0, 1, 0]

    def loss(w):
        with jax.named_scope("tiny"):
            return jnp.sum(w * c)

    report = jaxamp.range_report(jax.jit(loss))(jnp.ones(4))
    tiny = next(r for r in report.layers if r.layer == "tiny" and r.phase == "backward")
    # its gradient values: the cotangent ones (4) and c (4)
    assert tiny.below_subnormal == 2 / 8, tiny  # 2**-25 and 2**-26
    assert tiny.below_normal == 3 / 8, tiny  # and 2**-25 (1 + 2**-20); 2**-14 - 2**-26 rounds up


@pytest.mark.standard_promotion(SUBJECT)
def test_range_report_under_a_policy_counts_only_its_16_bit_values():
    """A LayerNorm's statistics have huge derivatives for near-constant rows; a policy
    computes them in float32, so they are no reason to avoid float16."""

    def loss(w, x):
        with jax.named_scope("proj"):
            h = x @ w
        with jax.named_scope("norm"):
            mu = jnp.mean(h, -1, keepdims=True)
            var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
            y = (h - mu) * jax.lax.rsqrt(var + 1e-12)
        return jnp.mean(y[:, :2] ** 3)

    x = jax.random.normal(jax.random.key(0), (4, 8))
    w = jnp.full((8, 8), 1e-3) + 1e-5 * jax.random.normal(jax.random.key(1), (8, 8))
    plain = jaxamp.range_report(loss)(w, x)
    assert ("norm", "backward") in {(r.layer, r.phase) for r in plain.overflows()}
    assert plain.policy is None
    mixed = jaxamp.range_report(loss, policy="mixed_float16")(w, x)
    assert mixed.overflows() == [] and mixed.recommend().dtype == "float16"
    assert mixed.policy == str(jaxamp.get_policy("mixed_float16"))
    # a value the policy does hold in 16 bits is measured at its float32 size, not inf
    big = jaxamp.range_report(loss, policy="mixed_float16")(w * 1e8, x)
    proj = next(r for r in big.layers if r.layer == "proj" and r.phase == "forward")
    assert proj.nonfinite == 0 and proj.max_abs > 65504
    assert ("proj", "forward") in {(r.layer, r.phase) for r in big.overflows()}
    with pytest.raises(TypeError, match="policy must be"):
        jaxamp.range_report(loss, policy=3)


def test_range_report_forward_only_with_grad_false():
    w, x = jnp.full((4,), 300.0), jnp.ones((2, 4))
    report = jaxamp.range_report(lambda w, x: (x * w) ** 2, grad=False)(w, x)
    assert report.forward_only == "grad=False"
    assert report.layers and {r.phase for r in report.layers} == {"forward"}
