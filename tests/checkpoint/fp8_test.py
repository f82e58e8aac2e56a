"""Tests for jaxamp/_src/checkpoint/fp8.py: FP8 state moved between fp8_history lengths.

Reference: Flax's own delayed-scaling history update (``fp8_ops.compute_amax_history``),
run from a fresh history of the target's length on the same amaxes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import fp8_ops
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxamp
from jaxamp.checkpoint import LossyConversionError, convert_fp8_state
from jaxamp.ops import FP8_STATE_COLLECTION, init_gemm_fp8_state


def _flax_history(amaxes, length):
    """A fresh history of ``length`` after Flax's update on each amax in turn (the amax of
    an operand ``x`` is ``max|x|``: a one-element operand holding it)."""
    h = jnp.zeros((length,), jnp.float32)
    for a in amaxes:
        h = fp8_ops.compute_amax_history(jnp.asarray([a], jnp.float32), h)
    return np.asarray(h)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(0.0625, 100.0, width=32), min_size=0, max_size=12),
    st.integers(1, 8),
    st.integers(1, 8),
)
def test_a_resized_history_is_flaxs_history_of_that_length(amaxes, old, new):
    """Shorter: the last ``new`` amaxes, exactly Flax's history of that length. Longer:
    the same where the old history forgot nothing (no more amaxes than it holds)."""
    from jaxamp._src.checkpoint.fp8 import resize_history

    if new > old and len(amaxes) > old:
        amaxes = amaxes[-old:]
    saved = {
        "gemm": init_gemm_fp8_state(old)._replace(input_amax_history=_flax_history(amaxes, old))
    }
    like = {"gemm": init_gemm_fp8_state(new)}
    want = _flax_history(amaxes, new)
    np.testing.assert_array_equal(resize_history(saved["gemm"].input_amax_history, new), want)
    out, report = convert_fp8_state(saved, like, allow_lossy=True)
    np.testing.assert_array_equal(out["gemm"].input_amax_history, want)
    # only the largest amax sets the scale: lossless where the saved one is still there
    lossless = float(want.max()) == float(saved["gemm"].input_amax_history.max())
    assert report.lossless == lossless, (report, amaxes, old, new)
    if not lossless:
        with pytest.raises(LossyConversionError, match="convert_fp8_state would change"):
            convert_fp8_state(saved, like)


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def test_linen_variables_move_between_history_lengths_and_policies():
    x = jnp.ones((2, 4))
    policy = lambda n: f"p=f32,c=bf16,o=f32,fp8=delayed,fp8_history={n}"
    long = jaxamp.linen.apply_policy(_Mlp(), policy(16)).init(jax.random.key(0), x)
    state = long[FP8_STATE_COLLECTION]
    state = jax.tree.map(lambda v: v + 1.0 if v.shape == (16,) else v, state)  # amaxes of 1
    long = {**long, FP8_STATE_COLLECTION: state}
    short = jaxamp.linen.apply_policy(_Mlp(), policy(4)).init(jax.random.key(1), x)
    out, report = convert_fp8_state(long, short)
    assert report.lossless and {r.action for r in report.rows} == {"resized"}
    for a, b in zip(jax.tree.leaves(out["params"]), jax.tree.leaves(short["params"]), strict=True):
        assert a is b  # not FP8 state: returned as it is
    for leaf in jax.tree.leaves(out[FP8_STATE_COLLECTION]):
        assert leaf.shape in ((4,), (1,))
    assert float(out[FP8_STATE_COLLECTION]["Dense_0"]["input_amax_history"].max()) == 1.0
    # to a policy without delayed scaling: dropped; from one without: fresh
    plain = jaxamp.linen.apply_policy(_Mlp(), "mixed_bfloat16").init(jax.random.key(1), x)
    dropped, report = convert_fp8_state(long, plain)
    assert jax.tree.structure(dropped) == jax.tree.structure(plain)
    assert {r.action for r in report.rows} == {"dropped"} and report.lossless
    created, report = convert_fp8_state(plain, short)
    assert {r.action for r in report.rows} == {"created"}
    np.testing.assert_array_equal(
        created[FP8_STATE_COLLECTION]["Dense_1"]["kernel_amax_history"], np.zeros(4)
    )


def test_nnx_state_moves_between_history_lengths():
    policy = lambda n: f"p=f32,c=bf16,o=f32,fp8=delayed,fp8_history={n}"
    make = lambda n: jaxamp.nnx.apply_policy(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), policy(n))
    old, new = make(8), make(4)
    saved = nnx.state(old)
    saved = jax.tree.map(lambda v: jnp.arange(8.0) if v.shape == (8,) else v, saved)
    out, report = convert_fp8_state(saved, nnx.state(new))
    assert report.lossless  # the largest amax (7, the newest-but-one) is among the kept
    nnx.update(new, out)
    found = {path: value for path, value in jax.tree_util.tree_flatten_with_path(nnx.state(new))[0]}
    histories = [v for p, v in found.items() if "input_amax_history" in jax.tree_util.keystr(p)]
    assert [np.asarray(h).tolist() for h in histories] == [[0.0, 5.0, 6.0, 7.0]]


def test_the_target_may_be_shapes_from_eval_shape():
    x = jnp.ones((2, 4))
    policy = lambda n: f"p=f32,c=bf16,o=f32,fp8=delayed,fp8_history={n}"
    saved = jaxamp.linen.apply_policy(_Mlp(), policy(4)).init(jax.random.key(0), x)
    like = jax.eval_shape(jaxamp.linen.apply_policy(_Mlp(), policy(8)).init, jax.random.key(1), x)
    out, report = convert_fp8_state(saved, like)
    assert report.lossless
    history = out[FP8_STATE_COLLECTION]["Dense_0"]["input_amax_history"]
    assert isinstance(history, jax.Array) and history.shape == (8,)
    fresh, _ = convert_fp8_state({"params": saved["params"]}, like)
    scale = fresh[FP8_STATE_COLLECTION]["Dense_1"]["kernel_scale"]
    np.testing.assert_array_equal(scale, np.ones(1))
    assert isinstance(fresh["params"]["Dense_0"]["kernel"], jax.ShapeDtypeStruct)
