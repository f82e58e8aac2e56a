"""Tests for jaxamp/_src/numerics/ranges.py: RangeReport.overflows and recommend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from tests.numerics.nets import DTYPES, X, dense_loss


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


def test_range_report_dtype_errors():
    report = jaxamp.range_report(lambda w: jnp.sum(w))(jnp.ones(2))
    with pytest.raises(
        ValueError, match=r"Unknown dtype .int8.\. Valid choices: float16, bfloat16"
    ):
        report.overflows("int8")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_recommend_names_a_loss_scale_that_fits_when_the_scale_overflows(dtype, policy):
    """Gradients that fit float16 unscaled but overflow at 2**24: float16 with a smaller
    loss scale, not bfloat16."""
    if policy and dtype != jnp.float32:
        pytest.skip("a policy applies to the float32 function")
    w, x = jnp.full((4, 4), 0.5), jnp.abs(X[:2, :4]) + 0.5
    loss = jax.jit(dense_loss(dtype))
    report = jaxamp.range_report(loss, loss_scale=2.0**24, policy=policy)(w, x)
    assert any(r.phase == "backward" for r in report.overflows()), report.table()
    advice = report.recommend()
    assert advice.dtype == "float16" and advice.loss_scaling, advice
    assert advice.loss_scale is not None and 1 <= advice.loss_scale < 2.0**24
    assert f"{advice.loss_scale:g}" in advice.reason and "smaller loss scale" in advice.reason
    assert np.log2(advice.loss_scale).is_integer()
    # the scale it names does fit, and twice... the largest power of two that does
    fits = jaxamp.range_report(loss, loss_scale=advice.loss_scale, policy=policy)(w, x)
    assert fits.overflows() == [], fits.table()
    assert fits.recommend().dtype == "float16" and fits.recommend().loss_scale is None
    # gradients float16 cannot hold even unscaled still need bfloat16
    big = jaxamp.range_report(loss, loss_scale=2.0**24, policy=policy)(w * 300.0, x * 300.0)
    assert big.recommend().dtype == "bfloat16"


@pytest.mark.parametrize(
    ("value", "dtype", "overflows"),
    [
        (65504.0, "float16", False),
        (65519.0, "float16", False),  # rounds to 65504
        (65520.0, "float16", True),  # rounds to inf
        (3.3895e38, "bfloat16", False),
        (3.395e38, "bfloat16", False),  # above bfloat16's largest, rounds down to it
        (3.4e38, "bfloat16", True),
    ],
)
def test_range_report_overflow_boundary_is_the_dtype_rounding(value, dtype, overflows):
    def loss(w):
        with jax.named_scope("big"):
            h = w * 1.0
        return jnp.sum(h) * 0.0

    report = jaxamp.range_report(jax.jit(loss))(jnp.array([value, 1.0], jnp.float32))
    big = next(r for r in report.layers if r.layer == "big" and r.phase == "forward")
    assert big.max_abs == float(np.float32(value))
    assert (big in report.overflows(dtype)) == overflows
