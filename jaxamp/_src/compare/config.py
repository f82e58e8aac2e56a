"""What ``jaxamp compare`` runs: its options, and the checks that refuse ones it cannot run."""

from __future__ import annotations

import dataclasses
import math

from jaxamp._src.compare import data as data_lib
from jaxamp._src.compare.variants import AUTO, expand_variants, get_variant
from jaxamp._src.errors import invalid_choice

MODELS = ("auto", "resnet50", "resnet18", "bert")


@dataclasses.dataclass(frozen=True)
class CompareConfig:
    """What ``jaxamp compare`` runs; the defaults finish in minutes on a 2-core CPU.

    Attributes:
      model: ``"resnet50"`` (FashionMNIST, 28x28x1), ``"resnet18"``, ``"bert"`` (IMDB),
        or ``"auto"``: the model that shows AMP on this machine (see
        the jaxamp compare guide, guides/compare.md), in its shape for this machine
        except for the shape fields below that differ from their defaults.
      variants: variant names, each once, ``"fp32"`` (the baseline) among them, or
        ``None`` for this machine's defaults
        (``jaxamp._src.compare.variants.default_variants``).
      epochs: passes over the training examples.
      batch_size: examples per step.
      train_examples: training examples used (``None``: all).
      test_examples: test examples evaluated (``None``: all).
      learning_rate: Adam's learning rate (``None``: 1e-3 for ResNets, 1e-4 for BERT).
      seed: initialisation, shuffling and dropout seed (of the first run).
      seeds: runs with seeds ``seed, seed + 1, ...``; each variant's test accuracy is
        read against fp32's paired by seed and by example (``jaxamp._src.compare.accuracy``).
      data: ``"auto"``, ``"tfds"`` or ``"embedded"``
        (``jaxamp._src.compare.data.load_dataset``).
      data_dir: tensorflow-datasets data directory (``data`` ``"tfds"`` or ``"auto"``;
        refused beside ``"embedded"``, which never reads it).
      bn_recalibration: before evaluation, run this many training batches through the
        model in training mode at the final weights, so that BatchNorm's running
        statistics (a moving average that lags behind fast-changing weights in a short
        run) describe the final model; 0 evaluates with the statistics as trained.
      numerics: before training, the per-layer divergence of each variant from float32
        at the initial weights (``jaxamp.numerics_diff``, on the first training batch,
        BatchNorm normalising over it as in training; a loss-scaled variant at the scale
        of the first step its optimizer takes on it, steps that overflow skipped as in
        training, and recorded as ``divergence_loss_scale``), each layer beside a floor
        (the error of the variant's ideal recipe: its GEMMs and stored activations
        rounded, nothing else) and flagged when well above it
        (``numerics_checks.with_floor``); when a variant computes in float16, a float16
        range check of the float32 model (``jaxamp.range_report``); during training,
        the first non-finite layer of a variant whose loss stops being finite
        (``jaxamp.find_nonfinite``). Each runs outside the timed steps; the float32
        model is measured once for every variant.
      width: channels of a ResNet's first stage.
      layers: BERT layers.
      hidden: BERT hidden size.
      heads: BERT attention heads.
      seq_len: BERT sequence length.
      vocab_size: BERT vocabulary (hashing tokenizer) size.

    A shape field left ``None`` takes the model's own value (``choice.MODEL_SHAPES``:
    BERT-base, a ResNet of width 64), or under ``model="auto"`` the shape picked for
    this machine; one given is kept. ``heads`` left ``None`` with ``hidden`` given is
    ``hidden // 64`` (BERT's heads of 64) where 64 divides it.
    """

    model: str = "auto"
    variants: tuple[str, ...] | None = None
    epochs: int = 3
    batch_size: int = 32
    train_examples: int | None = None
    test_examples: int | None = 1000
    learning_rate: float | None = None
    seed: int = 0
    seeds: int = 1
    data: str = "auto"
    data_dir: str | None = None
    bn_recalibration: int = 20
    numerics: bool = True
    width: int | None = None
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise OptionError(str(invalid_choice("model", self.model, MODELS)))
        for name in ("epochs", "batch_size", "seeds"):
            if getattr(self, name) < 1:
                raise OptionError(f"{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("width", "layers", "hidden", "heads", "seq_len", "vocab_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OptionError(
                    f"{name} must be >= 1 or None (the model's own), got {getattr(self, name)}."
                )
        for name in ("train_examples", "test_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise OptionError(f"{name} must be >= 1 or None (all), got {getattr(self, name)}.")
        if self.bn_recalibration < 0:
            raise OptionError(
                f"bn_recalibration must be >= 0 (0: evaluate with the statistics as trained), "
                f"got {self.bn_recalibration}."
            )
        rate = self.learning_rate
        if rate is not None and not (math.isfinite(rate) and rate > 0):
            raise OptionError(f"learning_rate must be a finite number > 0, got {rate}.")
        if not 0 <= self.seed <= _MAX_SEED - self.seeds:
            raise OptionError(
                f"seed must be from 0 to {_MAX_SEED - self.seeds} (seeds seed to seed + "
                f"seeds - 1 are run), got {self.seed}."
            )
        if self.vocab_size is not None and self.vocab_size < 4:
            raise OptionError(
                f"vocab_size must be >= 4 (the tokenizer's special ids), got {self.vocab_size}."
            )
        if self.seq_len is not None and self.seq_len < 2:
            raise OptionError(
                f"seq_len must be >= 2 (a [CLS] token and a word), got {self.seq_len}."
            )
        if self.model == "bert" and self.hidden is not None and self.heads is not None:
            _check_heads(self)
        if self.variants is not None:
            _check_variants(self.variants)
        if self.data not in data_lib.DATA_SOURCES:
            raise OptionError(str(invalid_choice("data source", self.data, data_lib.DATA_SOURCES)))
        if self.data == "embedded" and self.data_dir is not None:
            raise OptionError(
                f"data_dir={self.data_dir!r} is never read with data='embedded' (the "
                "embedded dataset ships with jaxamp); leave data_dir out, or read it with "
                "data='tfds' (or 'auto')."
            )
        if self.train_examples is not None and self.batch_size > self.train_examples:
            raise OptionError(
                f"batch_size {self.batch_size} exceeds the {self.train_examples} training "
                "examples asked for (train_examples): no full batch to train on."
            )


# Seeds feed NumPy's shuffling, which takes 32-bit seeds.
_MAX_SEED = 2**31 - 1


def _check_heads(config: CompareConfig) -> None:
    hidden, heads = config.hidden, config.heads
    if hidden is not None and heads is not None and hidden % heads:
        valid = [h for h in range(1, hidden + 1) if hidden % h == 0]
        raise OptionError(
            f"hidden ({hidden}) must be divisible by heads ({heads}); heads that divide "
            f"{hidden}: {', '.join(map(str, valid))}."
        )


class OptionError(ValueError):
    """An option of ``jaxamp compare`` that cannot run: names the value and what is valid.

    Raised before any work (the command line prints it in one line and exits 2).
    """


def _check_variants(variants: tuple[str, ...]) -> None:
    """Known names, each once, fp32 (the baseline every verdict is read against) among them."""
    if not variants:
        raise OptionError("variants is empty; give fp32 and at least one other, e.g. fp32,bf16.")
    variants = tuple(expand_variants(variants))
    for name in variants:
        if name.strip().lower() == AUTO:
            continue
        try:
            get_variant(name)
        except ValueError as e:
            raise OptionError(str(e)) from None
    names = [AUTO if v.strip().lower() == AUTO else get_variant(v).name for v in variants]
    repeated = sorted({v for v in names if names.count(v) > 1})
    if repeated:
        raise OptionError(
            f"variant(s) {', '.join(repeated)} given more than once in {', '.join(variants)}; "
            "give each once."
        )
    if "fp32" not in names:
        raise OptionError(
            f"variants {', '.join(variants)} lack fp32, the baseline every speed-up and "
            f"accuracy verdict is read against; add it: fp32,{','.join(names)}."
        )


# The options that shape one kind of model only: set on another, they would do nothing.
_MODEL_OPTIONS = {
    "width": ("resnet50", "resnet18"),
    "bn_recalibration": ("resnet50", "resnet18"),
    "layers": ("bert",),
    "hidden": ("bert",),
    "heads": ("bert",),
    "seq_len": ("bert",),
    "vocab_size": ("bert",),
}


def check_options(config: CompareConfig, reason: str = "") -> None:
    """Refuses options set away from their defaults that the model ``config`` runs ignores.

    Args:
      config: the config after ``model="auto"`` is resolved.
      reason: why that model runs (said in the error when ``auto`` picked it).

    Raises:
      OptionError: naming the options, the model, and the models they apply to.
    """
    defaults = CompareConfig()
    given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    ignored = [
        name
        for name, models in _MODEL_OPTIONS.items()
        if config.model not in models
        and given[name] != getattr(defaults, name)
        and not (name == "bn_recalibration" and given[name] == 0)  # off: true of any model
    ]
    if ignored:
        applies = "; ".join(f"{n} applies to {', '.join(_MODEL_OPTIONS[n])}" for n in ignored)
        picked = f" ({reason})" if reason.startswith("auto") else ""
        raise OptionError(
            f"{', '.join(f'{n}={given[n]}' for n in ignored)} do(es) nothing for model "
            f"{config.model!r}{picked}: {applies}. Leave it out, or choose that model."
        )
    if config.model == "bert":  # after auto: the heads of the BERT it picked
        _check_heads(config)
