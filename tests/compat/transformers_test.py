"""transformers' Flax models (4.57, the last line with them), unmodified, under jaxamp.

Each model is built from a tiny config with random weights (no downloads) and
called through its own ``__call__``, as its users call it. Under
``apply_policy`` the model's Linen module is replaced by the policy's; under
``autocast`` the whole loss is wrapped.
"""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxamp
from tests.compat.harness import POLICIES, check_model
from tests.helpers.expected_warnings import FLOAT16_OVERFLOW
from tests.helpers.promotion import FLAX, OTHER_LIBRARY

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, LABELS = 96, 16, 4, 3


def _tokens(key=0):
    ids = jax.random.randint(jax.random.key(key), (BATCH, SEQ), 1, VOCAB)
    return ids.at[:, -3:].set(0)


def _classification_loss(outputs, labels):
    logits = outputs.logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _lm_loss(outputs, ids):
    logits = outputs.logits[:, :-1].astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def bert():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ, num_labels=LABELS,
    )  # fmt: skip
    model = transformers.FlaxBertForSequenceClassification(config, seed=0)
    ids = _tokens()
    inputs = {"input_ids": ids, "attention_mask": (ids > 0).astype(jnp.int32)}
    return model, inputs, jnp.arange(BATCH) % LABELS, _classification_loss


def roberta():
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=SEQ + 2, num_labels=LABELS,
    )  # fmt: skip
    model = transformers.FlaxRobertaForSequenceClassification(config, seed=0)
    ids = _tokens(1).at[:, 0].set(0)  # <s>
    inputs = {"input_ids": ids, "attention_mask": jnp.ones_like(ids)}
    return model, inputs, jnp.arange(BATCH) % LABELS, _classification_loss


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4
    )
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    ids = _tokens(2)
    return model, {"input_ids": ids}, ids, _lm_loss


def vit():
    # ViT's and OPT's default attention dropout is 0: 0.1 here, for the train-mode test
    # (dropout is off in every other test, which runs eval mode)
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=LABELS,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )  # fmt: skip
    model = transformers.FlaxViTForImageClassification(config, seed=0)
    pixels = jax.random.normal(jax.random.key(3), (BATCH, 3, 16, 16))
    return model, {"pixel_values": pixels}, jnp.arange(BATCH) % LABELS, _classification_loss


def resnet():
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=LABELS,
    )  # fmt: skip
    model = transformers.FlaxResNetForImageClassification(config, seed=0)
    pixels = jax.random.normal(jax.random.key(4), (BATCH, 3, 32, 32))
    return model, {"pixel_values": pixels}, jnp.arange(BATCH) % LABELS, _classification_loss


def distilbert():
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=SEQ, num_labels=LABELS,
    )  # fmt: skip
    model = transformers.FlaxDistilBertForSequenceClassification(config, seed=0)
    ids = _tokens(5)
    inputs = {"input_ids": ids, "attention_mask": (ids > 0).astype(jnp.int32)}
    return model, inputs, jnp.arange(BATCH) % LABELS, _classification_loss


def opt():
    config = transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
        num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=32,
        attention_dropout=0.1,
    )  # fmt: skip
    model = transformers.FlaxOPTForCausalLM(config, seed=0)
    ids = _tokens(6)
    return model, {"input_ids": ids, "attention_mask": jnp.ones_like(ids)}, ids, _lm_loss


# T5 is left out: its Flax code calls jnp.clip(a_max=...), which jax 0.10 removed, so it
# does not run in float32 either.
MODELS = {
    "BERT": bert,
    "RoBERTa": roberta,
    "DistilBERT": distilbert,
    "GPT-2": gpt2,
    "OPT": opt,
    "ViT": vit,
    "ResNet": resnet,
}


def _loss_of(model, inputs, targets, loss_from_outputs):
    def loss(params, batch):
        return loss_from_outputs(model(**batch["inputs"], params=params), batch["targets"])

    return loss


# What does not work, and why: each entry is a strict xfail, so a fix shows up as a failure.
KNOWN_FAILURES: dict[tuple[str, str, str], str] = {}

# Cases the default run always takes: DistilBERT masks its scores with
# ``scores - 1e30 * (1 - mask)``, which float16 layers trace as ``inf * 0`` (NaN; transformers'
# own dtype=float16 does that, see test_distilbert_float16_nan_is_the_models_own). Under a
# policy the constant keeps the value written (jaxamp._src.autocast.constants).
ALWAYS_RUN = {("DistilBERT", "apply_policy", "mixed_float16")}


def _cases():
    """Every model x path x policy. The default run takes each model once, under the
    (path, policy) pairs in turn, so that every path runs with every policy, and every
    known failure; the rest are marked slow."""
    pairs = [(path, policy) for path in ("apply_policy", "autocast") for policy in POLICIES]
    cases = []
    for i, name in enumerate(MODELS):
        for path, policy in pairs:
            in_default = pairs[i % len(pairs)] == (path, policy)
            in_default = in_default or (name, path, policy) in {*KNOWN_FAILURES, *ALWAYS_RUN}
            marks = () if in_default else (pytest.mark.slow,)
            cases.append(pytest.param(name, path, policy, marks=marks))
    return cases


# DistilBERT's mask fill (finfo(float32).min) overflows float16 in its 16-bit trace
@pytest.mark.standard_promotion(FLAX)
@FLOAT16_OVERFLOW
@pytest.mark.parametrize("name, path, policy", _cases())
def test_transformers_model(name, path, policy, request):
    if (name, path, policy) in KNOWN_FAILURES:
        reason = KNOWN_FAILURES[name, path, policy]
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    model, inputs, targets, loss_from_outputs = MODELS[name]()
    fp32_loss = _loss_of(model, inputs, targets, loss_from_outputs)
    if path == "apply_policy":
        ours = copy.copy(model)
        ours._module = jaxamp.linen.apply_policy(model.module, policy)  # what __call__ applies
        amp_loss = _loss_of(ours, inputs, targets, loss_from_outputs)
    else:
        amp_loss = jaxamp.autocast(fp32_loss, policy)
    check_model(
        package="transformers",
        model=name,
        path=path,
        policy=policy,
        amp_loss=amp_loss,
        fp32_loss=fp32_loss,
        params=model.params,
        batch={"inputs": inputs, "targets": targets},
    )


@pytest.mark.standard_promotion(FLAX)
def test_distilbert_float16_nan_is_the_models_own():
    model, inputs, targets, loss_from_outputs = distilbert()
    half = transformers.FlaxDistilBertForSequenceClassification(model.config, dtype=jnp.float16)
    loss = _loss_of(half, inputs, targets, loss_from_outputs)(
        model.params, {"inputs": inputs, "targets": targets}
    )
    assert bool(jnp.isnan(loss))


def _train_loss_of(name, model, loss_from_outputs):
    """``loss(params, batch) -> (loss, state)`` in train mode: dropout on (hidden and
    attention) with ``batch["rng"]``; ResNet, which has none, updates its BatchNorm's
    ``batch_stats`` (``state``; ``{}`` for the others)."""
    train = {"deterministic": False} if name == "OPT" else {"train": True}

    def loss(params, batch):
        rng = {} if name == "ResNet" else {"dropout_rng": batch["rng"]}
        outputs = model(**batch["inputs"], params=params, **train, **rng)
        outputs, state = outputs if isinstance(outputs, tuple) else (outputs, {})
        return loss_from_outputs(outputs, batch["targets"]), state

    return loss


def _in_mode(mode, name, model, inputs, targets, loss_from_outputs):
    """``loss(params, batch) -> (loss, state)`` and its batch, in ``mode``."""
    batch = {"inputs": inputs, "targets": targets}
    if mode == "eval":
        loss = _loss_of(model, inputs, targets, loss_from_outputs)
        return lambda params, batch: (loss(params, batch), {}), batch
    return _train_loss_of(name, model, loss_from_outputs), {**batch, "rng": jax.random.key(8)}


# Train mode (dropout masks drawn, batch statistics updated) in CI; eval mode, which
# runs a subset of the same program, in the slow run.
@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("mode", [pytest.param("eval", marks=pytest.mark.slow), "train"])
@pytest.mark.parametrize("path", ["apply_policy", "autocast"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_float32_policy_is_the_identity(name, path, mode):
    """Under ``"float32"`` the model computes exactly what it computes alone: the loss, every
    gradient and, in train mode, the updated ``batch_stats``, bit for bit. In train mode the
    model alone draws its dropout masks (hidden and attention) with Flax's and
    transformers' own code, and the policy's path must draw the same from the same RNG."""
    model, inputs, targets, loss_from_outputs = MODELS[name]()
    alone, batch = _in_mode(mode, name, model, inputs, targets, loss_from_outputs)
    if path == "apply_policy":
        ours = copy.copy(model)
        ours._module = jaxamp.linen.apply_policy(model.module, "float32")
        policed, _ = _in_mode(mode, name, ours, inputs, targets, loss_from_outputs)
    else:
        policed = jaxamp.autocast(alone, "float32")
    expected = jax.jit(jax.value_and_grad(alone, has_aux=True))(model.params, batch)
    got = jax.jit(jax.value_and_grad(policed, has_aux=True))(model.params, batch)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for ours, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(ours, theirs, strict=True)
    if mode == "train":  # the mode is on: the model alone draws dropout masks, or updates
        if name == "ResNet":  # its batch statistics
            updated = jax.tree.leaves(expected[0][1]["batch_stats"])
            before = jax.tree.leaves(model.params["batch_stats"])
            assert any(not np.array_equal(a, b) for a, b in zip(updated, before, strict=True))
        else:
            assert "random_bits" in str(jax.make_jaxpr(alone)(model.params, batch))


@pytest.mark.standard_promotion(OTHER_LIBRARY)
@pytest.mark.parametrize("tied", [True, False])
def test_a_path_override_reaches_a_tied_head(tied):
    """Bloom's tied head calls ``self.lm_head.apply({"params": {"kernel": embedding.T}}, h)``,
    which roots the head in a scope of its own; the override still finds it."""
    config = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, tie_word_embeddings=tied
    )
    model = transformers.FlaxBloomForCausalLM(config, seed=0)
    module = jaxamp.linen.apply_policy(
        model.module, "mixed_bfloat16", overrides={"lm_head": "float32"}
    )
    ids = _tokens(7)
    mask = jnp.ones_like(ids)
    logits = lambda p: module.apply({"params": p}, ids, mask).logits
    report = jaxamp.precision_report(logits)(model.params)
    head = [op for op in report.ops if "lm_head" in op.name]
    assert head and {op.lhs_dtype for op in head} == {"float32"}, head
    assert report.count("bfloat16") >= 2 * config.n_layer  # the rest of the model runs bf16
