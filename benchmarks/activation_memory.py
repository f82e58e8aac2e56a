"""Bytes of activations saved for the backward pass: AMP over FP32, jaxamp and PyTorch.

    python -m benchmarks.activation_memory [--models resnet50,bert] [--out benchmarks/results/cpu]

Backend-independent: JAX's figure is read from the jaxpr
(``jaxamp.ops.activation_bytes``: every residual ``jax.vjp`` keeps, except the
function's own arguments), PyTorch's from ``torch.autograd.graph.saved_tensors_hooks``
on the identical architecture (every tensor saved for backward, by storage,
except parameters and inputs). Both in training mode (BatchNorm batch
statistics, dropout), with a float32 cross-entropy loss.

PyTorch's autocast also saves the 16-bit copies of the weights it casts; they
are reported in their own column and left out of ``activation_bytes`` and the
ratio. jaxamp recomputes those casts in the backward pass (a hand-written Flax
model saves them, inside its figure).

Rows per model: jaxamp ``fp32``, ``bf16`` and ``fp16`` policies (16-bit
residuals, the default), ``bf16`` with ``residuals="dots"``, the same Flax model
with ``dtype=jnp.bfloat16`` set on every layer by hand (what Flax users write
today), and PyTorch without and with ``torch.autocast`` (bf16, fp16).
"""

from __future__ import annotations

import argparse
import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jaxamp
from benchmarks.common import is_param_copy, markdown_table, write_results
from jaxamp.models import BertClassifier, BertConfig, ResNet50

SHAPES = {"resnet50": {"batch": 64, "image": 28}, "bert": {"batch": 8, "seq_len": 128}}


def _flax_setup(model_name: str, batch: int, dtype: Any = None):
    if model_name == "resnet50":
        module = ResNet50(10, dtype=dtype)
        x = jax.random.normal(
            jax.random.key(0), (batch, SHAPES[model_name]["image"], SHAPES[model_name]["image"], 1)
        )
        num_classes = 10
    else:
        module = BertClassifier(BertConfig(), dtype=dtype)
        x = jax.random.randint(jax.random.key(0), (batch, SHAPES["bert"]["seq_len"]), 1, 30522)
        num_classes = 2
    labels = jnp.arange(batch) % num_classes
    # Shapes suffice to trace; batch statistics are closed over, so they are arrays.
    variables = dict(jax.eval_shape(lambda: module.init(jax.random.key(0), x[:1])))
    if "batch_stats" in variables:
        variables["batch_stats"] = jax.tree.map(
            lambda s: jnp.ones(s.shape, s.dtype), variables["batch_stats"]
        )
    return module, x, labels, variables


def jax_bytes(model_name: str, batch: int, variant: str) -> dict[str, int]:
    """Activation bytes by dtype for one jaxamp/Flax variant (traced, not run)."""
    if variant == "flax-bf16":
        module, x, labels, variables = _flax_setup(model_name, batch, jnp.bfloat16)
        model = module
    else:
        module, x, labels, variables = _flax_setup(model_name, batch)
        policy, residuals = {
            "fp32": ("float32", "all"),
            "bf16": ("mixed_bfloat16", "compute_dtype"),
            "fp16": ("mixed_float16", "compute_dtype"),
            "bf16-dots": ("mixed_bfloat16", "dots"),
        }[variant]
        model = jaxamp.linen.apply_policy(module, policy, residuals=residuals)

    def loss(params):
        if model_name == "resnet50":
            logits, _ = model.apply(
                {"params": params, "batch_stats": variables["batch_stats"]},
                x,
                mutable=["batch_stats"],
            )
        else:
            logits = model.apply(
                {"params": params}, x, train=True, rngs={"dropout": jax.random.key(1)}
            )
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels
        ).mean()

    return jaxamp.ops.activation_bytes(loss, variables["params"], by_dtype=True)


def torch_bytes(model_name: str, batch: int, variant: str) -> dict[str, int]:
    """Bytes by dtype of the tensors PyTorch saves for backward (one forward pass, run)."""
    import torch

    from benchmarks import torch_models

    torch.manual_seed(0)
    if model_name == "resnet50":
        model = torch_models.resnet50(10, in_channels=1)
        size = SHAPES[model_name]["image"]
        inputs = (torch.randn(batch, 1, size, size).contiguous(memory_format=torch.channels_last),)
        model = model.to(memory_format=torch.channels_last)
        labels = torch.arange(batch) % 10
    else:
        model = torch_models.bert_classifier(BertConfig())
        inputs = (torch.randint(1, 30522, (batch, SHAPES["bert"]["seq_len"])),)
        labels = torch.arange(batch) % 2
    model.train()
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {t.untyped_storage().data_ptr() for t in inputs}
    storages: dict[int, tuple[int, Any, bool]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = (storage.nbytes(), tensor.dtype, is_param_copy(tensor))
        return tensor

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(variant)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(*inputs)
        torch.nn.functional.cross_entropy(logits.float(), labels)
    totals: collections.Counter[str] = collections.Counter()
    for nbytes, dt, param_copy in storages.values():
        key = "parameter copies" if param_copy else str(dt).replace("torch.", "")
        totals[key] += nbytes
    return dict(totals)


JAX_VARIANTS = ("fp32", "bf16", "fp16", "bf16-dots", "flax-bf16")
TORCH_VARIANTS = ("fp32", "bf16", "fp16")


def measure(
    models: list[str], batches: dict[str, int], with_torch: bool, progress: Any = None
) -> list[dict[str, Any]]:
    """One record per model x framework x variant, with the ratio to that framework's fp32."""
    records = []
    for model_name in models:
        batch = batches[model_name]
        runs = [("jaxamp", v, jax_bytes) for v in JAX_VARIANTS]
        if with_torch:
            runs += [("torch", v, torch_bytes) for v in TORCH_VARIANTS]
        baseline: dict[str, int] = {}
        for framework, variant, fn in runs:
            try:
                by_dtype = fn(model_name, batch, variant)
            except RuntimeError as e:  # e.g. an autocast dtype this CPU build lacks
                records.append(
                    {
                        "framework": framework,
                        "model": model_name,
                        "variant": variant,
                        "batch_size": batch,
                        "error": str(e)[:200],
                    }
                )
                continue
            copies = by_dtype.get("parameter copies", 0)
            total = sum(by_dtype.values()) - copies
            if variant == "fp32":
                baseline[framework] = total
            records.append(
                {
                    "framework": "flax" if variant == "flax-bf16" else framework,
                    "model": model_name,
                    "variant": variant,
                    "batch_size": batch,
                    "activation_bytes": total,
                    "parameter_copy_bytes": copies,
                    "by_dtype": by_dtype,
                    "ratio_to_fp32": total / baseline[framework] if framework in baseline else None,
                }
            )
            if progress is not None:
                progress.update(1)
    return records


def table(records: list[dict[str, Any]]) -> str:
    rows = [
        dict(
            r,
            activation_mb=r.get("activation_bytes", 0) / 1e6,
            copies_mb=r.get("parameter_copy_bytes", 0) / 1e6,
            dtypes=", ".join(f"{k} {v / 1e6:.1f}" for k, v in r.get("by_dtype", {}).items()),
        )
        for r in records
    ]
    return markdown_table(
        rows,
        [
            ("model", "model"),
            ("framework", "framework"),
            ("variant", "variant"),
            ("batch_size", "batch"),
            ("activation_mb", "activations MB"),
            ("ratio_to_fp32", "x fp32"),
            ("copies_mb", "weight copies MB"),
            ("dtypes", "MB by dtype"),
            ("error", "error"),
        ],
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert")
    parser.add_argument("--resnet-batch", type=int, default=SHAPES["resnet50"]["batch"])
    parser.add_argument("--bert-batch", type=int, default=SHAPES["bert"]["batch"])
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid choices: {', '.join(SHAPES)}")
    with_torch = not args.no_torch
    if with_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("torch is not installed: PyTorch rows skipped (pip install 'jaxamp[bench]')")
            with_torch = False
    total = len(models) * (len(JAX_VARIANTS) + (len(TORCH_VARIANTS) if with_torch else 0))
    with tqdm(total=total, desc="activation memory") as bar:
        records = measure(
            models, {"resnet50": args.resnet_batch, "bert": args.bert_batch}, with_torch, bar
        )
    text = table(records)
    print(text)
    if args.out:
        from jaxamp._src.compare.environment import environment

        write_results(
            args.out,
            "activation_memory",
            records,
            "# Activation bytes saved for the backward pass\n\n" + text,
            environment(),
        )
    return records


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
