"""Tests for jaxamp/_src/compare/models/gpt2.py: parameter count, causality, a policy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.models import GPT2Config, GPT2LMHeadModel
from tests.compare.models.counting import flax_param_count
from tests.helpers.promotion import FLAX
from tests.helpers.tiny_configs import TINY_GPT2


@pytest.mark.parametrize(
    ("model", "inputs", "expected"),
    [
        pytest.param(
            GPT2LMHeadModel(GPT2Config()), (jnp.zeros((1, 8), jnp.int32),), 124_439_808, id="gpt2"
        ),
    ],
)
def test_full_size_param_counts(model, inputs, expected):
    assert flax_param_count(model, *inputs) == expected


def test_gpt2_forward_is_causal(tokens):
    model = GPT2LMHeadModel(TINY_GPT2)
    variables = model.init(jax.random.key(0), tokens)
    apply = jax.jit(model.apply)
    logits = apply(variables, tokens)
    assert logits.shape == (2, 8, 64) and logits.dtype == jnp.float32
    changed = apply(variables, tokens.at[:, 5].set((tokens[:, 5] + 1) % 64))
    np.testing.assert_allclose(changed[:, :5], logits[:, :5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(changed[:, 5:], logits[:, 5:])


def test_gpt2_head_is_tied(tokens):
    variables = GPT2LMHeadModel(TINY_GPT2).init(jax.random.key(0), tokens)
    assert set(variables["params"]) == {"wte", "wpe", "h_0", "h_1", "ln_f"}


def test_gpt2_dropout_needs_train(tokens):
    model = GPT2LMHeadModel(TINY_GPT2)
    variables = model.init(jax.random.key(0), tokens)
    rngs = {"dropout": jax.random.key(3)}
    train = model.apply(variables, tokens, train=True, rngs=rngs)
    assert train.shape == (2, 8, 64)
    assert not np.allclose(train, model.apply(variables, tokens))


def test_gpt2_rejects_long_inputs():
    model = GPT2LMHeadModel(TINY_GPT2)
    with pytest.raises(ValueError, match="max_position=16"):
        jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 17), jnp.int32)))


@pytest.mark.standard_promotion(FLAX)
def test_gpt2_under_mixed_bfloat16(tokens):
    model = jaxamp.linen.apply_policy(GPT2LMHeadModel(TINY_GPT2), "mixed_bfloat16")
    variables = model.init(jax.random.key(0), tokens)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {np.dtype("float32")}
    logits = jax.jit(model.apply)(variables, tokens)
    assert logits.shape == (2, 8, 64) and logits.dtype == jnp.float32

    report = jaxamp.precision_report(lambda p: model.apply({"params": p}, tokens))(
        variables["params"]
    ).check(jnp.bfloat16)
    # q, k, v, out projections + two attention matmuls + two MLP layers per block, + LM head.
    assert len(report.ops) == TINY_GPT2.num_layers * 8 + 1, report
    assert report.all_operands_in(jnp.bfloat16), report
    assert "wte.attend" in report.ops[-1].name, report  # the tied LM head
    # every matmul, the tied head (Embed.attend, which has no precision field) included,
    # states float32 accumulation
    assert {op.accumulation_dtype for op in report.ops} == {"float32"}, report
