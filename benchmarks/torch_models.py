"""PyTorch twins of jaxamp's reference models, for side-by-side benchmarks.

Layer for layer the Flax models in :mod:`jaxamp.models`, in plain ``torch.nn``
(no torchvision), with the same parameter counts: a benchmark that compares
the two frameworks checks ``param_count(torch_model)`` against the Flax
model's count before timing anything. Differences that do not change the
parameters are those of the frameworks: images are NCHW here (NHWC in Flax),
and ``nn.Linear`` stores its weight as ``[out, in]`` (Flax: ``[in, out]``).

The factories take the same arguments as the Flax ones (for BERT and GPT-2,
jaxamp's config dataclasses)::

    from jaxamp.models import GPT2Config
    model = gpt2(GPT2Config())  # 124,439,808 parameters, as GPT2LMHeadModel's
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from jaxamp.models import BertConfig, GPT2Config


def param_count(module: nn.Module) -> int:
    """Number of trainable parameters; a tied (shared) parameter counts once."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def _norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-5, momentum=0.1)


def _conv(in_channels: int, out_channels: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(
        in_channels, out_channels, kernel, stride=stride, padding=kernel // 2, bias=False
    )


class BottleneckBlock(nn.Module):
    """1x1 -> 3x3 (strided) -> 1x1 convolutions with a residual connection (v1.5)."""

    expansion = 4

    def __init__(self, in_channels: int, features: int, stride: int = 1):
        super().__init__()
        out_channels = features * self.expansion
        self.conv1, self.bn1 = _conv(in_channels, features, 1), _norm(features)
        self.conv2, self.bn2 = _conv(features, features, 3, stride), _norm(features)
        self.conv3, self.bn3 = _conv(features, out_channels, 1), _norm(out_channels)
        nn.init.zeros_(self.bn3.weight)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                _conv(in_channels, out_channels, 1, stride), _norm(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(residual + y)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (ResNet18/34)."""

    expansion = 1

    def __init__(self, in_channels: int, features: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = _conv(in_channels, features, 3, stride), _norm(features)
        self.conv2, self.bn2 = _conv(features, features, 3), _norm(features)
        nn.init.zeros_(self.bn2.weight)
        self.downsample = None
        if stride != 1 or in_channels != features:
            self.downsample = nn.Sequential(
                _conv(in_channels, features, 1, stride), _norm(features)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(residual + y)


class ResNet(nn.Module):
    """A ResNet classifier for NCHW images, the twin of ``jaxamp.models.ResNet``.

    Args:
      stage_sizes: blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet50.
      block_cls: :class:`BottleneckBlock` or :class:`BasicBlock`.
      num_classes: number of output logits.
      width: channels of the first stage (64 in the paper).
      in_channels: channels of the input images (3 for ImageNet, 1 for FashionMNIST).
    """

    def __init__(
        self,
        stage_sizes: Sequence[int],
        block_cls: type[nn.Module] = BottleneckBlock,
        num_classes: int = 1000,
        width: int = 64,
        in_channels: int = 3,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = _norm(width)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        blocks = []
        channels = width
        for i, num_blocks in enumerate(stage_sizes):
            for j in range(num_blocks):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(block_cls(channels, width * 2**i, stride))
                channels = width * 2**i * block_cls.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        return self.fc(torch.mean(x, dim=(2, 3)))


def resnet18(num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet18, the twin of ``jaxamp.models.ResNet18``."""
    return ResNet((2, 2, 2, 2), BasicBlock, num_classes, in_channels=in_channels)


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> ResNet:
    """ResNet50, the twin of ``jaxamp.models.ResNet50``."""
    return ResNet((3, 4, 6, 3), BottleneckBlock, num_classes, in_channels=in_channels)


def _init_transformer(module: nn.Module) -> None:
    """normal(0.02) weights and zero biases, as the Flax models initialise theirs."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v and output projections.

    The twin of ``flax.linen.MultiHeadDotProductAttention`` used as self-attention:
    the same four biased projections, dropout on the attention weights.
    """

    def __init__(self, hidden_size: int, num_heads: int, dropout_rate: float):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}."
            )
        self.num_heads = num_heads
        self.dropout_rate = dropout_rate
        self.query = nn.Linear(hidden_size, hidden_size)
        self.key = nn.Linear(hidden_size, hidden_size)
        self.value = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False
    ) -> torch.Tensor:
        batch, length, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, self.num_heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            attn_mask=mask,
            dropout_p=self.dropout_rate if self.training else 0.0,
            is_causal=is_causal,
        )
        return self.out(y.transpose(1, 2).reshape(batch, length, hidden))


class BertLayer(nn.Module):
    """Self-attention and feed-forward blocks, each followed by add & LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        cfg = config
        self.attention = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.dropout_rate)
        self.attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, mask)))
        y = self.output(F.gelu(self.intermediate(x), approximate="none"))
        return self.output_norm(x + self.dropout(y))


class BertClassifier(nn.Module):
    """BERT encoder with a pooled classification head (``jaxamp.models.BertClassifier``'s twin).

    ``forward(input_ids, attention_mask=None, token_type_ids=None)`` takes integer
    tensors ``[batch, length]`` (``attention_mask``: nonzero for real tokens) and
    returns logits ``[batch, num_classes]``.
    """

    def __init__(self, config: BertConfig | None = None):
        super().__init__()
        cfg = self.config = BertConfig() if config is None else config
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.embeddings_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_classes)
        self.dropout = nn.Dropout(cfg.dropout_rate)
        self.apply(_init_transformer)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        length = input_ids.shape[-1]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(length, device=input_ids.device)[None, :]
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        x = self.dropout(self.embeddings_norm(x))
        mask = None
        if attention_mask is not None:
            # Additive mask on the keys, [batch, 1, 1, length]; finite, so a row
            # with every key masked gives uniform weights (as in Flax), not NaN.
            mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
            mask = mask.masked_fill(attention_mask == 0, torch.finfo(x.dtype).min)
            mask = mask[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        pooled = self.dropout(torch.tanh(self.pooler(x[:, 0])))
        return self.classifier(pooled)


def bert_classifier(config: BertConfig | None = None) -> BertClassifier:
    """The twin of ``jaxamp.models.BertClassifier(config)`` (BERT-base by default)."""
    return BertClassifier(config)


class GPT2Block(nn.Module):
    """LayerNorm -> causal self-attention -> residual; LayerNorm -> MLP -> residual."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        cfg = config
        self.ln_1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.dropout_rate)
        self.ln_2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.c_fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.c_proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x), is_causal=True))
        y = self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return x + self.dropout(y)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with a tied language-model head, the twin of ``jaxamp.models.GPT2LMHeadModel``.

    ``forward(input_ids)`` takes integer token ids ``[batch, length]`` and returns
    logits ``[batch, length, vocab_size]``. ``lm_head.weight`` is ``wte.weight``.
    """

    def __init__(self, config: GPT2Config | None = None):
        super().__init__()
        cfg = self.config = GPT2Config() if config is None else config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout_rate)
        self.h = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(_init_transformer)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[-1]
        if length > self.config.max_position:
            raise ValueError(
                f"input_ids has length {length}, longer than "
                f"max_position={self.config.max_position}."
            )
        positions = torch.arange(length, device=input_ids.device)[None, :]
        x = self.dropout(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(config: GPT2Config | None = None) -> GPT2LMHeadModel:
    """The twin of ``jaxamp.models.GPT2LMHeadModel(config)`` (GPT-2 small by default)."""
    return GPT2LMHeadModel(config)
