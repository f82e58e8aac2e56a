"""The policy advisor's hit list: ``jaxamp.suggest_policy`` on models with a known precision
fault (it must keep the faulty layer wider) and on clean ones (it must keep nothing).

Each fault is in the model as a user writes it and shows only under the policy: a
LayerNorm written by hand that rounds its statistics to the compute dtype (``dtype``, the
field a policy sets), a layer whose activations exceed float16's range, weights or an
embedding too small for float16, a first layer's input whose outlier makes float8's
per-tensor scale flush the rest. The clean models are jaxamp's own (BERT, GPT-2 and
ResNet18 at small sizes), an NNX transformer layer, and transformers' Flax BERT, GPT-2 and
ViT from tiny configs.

    python -m benchmarks.advisor --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxamp
from benchmarks.common import markdown_table, write_results
from jaxamp._src.compare.environment import describe_hardware, environment
from jaxamp._src.compare.models.bert import BertClassifier, BertConfig
from jaxamp._src.compare.models.gpt2 import GPT2Config, GPT2LMHeadModel
from jaxamp._src.compare.models.resnet import ResNet18


def _stats_in(dtype: Any, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The mean and the inverse standard deviation of ``h`` over its last axis, the
    variance as E[x^2] - E[x]^2 with both statistics rounded to ``dtype`` (as code that
    keeps every value in its layer's dtype rounds them)."""
    mean = jnp.mean(h, -1, keepdims=True).astype(dtype)
    square = jnp.mean(h * h, -1, keepdims=True).astype(dtype)
    return mean, jax.lax.rsqrt(square - mean * mean + jnp.asarray(1e-5, dtype))


class HandLayerNorm(nn.Module):
    """A LayerNorm written by hand in ``dtype``, a field a policy sets to its compute dtype."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        h = h.astype(self.dtype)
        mean, inverse = _stats_in(self.dtype, h)
        scale = self.param("scale", nn.initializers.ones, (h.shape[-1],)).astype(self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (h.shape[-1],)).astype(self.dtype)
        return (h - mean) * inverse * scale + bias


class NormNet(nn.Module):
    """Features with a mean of 16 and a spread of about 1 into the hand-written LayerNorm:
    its variance cancels (257 - 256), which 16-bit statistics cannot resolve."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(64, name="embed", bias_init=nn.initializers.constant(16.0))(x)
        h = HandLayerNorm(name="norm")(h)
        h = nn.relu(nn.Dense(64, name="hidden")(h))
        return nn.Dense(3, name="head")(h)


class NnxHandLayerNorm(nnx.Module):
    """``HandLayerNorm`` in NNX: computes in ``self.dtype``, which a policy sets."""

    def __init__(self, features: int):
        self.dtype: Any = jnp.float32
        self.scale = nnx.Param(jnp.ones((features,)))
        self.bias = nnx.Param(jnp.zeros((features,)))

    def __call__(self, h: jax.Array) -> jax.Array:
        h = h.astype(self.dtype)
        mean, inverse = _stats_in(self.dtype, h)
        scale, bias = self.scale[...].astype(self.dtype), self.bias[...].astype(self.dtype)
        return (h - mean) * inverse * scale + bias


class NnxNormNet(nnx.Module):
    """``NormNet`` in NNX."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.constant(16.0)
        self.embed = nnx.Linear(16, 64, bias_init=init, rngs=rngs)
        self.norm = NnxHandLayerNorm(64)
        self.hidden = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(nnx.relu(self.hidden(self.norm(self.embed(x)))))


class LoudNet(nn.Module):
    """A layer whose activations reach about 3e5, beyond float16's 65504, normalised after
    by Flax's LayerNorm (statistics in float32 under every policy)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(64, name="embed")(x)
        h = nn.Dense(64, name="loud", kernel_init=nn.initializers.normal(1e4))(h)
        h = nn.LayerNorm(name="norm")(h)
        return nn.Dense(3, name="head")(nn.relu(h))


class TinyEmbedNet(nn.Module):
    """An embedding initialised at a scale of 1e-8, below float16's smallest subnormal
    (6e-8), then Flax's LayerNorm, which normalises the scale away in float32."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        init = nn.initializers.normal(1e-8)
        h = nn.Embed(50, 32, embedding_init=init, name="embed")(tokens)
        h = nn.LayerNorm(name="norm")(h)
        h = nn.relu(nn.Dense(32, name="hidden")(h))
        return nn.Dense(3, name="head")(jnp.mean(h, axis=1))


class NnxEncoderLayer(nnx.Module):
    """A pre-norm transformer layer of Flax NNX's own modules (a clean model)."""

    def __init__(self, rngs: nnx.Rngs, dim: int = 32):
        self.embed = nnx.Linear(16, dim, rngs=rngs)
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(2, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)
        h = h + self.attn(self.norm1(h))
        h = h + self.down(nnx.gelu(self.up(self.norm2(h))))
        return self.head(jnp.mean(h, axis=1))


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def linen_loss(model: nn.Module, params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """The cross-entropy of a Linen classifier (``model.apply`` on ``{"params": ...}``)."""
    return _xent(model.apply({"params": params}, x), y)


def nnx_loss(model: nnx.Module, x: jax.Array, y: jax.Array) -> jax.Array:
    """The cross-entropy of an NNX classifier."""
    return _xent(model(x), y)


def _loud_function(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """``LoudNet`` written as a function with named scopes (for ``jaxamp.autocast``)."""
    with jax.named_scope("embed"):
        h = x @ params["embed"]
    with jax.named_scope("loud"):
        h = h @ params["loud"]
    with jax.named_scope("norm"):
        h = jax.nn.standardize(h, axis=-1)
    with jax.named_scope("head"):
        logits = jax.nn.relu(h) @ params["head"]
    return _xent(logits, y)


def _tiny_function(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """A matmul on weights of about 1e-8 (flushed to zero in float16) whose output a
    float32 standardisation brings back to ordinary size."""
    with jax.named_scope("tiny"):
        h = x @ params["tiny"]
    with jax.named_scope("norm"):
        h = jax.nn.standardize(h, axis=-1)
    with jax.named_scope("head"):
        logits = jax.nn.relu(h) @ params["head"]
    return _xent(logits, y)


def _outlier_function(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    """A first layer whose input holds one outlier feature: scaled per tensor from it,
    float8 e4m3 rounds the other features to zero."""
    with jax.named_scope("first"):
        h = jnp.tanh(x @ params["first"] / 1e3)
    with jax.named_scope("head"):
        logits = h @ params["head"]
    return _xent(logits, y)


def _outliers(outlier: float) -> tuple[Callable, tuple, dict]:
    params = {"first": _normal(2, (32, 32), 1 / 6), "head": _normal(3, (32, 3), 1 / 6)}
    x = _normal(1, (16, 32), 1.0).at[:, 0].set(outlier)
    return _outlier_function, (params, x, _labels(16)), {}


def _normal(key: int, shape: tuple[int, ...], scale: float) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _labels(n: int, classes: int = 3) -> jax.Array:
    return jnp.arange(n) % classes


def _linen(model: nn.Module, x: jax.Array, y: jax.Array) -> tuple[Callable, tuple, dict]:
    params = model.init(jax.random.key(0), x)["params"]
    return linen_loss, (params, x, y), {"model": model}


@dataclasses.dataclass(frozen=True)
class Case:
    """A model the advisor is tried on.

    Attributes:
      name: what the model is.
      api: ``"Linen"``, ``"NNX"`` or ``"autocast"``.
      fault: the fault planted, ``""`` for a clean model.
      candidates: the policies offered.
      expected: the layers the advisor must keep in float32 (none for a clean model).
      allowed: layers it may keep besides (downstream of the fault).
      build: makes ``(loss, args, keywords)`` for ``suggest_policy``.
    """

    name: str
    api: str
    fault: str
    candidates: tuple[str, ...]
    expected: frozenset[str]
    allowed: frozenset[str]
    build: Callable[[], tuple[Callable, tuple, dict]]


def _norm_net() -> tuple[Callable, tuple, dict]:
    x = _normal(1, (16, 16), 1.0)
    return _linen(NormNet(), x, _labels(16))


def _nnx_norm_net() -> tuple[Callable, tuple, dict]:
    x = _normal(1, (16, 16), 1.0)
    return nnx_loss, (NnxNormNet(nnx.Rngs(0)), x, _labels(16)), {}


def _loud_net() -> tuple[Callable, tuple, dict]:
    x = _normal(1, (16, 16), 1.0)
    return _linen(LoudNet(), x, _labels(16))


def _loud_params() -> tuple[Callable, tuple, dict]:
    params = {
        "embed": _normal(2, (16, 64), 0.25),
        "loud": _normal(3, (64, 64), 1e4),
        "head": _normal(4, (64, 3), 0.125),
    }
    return _loud_function, (params, _normal(1, (16, 16), 1.0), _labels(16)), {}


def _tiny_embed() -> tuple[Callable, tuple, dict]:
    tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, 50)
    return _linen(TinyEmbedNet(), tokens, _labels(8))


def _tiny_params() -> tuple[Callable, tuple, dict]:
    params = {"tiny": _normal(2, (16, 64), 1e-8), "head": _normal(4, (64, 3), 0.125)}
    return _tiny_function, (params, _normal(1, (16, 16), 1.0), _labels(16)), {}


def _bert() -> tuple[Callable, tuple, dict]:
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64
    )
    config = dataclasses.replace(config, max_position=32, num_classes=3)
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 1, 64)
    return _linen(BertClassifier(config), tokens, _labels(8))


def _gpt2() -> tuple[Callable, tuple, dict]:
    config = GPT2Config(vocab_size=64, max_position=32, hidden_size=32, num_layers=2, num_heads=2)
    model = GPT2LMHeadModel(config)
    tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 64)
    params = model.init(jax.random.key(0), tokens)["params"]

    def next_token(model: nn.Module, params: Any, tokens: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return next_token, (params, tokens), {"model": model}


def _resnet() -> tuple[Callable, tuple, dict]:
    model = ResNet18(3, width=8)
    x = _normal(1, (8, 16, 16, 3), 1.0)
    variables = model.init(jax.random.key(0), x, train=False)

    def loss(model: nn.Module, params: Any, stats: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits, _ = model.apply(
            {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
        )
        return _xent(logits, y)

    args = (variables["params"], variables["batch_stats"], x, _labels(8))
    return loss, args, {"model": model}


def _nnx_encoder() -> tuple[Callable, tuple, dict]:
    x = _normal(1, (8, 12, 16), 1.0)
    return nnx_loss, (NnxEncoderLayer(nnx.Rngs(0)), x, _labels(8)), {}


def _transformers(name: str) -> tuple[Callable, tuple, dict]:
    """A transformers Flax model from a tiny config (random weights, no download), its
    Linen module under ``model=`` as the tests' compatibility suite runs it."""
    import copy

    import transformers

    ids = jax.random.randint(jax.random.key(1), (4, 16), 1, 96)
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    if name == "BERT":
        config = transformers.BertConfig(vocab_size=96, max_position_embeddings=16, **small)
        config.num_labels = 3
        hf = transformers.FlaxBertForSequenceClassification(config, seed=0)
        inputs, target = {"input_ids": ids, "attention_mask": jnp.ones_like(ids)}, _labels(4)
    elif name == "GPT-2":
        config = transformers.GPT2Config(
            vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4
        )
        hf = transformers.FlaxGPT2LMHeadModel(config, seed=0)
        inputs, target = {"input_ids": ids}, ids
    else:
        config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, **small)
        config.num_labels = 3
        hf = transformers.FlaxViTForImageClassification(config, seed=0)
        inputs = {"pixel_values": _normal(1, (4, 3, 16, 16), 1.0)}
        target = _labels(4)

    def loss(module: nn.Module, params: Any, inputs: Any, target: jax.Array) -> jax.Array:
        ours = copy.copy(hf)
        ours._module = module  # what the model's __call__ applies
        logits = ours(**inputs, params=params).logits.astype(jnp.float32)
        if name == "GPT-2":  # next token
            logits, target = logits[:, :-1], target[:, 1:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

    return loss, (hf.params, inputs, target), {"model": hf.module}


_NONE: frozenset[str] = frozenset()
BF16 = ("mixed_bfloat16",)
F16 = ("mixed_float16",)
BOTH = ("mixed_bfloat16", "mixed_float16")
F8 = ("mixed_float8",)
_FLUSH = "a GEMM input float8 flushes"
_HAND = "hand LayerNorm, 16-bit statistics"
_LOUD = "activations beyond float16"
_TINY = "values below float16's range"
_NORM = frozenset({"norm"})
_EMBED = frozenset({"embed"})
CASES = (
    Case("NormNet", "Linen", _HAND, BF16, frozenset({"norm"}), _NONE, _norm_net),
    # NNX has no method interception, so the floor there does not store each layer's
    # inputs in 16 bits (``ideal_recipe``): the norm's input, embed's output, is held to
    # a stricter floor, and embed may be kept too.
    Case("NnxNormNet", "NNX", _HAND, BF16, frozenset({"norm"}), _EMBED, _nnx_norm_net),
    Case("LoudNet", "Linen", _LOUD, F16, frozenset({"loud"}), _NONE, _loud_net),
    Case("loud function", "autocast", _LOUD, F16, frozenset({"loud"}), _NONE, _loud_params),
    Case("TinyEmbedNet", "Linen", _TINY, F16, frozenset({"embed"}), _NORM, _tiny_embed),
    Case("tiny function", "autocast", _TINY, F16, frozenset({"tiny"}), _NORM, _tiny_params),
    Case(
        "outlier function",
        "autocast",
        _FLUSH,
        F8,
        frozenset({"first"}),
        _NONE,
        functools.partial(_outliers, 1e6),
    ),
    Case("BERT (jaxamp, 2x32)", "Linen", "", BOTH, _NONE, _NONE, _bert),
    Case("GPT-2 (jaxamp, 2x32)", "Linen", "", BOTH, _NONE, _NONE, _gpt2),
    Case("ResNet18 (jaxamp, width 8)", "Linen", "", BOTH, _NONE, _NONE, _resnet),
    Case("NNX encoder layer", "NNX", "", BOTH, _NONE, _NONE, _nnx_encoder),
    Case("BERT (jaxamp, 2x32), float16", "Linen", "", F16, _NONE, _NONE, _bert),
    Case("GPT-2 (jaxamp, 2x32), float16", "Linen", "", F16, _NONE, _NONE, _gpt2),
    Case(
        "the same function, no outlier",
        "autocast",
        "",
        F8,
        _NONE,
        _NONE,
        functools.partial(_outliers, 1.0),
    ),
)
# transformers' Flax models (clean): in the result file, and in the slow tests
TRANSFORMERS_CASES = tuple(
    Case(f"{name} (transformers, 2x32)", "Linen", "", BOTH, _NONE, _NONE,
         functools.partial(_transformers, name))
    for name in ("BERT", "GPT-2", "ViT")
)  # fmt: skip


def run_case(case: Case) -> tuple[jaxamp.PolicySuggestion, dict[str, Any]]:
    """``suggest_policy`` on ``case``, and its record: what it kept and whether that is
    the expected hit (every expected layer kept, nothing outside ``allowed``)."""
    loss, args, keywords = case.build()
    start = time.perf_counter()
    advice = jaxamp.suggest_policy(
        loss, *args, candidates=case.candidates, progress=False, **keywords
    )
    seconds = time.perf_counter() - start
    kept = set(advice.overrides)
    hit = advice.policy == jaxamp.get_policy(case.candidates[0]) and (
        case.expected <= kept <= case.expected | case.allowed
    )
    record = {
        "model": case.name,
        "api": case.api,
        "fault": case.fault or "none",
        "candidates": ", ".join(case.candidates),
        "suggested": next(t.policy for t in advice.trials if t.accepted)
        if any(t.accepted for t in advice.trials)
        else "float32",
        "kept_in_float32": ", ".join(sorted(kept)) or "none",
        "expected": ", ".join(sorted(case.expected)) or "none",
        "hit": hit,
        "runs": 1 + sum(t.measurements + 2 for t in advice.trials),
        "seconds": seconds,
        "reasons": dict(advice.reasons),
        "verdicts": {t.policy: t.verdict for t in advice.trials},
    }
    return advice, record


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the results")
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    args = parser.parse_args(argv)
    env = environment()
    records = []
    every = (*CASES, *TRANSFORMERS_CASES)
    cases = [c for c in every if args.only is None or c.name in args.only]
    for case in cases:
        advice, record = run_case(case)
        records.append(record)
        print(f"{case.name}: {record['suggested']}, kept {record['kept_in_float32']}", flush=True)
        if case.fault and case.api == "Linen":
            advice.plot(Path(args.out) / f"advisor_{case.name.lower()}.png")
    md = "# The policy advisor on models with and without a precision fault\n\n"
    md += f"Hardware: {describe_hardware(env)}; jax {jax.__version__}, flax {env['flax']}.\n\n"
    md += (
        "`jaxamp.suggest_policy` on one batch of each model, offered the candidates listed "
        "(cheapest first). A hit keeps every layer the fault is in, and no layer outside "
        "the ones downstream of it that it may also need; on a clean model, the cheapest "
        "candidate with nothing kept. Runs: forward and backward passes measured (the "
        "float32 reference, two floors per candidate, then one per round). Regenerate: "
        "`python -m benchmarks.advisor`.\n\n"
    )
    md += markdown_table(
        records,
        [
            ("model", "model"),
            ("api", "API"),
            ("fault", "fault"),
            ("candidates", "candidates"),
            ("suggested", "suggested"),
            ("kept_in_float32", "kept in float32"),
            ("expected", "expected"),
            ("hit", "hit"),
            ("runs", "runs"),
            ("seconds", "seconds"),
        ],
    )
    md += "\n\nWhy each layer was kept:\n\n"
    for r in records:
        for layer, reason in r["reasons"].items():
            md += f"- {r['model']}, `{layer}`: {reason}\n"
    hits = sum(r["hit"] for r in records)
    md += f"\n{hits} of {len(records)} hits.\n"
    write_results(args.out, "advisor", records, md, env)
    print(md)
    return records


if __name__ == "__main__":
    main()
