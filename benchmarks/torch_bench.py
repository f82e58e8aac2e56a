"""PyTorch AMP training steps on the same architectures, ready to time.

PyTorch AMP as its documentation recommends: ``torch.autocast(device_type, dtype)``
for bf16 and fp16, plus ``torch.amp.GradScaler`` for fp16; channels_last for
convnets; TF32 switched off for ``fp32`` and on for ``tf32``. ``torch.compile``
is a separate row, never instead of eager.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import is_param_copy
from benchmarks.jax_bench import Step
from benchmarks.specs import ModelSpec

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(out: Any) -> Any:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def _inputs(spec: ModelSpec, batch_size: int, dev: torch.device):
    x_np, y_np = spec.batch(batch_size)
    if spec.family == "resnet":
        x = (
            torch.from_numpy(x_np)
            .permute(0, 3, 1, 2)
            .contiguous(memory_format=torch.channels_last)
            .to(dev)
        )
    else:
        x = torch.from_numpy(x_np).long().to(dev)
    return x, torch.from_numpy(y_np).long().to(dev)


def _loss(spec: ModelSpec, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    if spec.family == "gpt2":
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1))
    return F.cross_entropy(logits, y)


def build(
    spec: ModelSpec,
    variant: str,
    batch_size: int,
    compile: bool = False,
    measure_activations: bool = True,
) -> Step:
    """An eager (or ``torch.compile``d) Adam training step under ``variant``."""
    dev = device()
    torch.manual_seed(0)
    model = spec.torch_module().to(dev)
    if spec.family == "resnet":
        model = model.to(memory_format=torch.channels_last)
    model.train()
    tf32 = variant == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler(dev.type, enabled=variant == "fp16")
    dtype = _AUTOCAST.get(variant)
    x, y = _inputs(spec, batch_size, dev)
    forward = torch.compile(model) if compile else model

    def run():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = _loss(spec, forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    _sync(run())  # first step: compilation for torch.compile, allocation for eager
    compile_s = time.perf_counter() - start
    memory = {"peak_allocated": torch.cuda.max_memory_allocated() if dev.type == "cuda" else None}
    activation = None
    if measure_activations and not compile:
        activation = saved_bytes(spec, model, x, y, dtype)
    return Step(
        framework="torch.compile" if compile else "torch",
        variant=variant,
        run=run,
        compile_s=compile_s,
        memory=memory,
        activation_bytes=activation,
        converts=None,
        host_syncs=None,  # not measured: eager PyTorch has no compiled program to read
        flops=None,
        sync=_sync,
    )


def saved_bytes(spec: ModelSpec, model, x, y, dtype) -> int:
    """Bytes of the tensors saved for backward, by storage, without parameters, inputs and
    autocast's 16-bit copies of parameters."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip.add(x.untyped_storage().data_ptr())
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip and not is_param_copy(tensor):
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None),
    ):
        loss = _loss(spec, model(x), y)
    del loss
    return sum(storages.values())


def peak_bytes(spec: ModelSpec, variant: str, batch_size: int) -> int | None:
    """Peak CUDA memory of a few steps at ``batch_size`` (``None`` off GPU)."""
    if device().type != "cuda":
        return None
    torch.cuda.empty_cache()
    step = build(spec, variant, batch_size, measure_activations=False)
    torch.cuda.reset_peak_memory_stats()
    _sync(step.run())
    return torch.cuda.max_memory_allocated()
