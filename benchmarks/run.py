"""jaxamp's benchmark suite: FP32, TF32, BF16 and FP16 speed and memory, next to PyTorch AMP.

    python -m benchmarks.run --suite cpu-smoke --out /tmp/bench
    python -m benchmarks.run --suite cpu --out benchmarks/results/cpu
    python -m benchmarks.run --suite gpu --out benchmarks/results/h200   # see gpu_suite.sh

For every model and batch size all (framework, variant) steps are compiled
first, then timed side by side, alternating round by round, each step inside
``jax.block_until_ready`` (``torch.cuda.synchronize`` for PyTorch on GPU). One
JSON record per model x variant x framework, a Markdown table and a PNG chart.
Speed-ups are taken within one framework (over its fp32 and tf32 rows); the
``jaxamp/torch`` column divides jaxamp's step time by PyTorch eager's for the
same variant. The ``flax`` framework is the same model with ``dtype=bfloat16``
set on every layer by hand: the baseline for jaxamp's policy overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
from pathlib import Path
from typing import Any

import jax
from tqdm import tqdm

from benchmarks import jax_bench
from benchmarks.common import markdown_table, summarize, time_alternating
from benchmarks.specs import get_spec
from jaxamp._src.compare.environment import describe_hardware, environment
from jaxamp._src.compare.variants import PRECISION_VARIANTS, VARIANTS


@dataclasses.dataclass(frozen=True)
class Suite:
    """What a suite runs."""

    models: tuple[tuple[str, int], ...]  # (model, batch size)
    variants: tuple[str, ...] = PRECISION_VARIANTS  # the optimizer-state recipes on request
    frameworks: tuple[str, ...] = ("jaxamp", "flax", "torch")
    warmup: int = 3
    repeats: int = 5
    torch_compile: tuple[str, ...] = ()  # variants that also get a torch.compile row
    device_extras: tuple[str, ...] = ()  # variants whose largest batch is estimated (GPU)
    # Alternate every framework's steps together (all models held at once), or time the
    # JAX steps together, then the PyTorch ones (for large models in host memory).
    alternate_frameworks: bool = True


SUITES = {
    # torch.compile (inductor, C++ through the host compiler) beside eager autocast for bf16:
    # its first step compiles, for minutes on a small CPU; --no-torch-compile leaves it out.
    "cpu-smoke": Suite(
        models=(("resnet-tiny", 8), ("bert-tiny", 4), ("gpt2-tiny", 2)),
        warmup=2,
        repeats=3,
        torch_compile=("bf16",),
    ),
    "cpu": Suite(
        alternate_frameworks=False,
        models=(
            ("resnet50-28", 32),
            ("resnet50-224", 4),
            ("bert-small-128", 8),
            ("gpt2-small-256", 4),
        ),
        warmup=3,
        repeats=5,
        torch_compile=("bf16",),
    ),
    # The 16-bit GEMM shapes on a CPU: 4 x 768 BERT and GPT-2 (see benchmarks/specs.py).
    "cpu-transformers": Suite(
        alternate_frameworks=False,
        models=(("bert4-128", 8), ("gpt2-4-128", 4)),
        warmup=3,
        repeats=7,
        torch_compile=("bf16",),
    ),
    # One H200 in about 8 minutes: three models, every variant, torch.compile for bf16 only
    # (its compilation takes minutes), largest-batch estimates for fp32 and bf16.
    "gpu": Suite(
        models=(("resnet50-224", 256), ("bert-128", 64), ("gpt2-1024", 8)),
        warmup=20,
        repeats=50,
        torch_compile=("bf16",),
        device_extras=("fp32", "bf16"),
    ),
}


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def step_groups(model: str, batch: int, suite: Suite):
    """The steps of one model and batch size, as groups of builders timed together."""
    spec = get_spec(model)
    jax_group = [lambda v=v: jax_bench.build(spec, v, batch) for v in suite.variants]
    if "flax" in suite.frameworks and "bf16" in suite.variants:
        jax_group.append(lambda: jax_bench.build(spec, "bf16", batch, framework="flax"))
    torch_group = []
    if "torch" in suite.frameworks and _torch_available():
        from benchmarks import torch_bench

        torch_group = [lambda v=v: torch_bench.build(spec, v, batch) for v in suite.variants]
        for v in suite.variants:
            if v in suite.torch_compile:
                torch_group.append(lambda v=v: _compiled_torch(torch_bench, spec, v, batch))
    if suite.alternate_frameworks:
        return [jax_group + torch_group]
    return [g for g in (jax_group, torch_group) if g]


def _compiled_torch(torch_bench, spec, variant: str, batch: int) -> jax_bench.Step:
    """The ``torch.compile`` step, or, where inductor fails here, a step holding the error
    (its row is written with the error and no times)."""
    try:
        return torch_bench.build(spec, variant, batch, compile=True)
    except Exception as e:  # torch.compile does not run everywhere (a C++ compiler, the CPU)
        error = f"{type(e).__name__}: {e}"[:500]
        print(f"torch.compile {spec.name} {variant}: failed ({error})"[:300])
        return jax_bench.Step(
            framework="torch.compile",
            variant=variant,
            run=None,
            compile_s=None,
            memory={},
            activation_bytes=None,
            converts=None,
            host_syncs=None,
            flops=None,
            error=error,
        )


def records_for(
    model: str,
    batch: int,
    steps: list[jax_bench.Step],
    times: dict[str, list[float]],
    extras: dict[str, Any],
) -> list[dict[str, Any]]:
    """One record per step, with the ratios taken side by side."""
    spec = get_spec(model)
    by_key = {
        (s.framework, s.variant): statistics.median(times[_key(s)]) for s in steps if not s.error
    }
    records = []
    for s in steps:
        if s.error:
            records.append(_failed_record(model, batch, s))
            continue
        t = summarize(times[_key(s)])
        fp32 = by_key.get((s.framework, "fp32"))
        tf32 = by_key.get((s.framework, "tf32"))
        torch_eager = by_key.get(("torch", s.variant))
        torch_compiled = by_key.get(("torch.compile", s.variant))
        record = {
            "framework": s.framework,
            "model": model,
            "variant": s.variant,
            "batch_size": batch,
            "step_time_median_s": t["median_s"],
            "step_time_min_s": t["min_s"],
            "step_time_max_s": t["max_s"],
            "timed_steps": t["n"],
            "examples_per_s": batch / t["median_s"],
            "examples": spec.examples_name(),
            "compile_s": s.compile_s,
            "speedup_vs_fp32": fp32 / t["median_s"] if fp32 else None,
            "speedup_vs_tf32": tf32 / t["median_s"] if tf32 else None,
            "jaxamp_over_torch": (
                t["median_s"] / torch_eager if s.framework == "jaxamp" and torch_eager else None
            ),
            "jaxamp_over_torch_compile": (
                t["median_s"] / torch_compiled
                if s.framework == "jaxamp" and torch_compiled
                else None
            ),
            "temp_bytes": s.memory.get("temp"),
            "argument_bytes": s.memory.get("argument"),
            "peak_device_bytes": s.memory.get("peak_allocated"),
            "activation_bytes": s.activation_bytes,
            "converts": s.converts,
            "control_flow_ops": s.host_syncs,
            "flops_per_step": s.flops,
            "error": None,
        }
        record.update(extras.get((s.framework, s.variant), {}))
        if record.get("flops_per_step") and extras.get("matmul_tflops"):
            achieved = record["flops_per_step"] / t["median_s"] / 1e12
            record["model_tflops"] = achieved
            record["mfu"] = achieved / extras["matmul_tflops"]
        records.append(record)
    # Host syncs a precision recipe adds: its step's conditionals, loops and callbacks beyond
    # those of the same framework's fp32 step (the model's own, e.g. dropout's RNG loop on CPU).
    baseline_ops = {
        r["framework"]: r["control_flow_ops"]
        for r in records
        if r["variant"] == "fp32" and "control_flow_ops" in r
    }
    for r in records:
        if r["framework"].startswith("torch"):  # not measured: eager PyTorch has no program
            r.pop("control_flow_ops", None)
            r["host_syncs_per_step"] = None
            continue
        base = baseline_ops.get(r["framework"], baseline_ops.get("jaxamp", 0))
        r["host_syncs_per_step"] = r["control_flow_ops"] - base  # a difference, not floored
    handwritten = by_key.get(("flax", "bf16"))
    for r in records:
        if r["framework"] == "jaxamp" and r["variant"] == "bf16" and handwritten:
            r["jaxamp_over_handwritten_flax"] = r["step_time_median_s"] / handwritten
    return records


def _failed_record(model: str, batch: int, step: jax_bench.Step) -> dict[str, Any]:
    """The row of a step that could not be built: its error, no times."""
    return {
        "framework": step.framework,
        "model": model,
        "variant": step.variant,
        "batch_size": batch,
        "step_time_median_s": None,
        "step_time_min_s": None,
        "step_time_max_s": None,
        "timed_steps": 0,
        "examples_per_s": None,
        "compile_s": None,
        "speedup_vs_fp32": None,
        "speedup_vs_tf32": None,
        "host_syncs_per_step": None,
        "error": step.error,
    }


def _key(step: jax_bench.Step) -> str:
    return f"{step.framework}:{step.variant}"


def device_extras(
    model: str, batch: int, suite: Suite, memory_limit: float | None
) -> dict[Any, Any]:
    """Largest batch that fits (linear fit of compiled memory at two batch sizes) per jaxamp
    variant, and PyTorch's peak memory; for GPU runs."""
    spec = get_spec(model)
    limit = memory_limit
    if limit is None:
        stats = jax.devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
    extras: dict[Any, Any] = {}
    if limit:
        for v in (v for v in suite.variants if v in suite.device_extras):
            small, large = (jax_bench.compiled_bytes(spec, v, b) for b in (batch, 2 * batch))
            per_example = max((large - small) / batch, 1.0)
            extras[("jaxamp", v)] = {
                "largest_batch_estimate": int(
                    (limit - (small - per_example * batch)) // per_example
                ),
                "compiled_bytes": small,
                "device_bytes_limit": limit,
            }
    return extras


def run_suite(
    suite: Suite, out: str | None, memory_limit: float | None = None
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    extras_common: dict[Any, Any] = {}
    if suite.device_extras:
        extras_common["matmul_tflops"] = jax_bench.matmul_tflops(
            8192 if jax.default_backend() != "cpu" else 512, repeats=10
        )
    for model, batch in tqdm(suite.models, desc="models", unit="model"):
        steps, times = [], {}
        for group in step_groups(model, batch, suite):
            built = [s for s in (build() for build in group) if s is not None]
            timed = [s for s in built if not s.error]
            with tqdm(
                total=suite.repeats, desc=f"{model} x{batch}", unit="round", leave=False
            ) as bar:
                # each step waits for its own device work: block_until_ready / cuda.synchronize
                times.update(
                    time_alternating(
                        {_key(s): (lambda s=s: s.sync(s.run())) for s in timed},
                        suite.warmup,
                        suite.repeats,
                        sync=lambda out: out,
                        progress=bar,
                    )
                )
            for s in built:
                s.run = None  # release the training state before the next group is built
            steps += built
            gc.collect()
        extras = dict(extras_common)
        if suite.device_extras:
            extras.update(device_extras(model, batch, suite, memory_limit))
        for r in records_for(model, batch, steps, times, extras):
            r["alternated"] = "all frameworks" if suite.alternate_frameworks else "per framework"
            records.append(r)
    if out:
        write(records, out)
    return records


def write(records: list[dict[str, Any]], out: str) -> None:
    env = environment()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "benchmarks.json").write_text(
        json.dumps({"environment": env, "records": records}, indent=2, default=str) + "\n"
    )
    (path / "benchmarks.md").write_text(markdown(records, env))
    chart(records, env, path / "benchmarks.png")


COLUMNS = [
    ("model", "model"),
    ("batch_size", "batch"),
    ("framework", "framework"),
    ("variant", "variant"),
    ("step_ms", "step ms"),
    ("range_ms", "min-max ms"),
    ("examples_per_s", "examples/s"),
    ("speedup_vs_fp32", "x fp32 speed"),
    ("speedup_vs_tf32", "x tf32 speed"),
    ("jaxamp_over_torch", "jaxamp/torch time"),
    ("jaxamp_over_torch_compile", "jaxamp/torch.compile time"),
    ("compile_s", "compile s"),
    ("temp_mb", "compiled temp MB"),
    ("activation_mb", "activations MB"),
    ("converts", "converts"),
    ("host_syncs_per_step", "host syncs"),
    ("mfu", "MFU"),
    ("largest_batch_estimate", "largest batch"),
    ("error", "error"),
]
_OPTIONAL = {"jaxamp_over_torch_compile", "error"}


def markdown(records: list[dict[str, Any]], env: dict[str, Any]) -> str:
    rows = []
    for r in records:
        if r.get("error"):  # a step that could not be built: its error, no times
            rows.append(dict(r, error=r["error"][:160].replace("|", "/").replace("\n", " ")))
            continue
        rows.append(
            dict(
                r,
                step_ms=1e3 * r["step_time_median_s"],
                range_ms=f"{1e3 * r['step_time_min_s']:.1f}-{1e3 * r['step_time_max_s']:.1f}",
                temp_mb=(r["temp_bytes"] or 0) / 1e6 if r.get("temp_bytes") is not None else None,
                activation_mb=(
                    r["activation_bytes"] / 1e6 if r.get("activation_bytes") is not None else None
                ),
            )
        )
    head = (
        f"# jaxamp benchmarks\n\nHardware: {describe_hardware(env)}; backend "
        f"{env['backend']}; jax {env['jax']}, flax {env['flax']}, torch {env.get('torch')}; "
        f"{env['date']}.\n\n"
    )
    note = (
        "\n\nStep time: median of the timed steps after warm-up, in one process, the steps "
        f"alternated round by round ({_alternation(records)}). Speed-ups are within a "
        "framework; `jaxamp/torch time` is jaxamp's step time over PyTorch eager's for the "
        "same variant (below 1: jaxamp is faster). "
        "`flax` is the same model with `dtype=bfloat16` written into every layer by hand. "
        "Activations: bytes saved for the backward pass (PyTorch: without autocast's weight "
        "copies). Host syncs: the conditionals, loops and host callbacks a variant's compiled "
        "step has beyond the same framework's fp32 step (the model's own, such as dropout's "
        "random-number loop on CPU, are not the recipe's), counted in the compiled program; "
        "not measured for PyTorch (eager PyTorch has no program to read). For PyTorch "
        "eager, compile s is the first step; for `torch.compile`, the first step with "
        "inductor's compilation (the model's forward and backward are compiled, the "
        "optimizer step is eager), and a row with an error where it failed here.\n"
    )
    # columns only some runs fill: torch.compile's ratio, the error of a step not built
    columns = [
        c for c in COLUMNS if c[0] not in _OPTIONAL or any(r.get(c[0]) is not None for r in rows)
    ]
    return head + markdown_table(rows, columns) + note


def _alternation(records: list[dict[str, Any]]) -> str:
    modes = {r.get("alternated") for r in records}
    if modes == {"per framework"}:
        return (
            "each framework's variants alternated together, JAX's then PyTorch's, to hold "
            "one framework's models in memory at a time"
        )
    return "every framework and variant alternated together"


def chart(records: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = [r for r in records if r.get("step_time_median_s") is not None]
    models = list(dict.fromkeys(f"{r['model']} x{r['batch_size']}" for r in records))
    series = list(dict.fromkeys((r["framework"], r["variant"]) for r in records))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = {
            (r["framework"], r["variant"]): r
            for r in records
            if f"{r['model']} x{r['batch_size']}" == model
        }
        keys = [k for k in series if k in rows]
        ax.bar(
            np.arange(len(keys)),
            [1e3 * rows[k]["step_time_median_s"] for k in keys],
            color=[_COLORS.get(k[0], "gray") for k in keys],
        )
        ax.set_xticks(np.arange(len(keys)), [f"{f}\n{v}" for f, v in keys], rotation=60, fontsize=7)
        ax.set(title=model, ylabel="median step time (ms, log scale)", yscale="log")
    fig.suptitle(f"Training step time on {describe_hardware(env)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLORS = {
    "jaxamp": "tab:blue",
    "flax": "tab:cyan",
    "torch": "tab:orange",
    "torch.compile": "tab:red",
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=list(SUITES), default="cpu-smoke")
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated model:batch pairs overriding the suite's, "
        "e.g. resnet50-28:64,bert-128:8",
    )
    parser.add_argument(
        "--variants", default=None, help="comma-separated, from fp32,tf32,bf16,fp16"
    )
    parser.add_argument(
        "--frameworks", default=None, help="comma-separated, from jaxamp,flax,torch"
    )
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-torch-compile", action="store_true")
    parser.add_argument(
        "--memory-limit-gb",
        type=float,
        default=None,
        help="device memory for the largest-batch estimate (default: the device's own limit)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    suite = SUITES[args.suite]
    changes: dict[str, Any] = {}
    if args.models:
        pairs = []
        for item in args.models.split(","):
            name, _, batch = item.partition(":")
            get_spec(name.strip())
            if not batch.isdigit() or int(batch) < 1:
                parser.error(f"--models wants model:batch pairs, got {item!r}")
            pairs.append((name.strip(), int(batch)))
        changes["models"] = tuple(pairs)
    if args.variants:
        variants = tuple(v.strip() for v in args.variants.split(","))
        # The float8 variants are timed by benchmarks/fp8_gemm.py (PyTorch has no twin here,
        # and a delayed-scaling step carries state this suite's steps do not).
        valid = [v for v in VARIANTS if VARIANTS[v].policy.fp8 is None]
        unknown = [v for v in variants if v not in valid]
        if unknown:
            parser.error(
                f"unknown variant(s) {', '.join(unknown)}; valid: {', '.join(valid)} "
                "(float8: python -m benchmarks.fp8_gemm)"
            )
        changes["variants"] = variants
    if args.frameworks:
        frameworks = tuple(f.strip() for f in args.frameworks.split(","))
        unknown = [f for f in frameworks if f not in ("jaxamp", "flax", "torch")]
        if unknown:
            parser.error(f"unknown framework(s) {', '.join(unknown)}; valid: jaxamp, flax, torch")
        changes["frameworks"] = frameworks
    for name in ("warmup", "repeats"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.no_torch_compile:
        changes["torch_compile"] = ()
    suite = dataclasses.replace(suite, **changes)
    limit = args.memory_limit_gb * 2**30 if args.memory_limit_gb else None
    records = run_suite(suite, args.out, limit)
    print(markdown(records, environment()))
    return records


if __name__ == "__main__":
    main()
