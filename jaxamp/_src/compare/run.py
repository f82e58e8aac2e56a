"""One variant of a comparison: its model, optimizer, compiled steps and what they measure."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxamp._src.compare import data as data_lib
from jaxamp._src.compare import numerics_checks
from jaxamp._src.compare.accuracy import classification_metrics
from jaxamp._src.compare.config import CompareConfig
from jaxamp._src.compare.task import Task
from jaxamp._src.compare.variants import Variant
from jaxamp._src.flax_policy.linen import apply_policy
from jaxamp._src.ops.fp8_state import STATE_COLLECTION as FP8_STATE
from jaxamp._src.ops.residuals import activation_bytes
from jaxamp._src.optim.diagnostics import underflow_fraction
from jaxamp._src.optim.gradients import value_and_grad
from jaxamp._src.optim.opt_state import find_loss_scaled_state
from jaxamp._src.policy import cast_floating


def _eval_batch(batch_size: int) -> int:
    return max(batch_size, 256)


class Run:
    """One variant: its model, optimizer, compiled steps and everything measured.

    The compiled programs take the seed's key as an argument, so one ``Run`` serves
    every seed of a comparison: ``reset`` starts it again from a seed's initial
    variables without compiling anything.

    A delayed float8 variant keeps its FP8 state in ``fp8_state`` (``{}`` for every
    other variant): each step differentiates it beside the params and replaces it with
    its gradient, its next value; the optimizer never sees it.
    """

    def __init__(
        self,
        variant: Variant,
        task: Task,
        variables: dict,
        config: CompareConfig,
        sample: tuple[Any, Any],
    ) -> None:
        self.variant, self.task = variant, task
        self.model = apply_policy(task.module, variant.policy, overrides=dict(variant.overrides))
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
        """A delayed float8 policy's fresh FP8 state (histories of zeros, scales of one)
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
            "overrides": dict(self.variant.overrides),
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


def _bytes_per_param(params: Any, opt_state: Any) -> float:
    """Bytes of the params and the optimizer state (master, compensation, moments) per
    parameter, read from the arrays: 12 for float32 Adam, 14 with bfloat16 params and a
    float32 master."""
    count = sum(x.size for x in jax.tree.leaves(params))
    size = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    return size / max(count, 1)
