"""A GPT-2 decoder-only language model in Flax Linen (GPT-2 small by default)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

_init = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """Sizes of the decoder; the defaults are GPT-2 small's (124M parameters).

    Attributes:
      vocab_size: number of token ids.
      max_position: longest sequence.
      hidden_size: width of the residual stream.
      num_layers: decoder blocks.
      num_heads: attention heads per block.
      dropout_rate: dropout on embeddings, attention weights and block outputs.
      layer_norm_eps: LayerNorm epsilon.
    """

    vocab_size: int = 50257
    max_position: int = 1024
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    dropout_rate: float = 0.1
    layer_norm_eps: float = 1e-5


class GPT2Block(nn.Module):
    """LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP -> residual."""

    config: GPT2Config
    dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool = False) -> jax.Array:
        cfg = self.config
        dense = functools.partial(nn.Dense, kernel_init=_init, dtype=self.dtype)
        norm = functools.partial(nn.LayerNorm, epsilon=cfg.layer_norm_eps, dtype=self.dtype)
        dropout = nn.Dropout(cfg.dropout_rate, deterministic=not train)
        y = norm(name="ln_1")(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            kernel_init=_init,
            dropout_rate=cfg.dropout_rate,
            deterministic=not train,
            dtype=self.dtype,
            name="attn",
        )(y, y, mask=mask)
        x = x + dropout(y)
        y = norm(name="ln_2")(x)
        y = dense(4 * cfg.hidden_size, name="c_fc")(y)
        y = nn.gelu(y, approximate=True)
        y = dense(cfg.hidden_size, name="c_proj")(y)
        return x + dropout(y)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 decoder with a language-model head tied to the token embedding.

    ``__call__(input_ids, train=False)`` takes integer token ids ``[batch, length]``
    (``length <= config.max_position``) and returns next-token logits
    ``[batch, length, vocab_size]``; position ``t`` sees tokens ``0..t`` only.

    Attributes:
      config: the sizes.
      dtype: Flax's per-layer compute dtype (``None``: inferred, float32 here); set it
        by hand to compare with a policy.
    """

    config: GPT2Config = GPT2Config()
    dtype: Any = None

    @nn.compact
    def __call__(self, input_ids: jax.Array, train: bool = False) -> jax.Array:
        cfg = self.config
        length = input_ids.shape[-1]
        if length > cfg.max_position:
            raise ValueError(
                f"input_ids has length {length}, longer than max_position={cfg.max_position}."
            )
        embed = functools.partial(nn.Embed, embedding_init=_init, dtype=self.dtype)
        wte = embed(cfg.vocab_size, cfg.hidden_size, name="wte")
        wpe = embed(cfg.max_position, cfg.hidden_size, name="wpe")
        x = wte(input_ids) + wpe(jnp.arange(length)[None, :])
        x = nn.Dropout(cfg.dropout_rate, deterministic=not train)(x)
        mask = nn.make_causal_mask(input_ids)
        for i in range(cfg.num_layers):
            x = GPT2Block(cfg, dtype=self.dtype, name=f"h_{i}")(x, mask, train=train)
        x = nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x)
