"""A BERT-style encoder classifier in Flax Linen (BERT-base by default)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

_init = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Sizes of the encoder; the defaults are BERT-base's.

    Attributes:
      vocab_size: number of token ids.
      hidden_size: width of the residual stream.
      num_layers: encoder layers.
      num_heads: attention heads per layer.
      intermediate_size: width of the feed-forward block.
      max_position: longest sequence.
      type_vocab_size: number of segment ids.
      num_classes: classifier outputs.
      dropout_rate: dropout on embeddings, attention weights and block outputs.
      layer_norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position: int = 512
    type_vocab_size: int = 2
    num_classes: int = 2
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-12


class BertLayer(nn.Module):
    """Self-attention and feed-forward blocks, each followed by add & LayerNorm."""

    config: BertConfig
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool = False) -> jax.Array:
        cfg = self.config
        dense = functools.partial(nn.Dense, kernel_init=_init, dtype=self.dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_eps, dtype=self.dtype)
        dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
        attn = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            kernel_init=_init,
            dropout_rate=cfg.dropout_rate,
            deterministic=not train,
            dtype=self.dtype,
            name="attention",
        )(x, x, mask=mask)
        x = norm(name="attention_norm")(x + dropout(attn))
        y = dense(cfg.intermediate_size, name="intermediate")(x)
        y = nn.gelu(y, approximate=False)
        y = dense(cfg.hidden_size, name="output")(y)
        return norm(name="output_norm")(x + dropout(y))


class BertClassifier(nn.Module):
    """BERT encoder with a pooled classification head.

    ``__call__(input_ids, attention_mask=None, token_type_ids=None, train=False)``
    takes integer arrays ``[batch, length]`` and returns logits ``[batch, num_classes]``.

    Attributes:
      config: the sizes.
      dtype: Flax's per-layer compute dtype (``None``: inferred, float32 here); set it
        by hand to compare with a policy.
    """

    config: BertConfig = BertConfig()
    dtype: Any = None

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        token_type_ids: jax.Array | None = None,
        train: bool = False,
    ) -> jax.Array:
        cfg = self.config
        embed = functools.partial(nn.Embed, embedding_init=_init, dtype=self.dtype)
        dense = functools.partial(nn.Dense, kernel_init=_init, dtype=self.dtype)
        length = input_ids.shape[-1]
        if attention_mask is None:
            attention_mask = jnp.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = jnp.zeros_like(input_ids)
        positions = jnp.arange(length)[None, :]
        x = (
            embed(cfg.vocab_size, cfg.hidden_size, name="word")(input_ids)
            + embed(cfg.max_position, cfg.hidden_size, name="position")(positions)
            + embed(cfg.type_vocab_size, cfg.hidden_size, name="token_type")(token_type_ids)
        )
        x = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=self.dtype, name="embeddings_norm")(x)
        x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
        mask = nn.make_attention_mask(attention_mask > 0, attention_mask > 0)
        for i in range(cfg.num_layers):
            x = BertLayer(cfg, dtype=self.dtype, name=f"layer_{i}")(x, mask, train=train)
        pooled = jnp.tanh(dense(cfg.hidden_size, name="pooler")(x[:, 0]))
        pooled = nn.Dropout(cfg.dropout_rate, deterministic=not train)(pooled)
        return dense(cfg.num_classes, name="classifier")(pooled)
