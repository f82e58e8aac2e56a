"""The model a comparison trains, ResNet or BERT, and how to feed it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxamp._src.compare.config import CompareConfig
from jaxamp._src.compare.models.bert import BertClassifier, BertConfig
from jaxamp._src.compare.models.resnet import ResNet18, ResNet50
from jaxamp._src.ops.fp8_state import STATE_COLLECTION as FP8_STATE


@dataclasses.dataclass
class Task:
    """A model and how to feed it: the parts that differ between ResNet and BERT."""

    module: Any
    has_batch_stats: bool
    learning_rate: float

    def apply(
        self,
        model: Any,
        params: Any,
        state: Any,
        x: Any,
        train: bool,
        rng: Any,
        fp8: Any = None,
    ) -> tuple[Any, Any]:
        """The logits and the updated ``state`` (BatchNorm statistics); ``fp8``, a delayed
        float8 policy's FP8 state (the ``_overwrite_with_gradient`` collection), is
        read, never updated: its next value is its gradient."""
        extra = {FP8_STATE: fp8} if fp8 else {}
        if self.has_batch_stats:
            variables = {"params": params, "batch_stats": state, **extra}
            if not train:
                return model.apply(variables, x, train=False), state
            logits, updates = model.apply(variables, x, train=True, mutable=["batch_stats"])
            return logits, updates["batch_stats"]
        logits = model.apply(
            {"params": params, **extra},
            x,
            attention_mask=(x > 0).astype(jnp.int32),
            train=train,
            rngs={"dropout": rng} if train else {},
        )
        return logits, state


def make_task(config: CompareConfig, num_classes: int) -> Task:
    """The model ``config`` names, for ``num_classes`` classes, and its learning rate."""
    if config.model == "bert":
        # choose_model fills the shape fields the user left out
        assert config.vocab_size is not None and config.hidden is not None
        assert config.layers is not None and config.heads is not None
        assert config.seq_len is not None
        bert = BertConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden,
            num_layers=config.layers,
            num_heads=config.heads,
            intermediate_size=4 * config.hidden,
            max_position=max(512, config.seq_len),
            num_classes=num_classes,
        )
        return Task(BertClassifier(bert), False, config.learning_rate or 1e-4)
    factory = ResNet50 if config.model == "resnet50" else ResNet18
    return Task(factory(num_classes, width=config.width), True, config.learning_rate or 1e-3)
