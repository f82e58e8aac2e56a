"""What the backend offers: the policy to pick, and how 16-bit matmuls accumulate.

Nothing here runs at import time: devices are queried when a function is called.
"""

from __future__ import annotations

import functools
import os
import platform
import typing
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxamp._src.policy import PRESETS, Policy

# The /proc/cpuinfo flags of CPUs with 16-bit GEMM units, per dtype.
CPU_16BIT_UNITS = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
}


# NVIDIA compute capability from which bfloat16 tensor cores exist (Ampere).
_BF16_MIN_CAPABILITY = 8.0
# ... and from which float16 tensor cores exist (Volta).
_F16_MIN_CAPABILITY = 7.0
# ... and from which float8 tensor cores exist (Ada, Hopper).
_FP8_MIN_CAPABILITY = 8.9
# Blackwell: the block-scaled GEMM (MXFP8, NVFP4) in hardware.
_BLOCK_SCALED_MIN_CAPABILITY = 10.0


def _compute_capability(device: Any) -> float | None:
    capability = getattr(device, "compute_capability", None)
    if capability is None:
        return None
    try:
        return float(capability)
    except (TypeError, ValueError):
        return None


def _is_rocm(device: Any) -> bool:
    version = getattr(getattr(device, "client", None), "platform_version", "") or ""
    return "rocm" in version.lower()


def has_block_scaled_gemm(devices: Any = None) -> bool:
    """Whether ``devices`` (default: this process's) all run the block-scaled GEMM in
    hardware: NVIDIA GPUs of compute capability 10.0 or more (Blackwell).

    Examples:
      >>> from jaxamp._src.backend import has_block_scaled_gemm
      >>> import jax
      >>> jax.default_backend() != "cpu" or has_block_scaled_gemm()
      False
    """
    devices = jax.devices() if devices is None else devices
    return bool(devices) and all(
        d.platform in ("gpu", "cuda")
        and not _is_rocm(d)
        and (_compute_capability(d) or 0.0) >= _BLOCK_SCALED_MIN_CAPABILITY
        for d in devices
    )


def cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor(), set[str]()
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

    Examples:
      >>> isinstance(cpu_16bit_units(), tuple)
      True
    """
    flags = cpu_info()[1]
    return tuple(f for f in CPU_16BIT_UNITS.get(np.dtype(dtype).name, ()) if f in flags)


def _cpu_reason() -> str:
    """Why ``float32`` on this CPU, naming it (from /proc/cpuinfo)."""
    model, flags = cpu_info()
    units = cpu_16bit_units("bfloat16")
    named = f"cpu: {model or 'unknown'} ({os.cpu_count()} cores)"
    if units:
        return (
            f"{named} lists {', '.join(units)}: XLA:CPU runs bfloat16 GEMMs on these units, "
            "so mixed_bfloat16 speeds up matmul-heavy models (transformers) here, but not "
            "convolutions, and float16 gains nothing (XLA:CPU has no float16 GEMM kernels); "
            "float32 is the default, ask for mixed_bfloat16 for a matmul-heavy model"
        )
    listed = [f for f in ("avx2", "fma", "avx512f") if f in flags]
    return (
        f"{named} lists no avx512_bf16 or amx_bf16 (it has {', '.join(listed) or 'neither'}): "
        "XLA:CPU computes 16-bit matmuls there with float32 arithmetic, so mixed precision "
        "runs no faster than float32 and pays for its casts; it saves activation memory only"
    )


@typing.overload
def auto_policy(device: Any = None, *, explain: Literal[False] = False) -> Policy: ...


@typing.overload
def auto_policy(device: Any = None, *, explain: Literal[True]) -> tuple[Policy, str]: ...


def auto_policy(device: Any = None, *, explain: bool = False) -> Policy | tuple[Policy, str]:
    """Picks the mixed-precision preset that suits a device.

    * NVIDIA GPU with compute capability 8.0 or newer (Ampere, Hopper,
      Blackwell): ``mixed_bfloat16``;
    * NVIDIA GPU with compute capability 7.x (Volta, Turing): ``mixed_float16``
      (use it with dynamic loss scaling);
    * older NVIDIA GPUs: ``float32`` (no tensor cores);
    * AMD GPUs (ROCm) and TPUs: ``mixed_bfloat16``;
    * CPUs and anything else: ``float32``.

    On a CPU without bf16 units (no ``avx512_bf16``/``amx_bf16`` in
    ``/proc/cpuinfo``) XLA computes 16-bit matmuls with float32 arithmetic, so a
    mixed policy saves activation memory but no time. With those units, bfloat16
    matmuls run faster under jaxamp's matmul rule, but convolutions and float16
    gain nothing, so ask for ``mixed_bfloat16`` for a matmul-heavy model there.
    ``explain=True`` returns the reason too, naming the device.

    Args:
      device: the device to decide for; the first device of the default backend
        when ``None``.
      explain: also return why, as ``(policy, reason)``.

    Returns:
      One of the presets in ``jaxamp.PRESETS`` (and the reason, with ``explain``).

    Examples:
      >>> import jax
      >>> policy, reason = auto_policy(explain=True)
      >>> jax.default_backend() != "cpu" or (str(policy), reason[:4])
      ('params=float32,compute=float32,output=float32', 'cpu:')
    """
    if device is None:
        device = jax.devices()[0]
    name, reason = _choose(device)
    return (PRESETS[name], reason) if explain else PRESETS[name]


def candidate_policies(device: Any = None) -> tuple[str, ...]:
    """The mixed-precision presets ``device`` computes, cheapest first: those
    ``jaxamp.suggest_policy`` measures when it is given none (``"float32"``, always
    possible, is not listed).

    * NVIDIA GPU from compute capability 8.9 (Ada, Hopper, Blackwell): ``mixed_float8``,
      ``mixed_bfloat16``, ``mixed_float16``; from 8.0: the last two; 7.x:
      ``mixed_float16``; older: none.
    * AMD GPUs and TPUs: ``mixed_bfloat16``.
    * CPUs: ``mixed_bfloat16`` and ``mixed_float16``. They halve activation memory on
      every CPU; only ``mixed_bfloat16``'s matmuls are faster, and only on a CPU with
      bf16 units (see ``auto_policy``, which picks for speed).

    bfloat16 comes before float16 wherever both run: as fast, and with no loss scale.

    Examples:
      >>> from jaxamp._src.backend import candidate_policies
      >>> import jax
      >>> jax.default_backend() != "cpu" or candidate_policies()
      ('mixed_bfloat16', 'mixed_float16')
    """
    if device is None:
        device = jax.devices()[0]
    platform = device.platform
    if platform == "tpu" or platform == "rocm" or (platform == "gpu" and _is_rocm(device)):
        return ("mixed_bfloat16",)
    if platform in ("gpu", "cuda"):
        capability = _compute_capability(device)
        if capability is None or capability >= _FP8_MIN_CAPABILITY:
            return ("mixed_float8", "mixed_bfloat16", "mixed_float16")
        if capability >= _BF16_MIN_CAPABILITY:
            return ("mixed_bfloat16", "mixed_float16")
        return ("mixed_float16",) if capability >= _F16_MIN_CAPABILITY else ()
    if platform == "cpu":
        return ("mixed_bfloat16", "mixed_float16")
    return ()


def _choose(device: Any) -> tuple[str, str]:
    """The preset's name for ``device`` and why."""
    platform = device.platform
    if platform == "tpu":
        return "mixed_bfloat16", f"tpu: {device.device_kind} has bfloat16 matrix units"
    if platform in ("gpu", "cuda", "rocm"):
        kind = getattr(device, "device_kind", platform)
        if platform == "rocm" or _is_rocm(device):
            return "mixed_bfloat16", f"gpu: {kind} (ROCm) runs bfloat16 GEMMs"
        capability = _compute_capability(device)
        if capability is None or capability >= _BF16_MIN_CAPABILITY:
            return "mixed_bfloat16", f"gpu: {kind} has bfloat16 tensor cores"
        if capability >= _F16_MIN_CAPABILITY:
            return "mixed_float16", (
                f"gpu: {kind} (compute capability {capability}) has float16 tensor cores "
                "but no bfloat16 ones; use dynamic loss scaling"
            )
        return "float32", f"gpu: {kind} (compute capability {capability}) has no tensor cores"
    if platform == "cpu":
        return "float32", _cpu_reason()
    return "float32", f"{platform}: no known 16-bit units"


@functools.cache
def _algorithm_supported(platform: str, capability: float | None, dtype_name: str) -> bool:
    if dtype_name == "bfloat16":
        if platform in ("cpu", "tpu"):
            return True
        if platform in ("gpu", "cuda"):
            return capability is None or capability >= _BF16_MIN_CAPABILITY
        return False
    if dtype_name == "float16":
        if platform in ("gpu", "cuda"):
            return capability is None or capability >= _F16_MIN_CAPABILITY
        return False
    return False


def dot_algorithm(compute_dtype: Any, device: Any = None) -> lax.DotAlgorithmPreset | None:
    """The dot algorithm that makes 16-bit operands accumulate in float32, if the backend has it.

    jaxamp's layers and ``autocast`` no longer use it: they run the 16-bit
    16-bit matmul rule, whose float32-result GEMMs XLA:CPU
    runs on its bf16 kernels where this algorithm runs no faster than float32.
    It stays for code that sets ``precision=`` itself.

    With ``precision=BF16_BF16_F32`` (or ``F16_F16_F32``) a ``dot_general`` takes
    16-bit operands, returns a 16-bit result and states float32 accumulation in
    the lowered program, in the forward pass and in the transposed dots of the
    backward pass alike. (Asking for ``preferred_element_type=float32`` instead
    turns the backward dots into float32 x float32 dots, because their cotangent
    is float32.)

    XLA:CPU takes ``BF16_BF16_F32`` but not ``F16_F16_F32``; XLA:GPU takes both
    (bfloat16 from compute capability 8.0); TPUs take ``BF16_BF16_F32``. Where
    the algorithm is not available this returns ``None`` and the backend's
    default applies (on GPUs and TPUs that default accumulates 16-bit products
    in float32 as well, on CPUs XLA computes them in float32).

    Args:
      compute_dtype: the operands' dtype.
      device: the device to decide for; the first default device when ``None``.

    Returns:
      A ``jax.lax.DotAlgorithmPreset`` or ``None``.
    """
    dtype = np.dtype(compute_dtype)
    if dtype == np.dtype(jnp.bfloat16):
        preset = lax.DotAlgorithmPreset.BF16_BF16_F32
    elif dtype == np.dtype(jnp.float16):
        preset = lax.DotAlgorithmPreset.F16_F16_F32
    else:
        return None
    if device is None:
        device = jax.devices()[0]
    if not _algorithm_supported(device.platform, _compute_capability(device), dtype.name):
        return None
    return preset
