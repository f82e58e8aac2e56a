"""Where a training step's time goes: XLA's own per-thunk trace beside ``torch.profiler``.

    python -m benchmarks.profile --models bert4-128:8 gpt2-4-128:4 \\
        --out benchmarks/results/profile-cpu

For each model, the jaxamp fp32 and bf16 steps and the hand-written Flax
``dtype=bfloat16`` step are compiled and warmed up, then a few steps of each run
under ``jax.profiler.trace``. XLA:CPU records one trace event per executed thunk
(a fusion, a GEMM, a copy), named by its HLO instruction; each is put in one
category by reading that instruction in the compiled program:

* ``gemm``: the thunk holds a dot or a convolution (the fusions around it included);
* ``norm``, ``softmax``, ``activation``, ``dropout``: by the Flax module or
  primitive that the instruction's metadata names (``*_norm``, ``ln_*``, ``softmax``
  or exp-and-reduce, erf/tanh/logistic, ``Dropout`` and its random bits);
* ``convert`` (shown as "convert or copy"): a thunk that only converts, copies or
  moves data (transposes included);
* ``optimizer``: the update after the gradient: a thunk with an op outside the
  gradient's scope (no ``jvp`` in its name), the gradient's last ops fused in or not;
* ``other``: the remaining elementwise work and reductions (bias and residual adds,
  the loss, the embedding gathers).

PyTorch's eager fp32 and AMP bf16 steps run under ``torch.profiler`` and their
ATen ops' self times are put in the same categories by name. Times are per step,
the mean over the profiled steps. Thunks can run concurrently on the CPU's threads,
so a framework's category times add up to its busy time, which may exceed the step's
wall time; shares are of the busy time.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax

from benchmarks.common import write_results
from benchmarks.hlo_text import computations as hlo_computations

CATEGORIES = (
    "gemm",
    "norm",
    "softmax",
    "activation",
    "dropout",
    "convert",
    "optimizer",
    "other",
)

_SHOWN = {"convert": "convert or copy"}  # the category's name in the table
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MOVES = {
    "convert",
    "bitcast",
    "bitcast-convert",
    "copy",
    "broadcast",
    "reshape",
    "transpose",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "reduce-precision",
    "pad",
}
_CONTROL = {"while", "conditional", "call", "async-start", "async-done"}
_NORM = re.compile(r"(?:^|/)(?:\w*_norm|ln_\w+|LayerNorm_\d+|BatchNorm_\d+|bn\d*)(?:/|$)")
_ACTIVATIONS = {"erf", "erfc", "tanh", "logistic"}


@dataclasses.dataclass
class _Instruction:
    name: str
    opcode: str
    op_name: str
    calls: list[str]


def parse_hlo(text: str) -> dict[str, list[_Instruction]]:
    """The compiled program's computations, each a list of its instructions."""
    computations: dict[str, list[_Instruction]] = {}
    for computation, instructions in hlo_computations(text).items():
        current = computations.setdefault(computation, [])
        for name, _, opcode, rest in instructions:
            calls = [
                c.strip().lstrip("%") for m in _CALLS.finditer(rest) for c in m.group(1).split(",")
            ]
            op_name = _OP_NAME.search(rest)
            current.append(_Instruction(name, opcode, op_name.group(1) if op_name else "", calls))
    return computations


def _flatten(instruction: _Instruction, computations: dict[str, list[_Instruction]]):
    """The instruction and, for a fusion, every instruction of its fused computations."""
    yield instruction
    if instruction.opcode == "fusion":
        for name in instruction.calls:
            for inner in computations.get(name, ()):
                yield from _flatten(inner, computations)


def classify(instruction: _Instruction, computations: dict[str, list[_Instruction]]) -> str:
    """The category of the thunk that executes ``instruction`` (see the module docstring)."""
    body = list(_flatten(instruction, computations))
    opcodes = {i.opcode for i in body}
    names = [i.op_name for i in body if i.op_name]
    target = instruction.op_name.lower()
    if opcodes & {"dot", "convolution"} or (
        instruction.opcode == "custom-call" and re.search("matmul|conv|gemm", target)
    ):
        return "gemm"
    if opcodes - {"fusion"} <= _MOVES:
        return "convert"
    if any("Dropout" in n or "threefry" in n or "random_bits" in n for n in names):
        return "dropout"
    # The update after the gradient: XLA fuses the first optimizer ops with the
    # gradient's last (a cast, a dot's output) in 16-bit steps, so one is enough.
    if any("jvp(" not in n for n in names):
        return "optimizer"
    if any(_NORM.search(n) for n in names) or "rsqrt" in opcodes:
        return "norm"
    if any("softmax" in n for n in names) or {"exponential", "reduce"} <= opcodes:
        return "softmax"
    if opcodes & _ACTIVATIONS or any("gelu" in n for n in names):
        return "activation"
    return "other"


def thunk_categories(hlo_text: str) -> dict[str, tuple[str | None, int]]:
    """Each thunk-level instruction's ``(category, converts inside it)``.

    Thunk-level means an instruction of a computation that is executed, not fused:
    the entry and the bodies of loops and conditionals. Control flow itself gets the
    category ``None``: its trace event spans its body's, which are counted.
    """
    computations = parse_hlo(hlo_text)
    fused = {
        c for body in computations.values() for i in body if i.opcode == "fusion" for c in i.calls
    }
    result = {}
    for name, body in computations.items():
        if name in fused:
            continue
        for instruction in body:
            if instruction.opcode in _CONTROL:
                result[instruction.name] = (None, 0)
                continue
            converts = sum(i.opcode == "convert" for i in _flatten(instruction, computations))
            result[instruction.name] = (classify(instruction, computations), converts)
    return result


def _trace_events(trace_dir: str) -> list[dict[str, Any]]:
    (path,) = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def profile_jax(run: Callable[[], Any], hlo_text: str, steps: int) -> dict[str, Any]:
    """Per-category time of ``steps`` executions of a compiled step, from XLA's trace."""
    thunks = thunk_categories(hlo_text)
    trace_dir = tempfile.mkdtemp(prefix="jaxamp-profile-")
    try:
        start = time.perf_counter()
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(run())
        wall = (time.perf_counter() - start) / steps
        events = _trace_events(trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    converts: dict[str, int] = collections.defaultdict(int)
    unmatched = 0.0
    for event in events:
        op = event["args"]["hlo_op"]
        if op not in thunks:
            unmatched += event["dur"] * 1e-6
            continue
        category, n = thunks[op]
        if category is None:  # a loop or conditional: its body's thunks have events
            continue
        seconds[category] += event["dur"] * 1e-6  # trace times are in microseconds
        counts[category] += 1
        converts[category] += n
    return _summary(seconds, counts, converts, steps, wall, unmatched)


_TORCH_RULES = (
    ("gemm", ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mkldnn", "conv")),
    ("norm", ("layer_norm", "batch_norm")),
    ("softmax", ("softmax",)),
    ("activation", ("gelu", "tanh", "sigmoid", "silu", "relu")),
    ("dropout", ("dropout", "bernoulli")),
    ("convert", ("_to_copy", "copy_", "to", "contiguous", "clone")),
    ("optimizer", ("_foreach", "adam", "_amp_", "addcdiv", "addcmul", "sqrt", "lerp")),
)


def torch_category(name: str) -> str:
    """The category of an ATen op (``aten::native_layer_norm_backward`` -> ``norm``)."""
    op = name.split("::")[-1]
    for category, keys in _TORCH_RULES:
        for key in keys:
            if op == key or op.startswith(f"{key}_") or op.startswith(f"_{key}") or key in op:
                if category == "convert" and key == "to" and op not in ("to", "_to_copy"):
                    continue
                return category
    return "other"


def profile_torch(run: Callable[[], Any], steps: int) -> dict[str, Any]:
    """Per-category self time of ATen ops over ``steps`` eager PyTorch steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    wall = (time.perf_counter() - start) / steps
    seconds: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in prof.key_averages():
        if not event.key.startswith("aten::"):
            continue
        category = torch_category(event.key)
        seconds[category] += event.self_cpu_time_total * 1e-6
        counts[category] += event.count
    del torch
    return _summary(seconds, counts, {}, steps, wall, 0.0)


def _summary(seconds, counts, converts, steps, wall, unmatched) -> dict[str, Any]:
    busy = sum(seconds.values())
    return {
        "step_wall_s": wall,
        "busy_s": busy / steps,
        "unmatched_s": unmatched / steps,
        "categories": {
            c: {
                "ms": 1e3 * seconds.get(c, 0.0) / steps,
                "share": seconds.get(c, 0.0) / busy if busy else 0.0,
                "thunks": counts.get(c, 0) // steps,
                "converts": converts.get(c, 0) // steps if converts else None,
            }
            for c in CATEGORIES
        },
    }


def markdown(records: list[dict[str, Any]], hardware: str) -> str:
    """One table per model: a row per category, a column pair (ms, share) per step."""
    lines = ["# Where the step's time goes", "", f"Hardware: {hardware}.", ""]
    by_model: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in records:
        by_model[r["model"]].append(r)
    for model, rows in by_model.items():
        heads = [f"{r['framework']} {r['variant']}" for r in rows]
        lines += [f"## {model}, batch {rows[0]['batch']}", ""]
        lines.append("| category | " + " | ".join(f"{h} ms | {h} %" for h in heads) + " |")
        lines.append("|---|" + "---|---|" * len(rows))
        for c in CATEGORIES:
            cells = [
                f"{r['profile']['categories'][c]['ms']:.1f} | "
                f"{100 * r['profile']['categories'][c]['share']:.0f}"
                for r in rows
            ]
            lines.append(f"| {_SHOWN.get(c, c)} | " + " | ".join(cells) + " |")
        busy = " | ".join(f"{1e3 * r['profile']['busy_s']:.1f} | 100" for r in rows)
        wall = " | ".join(f"{1e3 * r['profile']['step_wall_s']:.1f} | " for r in rows)
        lines += [f"| busy (sum) | {busy} |", f"| step wall time | {wall} |"]
        converts = [
            str(sum(v["converts"] or 0 for v in r["profile"]["categories"].values()))
            if r["framework"] != "torch"
            else "n/a"
            for r in rows
        ]
        lines += ["| converts executed | " + " | ".join(f"{c} | " for c in converts) + " |", ""]
    lines += [
        "Categories, from the compiled HLO (jax) or the ATen op name (torch): see "
        "`benchmarks/profile.py`. JAX: XLA's per-thunk trace (`jax.profiler.trace`); "
        "PyTorch: `torch.profiler` self CPU time of ATen ops. Busy time can exceed the "
        "wall time when thunks or ops run on several threads at once.",
    ]
    return "\n".join(lines)


def _parse_models(values: Iterable[str]) -> list[tuple[str, int]]:
    models = []
    for value in values:
        name, _, batch = value.partition(":")
        models.append((name, int(batch or 8)))
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert4-128:8", "gpt2-4-128:4"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--fp16", action="store_true", help="also jaxamp's fp16 step")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from benchmarks import jax_bench
    from benchmarks.specs import get_spec
    from jaxamp._src.compare.environment import describe_hardware, environment

    env = environment()
    records = []
    for name, batch in _parse_models(args.models):
        spec = get_spec(name)
        steps = [("jaxamp", "fp32"), ("jaxamp", "bf16"), ("flax", "bf16")]
        steps += [("jaxamp", "fp16")] if args.fp16 else []
        for framework, variant in steps:
            step = jax_bench.build(spec, variant, batch, framework, measure_activations=False)
            for _ in range(args.warmup):
                jax.block_until_ready(step.run())
            result = profile_jax(step.run, step.hlo_text, args.steps)
            records.append(_record(name, batch, framework, variant, result))
            print(_line(records[-1]), flush=True)
            del step
        if args.no_torch:
            continue
        from benchmarks import torch_bench

        for variant in ("fp32", "bf16"):
            step = torch_bench.build(spec, variant, batch, measure_activations=False)
            for _ in range(args.warmup):
                step.run()
            result = profile_torch(step.run, args.steps)
            records.append(_record(name, batch, "torch", variant, result))
            print(_line(records[-1]), flush=True)
    write_results(args.out, "profile", records, markdown(records, describe_hardware(env)), env)
    print(f"wrote {args.out}/profile.json and profile.md")


def _record(model, batch, framework, variant, profile) -> dict[str, Any]:
    return {
        "model": model,
        "batch": batch,
        "framework": framework,
        "variant": variant,
        "profile": profile,
    }


def _line(r: dict[str, Any]) -> str:
    cats = ", ".join(f"{c} {v['ms']:.0f}" for c, v in r["profile"]["categories"].items())
    return f"{r['model']} {r['framework']} {r['variant']}: {cats} ms"


if __name__ == "__main__":
    main()
