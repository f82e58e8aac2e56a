"""Tests for jaxamp/_src/compare/models/bert.py: parameter count, padding-invariant pooling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxamp.models import BertClassifier, BertConfig
from tests.compare.models.counting import flax_param_count
from tests.helpers.tiny_configs import TINY_BERT


@pytest.mark.parametrize(
    ("model", "inputs", "expected"),
    [
        pytest.param(
            BertClassifier(BertConfig()), (jnp.zeros((1, 8), jnp.int32),), 109_483_778, id="bert"
        ),
    ],
)
def test_full_size_param_counts(model, inputs, expected):
    assert flax_param_count(model, *inputs) == expected


def test_bert_forward(tokens):
    model = BertClassifier(TINY_BERT)
    mask = jnp.ones_like(tokens).at[:, -2:].set(0)
    variables = model.init(jax.random.key(0), tokens)
    logits = jax.jit(model.apply)(variables, tokens, mask)
    assert logits.shape == (2, 3) and logits.dtype == jnp.float32
    # Padded positions do not change the pooled output.
    changed = jax.jit(model.apply)(variables, tokens.at[:, -1].set(7), mask)
    np.testing.assert_allclose(changed, logits, rtol=1e-5, atol=1e-6)
