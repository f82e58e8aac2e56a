"""The environment a measurement was taken in: versions, backend, device, CPU features."""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from typing import Any

import jax
import numpy as np

from jaxamp._src.matmul_forms import matmul_form

# The /proc/cpuinfo flags of CPUs with 16-bit GEMM units, per dtype.
CPU_16BIT_UNITS = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags


def cpu_16bit_units(dtype: Any = "bfloat16") -> tuple[str, ...]:
    """The flags of ``/proc/cpuinfo`` that give this CPU 16-bit GEMM units for ``dtype``.

    Empty on a CPU without them (and off Linux). XLA:CPU runs bfloat16 GEMMs on
    ``avx512_bf16``/``amx_bf16`` units; it has no float16 GEMM kernels, so the
    float16 flags change nothing in what it runs.

    Example:
      >>> isinstance(cpu_16bit_units(), tuple)
      True
    """
    flags = cpu_info()[1]
    return tuple(f for f in CPU_16BIT_UNITS.get(np.dtype(dtype).name, ()) if f in flags)


def environment() -> dict[str, Any]:
    """Versions of jax, jaxlib, flax, optax, jmp and torch; backend; device; CPU bf16 features.

    Example:
      >>> env = environment()
      >>> sorted(k for k in env if k in ("jax", "backend", "device"))
      ['backend', 'device', 'jax']
    """
    cpu_model, flags = cpu_info()
    device = jax.devices()[0]
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "flax": _version("flax"),
        "optax": _version("optax"),
        "jmp": _version("jmp"),
        "torch": _version("torch"),
        "backend": jax.default_backend(),
        "device": device.device_kind,
        "device_count": jax.device_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpu_bf16_features": sorted(f for f in flags if "bf16" in f or f.startswith("amx")),
        "cpu_fp16_features": sorted(f for f in flags if "fp16" in f),
        "cpu_bf16_units": list(cpu_16bit_units("bfloat16")),
    }
    env["matmul_form"] = matmul_form().name
    capability = getattr(device, "compute_capability", None)
    if capability is not None:
        env["compute_capability"] = str(capability)
    return env


def describe_hardware(env: dict[str, Any]) -> str:
    """A one-line name for the hardware, e.g. ``"NVIDIA H200"``.

    On a CPU: the model, the core count and the 16-bit flags of /proc/cpuinfo,
    e.g. ``"cpu: AMD EPYC (2 cores; avx512_bf16)"``.
    """
    if env.get("backend") == "cpu":
        units = [*env.get("cpu_bf16_features", ()), *env.get("cpu_fp16_features", ())]
        listed = ", ".join(units) if units else "no bf16/fp16 flags"
        return f"cpu: {env.get('cpu_model')} ({env.get('cpu_count')} cores; {listed})"
    return str(env.get("device"))
