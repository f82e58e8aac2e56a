"""Does training with float8 matmuls follow bfloat16? A small GPT and a small BERT, trained side by
side from the same initialisation on the same synthetic token batches, under

* ``fp32``: float32, highest matmul precision;
* ``bf16``: ``mixed_bfloat16``;
* ``fp8``: ``mixed_float8`` (float8 matmuls, current scaling);
* ``fp8-delayed``: ``mixed_float8_delayed`` (delayed scaling; the state, the
  ``_overwrite_with_gradient`` collection, differentiated apart from the params and
  overwritten with its gradient each step, never given to the optimizer);
* ``mxfp8``, ``nvfp4`` (with ``--variants``): ``mixed_mxfp8`` and ``mixed_nvfp4``, the
  block-scaled formats, emulated on a CPU.

Recorded per model and variant: the loss curve, the final loss (mean of the last 20
steps' training losses; every batch is fresh, so it is also a held-out loss), its gap to
bf16 and to fp32, the steps whose loss or gradients were not finite and, for delayed
scaling, the steps where an operand saturated: its amax at that step (``history[0]`` of the
new state) exceeded the float8 maximum (448 for e4m3 inputs and kernels, 57344 for e5m2
output gradients) times the scale the step quantized with (the new state's ``*_scale``),
so that its largest values were clipped.

The verdict's tolerance, fixed before any run (``TOLERANCES``): a float8 variant follows
bf16 when ``|final_fp8 - final_bf16| <= 0.05 * final_bf16``; NVFP4 within 0.10 (see
``NVFP4_TOLERANCE``).

The data: GPT predicts the next token of sequences drawn from a fixed random bigram chain
(8 likely successors per token; its entropy rate is the loss floor, recorded); BERT tells
which of 4 such chains a sequence was drawn from, with 25% of the labels replaced at random
(a floor of about 0.69 nats, so that the relative gap stays meaningful).

On a CPU the float8 GEMMs run as float32 after converts (XLA:CPU has no float8 kernels): the
numerics are float8's, the step times are not what float8 buys (``benchmarks/fp8_gemm.py``
times that on a GPU).

Sample command (about 4 minutes on the project's 2-core CPU)::

  python -m benchmarks.fp8_training --out benchmarks/results
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.common import environment, markdown_table
from benchmarks.optimizer_state import DigitsNet
from jaxamp._src.audit.report import precision_report
from jaxamp._src.backend import cpu_info
from jaxamp._src.compare.data import load_digits_28x28
from jaxamp._src.compare.variants import get_variant
from jaxamp._src.flax_policy.linen import apply_policy
from jaxamp._src.ops.fp8_scaling import E4M3, E5M2, fp8_max
from jaxamp.models import BertClassifier, BertConfig, GPT2Config, GPT2LMHeadModel
from jaxamp.ops import FP8_STATE_COLLECTION as FP8_STATE

VARIANTS = ("fp32", "bf16", "fp8", "fp8-delayed")
TOLERANCE = 0.05
"""A float8 variant follows bf16 when ``|final - final_bf16| <= TOLERANCE * final_bf16``
(decided before the first run)."""
NVFP4_TOLERANCE = 0.10
"""NVFP4's tolerance, fixed before its first run: twice float8's, because e2m1 keeps one
mantissa bit where e4m3 keeps three (a rounding step of a quarter of a value's magnitude
against a sixteenth), and because this run keeps none of the layers in bf16 and applies no
random Hadamard transform, both of which NVIDIA's NVFP4 recipe (arXiv 2509.25149) uses to
stay close to FP8 at scale."""
TOLERANCES = {"fp8": TOLERANCE, "fp8-delayed": TOLERANCE, "mxfp8": TOLERANCE}
TOLERANCES["nvfp4"] = NVFP4_TOLERANCE
"""Each low-precision variant's tolerance against bf16's final loss."""
ACCURACY_VERDICT = ("digits",)
ACCURACY_TOLERANCE = 0.015
"""For digits the verdict reads held-out accuracy: a variant follows bf16 when its test
accuracy is within 1.5 points of bf16's. The final training loss of a model that nearly
memorises its data is too noisy to judge by (a first run: fp32 and bf16 21% apart, the
last steps' sd as large as the loss); decided before the run that uses it."""
LAST = 20
"""The final loss is the mean of the last ``LAST`` steps' losses."""
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
"""The /proc/cpuinfo flags recorded with the result (the CPU's 16-bit and AVX units)."""
_OPERANDS = {"input": E4M3, "kernel": E4M3, "output_grad": E5M2}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models' and the run's sizes (the defaults take about 4 minutes on 2 cores)."""

    steps: int = 400
    batch: int = 16
    seq_len: int = 64
    vocab: int = 256
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    learning_rate: float = 1e-3
    seed: int = 0
    eval_examples: int = 512


# --------------------------------------------------------------------------- data


def _chain(rng: np.random.Generator, vocab: int, successors: int = 8) -> np.ndarray:
    """A bigram transition matrix: each token has ``successors`` likely next tokens."""
    probs = np.zeros((vocab, vocab))
    for t in range(vocab):
        nxt = rng.choice(vocab, successors, replace=False)
        probs[t, nxt] = rng.dirichlet(np.ones(successors))
    return probs


def _entropy_rate(probs: np.ndarray) -> float:
    """The chain's entropy per token under its stationary distribution (nats)."""
    values, vectors = np.linalg.eig(probs.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    pi = np.abs(pi) / np.abs(pi).sum()
    logs = np.log(np.where(probs > 0, probs, 1.0))
    return float(-(pi[:, None] * probs * logs).sum())


def _sample(rng: np.random.Generator, probs: np.ndarray, n: int, length: int) -> np.ndarray:
    vocab = probs.shape[0]
    cumulative = np.cumsum(probs, axis=1)
    out = np.empty((n, length), np.int32)
    out[:, 0] = rng.integers(1, vocab, n)
    for i in range(1, length):
        u = rng.random(n)[:, None]
        nxt = (u > cumulative[out[:, i - 1]]).sum(axis=1)
        out[:, i] = np.minimum(nxt, vocab - 1)
    return out


def gpt_batches(sizes: Sizes) -> tuple[np.ndarray, np.ndarray, float]:
    """``[steps, batch, seq_len + 1]`` token ids from one bigram chain, ``eval_examples``
    held-out sequences from it, and its entropy rate."""
    rng = np.random.default_rng(sizes.seed)
    probs = _chain(rng, sizes.vocab)
    tokens = _sample(rng, probs, sizes.steps * sizes.batch, sizes.seq_len + 1)
    held_out = _sample(
        np.random.default_rng(sizes.seed + 100), probs, sizes.eval_examples, sizes.seq_len + 1
    )
    return tokens.reshape(sizes.steps, sizes.batch, -1), held_out, _entropy_rate(probs)


def bert_batches(sizes: Sizes, classes: int = 4, noise: float = 0.25):
    """``(([steps, batch, seq_len] ids, [steps, batch] labels), (held-out ids, labels),
    floor)``: which of ``classes`` chains drew each sequence, a fraction ``noise`` of labels
    redrawn at random; ``floor`` is the loss the label noise alone leaves."""
    rng = np.random.default_rng(sizes.seed + 1)
    chains = [_chain(rng, sizes.vocab) for _ in range(classes)]

    def draw(rng, n):
        labels = rng.integers(0, classes, n)
        ids = np.empty((n, sizes.seq_len), np.int32)
        for c, probs in enumerate(chains):
            where = np.flatnonzero(labels == c)
            ids[where] = _sample(rng, probs, len(where), sizes.seq_len)
        noisy = rng.random(n) < noise
        return ids, np.where(noisy, rng.integers(0, classes, n), labels).astype(np.int32)

    ids, labels = draw(rng, sizes.steps * sizes.batch)
    held_out = draw(np.random.default_rng(sizes.seed + 101), sizes.eval_examples)
    right = 1 - noise + noise / classes
    floor = -(right * np.log(right) + (1 - right) * np.log(noise / classes))
    shape = (sizes.steps, sizes.batch)
    return (ids.reshape(*shape, -1), labels.reshape(shape)), held_out, float(floor)


# ------------------------------------------------------------------------- models


def gpt_task(sizes: Sizes):
    """The GPT (no dropout), its batches, loss and floor."""
    config = GPT2Config(
        vocab_size=sizes.vocab,
        max_position=sizes.seq_len,
        hidden_size=sizes.hidden,
        num_layers=sizes.layers,
        num_heads=sizes.heads,
        dropout_rate=0.0,
    )
    tokens, held_out, floor = gpt_batches(sizes)

    def loss(model, variables, batch):
        logits = model.apply(variables, batch[:, :-1]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return GPT2LMHeadModel(config), (tokens,), (held_out,), loss, floor


def bert_task(sizes: Sizes):
    """The BERT classifier (no dropout), its batches, loss and floor."""
    config = BertConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        num_layers=sizes.layers,
        num_heads=sizes.heads,
        intermediate_size=4 * sizes.hidden,
        max_position=sizes.seq_len,
        num_classes=4,
        dropout_rate=0.0,
    )
    data, held_out, floor = bert_batches(sizes)

    def loss(model, variables, ids, labels):
        logits = model.apply(variables, ids).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return BertClassifier(config), data, held_out, loss, floor


def digits_task(sizes: Sizes):
    """scikit-learn's handwritten digits (shipped, real) at 28x28 and the optimizer-state
    benchmark's MLP (784-256-128-10): batches of
    ``sizes.batch`` drawn in a shuffled order, epoch after epoch; the 20% test split held
    out. No known loss floor (0 is drawn)."""
    dataset = load_digits_28x28(sizes.seed)
    rng = np.random.default_rng(sizes.seed)
    n = len(dataset.train_y)
    order = np.concatenate([rng.permutation(n) for _ in range(-(-sizes.steps * sizes.batch // n))])[
        : sizes.steps * sizes.batch
    ].reshape(sizes.steps, sizes.batch)
    data = (dataset.train_x[order].astype(np.float32), dataset.train_y[order].astype(np.int32))
    held_out = (dataset.test_x.astype(np.float32), dataset.test_y.astype(np.int32))

    def loss(model, variables, images, labels):
        logits = model.apply(variables, images).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return DigitsNet(), data, held_out, loss, 0.0


TASKS = {"gpt": gpt_task, "bert": bert_task, "digits": digits_task}
CLASSES = {"bert": 4, "digits": 10}
"""The classifiers' classes (the GPT's are its vocabulary), for the uniform guess's loss."""


# ---------------------------------------------------------------------- one variant


def saturated(state: Any) -> dict[str, tuple[jax.Array, jax.Array]]:
    """Per operand kind, at the step that made ``state``: how many GEMMs' operands saturated,
    ``history[0]`` (that step's amax) above the float8 maximum times ``*_scale`` (the scale
    that step quantized with), and the largest ratio of the two (above 1: clipped)."""
    out = {}
    layers = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dict) and "input_scale" in x)
    for operand, dtype in _OPERANDS.items():
        ratios = jnp.stack(
            [
                layer[f"{operand}_amax_history"][0]
                / (fp8_max(dtype) * layer[f"{operand}_scale"].reshape(()))
                for layer in layers
            ]
        )
        out[operand] = (jnp.sum(ratios > 1), jnp.max(ratios))
    return out


def _name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


class Run:
    """One variant of one model: its compiled step, state and what it records."""

    def __init__(
        self, name: str, module, loss, variables: dict, example: tuple, model_input, sizes: Sizes
    ):
        self.name = name
        self.variant = get_variant(name)
        self.model = apply_policy(module, self.variant.policy)
        self.tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(sizes.learning_rate))
        self.params = self.variant.policy.cast_to_param(variables["params"])
        self.opt_state = self.tx.init(self.params)
        fp8 = self.variant.policy.fp8
        self.delayed = fp8 is not None and fp8.scaling == "delayed"
        self.fp8_state: Any = {}
        if self.delayed:  # fresh state, as init makes it: histories of zeros, scales of one
            shapes = jax.eval_shape(self.model.init, jax.random.key(0), model_input)[FP8_STATE]
            self.fp8_state = jax.tree_util.tree_map_with_path(
                lambda path, x: (jnp.ones if _name(path).endswith("_scale") else jnp.zeros)(
                    x.shape, x.dtype
                ),
                shapes,
            )
        model, tx = self.model, self.tx

        def objective(params, fp8_state, *batch):
            variables = {"params": params}
            if fp8_state:
                variables[FP8_STATE] = fp8_state
            return loss(model, variables, *batch)

        def step(params, fp8_state, opt_state, *batch):
            # the scaling state differentiated apart; its gradient is its next value
            value, (grads, fp8_state) = jax.value_and_grad(objective, argnums=(0, 1))(
                params, fp8_state, *batch
            )
            finite = jnp.isfinite(value) & jnp.all(
                jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
            )
            updates, opt_state = tx.update(grads, opt_state, params)  # params' gradients only
            params = optax.apply_updates(params, updates)
            sat = saturated(fp8_state) if fp8_state else {}
            return params, fp8_state, opt_state, value, finite, sat

        with self.variant.tracing():
            start = time.perf_counter()
            self.step = (
                jax.jit(step).lower(self.params, self.fp8_state, self.opt_state, *example).compile()
            )
            self.compile_s = time.perf_counter() - start
            self.held_out_loss = jax.jit(objective)  # the model as trained, on held-out data
            # the precision audit of the step: its GEMMs by block format, and float8 ones
            report = precision_report(step)(self.params, self.fp8_state, self.opt_state, *example)
            self.gemm_formats = {"float8": report.float8_gemms()[0], **report.block_gemms()}
        self.losses: list[float] = []
        self.nonfinite = 0
        self.saturated_steps = 0
        self.saturations = dict.fromkeys(_OPERANDS, 0) if self.delayed else {}
        self.worst_ratio = dict.fromkeys(_OPERANDS, 0.0) if self.delayed else {}
        self.times: list[float] = []

    def train_step(self, *batch) -> None:
        start = time.perf_counter()
        out = jax.block_until_ready(self.step(self.params, self.fp8_state, self.opt_state, *batch))
        self.times.append(time.perf_counter() - start)
        self.params, self.fp8_state, self.opt_state, value, finite, sat = out
        self.losses.append(float(value))
        self.nonfinite += int(not bool(finite))
        if self.delayed:
            counts = {k: int(v[0]) for k, v in sat.items()}
            self.saturated_steps += int(any(counts.values()))
            for k, (count, ratio) in sat.items():
                self.saturations[k] += int(count)
                self.worst_ratio[k] = max(self.worst_ratio[k], float(ratio))

    def evaluate(self, *held_out) -> float:
        """The loss on held-out examples (the delayed state as the last step left it)."""
        with self.variant.tracing():
            return float(self.held_out_loss(self.params, self.fp8_state, *held_out))

    def record(self, last: int, held_out: tuple) -> dict[str, Any]:
        tail = self.losses[-last:]
        scales = None
        if self.delayed:  # the last scales, per layer and operand
            flat = jax.tree_util.tree_flatten_with_path(self.fp8_state)[0]
            scales = {
                _name(path): float(v.reshape(-1)[0])
                for path, v in flat
                if str(getattr(path[-1], "key", "")).endswith("_scale")
            }
        return {
            "variant": self.name,
            "policy": str(self.variant.policy),
            "final_loss": float(np.mean(tail)),
            "final_loss_sd": float(np.std(tail)),
            "held_out_loss": self.evaluate(*held_out),
            "first_loss": self.losses[0],
            "nonfinite_steps": self.nonfinite,
            "saturated_steps": self.saturated_steps if self.delayed else None,
            "saturations": self.saturations or None,
            "max_amax_over_range": self.worst_ratio or None,
            "compile_s": self.compile_s,
            "step_time_median_s": statistics.median(self.times),
            "losses": self.losses,
            "final_scales": scales,
            "gemm_formats": self.gemm_formats,
        }


# ------------------------------------------------------------------------ the run


def run_model(name: str, sizes: Sizes, variants=VARIANTS, log=print) -> dict[str, Any]:
    """Trains ``name`` under each variant, steps interleaved; the model's record."""
    module, data, held_out, loss, floor = TASKS[name](sizes)
    example = tuple(jnp.asarray(d[0]) for d in data)
    model_input = example[0][:, :-1] if name == "gpt" else example[0]
    variables = module.init(jax.random.key(sizes.seed), model_input)
    runs = [Run(v, module, loss, variables, example, model_input, sizes) for v in variants]
    log(f"{name}: compiled {', '.join(f'{r.name} {r.compile_s:.1f}s' for r in runs)}")
    start = time.perf_counter()
    for i in range(sizes.steps):
        batch = tuple(jnp.asarray(d[i]) for d in data)
        for r in runs:
            r.train_step(*batch)
        if (i + 1) % max(1, sizes.steps // 5) == 0:
            losses = ", ".join(f"{r.name} {np.mean(r.losses[-LAST:]):.4f}" for r in runs)
            log(f"{name} step {i + 1}/{sizes.steps}: {losses}")
    records = [r.record(LAST, tuple(jnp.asarray(d) for d in held_out)) for r in runs]
    by_name = {r["variant"]: r for r in records}
    for r in records:
        for ref in ("bf16", "fp32"):
            if ref in by_name:
                gap = r["final_loss"] - by_name[ref]["final_loss"]
                r[f"gap_to_{ref}"] = gap
                r[f"relative_gap_to_{ref}"] = gap / by_name[ref]["final_loss"]
                held_out_gap = r["held_out_loss"] - by_name[ref]["held_out_loss"]
                r[f"held_out_relative_gap_to_{ref}"] = held_out_gap / by_name[ref]["held_out_loss"]
    if name in ACCURACY_VERDICT:
        for r, run in zip(records, runs, strict=True):
            images, labels = (jnp.asarray(d) for d in held_out)
            logits = run.model.apply({"params": run.params}, images)
            r["held_out_accuracy"] = float(jnp.mean(jnp.argmax(logits, -1) == labels))
    for r in records:
        if "bf16" in by_name and r["variant"] in TOLERANCES and name in ACCURACY_VERDICT:
            r["tolerance"] = ACCURACY_TOLERANCE
            gap = r["held_out_accuracy"] - by_name["bf16"]["held_out_accuracy"]
            r["follows_bf16"] = bool(abs(gap) <= ACCURACY_TOLERANCE and not r["nonfinite_steps"])
        elif "bf16" in by_name and r["variant"] in TOLERANCES:
            r["tolerance"] = TOLERANCES[r["variant"]]
            r["follows_bf16"] = bool(
                abs(r["gap_to_bf16"]) <= r["tolerance"] * by_name["bf16"]["final_loss"]
                and r["nonfinite_steps"] == 0
            )
    parameters = sum(x.size for x in jax.tree.leaves(variables["params"]))
    return {
        "model": name,
        "parameters": int(parameters),
        "loss_floor": floor,
        "initial_loss_uniform": float(np.log(CLASSES.get(name, sizes.vocab))),
        "train_s": time.perf_counter() - start,
        "runs": records,
    }


def cpu_tag(model: str, flags: set[str]) -> str:
    """A short name for this machine, for file names: ``cpu-epyc``, ``cpu-xeon-amx``, or the
    accelerator's kind (``nvidia-h200``)."""
    if jax.default_backend() != "cpu":
        return re.sub(r"[^a-z0-9]+", "-", jax.devices()[0].device_kind.lower()).strip("-")
    lowered = model.lower()
    family = next((f for f in ("epyc", "xeon", "ryzen", "core") if f in lowered), None)
    if family is None:
        family = re.sub(r"[^a-z0-9]+", "-", lowered).strip("-")[:24] or "unknown"
    return f"cpu-{family}" + ("-amx" if "amx_bf16" in flags else "")


def markdown(result: dict[str, Any]) -> str:
    env, sizes = result["environment"], result["sizes"]
    flags = ", ".join(f for f, on in env["cpu_flags"].items() if on) or "none of them"
    lines = [
        "# Training with float8 matmuls against bfloat16",
        "",
        f"- Machine: {env['cpu_model']} ({env['cpu_threads']} threads; of "
        f"{', '.join(CPU_FLAGS)}, /proc/cpuinfo lists {flags}); backend {env['backend']}, "
        f"device {env['device']}; jax {env['jax']}, flax {env['flax']}, optax {env['optax']}; "
        f"{env['date']}.",
        f"- Runs: {sizes['steps']} steps of batch {sizes['batch']} x length {sizes['seq_len']}, "
        f"vocabulary {sizes['vocab']}, layers {sizes['layers']} of width {sizes['hidden']} "
        f"({sizes['heads']} heads), no dropout; Adam {sizes['learning_rate']:g} after "
        "clipping to global norm 1; the same initialisation and batches for every variant, "
        "the variants' steps interleaved.",
        f"- Final loss: the mean of the last {LAST} steps' training losses (each batch fresh). "
        f"Tolerance, fixed before the run: a float8 variant follows bf16 when "
        f"|final - final_bf16| <= {TOLERANCE:g} x final_bf16 (NVFP4: {NVFP4_TOLERANCE:g}; "
        "twice float8's, since e2m1 rounds 4x more coarsely than e4m3 and no layer is kept "
        "in bf16) and no step was non-finite. The "
        f"final loss's own noise is about its sd over those steps / sqrt({LAST}).",
        "- GEMMs: the training step's matmuls of jaxamp's low-precision rule, from the "
        "precision audit (`jaxamp.precision_report`): float8 counts them all, mxfp8 and "
        "nvfp4 those that ran block-scaled (forward, activation- and weight-gradient).",
        f"- Held-out loss (not part of the verdict): each variant's model as trained, on "
        f"{sizes['eval_examples']} fresh examples after the last step (digits: the "
        "20% test split).",
        f"- Digits: the verdict reads held-out accuracy, within {ACCURACY_TOLERANCE:g} of "
        "bf16's (the final training loss of a model that nearly memorises its data is too "
        "noisy to judge by); its tolerance column is in accuracy.",
        "- Saturated steps (delayed scaling): steps where some GEMM operand's amax exceeded "
        "the float8 maximum (448 for e4m3 inputs and kernels, 57344 for e5m2 output gradients) "
        "times the scale it was quantized with; saturations count (GEMM, step) pairs per "
        "operand; worst overshoot is the largest amax / (maximum x scale) seen, per operand "
        "(above 1: that step clipped the operand's largest values).",
    ]
    if env["backend"] == "cpu":
        lines.append(
            "- On a CPU XLA runs the float8 GEMMs as float32 after converts: the numerics are "
            "float8's, the step times say nothing of float8's speed."
        )
    columns = [
        ("variant", "variant"),
        ("final_loss", "final loss"),
        ("final_loss_sd", "sd of the last steps"),
        ("gap_to_bf16", "gap to bf16"),
        ("relative_gap_to_bf16", "relative gap"),
        ("tolerance", "tolerance"),
        ("follows_bf16", "within it"),
        ("gemm_text", "GEMMs (audit)"),
        ("gap_to_fp32", "gap to fp32"),
        ("held_out_loss", "held-out loss"),
        ("held_out_accuracy", "held-out accuracy"),
        ("held_out_relative_gap_to_bf16", "held-out relative gap"),
        ("nonfinite_steps", "non-finite steps"),
        ("saturated_steps", "saturated steps"),
        ("saturation_text", "saturations (input/kernel/grad)"),
        ("overshoot_text", "worst overshoot (input/kernel/grad)"),
        ("step_time_median_s", "step s (CPU)"),
    ]
    for m in result["models"]:
        rows = []
        for r in m["runs"]:
            sat = r.get("saturations")
            text = "/".join(str(sat[k]) for k in _OPERANDS) if sat else None
            worst = r.get("max_amax_over_range")
            over = "/".join(f"{worst[k]:.3g}" for k in _OPERANDS) if worst else None
            formats = r.get("gemm_formats") or {}
            gemms = ", ".join(f"{n} {k}" for k, n in formats.items() if n) or None
            rows.append({**r, "saturation_text": text, "overshoot_text": over, "gemm_text": gemms})
        lines += [
            "",
            f"## {m['model']} ({m['parameters']:,} parameters; loss floor {m['loss_floor']:.3f}, "
            f"uniform guess {m['initial_loss_uniform']:.3f})",
            "",
            markdown_table(rows, columns),
        ]
    verdicts = [
        f"{m['model']} {r['variant']}: {'follows' if r['follows_bf16'] else 'does NOT follow'}"
        for m in result["models"]
        for r in m["runs"]
        if "follows_bf16" in r
    ]
    lines += ["", "Verdicts: " + "; ".join(verdicts) + "." if verdicts else ""]
    lines += ["", f"Loss curves: {result['plot']}"] if result.get("plot") else []
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = result["models"]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        for r in m["runs"]:
            losses = np.asarray(r["losses"])
            window = min(10, len(losses))
            smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
            ax.plot(np.arange(window - 1, len(losses)), smooth, label=r["variant"], lw=1.2)
        ax.axhline(m["loss_floor"], color="gray", ls=":", lw=0.8, label="loss floor")
        ax.set(
            xlabel="step",
            ylabel="training loss (moving mean of 10)",
            title=f"{m['model']}: float8 against bfloat16",
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Sizes()
    for field in dataclasses.fields(Sizes):
        flag = "--" + field.name.replace("_", "-")
        kind = float if field.type in ("float", float) else int
        parser.add_argument(flag, type=kind, default=getattr(defaults, field.name))
    parser.add_argument("--models", default="gpt,bert", help="comma-separated: gpt, bert, digits")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tag", default=None, help="file name tag (default: from the CPU)")
    parser.add_argument("--out", default=None, help="folder for the .json, .md and .png")
    args = parser.parse_args(argv)
    sizes = Sizes(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes)})
    models = [m.strip() for m in args.models.split(",")]
    variants = tuple(v.strip() for v in args.variants.split(","))
    for m in models:
        if m not in TASKS:
            parser.error(f"unknown model {m!r}; valid: {', '.join(TASKS)}")
    for v in variants:
        get_variant(v)
    if sizes.hidden % sizes.heads:
        parser.error(f"--hidden {sizes.hidden} must be divisible by --heads {sizes.heads}")

    start = time.perf_counter()
    env = environment()
    model_name, flags = cpu_info()
    env["cpu_model"] = model_name or env["cpu_model"]
    env["cpu_flags"] = {f: f in flags for f in CPU_FLAGS}
    result: dict[str, Any] = {
        "sizes": dataclasses.asdict(sizes),
        "tolerance": TOLERANCE,
        "last_steps_averaged": LAST,
        "environment": env,
        "models": [run_model(m, sizes, variants) for m in models],
    }
    result["total_s"] = time.perf_counter() - start
    tag = args.tag or cpu_tag(model_name, flags)
    name = f"fp8_training_{tag}"
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result["plot"] = f"{name}.png"
        plot(result, out / f"{name}.png")
        (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        (out / f"{name}.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    print(f"total {result['total_s']:.0f}s")
    return result


if __name__ == "__main__":
    main()
