"""The environment a measurement was taken in: versions, backend, device, CPU features."""

from __future__ import annotations

import os
import platform
import time
from importlib import metadata
from typing import Any

import jax

from jaxamp._src.backend import cpu_16bit_units, cpu_info
from jaxamp._src.ops.forms import matmul_form


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions of jax, jaxlib, flax, optax, jmp and torch; backend; device; CPU bf16 features.

    Examples:
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
    env["xla_flags"] = os.environ.get("XLA_FLAGS") or None  # --xla_cpu_max_isa changes the CPU
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
        flags = f"; XLA_FLAGS={env['xla_flags']}" if env.get("xla_flags") else ""
        return f"cpu: {env.get('cpu_model')} ({env.get('cpu_count')} cores; {listed}{flags})"
    return str(env.get("device"))
