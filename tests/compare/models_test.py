"""Tests for jaxamp/_src/models: parameter counts, shapes, causality, a policy on GPT-2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxamp
from jaxamp.models import (
    BasicBlock,
    BertClassifier,
    BertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    ResNet,
    ResNet50,
)
from tests.tiny_configs import TINY_BERT, TINY_GPT2


def flax_param_count(model, *inputs):
    """Parameters of ``model`` for ``inputs``, from shapes only (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(2), (2, 8), 1, 64)


@pytest.mark.parametrize(
    ("model", "inputs", "expected"),
    [
        pytest.param(ResNet50(1000), (jnp.zeros((1, 224, 224, 3)),), 25_557_032, id="resnet50"),
        pytest.param(
            BertClassifier(BertConfig()), (jnp.zeros((1, 8), jnp.int32),), 109_483_778, id="bert"
        ),
        pytest.param(
            GPT2LMHeadModel(GPT2Config()), (jnp.zeros((1, 8), jnp.int32),), 124_439_808, id="gpt2"
        ),
    ],
)
def test_full_size_param_counts(model, inputs, expected):
    assert flax_param_count(model, *inputs) == expected


def test_resnet_forward():
    model = ResNet((1, 1), BasicBlock, num_classes=5, width=8)
    images = jax.random.normal(jax.random.key(1), (2, 28, 28, 1))
    variables = model.init(jax.random.key(0), images)
    logits, updates = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))(
        variables, images
    )
    assert logits.shape == (2, 5) and logits.dtype == jnp.float32
    assert jax.tree.structure(updates["batch_stats"]) == jax.tree.structure(
        variables["batch_stats"]
    )
    eval_logits = model.apply(variables, images, train=False)
    assert eval_logits.shape == (2, 5) and bool(jnp.all(jnp.isfinite(eval_logits)))


def test_bert_forward(tokens):
    model = BertClassifier(TINY_BERT)
    mask = jnp.ones_like(tokens).at[:, -2:].set(0)
    variables = model.init(jax.random.key(0), tokens)
    logits = jax.jit(model.apply)(variables, tokens, mask)
    assert logits.shape == (2, 3) and logits.dtype == jnp.float32
    # Padded positions do not change the pooled output.
    changed = jax.jit(model.apply)(variables, tokens.at[:, -1].set(7), mask)
    np.testing.assert_allclose(changed, logits, rtol=1e-5, atol=1e-6)


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
