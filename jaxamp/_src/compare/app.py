"""``jaxamp compare``: train one model under several precision variants, side by side."""

from __future__ import annotations

import dataclasses
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
from jaxamp._src.compare.accuracy import merge_seeds
from jaxamp._src.compare.choice import choose_model
from jaxamp._src.compare.config import CompareConfig, OptionError, check_options
from jaxamp._src.compare.environment import environment
from jaxamp._src.compare.run import Run
from jaxamp._src.compare.suggested import suggested_variant
from jaxamp._src.compare.task import Task, make_task
from jaxamp._src.compare.variants import (
    AUTO,
    FP16_ON_CPU,
    Variant,
    expand_variants,
    get_variant,
)
from jaxamp._src.dtypes import is_float16
from jaxamp._src.numerics.numerics_diff import measure
from jaxamp._src.optim.gradients import value_and_grad
from jaxamp._src.optim.opt_state import find_loss_scaled_state


def _numerics_before_training(
    runs: list[Run],
    task: Task,
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
    measured = measure(reference, args)  # once, for every variant and floor
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
        rows = numerics_checks.divergence(measured, run.loss_fn(rng), *args, loss_scale=scale)
        taken = run.divergence_loss_scale
        finite = taken is None or taken["loss_finite"]  # a loss no scale makes finite: no floor
        if dtype != np.float32 and finite:  # float32 has no rounding to put a floor under
            if dtype not in floors:
                floors[dtype] = numerics_checks.input_sensitivity(
                    reference, dtype, *args, measured=measured
                )
            ideal = (policy.compute_dtype, policy.fp8, scale)
            if ideal not in floors:
                floors[ideal] = numerics_checks.ideal_rounding(
                    reference, policy, *args, loss_scale=scale, measured=measured
                )
            rows = numerics_checks.with_floor(rows, floors[dtype], floors[ideal])
        run.divergence = rows
    float16 = [r for r in runs if is_float16(r.variant.policy.compute_dtype)]
    if not float16:
        return None
    check = numerics_checks.float16_check(reference, float16[0].loss_fn(rng), params, state, x, y)
    if check["dtype"] != "float16":
        log(f"float16 range check (before training): {check['reason']}")
    return check


def _step_on(
    run: Run, rng: Any, params: Any, state: Any, x: Any, y: Any
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
    compiled: dict[str, Run] = {}  # one per variant, compiled once for all seeds
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


def _same_as(auto: Variant | None, names: list[str]) -> str | None:
    """The variant of ``names`` that trains exactly what ``auto`` would (its policy, loss
    scaling and optimizer, no overrides), if any."""
    if auto is None or auto.overrides:
        return None
    for name in names:
        if name == AUTO:
            continue
        v = get_variant(name)
        mine = (v.policy, v.dynamic_loss_scaling, v.optimizer_recipe, v.matmul_precision)
        if mine == (auto.policy, auto.dynamic_loss_scaling, None, None):
            return name
    return None


def _compare_once(
    config: CompareConfig,
    dataset: data_lib.Dataset,
    log: Callable[[str], None] = print,
    compiled: dict[str, Run] | None = None,
) -> dict[str, Any]:
    """One seed: every variant trained side by side (``compiled``: the variants' runs
    from an earlier seed, reused and filled in)."""
    steps_per_epoch = len(dataset.train_x) // config.batch_size
    names = expand_variants(config.variants)
    task = make_task(config, dataset.num_classes)
    sample = jax.device_put(
        (dataset.train_x[: config.batch_size], dataset.train_y[: config.batch_size])
    )
    variables = task.module.init(jax.random.key(config.seed), sample[0][:1])
    compiled = {} if compiled is None else compiled
    fresh = [n for n in names if n not in compiled]
    variants = {n: get_variant(n) for n in fresh if n != AUTO}
    suggestion = None
    if AUTO in fresh:  # measured once, at the first seed's weights
        log("auto: jaxamp.suggest_policy measures the model on the first batch")
        variants[AUTO], suggestion = suggested_variant(task, variables, sample)
        log(f"auto: {variants[AUTO].description}")
    same = _same_as(variants.get(AUTO), names)
    for name in tqdm(
        [n for n in fresh if not (n == AUTO and same)], desc="compile", unit="variant"
    ):
        compiled[name] = Run(variants[name], task, variables, config, sample)
    if same:  # the suggestion is a preset of this run: trained once, reported under both
        compiled[AUTO] = compiled[same]
    runs = list(dict.fromkeys(compiled[name] for name in names))  # each trained once
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
    made = {id(run): run.record(dataset, config.batch_size) for run in runs}
    records = []
    for name in names:
        record, run = made[id(compiled[name])], compiled[name]
        if name == AUTO and run.variant.name != AUTO:  # the preset's run, under auto's name
            record = {**record, "variant": AUTO, "same_as": run.variant.name}
            record["description"] = f"the suggestion, {run.variant.description} (trained once)"
        if name == AUTO and suggestion is not None:
            record["suggestion"] = suggestion
        records.append(record)
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
