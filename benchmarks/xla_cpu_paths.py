"""XLA:CPU's GEMM and fusion paths: step time, compile time, numerics and library calls per
``XLA_FLAGS`` setting, beside PyTorch's eager bf16 autocast.

    python -m benchmarks.xla_cpu_paths --out benchmarks/results/cpu-epyc
    python -m benchmarks.xla_cpu_paths --tiny --out /tmp/xla_cpu_paths

``XLA_FLAGS`` is read once, when JAX starts, so every (model, flags) pair runs in a fresh
subprocess. Each setting is first tried on a bare JAX start: a flag this jaxlib does not
know, or a value it does not take, makes XLA abort; that is recorded as the setting's
error and the run goes on. A subprocess builds the suite's training step (benchmarks/
jax_bench.py, Adam) under jaxamp's ``fp32`` and ``bf16`` variants and PyTorch's eager
autocast bf16 step (benchmarks/torch_bench.py, imported after JAX, its threads as they
are), then times the three alternated round by round, each step waited for. Step-time
ratios (jax bf16 / torch bf16, bf16 / fp32) are taken within one process; absolute times
from different processes are not comparable on a shared machine.

Numerics: each subprocess saves the loss and gradients of the first step (fixed params,
inputs and dropout key; ``value_and_grad`` compiled on its own) and the parent compares
each setting against the default path (``XLA_FLAGS`` empty) for the same variant: the
loss's relative error, and the largest over gradient leaves of ``max|g - g_ref| /
max|g_ref|``, in float64. ``vs default fp32`` compares with the default path's fp32
gradients, the scale of bf16's own rounding.

HLO counts, from the compiled step: ``dot`` instructions by where they run (XLA's own
emitter, or inside a library fusion: ``__onednn_fusion``, ``__xnn_fusion``,
``__ynn_fusion``), the library fusions themselves, and oneDNN custom calls
(``__onednn$...``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.hlo_text import computations as hlo_computations
from benchmarks.specs import get_spec

DEFAULT_FLAGS = (
    "",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot,eltwise,reduce",
    "--xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
    "--xla_cpu_experimental_ynn_fusion_type=dot",
)
DEFAULT_MODELS = (("bert4-128", 8), ("gpt2-4-128", 4))
TINY_MODELS = (("bert-tiny", 2), ("gpt2-tiny", 2))
VARIANTS = ("fp32", "bf16")
LIBRARIES = ("onednn", "xnn", "ynn")
_RECORD = "XLA_CPU_PATHS_RECORD "  # the prefix of the worker's one line of results
_ROOT = Path(__file__).resolve().parent.parent

_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_FUSION_KIND = re.compile(r'"fusion_config":\{"kind":"__(\w+?)_fusion"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def hlo_paths(hlo_text: str) -> dict[str, int]:
    """Where a compiled program's dots run, read from its HLO text.

    ``dots_xla`` are dots XLA emits itself; ``dots_<library>`` are inside a library fusion
    (``"fusion_config":{"kind":"__<library>_fusion"}``, nested fusions included);
    ``bf16_dots_*`` the same for dots with a bfloat16 first operand; ``fusions_<library>``
    counts the fusions (dots or not), ``onednn_custom_calls`` targets ``__onednn$...``.

    Examples:
      >>> ynn = 'backend_config={"fusion_config":{"kind":"__ynn_fusion"}}'
      >>> hlo = '''%lib (p0: bf16[4,4]) -> f32[4,4] {
      ...   %p0 = bf16[4,4]{1,0} parameter(0)
      ...   ROOT %d = f32[4,4]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}
      ... }
      ...
      ... ENTRY %main (a: bf16[4,4]) -> f32[4,4] {
      ...   %a = bf16[4,4]{1,0} parameter(0)
      ...   %f = f32[4,4]{1,0} fusion(%a), kind=kCustom, calls=%lib, YNN
      ...   ROOT %d = f32[4,4]{1,0} dot(%f, %f), lhs_contracting_dims={1}
      ... }'''.replace("YNN", ynn)
      >>> facts = hlo_paths(hlo)
      >>> facts["dots_xla"], facts["dots_ynn"], facts["bf16_dots_ynn"], facts["fusions_ynn"]
      (1, 1, 1, 1)
    """
    computations = hlo_computations(hlo_text)
    library: dict[str, str] = {}  # fused computation -> the library that runs it
    calls: dict[str, list[str]] = {}
    facts = Counter(
        {f"{k}_{lib}": 0 for k in ("dots", "bf16_dots", "fusions") for lib in LIBRARIES}
    )
    facts.update(dots_xla=0, bf16_dots_xla=0, onednn_custom_calls=0)
    for name, instructions in computations.items():
        for _, _, opcode, rest in instructions:
            called = _CALLS.findall(rest)
            calls.setdefault(name, []).extend(called)
            kind = _FUSION_KIND.search(rest)
            if opcode == "fusion" and kind:
                facts[f"fusions_{kind.group(1)}"] += 1
                library.update((c, kind.group(1)) for c in called)
            target = _TARGET.search(rest)
            if opcode == "custom-call" and target and target.group(1).startswith("__onednn$"):
                facts["onednn_custom_calls"] += 1
    pending = list(library)
    while pending:  # computations called from a library's fused computation run there too
        outer = pending.pop()
        for inner in calls.get(outer, ()):
            if inner not in library:
                library[inner] = library[outer]
                pending.append(inner)
    for name, instructions in computations.items():
        types = {n: t for n, t, _, _ in instructions}
        for _, _, opcode, rest in instructions:
            if opcode != "dot":
                continue
            where = library.get(name, "xla")
            first = re.match(r"\s*(?:([a-z]\w*\[\S*)\s+)?%([\w.\-]+)", rest)
            dtype = (first.group(1) or types.get(first.group(2), "")) if first else ""
            facts[f"dots_{where}"] += 1
            facts[f"bf16_dots_{where}"] += dtype.startswith("bf16")
    return dict(facts)


def probe(flags: str, timeout: float = 300) -> str | None:
    """``None`` if JAX starts with ``XLA_FLAGS=flags``; otherwise XLA's complaint."""
    result = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env=_env(flags),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return None if result.returncode == 0 else _complaint(result.stderr, result.returncode)


def _env(flags: str) -> dict[str, str]:
    env = dict(os.environ, XLA_FLAGS=flags)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _complaint(stderr: str, returncode: int) -> str:
    """The lines that say why a subprocess failed, without XLA's listing of every flag."""
    text = stderr.split("\nFlags:\n")[0]
    lines = [line for line in text.splitlines() if line.strip()]
    keep = [line for line in lines if re.match(r"[EF]\d{4} |\w*Error|usage:", line)]
    how = f"exit {returncode}"
    if returncode < 0:
        how = f"killed by {signal.Signals(-returncode).name}"
    return f"{how}: " + " | ".join((keep or lines)[-6:])[-1500:]


def worker(config: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process with XLA_FLAGS set: build, time, count and save the numerics."""
    from benchmarks import jax_bench
    from benchmarks.common import environment, time_alternating

    spec, batch = get_spec(config["model"]), config["batch"]
    steps, counts, errors = {}, {}, {}
    for variant in VARIANTS:
        loss, grads = jax_bench.loss_and_grads(spec, variant, batch)
        _save_numerics(Path(config["numerics_dir"]) / f"{variant}.npz", loss, grads)
        step = jax_bench.build(spec, variant, batch, measure_activations=False)
        counts[f"jaxamp:{variant}"] = hlo_paths(step.hlo_text)
        steps[f"jaxamp:{variant}"] = step
    if config["torch"]:
        try:  # imported here, after JAX started with the flags; its threads as they are
            from benchmarks import torch_bench

            steps["torch:bf16"] = torch_bench.build(spec, "bf16", batch, measure_activations=False)
        except Exception as e:  # recorded, not raised: the JAX rows still stand
            errors["torch:bf16"] = f"{type(e).__name__}: {e}"[:500]
    else:
        errors["torch:bf16"] = "not run (--no-torch)"
    times = time_alternating(
        {k: (lambda s=s: s.sync(s.run())) for k, s in steps.items()},
        config["warmup"],
        config["repeats"],
        sync=lambda out: out,
    )
    records = _records(config, steps, times, counts, errors)
    env = dict(environment(), xla_flags=os.environ.get("XLA_FLAGS", ""))
    return {"environment": env, "records": records}


def _save_numerics(path: Path, loss: Any, grads: Any) -> None:
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    arrays = {
        "grad/" + jax.tree_util.keystr(key, simple=True, separator="/"): np.asarray(leaf)
        for key, leaf in leaves
    }
    np.savez(path, loss=np.asarray(loss), **arrays)


def _records(config, steps, times, counts, errors) -> list[dict[str, Any]]:
    """One row per step: times, ratios taken in this process, the compiled step's dots."""
    from benchmarks.common import summarize

    medians = {k: statistics.median(t) for k, t in times.items()}
    records = []
    for key in (*(f"jaxamp:{v}" for v in VARIANTS), "torch:bf16"):
        framework, variant = key.split(":")
        record = _base(config, framework, variant)
        records.append(record)
        if key not in steps:
            record["error"] = errors.get(key, "not built")
            continue
        t = summarize(times[key])
        fp32, torch = medians.get(f"{framework}:fp32"), medians.get("torch:bf16")
        record.update(
            step_time_median_s=t["median_s"],
            step_time_min_s=t["min_s"],
            step_time_max_s=t["max_s"],
            timed_steps=t["n"],
            compile_s=steps[key].compile_s,
            speedup_vs_fp32=fp32 / t["median_s"] if fp32 else None,
            over_torch_bf16=t["median_s"] / torch if torch and framework == "jaxamp" else None,
            **counts.get(key, {}),
        )
    return records


def _base(config: dict[str, Any], framework: str, variant: str) -> dict[str, Any]:
    return {
        "model": config["model"],
        "batch_size": config["batch"],
        "xla_flags": config["flags"],
        "framework": framework,
        "variant": variant,
        "error": None,
    }


def run_one(config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs ``worker`` in a fresh process with ``config["flags"]`` as XLA_FLAGS."""
    start = time.perf_counter()
    error = probe(config["flags"], timeout)
    if error is None:
        try:
            result = subprocess.run(
                [sys.executable, "-m", "benchmarks.xla_cpu_paths", "--worker", json.dumps(config)],
                env=_env(config["flags"]),
                cwd=_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:.0f} s"
        else:
            lines = [x for x in result.stdout.splitlines() if x.startswith(_RECORD)]
            if result.returncode == 0 and lines:
                output = json.loads(lines[-1][len(_RECORD) :])
                for r in output["records"]:
                    r["process_s"] = time.perf_counter() - start
                return output
            error = _complaint(result.stderr, result.returncode)
    return failed(config, error)


def failed(config: dict[str, Any], error: str) -> dict[str, Any]:
    """The rows of a (model, setting) that did not run: each step's, holding the error."""
    frameworks = [("jaxamp", v) for v in VARIANTS] + [("torch", "bf16")]
    records = [dict(_base(config, f, v), error=error) for f, v in frameworks]
    return {"environment": None, "records": records}


def compare_numerics(records: list[dict[str, Any]], numerics_dir: Path) -> None:
    """Adds each jaxamp row of one model its loss and gradient errors against setting 0's
    (saved under ``numerics_dir/<flags_index>/<variant>.npz``)."""

    def load(flags_index: int, variant: str):
        path = numerics_dir / str(flags_index) / f"{variant}.npz"
        return dict(np.load(path)) if path.exists() else None

    for r in records:
        if r["framework"] != "jaxamp" or r["error"]:
            continue
        mine = load(r["flags_index"], r["variant"])
        same, fp32 = load(0, r["variant"]), load(0, "fp32")
        if mine is None:
            continue
        if same is not None:
            r["loss_rel_err"] = _relative(mine["loss"], same["loss"])
            r.update(grad_errors(mine, same))
        if fp32 is not None:
            r["grad_rel_err_vs_default_fp32"] = grad_errors(mine, fp32)["grad_rel_err_global"]


def _relative(a: np.ndarray, ref: np.ndarray, scale: float | None = None) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if scale is None:
        scale = float(np.max(np.abs(ref), initial=0.0))
    return float(np.max(np.abs(a - ref), initial=0.0) / max(scale, np.finfo(np.float32).tiny))


def grad_errors(a: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, Any]:
    """Gradient errors against ``ref``, in float64.

    ``grad_max_rel_err``: the largest over leaves of ``max|a - ref| / max|ref|``, and the
    leaf (``grad_worst_leaf``); a leaf whose true gradient is zero (an attention key's bias)
    makes this large for any rounding. ``grad_rel_err_global``: ``max|a - ref|`` over all
    leaves over ``max|ref|`` over all leaves.
    """
    names = sorted(k for k in ref if k.startswith("grad/"))
    if names != sorted(k for k in a if k.startswith("grad/")):
        nan = float("nan")  # different trees: not comparable
        return {"grad_max_rel_err": nan, "grad_worst_leaf": None, "grad_rel_err_global": nan}
    per_leaf = {k: _relative(a[k], ref[k]) for k in names}
    worst = max(per_leaf, key=per_leaf.get, default=None)
    scale = max((float(np.max(np.abs(ref[k]), initial=0.0)) for k in names), default=0.0)
    return {
        "grad_max_rel_err": per_leaf[worst] if worst else 0.0,
        "grad_worst_leaf": worst[len("grad/") :] if worst and per_leaf[worst] > 0 else None,
        "grad_rel_err_global": max((_relative(a[k], ref[k], scale) for k in names), default=0.0),
    }


COLUMNS = [
    ("model", "model"),
    ("flags", "XLA_FLAGS"),
    ("row", "step"),
    ("step_ms", "step ms"),
    ("range_ms", "min-max ms"),
    ("compile_s", "compile s"),
    ("speedup_vs_fp32", "x fp32 speed"),
    ("over_torch_bf16", "/ torch bf16 time"),
    ("loss_rel_err", "loss rel err"),
    ("grad_max_rel_err", "grad rel err, worst leaf"),
    ("grad_worst_leaf", "worst leaf"),
    ("grad_rel_err_global", "grad rel err, all leaves"),
    ("grad_rel_err_vs_default_fp32", "all leaves vs default fp32"),
    ("dots", "dots xla/onednn/xnn/ynn"),
    ("bf16_dots", "bf16 dots xla/onednn/xnn/ynn"),
    ("fusions", "fusions onednn/xnn/ynn"),
    ("error", "error"),
]


def markdown(records: list[dict[str, Any]], env: dict[str, Any] | None) -> str:
    rows = []
    for r in records:
        row = dict(r, flags=f"`{r['xla_flags']}`" if r["xla_flags"] else "(default)")
        row["row"] = f"{r['framework']} {r['variant']}"
        if r.get("step_time_median_s") is not None:
            row["step_ms"] = 1e3 * r["step_time_median_s"]
            row["range_ms"] = f"{1e3 * r['step_time_min_s']:.1f}-{1e3 * r['step_time_max_s']:.1f}"
        if "dots_xla" in r:
            row["dots"] = "/".join(str(r[f"dots_{k}"]) for k in ("xla", *LIBRARIES))
            row["bf16_dots"] = "/".join(str(r[f"bf16_dots_{k}"]) for k in ("xla", *LIBRARIES))
            row["fusions"] = "/".join(str(r[f"fusions_{k}"]) for k in LIBRARIES)
        row["error"] = (r["error"] or "")[:160].replace("|", "/")
        rows.append(row)
    from benchmarks.common import markdown_table

    hardware = "unknown (no setting ran)"
    if env:
        flags = ", ".join(env.get("cpu_bf16_flags") or ()) or "no bf16 flags"
        hardware = f"{env.get('cpu_model')} ({env.get('cpu_threads')} threads; {flags})"
    head = (
        f"# XLA:CPU's GEMM paths\n\nHardware: {hardware}; jax {env and env.get('jax')}, "
        f"jaxlib {env and env.get('jaxlib')}, torch {env and env.get('torch')}; "
        f"{env and env.get('date')}.\n\n"
    )
    note = (
        "\n\nEach (model, XLA_FLAGS) ran in a fresh process: jaxamp's fp32 and bf16 Adam steps "
        "and PyTorch's eager autocast bf16 step alternated round by round; ratios are within "
        "that process. Errors are against the default path's loss and gradients for the same "
        "variant, in float64: the worst leaf's max|g - g_ref| / max|g_ref| (large for any "
        "rounding where the true gradient is zero, as for an attention key's bias), and over "
        "all leaves max|g - g_ref| / max|g_ref|; the last error column compares with the "
        "default path's fp32 gradients, the scale of bf16's own rounding. Dots: where the "
        "compiled step's `dot`s run (XLA's emitter, or inside a oneDNN/XNNPACK/YNNPACK fusion).\n"
    )
    return head + markdown_table(rows, COLUMNS) + note


def _models(value: str) -> tuple[tuple[str, int], ...]:
    pairs = []
    for item in value.split(","):
        name, _, batch = item.strip().partition(":")
        get_spec(name)
        if not batch.isdigit() or int(batch) < 1:
            raise argparse.ArgumentTypeError(f"want model:batch pairs, got {item!r}")
        pairs.append((name, int(batch)))
    return tuple(pairs)


def run_settings(
    models: tuple[tuple[str, int], ...],
    settings: list[str],
    warmup: int,
    repeats: int,
    torch: bool = True,
    timeout: float = 1800,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every (model, setting) in its own process, model by model; ``settings[0]`` is the
    reference for the numerics. The records, and the environment of the first run."""
    records, env = [], None
    with tqdm(total=len(models) * len(settings), desc="XLA_FLAGS runs", unit="process") as bar:
        for model, batch in models:
            rows = []
            # a model's gradients, once per setting and variant, live until its comparison
            with tempfile.TemporaryDirectory(prefix="xla_cpu_paths_") as tmp:
                for index, flags in enumerate(settings):
                    bar.set_postfix_str(f"{model} {flags or '(default)'}")
                    numerics_dir = Path(tmp) / str(index)
                    numerics_dir.mkdir()
                    config = dict(model=model, batch=batch, flags=flags, warmup=warmup)
                    config.update(repeats=repeats, numerics_dir=str(numerics_dir), torch=torch)
                    result = run_one(config, timeout)
                    env = env or result["environment"]
                    rows += [dict(r, flags_index=index) for r in result["records"]]
                    bar.update(1)
                compare_numerics(rows, Path(tmp))
            records += rows
    return records, env


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=_models, default=None, help="e.g. bert4-128:8")
    parser.add_argument(
        "--flags",
        action="append",
        default=None,
        help='one XLA_FLAGS setting, as --flags="--xla_..." (a bare --xla_... reads as an option); '
        'repeat for several; the default path ("") always runs first, as the reference',
    )
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny models, 1 warm-up, 2 repeats")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(_RECORD + json.dumps(worker(json.loads(args.worker)), default=str), flush=True)
        return []
    models = args.models or (TINY_MODELS if args.tiny else DEFAULT_MODELS)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    repeats = args.repeats if args.repeats is not None else (2 if args.tiny else 7)
    settings = [" ".join(f.split()) for f in (args.flags or DEFAULT_FLAGS)]
    settings = ["", *(f for f in dict.fromkeys(settings) if f)]  # the default first: the reference
    records, env = run_settings(models, settings, warmup, repeats, not args.no_torch, args.timeout)
    text = markdown(records, env)
    if args.out:
        from benchmarks.common import write_results

        write_results(args.out, "xla_cpu_paths", records, text, env or {})
    print(text)
    return records


if __name__ == "__main__":
    main()
