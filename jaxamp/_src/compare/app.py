"""``jaxamp compare``: train one model under several precision variants, side by side."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from jaxamp._src.backend import auto_policy
from jaxamp._src.compare import data as data_lib
from jaxamp._src.compare import numerics_checks
from jaxamp._src.compare.accuracy import classification_metrics, merge_seeds
from jaxamp._src.compare.choice import choose_model
from jaxamp._src.compare.environment import environment
from jaxamp._src.compare.models.bert import BertClassifier, BertConfig
from jaxamp._src.compare.models.resnet import ResNet18, ResNet50
from jaxamp._src.compare.variants import FP16_ON_CPU, Variant, default_variants, get_variant
from jaxamp._src.errors import invalid_choice
from jaxamp._src.flax_policy.linen import apply_policy
from jaxamp._src.ops.fp8 import STATE_COLLECTION as FP8_STATE
from jaxamp._src.ops.residuals import activation_bytes
from jaxamp._src.optim.diagnostics import underflow_fraction
from jaxamp._src.optim.gradients import value_and_grad
from jaxamp._src.optim.opt_state import find_loss_scaled_state
from jaxamp._src.policy import cast_floating

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
        (``jaxamp.find_nonfinite``). Each is evaluated one primitive at a time, outside
        the timed steps.
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
    for name in variants:
        try:
            get_variant(name)
        except ValueError as e:
            raise OptionError(str(e)) from None
    names = [get_variant(v).name for v in variants]
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


@dataclasses.dataclass
class _Task:
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
        float8 policy's scaling state (the ``_overwrite_with_gradient`` collection), is
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


def _task(config: CompareConfig, num_classes: int) -> _Task:
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
        return _Task(BertClassifier(bert), False, config.learning_rate or 1e-4)
    factory = ResNet50 if config.model == "resnet50" else ResNet18
    return _Task(factory(num_classes, width=config.width), True, config.learning_rate or 1e-3)


def _eval_batch(batch_size: int) -> int:
    return max(batch_size, 256)


class _Run:
    """One variant: its model, optimizer, compiled steps and everything measured.

    The compiled programs take the seed's key as an argument, so one ``_Run`` serves
    every seed of a comparison: ``reset`` starts it again from a seed's initial
    variables without compiling anything.

    A delayed float8 variant keeps its scaling state in ``fp8_state`` (``{}`` for every
    other variant): each step differentiates it beside the params and replaces it with
    its gradient, its next value; the optimizer never sees it.
    """

    def __init__(
        self,
        variant: Variant,
        task: _Task,
        variables: dict,
        config: CompareConfig,
        sample: tuple[Any, Any],
    ) -> None:
        self.variant, self.task = variant, task
        self.model = apply_policy(task.module, variant.policy)
        self.tx = variant.optimizer(optax.adam(task.learning_rate))
        self.initial_fp8_state = self._initial_fp8_state(sample[0][:1])
        self.reset(variables, config)
        with variant.tracing():
            start = time.perf_counter()
            self.step = (
                jax.jit(self._step)
                .lower(
                    self.params, self.state, self.fp8_state, self.opt_state, *sample, 0, self.key
                )
                .compile()
            )
            self.compile_s = time.perf_counter() - start
            eval_x = jnp.repeat(sample[0][:1], _eval_batch(config.batch_size), axis=0)
            self.predict = (
                jax.jit(lambda p, s, f, x: self.task.apply(self.model, p, s, x, False, None, f)[0])
                .lower(self.params, self.state, self.fp8_state, eval_x)
                .compile()
            )
            self.update_statistics = jax.jit(
                lambda p, s, f, x, key: self.task.apply(self.model, p, s, x, True, key, f)[1]
            )
            # the float8 state differentiated beside the params, as the step does
            self.activation_bytes = activation_bytes(
                lambda pf: self._loss(pf[0], self.state, *sample, self.key, pf[1])[0],
                (self.params, self.fp8_state),
            )

    def _initial_fp8_state(self, x: Any) -> Any:
        """A delayed float8 policy's fresh scaling state (histories of zeros, scales of one)
        for this model, or ``{}``; the same for every seed."""
        fp8 = self.variant.policy.fp8
        if fp8 is None or fp8.scaling != "delayed":
            return {}
        init = lambda key, x: self.model.init(key, x).get(FP8_STATE, {})
        return jax.jit(init)(jax.random.key(0), x)  # what init makes of the params is dropped

    def reset(self, variables: dict, config: CompareConfig) -> None:
        """Starts this variant again from ``variables`` with ``config.seed``'s key."""
        self.params = self.variant.policy.cast_to_param(variables["params"])
        self.state = variables.get("batch_stats", {})
        self.fp8_state = self.initial_fp8_state
        self.opt_state = self.tx.init(self.params)
        self.bytes_per_param = _bytes_per_param(self.params, self.opt_state)
        self.key = jax.random.key(config.seed + 1)
        self.losses: list[Any] = []
        self.scales: list[Any] = []
        self.step_times: list[float] = []
        self.epoch_times: list[float] = []
        self.underflow: list[dict[str, float]] = []
        self.nonfinite: list[Any] = []
        self.diagnose = config.numerics
        self.first_nonfinite: dict[str, Any] | None = None
        self.divergence: list[dict[str, Any]] | None = None
        self.divergence_loss_scale: dict[str, Any] | None = None
        self.recalibration_change: float | None = None

    def _loss(
        self, params: Any, state: Any, x: Any, y: Any, rng: Any, fp8: Any = None
    ) -> tuple[jax.Array, Any]:
        logits, new_state = self.task.apply(self.model, params, state, x, True, rng, fp8)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), new_state

    def _grads(
        self,
        params: Any,
        state: Any,
        fp8: Any,
        opt_state: Any,
        x: Any,
        y: Any,
        step: Any,
        key: Any,
    ) -> tuple[Any, Any, Any]:
        """``((loss, state), grads, fp8)``: the float8 state, differentiated apart from the
        params, comes back as its gradient, its next value."""
        rng = jax.random.fold_in(key, step)
        if self.variant.dynamic_loss_scaling:
            if fp8:  # loss_scaled refuses the state among its gradients
                raise ValueError("a loss-scaled variant cannot carry delayed float8 state")
            loss = lambda p: self._loss(p, state, x, y, rng)
            return (*value_and_grad(loss, has_aux=True)(params, opt_state=opt_state), fp8)
        loss_of = lambda p, f: self._loss(p, state, x, y, rng, f)
        out, (grads, fp8) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(params, fp8)
        return out, grads, fp8

    def _step(
        self,
        params: Any,
        state: Any,
        fp8: Any,
        opt_state: Any,
        x: Any,
        y: Any,
        step: Any,
        key: Any,
    ) -> tuple[Any, ...]:
        (loss, state), grads, fp8 = self._grads(params, state, fp8, opt_state, x, y, step, key)
        # What float16 would flush to zero, without and with this step's loss scale: two
        # reductions over the gradients, well under 1% of a ResNet50 step.
        scale = self.scale_of(opt_state)
        true_grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
        underflow = (
            underflow_fraction(true_grads),
            underflow_fraction(jax.tree.map(lambda g: g * scale, true_grads)),
        )
        # A step whose loss or applied gradients are not finite (one loss scaling skips
        # is counted by the optimizer instead, as skipped).
        finite = jnp.isfinite(loss)
        if not self.variant.dynamic_loss_scaling:
            finite &= jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        updates, opt_state = self.tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, state, fp8, opt_state, loss, underflow, finite

    def scale_of(self, opt_state: Any) -> jax.Array:
        if self.variant.dynamic_loss_scaling:
            return find_loss_scaled_state(opt_state).loss_scale.scale
        return jnp.float32(1.0)

    def loss_fn(self, rng: Any, fp8: Any = None) -> Callable[..., Any]:
        """The training loss of float32 ``params`` (cast to the policy's param dtype),
        traced as this variant's step traces it: for the numerics tools. A delayed float8
        variant reads ``fp8`` (default: its current state) as a constant."""
        fp8 = self.fp8_state if fp8 is None else fp8

        def loss(params: Any, state: Any, x: Any, y: Any) -> jax.Array:
            with self.variant.tracing(), warnings.catch_warnings():
                # one step's values, not training: the state need not be differentiated
                warnings.filterwarnings("ignore", "Delayed float8 scaling", UserWarning)
                params = self.variant.policy.cast_to_param(params)
                return self._loss(params, state, x, y, rng, fp8)[0]

        return loss

    def train_step(self, x: Any, y: Any, step: int) -> None:
        before = (self.params, self.state, self.fp8_state, self.opt_state)
        start = time.perf_counter()
        out = jax.block_until_ready(
            self.step(self.params, self.state, self.fp8_state, self.opt_state, x, y, step, self.key)
        )
        self.step_times.append(time.perf_counter() - start)
        self.params, self.state, self.fp8_state, self.opt_state, loss, underflow, finite = out
        unscaled, scaled = underflow
        if self.diagnose and self.first_nonfinite is None and not np.isfinite(float(loss)):
            self._diagnose(before, x, y, step)
        self.losses.append(loss)
        self.nonfinite.append(~finite)
        self.scales.append(self.scale_of(self.opt_state))
        self.underflow.append({"step": step, "unscaled": unscaled, "scaled": scaled})

    def _diagnose(self, before: tuple[Any, Any, Any, Any], x: Any, y: Any, step: int) -> None:
        """Finds where the step that made a non-finite loss first went non-finite."""
        params, state, fp8, opt_state = before
        rng = jax.random.fold_in(self.key, step)
        scale = float(self.scale_of(opt_state)) if self.variant.dynamic_loss_scaling else None
        params = cast_floating(params, jnp.float32)
        fault = numerics_checks.first_nonfinite(
            self.loss_fn(rng, fp8), params, state, x, y, loss_scale=scale
        )
        self.first_nonfinite = {"step": step, **(fault or _NOT_REPRODUCED)}

    def recalibrate(self, batches: list[tuple[Any, Any]]) -> None:
        """Recomputes BatchNorm running statistics at the final weights, and records how far
        they moved (the largest change relative to the statistic's size)."""
        before = self.state
        with self.variant.tracing():
            for x, _ in batches:
                self.state = self.update_statistics(
                    self.params, self.state, self.fp8_state, x, self.key
                )
        changes = [
            float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
            for a, b in zip(jax.tree.leaves(self.state), jax.tree.leaves(before), strict=True)
        ]
        self.recalibration_change = max(changes, default=0.0)

    def evaluate(self, dataset: data_lib.Dataset, batch_size: int) -> dict[str, Any]:
        chunks = []
        x = dataset.test_x
        for start in range(0, len(x), batch_size):
            chunk = x[start : start + batch_size]
            padded = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - len(chunk), 0)])
            logits = self.predict(self.params, self.state, self.fp8_state, padded)
            chunks.append(np.asarray(jnp.argmax(logits, -1))[: len(chunk)])
        predictions = np.concatenate(chunks)
        metrics = classification_metrics(dataset.test_y, predictions, dataset.num_classes)
        return {**metrics, "correct": (predictions == dataset.test_y).astype(int).tolist()}

    def record(self, dataset: data_lib.Dataset, batch_size: int) -> dict[str, Any]:
        metrics = self.evaluate(dataset, _eval_batch(batch_size))
        median = statistics.median(self.step_times)
        memory = self.step.memory_analysis()
        skipped, final_scale = 0, None
        if self.variant.dynamic_loss_scaling or self.variant.optimizer_recipe:
            state = find_loss_scaled_state(self.opt_state)
            skipped = int(state.skipped_steps)
        if self.variant.dynamic_loss_scaling:
            final_scale = float(state.loss_scale.scale)
        return {
            "variant": self.variant.name,
            "description": self.variant.description,
            "policy": str(self.variant.policy),
            "compile_s": self.compile_s,
            "step_time_median_s": median,
            "step_time_min_s": min(self.step_times),
            "step_time_max_s": max(self.step_times),
            "epoch_time_s": statistics.mean(self.epoch_times),
            "examples_per_s": batch_size / median,
            "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
            "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
            "activation_bytes": self.activation_bytes,
            "final_loss": float(self.losses[-1]),
            "test_accuracy": metrics["accuracy"],
            "test_correct": metrics["correct"],
            "precision": metrics["precision"],
            "recall": metrics["recall"],
            "f1": metrics["f1"],
            "skipped_steps": skipped,
            "nonfinite_steps": int(sum(bool(v) for v in self.nonfinite)),
            "final_loss_scale": final_scale,
            "bn_recalibration_change": self.recalibration_change,
            "bytes_per_param": self.bytes_per_param,
            "divergence": self.divergence,
            "divergence_loss_scale": self.divergence_loss_scale,
            "first_nonfinite": self.first_nonfinite,
            "losses": [float(v) for v in self.losses],
            "loss_scales": [float(v) for v in self.scales] if final_scale is not None else None,
            "underflow": [{k: float(v) for k, v in u.items()} for u in self.underflow],
        }


_NOT_REPRODUCED = {
    "phase": None,
    "layer": "",
    "primitive": "",
    "source": "",
    "description": "find_nonfinite found every value finite when it reran the step",
}


def _numerics_before_training(
    runs: list[_Run],
    task: _Task,
    variables: dict,
    sample: tuple[Any, Any],
    config: CompareConfig,
    log: Callable[[str], None],
) -> dict | None:
    """Per-layer divergence of each variant from float32 at the initial weights, on the
    first training batch as training sees it (BatchNorm on the batch's statistics), each
    layer beside its floor; and the float16 range check when a variant computes in
    float16 (``config.numerics``)."""
    if not config.numerics:
        return None
    rng = jax.random.key(config.seed + 2)
    x, y = sample
    params = variables["params"]
    state = variables.get("batch_stats", {})

    # the unmodified model in true float32
    def reference(params: Any, state: Any, x: Any, y: Any) -> jax.Array:
        with jax.default_matmul_precision("highest"):
            logits, _ = task.apply(task.module, params, state, x, True, rng)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            return loss.mean()

    args = (params, state, x, y)
    floors: dict[Any, Any] = {}  # per dtype (inputs rounded), per recipe and scale (ideal)
    for run in tqdm(runs, desc="per-layer divergence from fp32", unit="variant"):
        scale = None
        if run.variant.dynamic_loss_scaling:  # where the optimizer takes its first step
            taken = numerics_checks.first_step_taken(
                _step_on(run, rng, params, state, x, y), run.opt_state, run.scale_of
            )
            run.divergence_loss_scale = taken
            scale = taken["initial"] if taken["used"] is None else taken["used"]
        policy = run.variant.policy
        dtype = numerics_checks.rounding_dtype(policy)
        rows = numerics_checks.divergence(reference, run.loss_fn(rng), *args, loss_scale=scale)
        taken = run.divergence_loss_scale
        finite = taken is None or taken["loss_finite"]  # a loss no scale makes finite: no floor
        if dtype != np.float32 and finite:  # float32 has no rounding to put a floor under
            if dtype not in floors:
                floors[dtype] = numerics_checks.input_sensitivity(reference, dtype, *args)
            ideal = (policy.compute_dtype, policy.fp8, scale)
            if ideal not in floors:
                floors[ideal] = numerics_checks.ideal_rounding(
                    reference, policy, *args, loss_scale=scale
                )
            rows = numerics_checks.with_floor(rows, floors[dtype], floors[ideal])
        run.divergence = rows
    float16 = [r for r in runs if np.dtype(r.variant.policy.compute_dtype) == np.float16]
    if not float16:
        return None
    check = numerics_checks.float16_check(reference, float16[0].loss_fn(rng), params, state, x, y)
    if check["dtype"] != "float16":
        log(f"float16 range check (before training): {check['reason']}")
    return check


def _step_on(
    run: _Run, rng: Any, params: Any, state: Any, x: Any, y: Any
) -> Callable[[Any], tuple[Any, Any, Any]]:
    """``run``'s training step on the divergence's examples, its params left as they are:
    ``opt_state -> (loss finite, step taken, opt_state after)``, jitted; the optimizer's
    own finiteness check and loss-scale rule decide."""
    loss = run.loss_fn(rng)

    @jax.jit
    def step(
        opt_state: Any, params: Any, run_params: Any, state: Any, x: Any, y: Any
    ) -> tuple[Any, Any, Any]:
        value, grads = value_and_grad(loss)(params, state, x, y, opt_state=opt_state)
        _, opt_state = run.tx.update(grads, opt_state, run_params)
        return jnp.isfinite(value), find_loss_scaled_state(opt_state).last_finite, opt_state

    return lambda opt_state: step(opt_state, params, run.params, state, x, y)


def _bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes of the params and the optimizer state (master, compensation, moments) per
    parameter, read from the arrays: 12 for float32 Adam, 14 with bfloat16 params and a
    float32 master."""
    count = sum(x.size for x in jax.tree.leaves(params))
    size = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    return size / max(count, 1)


def compare(
    config: CompareConfig,
    log: Callable[[str], None] = print,
    dataset: data_lib.Dataset | None = None,
) -> dict[str, Any]:
    """Runs the comparison and returns the report (``runs``: one record per variant).

    Args:
      config: what to run; ``model="auto"`` is resolved first (the report's
        ``model_choice`` says to what, and why).
      log: where to say which model runs, and that the dataset fell back to the
        embedded one.
      dataset: a ``jaxamp._src.compare.data.Dataset`` to use instead of the model's own
        (NHWC float32 images for ResNets, int32 token ids for BERT).

    Returns:
      The report: ``config``, ``model``, ``model_choice``, ``dataset``, ``steps``,
      ``seeds``, ``environment`` and ``runs``, one record per variant (test accuracy
      as the mean over seeds, with its spread and a verdict against fp32).
    """
    config, reason = choose_model(config)
    check_options(config, reason)
    if reason.startswith("auto"):
        log(reason)
    policy, why = auto_policy(explain=True)
    log(f"auto_policy picks {policy}: {why}")
    if config.variants is None and jax.default_backend() == "cpu":
        log(FP16_ON_CPU)
    note = None
    if dataset is None:
        kind = "text" if config.model == "bert" else "images"
        tokenizer = None
        if config.vocab_size is not None and config.seq_len is not None:  # BERT's shape
            tokenizer = data_lib.HashingTokenizer(config.vocab_size, config.seq_len)
        try:
            dataset, note = data_lib.load_dataset(kind, config.data, config.data_dir, tokenizer)
        except data_lib.DatasetUnavailable as e:
            raise OptionError(
                f"data {config.data!r}: {e} (--data auto falls back to the embedded dataset)"
            ) from e
        if note:
            log(note)
    dataset = dataset.subset(config.train_examples, config.test_examples)
    if config.batch_size > len(dataset.train_x):
        raise OptionError(
            f"batch_size {config.batch_size} exceeds the {len(dataset.train_x)} training "
            f"examples of {dataset.name}: no full batch to train on."
        )
    per_seed = []
    compiled: dict[str, _Run] = {}  # one per variant, compiled once for all seeds
    for i in range(config.seeds):
        if config.seeds > 1:
            log(f"seed {config.seed + i} ({i + 1} of {config.seeds})")
        seeded = dataclasses.replace(config, seed=config.seed + i)
        per_seed.append(_compare_once(seeded, dataset, log, compiled))
    report = merge_seeds(per_seed)
    report["config"] = dataclasses.asdict(config)
    report["model_choice"] = reason
    report["auto_policy"] = {"policy": str(policy), "reason": why}
    report["dataset"]["note"] = note
    return report


def _compare_once(
    config: CompareConfig,
    dataset: data_lib.Dataset,
    log: Callable[[str], None] = print,
    compiled: dict[str, _Run] | None = None,
) -> dict[str, Any]:
    """One seed: every variant trained side by side (``compiled``: the variants' runs
    from an earlier seed, reused and filled in)."""
    steps_per_epoch = len(dataset.train_x) // config.batch_size
    names = list(config.variants or default_variants())
    task = _task(config, dataset.num_classes)
    sample = jax.device_put(
        (dataset.train_x[: config.batch_size], dataset.train_y[: config.batch_size])
    )
    variables = task.module.init(jax.random.key(config.seed), sample[0][:1])
    compiled = {} if compiled is None else compiled
    for name in tqdm([n for n in names if n not in compiled], desc="compile", unit="variant"):
        compiled[name] = _Run(get_variant(name), task, variables, config, sample)
    runs = [compiled[name] for name in names]
    for run in runs:
        run.reset(variables, config)
    float16 = _numerics_before_training(runs, task, variables, sample, config, log)

    total = config.epochs * steps_per_epoch
    with tqdm(total=total, desc="train", unit="step") as bar:
        for epoch in range(config.epochs):
            epoch_time = dict.fromkeys(names, 0.0)
            for i, (x, y) in enumerate(
                data_lib.batches(
                    dataset.train_x, dataset.train_y, config.batch_size, config.seed, epoch
                )
            ):
                step = epoch * steps_per_epoch + i
                for run in runs:
                    run.train_step(x, y, step)
                    epoch_time[run.variant.name] += run.step_times[-1]
                bar.update(1)
                bar.set_postfix(
                    epoch=f"{epoch + 1}/{config.epochs}",
                    **{r.variant.name: f"{float(r.losses[-1]):.3f}" for r in runs},
                )
            for run in runs:
                run.epoch_times.append(epoch_time[run.variant.name])

    if task.has_batch_stats and config.bn_recalibration:
        calibration = list(
            data_lib.batches(
                dataset.train_x, dataset.train_y, config.batch_size, config.seed, config.epochs
            )
        )
        calibration = (calibration * config.bn_recalibration)[: config.bn_recalibration]
        for run in tqdm(runs, desc="BatchNorm statistics", unit="variant"):
            run.recalibrate(calibration)
    records = [run.record(dataset, config.batch_size) for run in runs]
    baseline = next(r for r in records if r["variant"] == "fp32")
    for r in records:
        r["speedup_vs_fp32"] = baseline["step_time_median_s"] / r["step_time_median_s"]
    return {
        "config": dataclasses.asdict(config),
        "model": config.model,
        "dataset": {
            "name": dataset.name,
            "source": dataset.source,
            "note": None,
            "train_examples": len(dataset.train_x),
            "test_examples": len(dataset.test_x),
            "classes": list(dataset.class_names),
        },
        "steps": total,
        "environment": environment(),
        "float16_check": float16,
        "runs": records,
    }
