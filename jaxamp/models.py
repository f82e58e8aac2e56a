"""The models of jaxamp's reference experiments, as plain Flax Linen code."""

from jaxamp._src.compare.models.bert import BertClassifier, BertConfig, BertLayer
from jaxamp._src.compare.models.gpt2 import GPT2Block, GPT2Config, GPT2LMHeadModel
from jaxamp._src.compare.models.resnet import (
    BasicBlock,
    BottleneckBlock,
    ResNet,
    ResNet18,
    ResNet50,
)

__all__ = (
    "BasicBlock",
    "BertClassifier",
    "BertConfig",
    "BertLayer",
    "BottleneckBlock",
    "GPT2Block",
    "GPT2Config",
    "GPT2LMHeadModel",
    "ResNet",
    "ResNet18",
    "ResNet50",
)
