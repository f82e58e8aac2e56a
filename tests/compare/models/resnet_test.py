"""Tests for jaxamp/_src/compare/models/resnet.py: parameter count, forward, batch stats."""

import jax
import jax.numpy as jnp
import pytest

from jaxamp.models import BasicBlock, ResNet, ResNet50
from tests.compare.models.counting import flax_param_count


@pytest.mark.parametrize(
    ("model", "inputs", "expected"),
    [
        pytest.param(ResNet50(1000), (jnp.zeros((1, 224, 224, 3)),), 25_557_032, id="resnet50"),
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
