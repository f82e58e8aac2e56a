"""Tests spanning the numerics tools: one signature, forward only, the walk-through."""

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from tests.helpers.promotion import FLAX
from tests.numerics.nets import DTYPES, LinenNet, X, linen_setup


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_function_returning_activations_is_checked_forward_only(dtype):
    loss, params = linen_setup()
    params = jax.tree.map(lambda p: p.astype(dtype), params)
    apply = jax.jit(lambda p, x: LinenNet().apply(p, x))
    with pytest.warns(UserWarning, match="forward only"):
        assert jaxamp.find_nonfinite(apply)(params, X.astype(dtype)) is None
    with pytest.warns(UserWarning, match="forward only"):
        fault = jaxamp.find_nonfinite(lambda x: jnp.log(x) * 2.0)(jnp.zeros(3, dtype))
    assert fault.forward_only and fault.primitive == "log" and fault.phase == "forward"
    assert "forward only: the function returns a non-scalar, so no gradient was taken" in str(fault)
    with pytest.warns(UserWarning, match="forward only"):
        report = jaxamp.range_report(apply)(params, X.astype(dtype))
    assert report.forward_only and {r.phase for r in report.layers} == {"forward"}
    assert "forward only" in report.table() and "forward only" in report.recommend().reason
    assert any(r.layer.endswith("amplify") for r in report.layers)
    full = jaxamp.range_report(loss)(params, X.astype(dtype))
    assert not full.forward_only and "forward only" not in full.table()


@pytest.mark.standard_promotion(FLAX)
def test_the_float16_walk_through_example(tmp_path):
    """examples/float16_overflow.py at a small size: the walk-through of the numerics guide."""
    import io

    from examples import float16_overflow

    out = io.StringIO()
    result = float16_overflow.main(["--steps", "4", "--out", str(tmp_path / "t.txt")], out=out)
    f16, bf16 = result["float16"], result["bfloat16"]
    assert f16["skipped"] == len(f16["losses"]) == 4 and "find_nonfinite" in f16["stuck"]
    assert result["fault"].phase == "forward"
    assert result["fault"].layer == "GPT2LMHeadModel/h_1/c_fc"
    assert result["fault"].output.dtype == "float16"
    assert result["advice"].dtype == "bfloat16"
    assert bf16["skipped"] == 0 and bf16["losses"][-1] < bf16["losses"][0]
    assert (tmp_path / "t.txt").read_text() == out.getvalue()


def test_the_three_tools_share_one_signature():
    import inspect

    def shape(tool):
        return [(p.name, p.kind, p.default) for p in inspect.signature(tool).parameters.values()]

    tools = (jaxamp.find_nonfinite, jaxamp.range_report, jaxamp.numerics_diff)
    assert shape(tools[0]) == shape(tools[1]) == shape(tools[2])
    assert [name for name, *_ in shape(tools[0])] == [
        "fun", "argnums", "policy", "has_aux", "loss_scale", "grad"
    ]  # fmt: skip
