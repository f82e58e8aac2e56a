"""Dot-product attention with 16-bit matmuls and a float32 softmax."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxamp._src.dtypes import is_16bit
from jaxamp._src.jaxprs import FLOAT32_SCOPE
from jaxamp._src.ops.matmul import DotGeneral

Array = jax.Array


def _sow(module: Any, weights: Array) -> None:
    """Records the attention weights the way the calling Flax API expects."""
    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)


def softmax_float32(
    logits: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    is_causal: bool = False,
    dtype: Any = None,
) -> Array:
    """Adds ``bias``, applies ``mask`` and takes the softmax over the last axis in float32.

    Args:
      logits: attention logits ``[..., heads, q_length, kv_length]``.
      bias: optional additive bias, broadcastable to ``logits``.
      mask: optional boolean mask, broadcastable to ``logits``; ``False`` masks out.
      is_causal: also mask out the keys after the query's own position, aligned top
        left as Flax and ``jax.nn.dot_product_attention`` align it: query ``i`` sees
        keys ``0..i``, whatever the two lengths.
      dtype: dtype of the returned weights (default: the dtype of ``logits``).

    Returns:
      The attention weights in ``dtype``.

    Examples:
      >>> import jax.numpy as jnp
      >>> w = softmax_float32(jnp.zeros((1, 2, 2), jnp.bfloat16))
      >>> w.dtype, float(w.sum())
      (dtype(bfloat16), 2.0)
    """
    dtype = logits.dtype if dtype is None else dtype
    x = logits.astype(jnp.float32)
    if bias is not None:
        x = x + bias.astype(jnp.float32)
    big_neg = jnp.finfo(jnp.float32).min
    if mask is not None:
        x = jnp.where(mask, x, big_neg)
    if is_causal:
        # aligned top left, as Flax's and jax.nn.dot_product_attention's: query i sees
        # keys 0..i, whatever the lengths
        causal = jnp.tril(jnp.ones(x.shape[-2:], jnp.bool_))
        x = jnp.where(causal, x, big_neg)
    return jax.nn.softmax(x, axis=-1).astype(dtype)


def _einsum_as_traced(*args: Any, **kwargs: Any) -> Array:
    """``jnp.einsum`` in the dtype it is given, which autocast keeps (a float32 compute
    dtype under a float8 policy: the two attention matmuls stay out of float8)."""
    with jax.named_scope(FLOAT32_SCOPE):
        return jnp.einsum(*args, **kwargs)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None = None,
    mask: Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    is_causal: bool = False,
    qk_attn_weights_einsum: Callable[..., Array] | None = None,
    attn_weights_value_einsum: Callable[..., Array] | None = None,
) -> Array:
    """Attention with compute-dtype matmuls and a float32 softmax.

    A drop-in ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention``
    and ``flax.nnx.MultiHeadAttention``, with the arguments of Flax's
    ``dot_product_attention``; grouped-query attention (fewer key/value heads
    than query heads) is supported. ``jaxamp.linen.apply_policy`` and
    ``jaxamp.nnx.apply_policy`` install it where a model uses Flax's default.

    Args:
      query: ``[batch..., q_length, num_heads, depth]``.
      key: ``[batch..., kv_length, num_kv_heads, depth]``.
      value: ``[batch..., kv_length, num_kv_heads, v_depth]``.
      bias: optional bias broadcastable to ``[batch..., num_heads, q_length, kv_length]``.
      mask: optional boolean mask of the same shape; ``False`` masks out.
      broadcast_dropout: use the same dropout mask across batch dimensions.
      dropout_rng: PRNG key for dropout.
      dropout_rate: dropout probability on the attention weights.
      deterministic: disables dropout.
      dtype: compute dtype of the matmuls (default: promoted from the inputs).
      precision: ``precision`` of the two matmuls (a ``lax.Precision``); with a
        16-bit ``dtype`` they run under jaxamp's matmul rule (16-bit operands,
        float32 accumulation, forward and backward).
      module: the Flax module to sow the attention weights into, or ``None``.
      is_causal: apply a causal mask.
      qk_attn_weights_einsum: optional replacement for the query-key ``einsum``.
      attn_weights_value_einsum: optional replacement for the weights-value ``einsum``.

    Returns:
      ``[batch..., q_length, num_heads, v_depth]`` in the compute dtype.
    """
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    q_heads, kv_heads = query.shape[-2], key.shape[-2]
    if q_heads != kv_heads:
        if q_heads % kv_heads:
            raise ValueError(
                f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})."
            )
        key = jnp.repeat(key, q_heads // kv_heads, axis=-2)
        value = jnp.repeat(value, q_heads // kv_heads, axis=-2)

    rule_einsum = DotGeneral(dtype).einsum if is_16bit(dtype) else _einsum_as_traced
    qk_einsum = qk_attn_weights_einsum or rule_einsum
    wv_einsum = attn_weights_value_einsum or rule_einsum
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    logits = qk_einsum("...qhd,...khd->...hqk", query, key, precision=precision)
    weights = softmax_float32(logits, bias, mask, is_causal, dtype)
    if module is not None:
        _sow(module, weights)

    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        if broadcast_dropout:
            shape = (1,) * (key.ndim - 2) + weights.shape[-2:]
        else:
            shape = weights.shape
        if dropout_rng is None:
            raise ValueError("attention dropout (deterministic=False) needs a dropout_rng.")
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = lax.select(
            jnp.broadcast_to(keep, weights.shape),
            weights / jnp.asarray(keep_prob, dtype),
            jnp.zeros_like(weights),
        )
    return wv_einsum("...hqk,...khd->...qhd", weights, value, precision=precision)
