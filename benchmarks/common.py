"""Shared measurement helpers: timing side by side, the environment, writing results.

Follows the project's rules for numbers people quote: compile first, warm up,
time with ``jax.block_until_ready`` around every step, report the median with
min and max, and take ratios from variants alternated within one process.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax


def environment() -> dict[str, Any]:
    """Versions, backend, device and the CPU features relevant to 16-bit compute."""
    import flax
    import optax

    env = {
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "flax": flax.__version__,
        "optax": optax.__version__,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
    except ImportError:
        env["torch"] = None
    from jaxamp._src.compare.environment import environment as jaxamp_environment

    shared = jaxamp_environment()  # CPU model and 16-bit flags, read from /proc/cpuinfo
    env["cpu_model"] = shared["cpu_model"]
    env["cpu_bf16_flags"] = shared["cpu_bf16_features"]
    env["cpu_fp16_flags"] = shared["cpu_fp16_features"]
    env["matmul_form"] = shared["matmul_form"]
    return env


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def summarize(times: Sequence[float]) -> dict[str, float]:
    """Median, min and max of step times in seconds."""
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "n": len(times),
    }


def time_alternating(
    steps: dict[str, Callable[[], Any]],
    warmup: int = 3,
    repeats: int = 5,
    sync: Callable[[Any], Any] = jax.block_until_ready,
    progress: Any = None,
) -> dict[str, list[float]]:
    """Times several already-compiled steps, alternating them round by round.

    Each callable runs one step and returns its output; ``sync`` waits for it.
    Alternating spreads machine noise evenly over the variants, so their ratio
    is what is trustworthy on a shared machine.
    """
    for _ in range(warmup):
        for fn in steps.values():
            sync(fn())
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            sync(fn())
            times[name].append(time.perf_counter() - start)
        if progress is not None:
            progress.update(1)
    return times


def write_results(
    out: str | Path, name: str, records: list[dict[str, Any]], markdown: str, env: dict[str, Any]
) -> Path:
    """Writes ``<name>.json`` (records and environment) and ``<name>.md`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(
        json.dumps({"environment": env, "records": records}, indent=2, default=str) + "\n"
    )
    (out / f"{name}.md").write_text(markdown + "\n")
    return out


def markdown_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A Markdown table of ``rows`` with ``(key, header)`` columns; floats get 3-4 digits."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


_TORCH_VIEWS = (
    "TBackward",
    "TransposeBackward",
    "ViewBackward",
    "PermuteBackward",
    "ExpandBackward",
    "UnsafeViewBackward",
    "ReshapeAliasBackward",
)


def is_param_copy(tensor: Any) -> bool:
    """Whether a torch tensor is (a view of) autocast's 16-bit copy of a parameter.

    Follows the tensor's autograd graph through views to a cast (``ToCopyBackward``)
    of a leaf (an ``AccumulateGrad`` node, which holds the parameter).
    """
    fn = tensor.grad_fn
    while fn is not None and fn.name().startswith(_TORCH_VIEWS) and len(fn.next_functions) == 1:
        fn = fn.next_functions[0][0]
    if fn is None or not fn.name().startswith("ToCopyBackward"):
        return False
    return any(hasattr(node, "variable") for node, _ in fn.next_functions if node is not None)
