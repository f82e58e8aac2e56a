"""Which model ``jaxamp compare`` runs by default on this machine, and why."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxamp._src.backend import cpu_16bit_units

# The transformer ``model="auto"`` trains on a CPU with bf16 units: BERT's heads of 64
# (the GEMM shapes the units run fast), half BERT's width, few layers and short
# sequences. On the 2-core AMD EPYC with avx512_bf16 it trains in 95 s and the whole
# run takes under 3 minutes (width 768 took about 7); the 402 test sentences and the
# 150 steps, which the verdict's power rests on, are the same.
CPU_TRANSFORMER = {"layers": 2, "hidden": 384, "heads": 6, "seq_len": 64, "vocab_size": 8192}
# The convnet it trains on a CPU without bf16 units: ResNet50 took 0.6 s a step there
# (AMD EPYC, AVX2 only, 2 cores: 12-13 minutes for the default run); a ResNet18 of width
# 32 has about a tenth of its FLOPs and shows the same: memory saved, no time.
CPU_CONVNET = {"model": "resnet18", "width": 32}


# Each model's own shape, for the shape fields a config leaves ``None``: BERT-base and a
# ResNet of the published width.
MODEL_SHAPES = {
    "bert": {"layers": 12, "hidden": 768, "heads": 12, "seq_len": 128, "vocab_size": 30522},
    "resnet50": {"width": 64},
    "resnet18": {"width": 64},
}
HEAD_SIZE = 64  # BERT's: ``heads`` left out is ``hidden // 64`` where 64 divides it


def choose_model(config: Any) -> tuple[Any, str]:
    """Resolves ``model="auto"`` and the shape fields left ``None``; returns the config to
    run and the reason, for the report."""
    if config.model != "auto":
        return _filled(config, MODEL_SHAPES[config.model]), f"model {config.model!r} as asked"
    if jax.default_backend() == "cpu" and cpu_16bit_units("bfloat16"):
        reason = (
            "auto: this CPU has bf16 GEMM units (/proc/cpuinfo), which speed up matmuls but "
            "not convolutions, so a BERT-shaped transformer (width 384) shows what AMP buys "
            "here; on GPUs the reference experiment is ResNet50 (--model resnet50)"
        )
        return _auto_shape(config, {"model": "bert", **CPU_TRANSFORMER}, reason)
    if jax.default_backend() == "cpu":
        reason = (
            f"auto: a ResNet18 of width {CPU_CONVNET['width']}; this CPU lists no bf16 "
            "units, so 16-bit compute "
            "saves activation memory here but no time, which a small convnet shows in "
            "minutes (the reference experiment, ResNet50: --model resnet50)"
        )
        return _auto_shape(config, CPU_CONVNET, reason)
    return _auto_shape(config, {"model": "resnet50"}, "auto: ResNet50, the reference experiment")


def _auto_shape(config: Any, shape: dict[str, Any], reason: str) -> tuple[Any, str]:
    """``config`` as ``shape`` makes it (its ``model`` among them) where a field is left
    ``None``; a shape option the user gave (``--width 16``, ``--hidden 768``) is kept,
    and the reason says so."""
    kept = {k: getattr(config, k) for k in shape if k != "model" and getattr(config, k) is not None}
    model = shape.get("model", config.model)
    config = dataclasses.replace(config, model=model)
    config = _filled(config, {**MODEL_SHAPES[model], **shape})
    if kept:
        reason += "; kept as given: " + ", ".join(f"{k}={v}" for k, v in kept.items())
    return config, reason


def _filled(config: Any, shape: dict[str, Any]) -> Any:
    """``config`` with ``shape``'s values for the shape fields it leaves ``None``; heads
    left out beside a given ``hidden`` are ``hidden // HEAD_SIZE`` where that divides."""
    values = {k: v for k, v in shape.items() if k != "model" and getattr(config, k) is None}
    if "heads" in values and config.hidden is not None and config.hidden % HEAD_SIZE == 0:
        values["heads"] = config.hidden // HEAD_SIZE
    return dataclasses.replace(config, **values)  # config.check_options checks the heads
