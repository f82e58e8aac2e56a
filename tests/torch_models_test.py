"""Tests for benchmarks/torch_models.py: the PyTorch twins match the Flax models' sizes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from benchmarks import torch_models  # noqa: E402
from jaxamp.models import (  # noqa: E402
    BasicBlock,
    BertClassifier,
    BertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    ResNet,
    ResNet18,
    ResNet50,
)
from tests.helpers.tiny_configs import TINY_BERT, TINY_GPT2  # noqa: E402

TOKENS = jnp.zeros((1, 8), jnp.int32)


def flax_param_count(model, *inputs):
    """Parameters of ``model`` for ``inputs``, from shapes only (nothing is allocated)."""
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *inputs))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes["params"]))


def images(channels, size):
    return jnp.zeros((1, size, size, channels))


PAIRS = {
    "resnet50_fashion_mnist": (
        lambda: ResNet50(10),
        (images(1, 28),),
        lambda: torch_models.resnet50(10, in_channels=1),
        None,
    ),
    "resnet50_imagenet": (
        lambda: ResNet50(1000),
        (images(3, 224),),
        lambda: torch_models.resnet50(1000, in_channels=3),
        25_557_032,
    ),
    "resnet18": (
        lambda: ResNet18(10),
        (images(3, 32),),
        lambda: torch_models.resnet18(10, in_channels=3),
        None,
    ),
    "tiny_resnet": (
        lambda: ResNet((1, 1), BasicBlock, num_classes=5, width=8),
        (images(1, 28),),
        lambda: torch_models.ResNet(
            (1, 1), torch_models.BasicBlock, num_classes=5, width=8, in_channels=1
        ),
        None,
    ),
    "bert_base": (
        lambda: BertClassifier(BertConfig()),
        (TOKENS,),
        lambda: torch_models.bert_classifier(BertConfig()),
        109_483_778,
    ),
    "tiny_bert": (
        lambda: BertClassifier(TINY_BERT),
        (TOKENS,),
        lambda: torch_models.bert_classifier(TINY_BERT),
        None,
    ),
    "gpt2_small": (
        lambda: GPT2LMHeadModel(GPT2Config()),
        (TOKENS,),
        lambda: torch_models.gpt2(GPT2Config()),
        124_439_808,
    ),
    "tiny_gpt2": (
        lambda: GPT2LMHeadModel(TINY_GPT2),
        (TOKENS,),
        lambda: torch_models.gpt2(TINY_GPT2),
        None,
    ),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_param_counts_match(name):
    flax_model, inputs, torch_model, expected = PAIRS[name]
    count = flax_param_count(flax_model(), *inputs)
    assert torch_models.param_count(torch_model()) == count
    if expected is not None:
        assert count == expected


def test_resnet_forward_shapes():
    model = torch_models.ResNet(
        (1, 1), torch_models.BasicBlock, num_classes=5, width=8, in_channels=1
    )
    x = torch.randn(2, 1, 28, 28)
    assert model(x).shape == (2, 5)  # train mode: batch statistics
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (2, 5)
    bottleneck = torch_models.ResNet(
        (1, 1), torch_models.BottleneckBlock, num_classes=4, width=4, in_channels=3
    ).eval()
    with torch.no_grad():
        assert bottleneck(torch.randn(2, 3, 16, 16)).shape == (2, 4)


def test_bert_forward_shapes():
    model = torch_models.bert_classifier(TINY_BERT).eval()
    ids = torch.randint(1, 64, (2, 8))
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    with torch.no_grad():
        logits = model(ids, mask)
        assert logits.shape == (2, 3) and logits.dtype == torch.float32
        assert model(ids).shape == (2, 3)
        # Padded positions do not change the pooled output.
        changed = ids.clone()
        changed[:, -1] = 7
        torch.testing.assert_close(model(changed, mask), logits)
        # A row with every token masked stays finite.
        assert torch.isfinite(model(ids, torch.zeros_like(ids))).all()


def test_gpt2_forward_shapes_and_causality():
    model = torch_models.gpt2(TINY_GPT2).eval()
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        logits = model(ids)
        assert logits.shape == (2, 8, 64) and logits.dtype == torch.float32
        changed = ids.clone()
        changed[:, 5] = (ids[:, 5] + 1) % 64
        out = model(changed)
    torch.testing.assert_close(out[:, :5], logits[:, :5])
    assert not torch.allclose(out[:, 5:], logits[:, 5:])
    with pytest.raises(ValueError, match="max_position=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
