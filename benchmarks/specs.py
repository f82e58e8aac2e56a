"""The benchmarked models, each buildable in Flax and in PyTorch with the same architecture."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxamp.models import (
    BasicBlock,
    BertClassifier,
    BertConfig,
    GPT2Config,
    GPT2LMHeadModel,
    ResNet,
    ResNet50,
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model at one input shape.

    Attributes:
      name: e.g. ``"resnet50-224"``.
      family: ``"resnet"``, ``"bert"`` or ``"gpt2"``.
      image: image side (ResNets).
      channels: image channels (ResNets).
      num_classes: logits (ResNets, BERT).
      seq_len: sequence length (BERT, GPT-2).
      config: ``BertConfig`` or ``GPT2Config``; for ResNets, ``(stage_sizes, width)``.
    """

    name: str
    family: str
    image: int = 0
    channels: int = 3
    num_classes: int = 10
    seq_len: int = 0
    config: Any = None

    def flax_module(self, dtype: Any = None):
        """The Flax model; ``dtype`` sets every layer's compute dtype by hand."""
        if self.family == "resnet":
            if self.config is None:
                return ResNet50(self.num_classes, dtype=dtype)
            stages, width = self.config
            return ResNet(stages, BasicBlock, self.num_classes, width=width, dtype=dtype)
        if self.family == "bert":
            return BertClassifier(self.config, dtype=dtype)
        return GPT2LMHeadModel(self.config, dtype=dtype)

    def torch_module(self):
        """The PyTorch twin (imports torch)."""
        from benchmarks import torch_models

        if self.family == "resnet":
            if self.config is None:
                return torch_models.resnet50(self.num_classes, in_channels=self.channels)
            stages, width = self.config
            return torch_models.ResNet(
                stages,
                torch_models.BasicBlock,
                self.num_classes,
                width=width,
                in_channels=self.channels,
            )
        if self.family == "bert":
            return torch_models.bert_classifier(self.config)
        return torch_models.gpt2(self.config)

    def batch(self, batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """NumPy inputs (NHWC images or token ids) and labels."""
        rng = np.random.default_rng(seed)
        if self.family == "resnet":
            x = rng.standard_normal(
                (batch_size, self.image, self.image, self.channels), dtype=np.float32
            )
            return x, (np.arange(batch_size) % self.num_classes).astype(np.int32)
        ids = rng.integers(1, self.config.vocab_size, (batch_size, self.seq_len), dtype=np.int32)
        if self.family == "bert":
            return ids, (np.arange(batch_size) % self.config.num_classes).astype(np.int32)
        return ids, ids  # next-token prediction

    def examples_name(self) -> str:
        return "images" if self.family == "resnet" else "sequences"


# Small transformers for CPU runs (PyTorch's 16-bit autocast takes minutes per BERT-base
# step on a CPU without bf16 units): 4 layers, width 256, both frameworks alike.
_SMALL_BERT = BertConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024)
_SMALL_GPT2 = GPT2Config(hidden_size=256, num_layers=4, num_heads=4)
# BERT- and GPT-2-shaped layers at full width, fewer of them (4 x 768): the shape on which
# 16-bit GEMMs pay on a CPU with bf16 units, at a step time a 2-core machine can repeat.
_BERT4 = BertConfig(num_layers=4)
_GPT2_4 = GPT2Config(num_layers=4)
_TINY_BERT = BertConfig(
    vocab_size=512,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    intermediate_size=64,
    max_position=64,
    num_classes=2,
)
_TINY_GPT2 = GPT2Config(vocab_size=512, max_position=64, hidden_size=32, num_layers=2, num_heads=2)

SPECS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("resnet50-224", "resnet", image=224, channels=3, num_classes=1000),
        ModelSpec("resnet50-28", "resnet", image=28, channels=1, num_classes=10),
        ModelSpec("bert-128", "bert", seq_len=128, config=BertConfig()),
        ModelSpec("bert-512", "bert", seq_len=512, config=BertConfig()),
        ModelSpec("gpt2-1024", "gpt2", seq_len=1024, config=GPT2Config()),
        ModelSpec("gpt2-256", "gpt2", seq_len=256, config=GPT2Config()),
        ModelSpec("bert-small-128", "bert", seq_len=128, config=_SMALL_BERT),
        ModelSpec("gpt2-small-256", "gpt2", seq_len=256, config=_SMALL_GPT2),
        ModelSpec("bert4-128", "bert", seq_len=128, config=_BERT4),
        ModelSpec("gpt2-4-128", "gpt2", seq_len=128, config=_GPT2_4),
        ModelSpec(
            "resnet-tiny", "resnet", image=32, channels=3, num_classes=10, config=((1, 1), 8)
        ),
        ModelSpec("bert-tiny", "bert", seq_len=32, config=_TINY_BERT),
        ModelSpec("gpt2-tiny", "gpt2", seq_len=32, config=_TINY_GPT2),
    )
}


def get_spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"Unknown model {name!r}. Valid choices: {', '.join(SPECS)}.")
    return SPECS[name]
