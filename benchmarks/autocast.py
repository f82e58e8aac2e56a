"""What op-level autocast costs: a training step under autocast, a Linen policy, and by hand.

    python -m benchmarks.autocast [--models resnet50,bert] [--repeats 5] [--out DIR]
        [--bert-layers 4] [--seq-len 128]

For each model, one training step (forward, backward, Adam update) of the same
Flax Linen model in three ways, compiled first, then timed alternating round by
round:

* ``autocast``: ``jaxamp.autocast(model.apply, "mixed_bfloat16")``, the model unmodified;
* ``apply_policy``: ``jaxamp.linen.apply_policy(model, "mixed_bfloat16")``;
* ``by_hand``: the model with ``dtype=jnp.bfloat16`` set on every layer.

Models: ResNet50 (10 classes) on 28x28x1 images, batch 16, and a 4-layer BERT
(hidden 256, 4 heads, intermediate 1024) on sequences of 128 tokens, batch 4.
Next to the times: the floating converts and the matmuls and convolutions of the
lowered step, by operand dtype (``jaxamp.precision_report``), and the bytes of
activations saved for the backward pass (``jaxamp.ops.activation_bytes``). On a CPU, XLA
computes 16-bit matmuls in float32: step times there say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import jaxamp
from benchmarks.common import (
    environment,
    markdown_table,
    summarize,
    time_alternating,
    write_results,
)
from jaxamp.models import BertClassifier, BertConfig, ResNet50

VARIANTS = ("autocast", "apply_policy", "by_hand")
POLICY = "mixed_bfloat16"


def _model(name: str, dtype=None, bert_layers: int = 4):
    if name == "resnet50":
        return ResNet50(10, dtype=dtype)
    config = BertConfig(
        hidden_size=256, num_layers=bert_layers, num_heads=4, intermediate_size=1024
    )
    return BertClassifier(config, dtype=dtype)


def build(name: str, batch: int, seq_len: int = 128, image: int = 28, bert_layers: int = 4):
    """``(steps, activations, args)``: one jitted training step per variant, the bytes of
    activations each saves for its backward pass, and the arguments the steps take."""
    key = jax.random.key(0)
    if name == "resnet50":
        inputs = jax.random.normal(key, (batch, image, image, 1))
        labels = jnp.arange(batch) % 10
    else:
        inputs = jax.random.randint(key, (batch, seq_len), 1, BertConfig().vocab_size)
        labels = jnp.arange(batch) % 2
    model = _model(name, bert_layers=bert_layers)
    variables = jax.jit(model.init)(jax.random.key(1), inputs)
    params, state = variables["params"], variables.get("batch_stats", {})
    tx = optax.adam(1e-3)

    def make_loss(apply):
        def loss_fn(params, state):
            if name == "resnet50":
                logits, updates = apply(
                    {"params": params, "batch_stats": state}, inputs, mutable=["batch_stats"]
                )
                state = updates["batch_stats"]
            else:
                logits = apply(
                    {"params": params}, inputs, train=True, rngs={"dropout": jax.random.key(2)}
                )
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), labels
            ).mean()
            return loss, state

        return loss_fn

    def make_step(loss_fn):
        @jax.jit
        def step(params, state, opt_state):
            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), state, opt_state, loss

        return step

    losses = {
        "autocast": make_loss(jaxamp.autocast(model.apply, POLICY)),
        "apply_policy": make_loss(jaxamp.linen.apply_policy(model, POLICY).apply),
        "by_hand": make_loss(_model(name, jnp.bfloat16, bert_layers).apply),
    }
    steps = {variant: make_step(loss_fn) for variant, loss_fn in losses.items()}
    activations = {
        variant: jaxamp.ops.activation_bytes(lambda p, f=loss_fn: f(p, state)[0], params)
        for variant, loss_fn in losses.items()
    }
    return steps, activations, (params, state, tx.init(params))


def measure(
    name: str, batch: int, warmup: int, repeats: int, seq_len: int = 128, bert_layers: int = 4
) -> list[dict]:
    """Compiles, reports and times the three variants of one model."""
    steps, activations, args = build(name, batch, seq_len=seq_len, bert_layers=bert_layers)
    compiled, records = {}, {}
    for variant, step in steps.items():
        start = time.perf_counter()
        lowered = step.lower(*args)
        compiled[variant] = lowered.compile()
        compile_s = time.perf_counter() - start
        report = jaxamp.debug.PrecisionReport.from_lowered(lowered)
        records[variant] = {
            "model": name,
            "batch_size": batch,
            "variant": variant,
            "compile_s": compile_s,
            "activation_mib": activations[variant] / 2**20,
            "converts": report.converts,
            "matmuls": len(report.ops),
            "matmuls_16bit": report.count("bfloat16"),
        }
    with tqdm(total=repeats, desc=name) as bar:
        times = time_alternating(
            {v: (lambda c=c: c(*args)) for v, c in compiled.items()},
            warmup,
            repeats,
            progress=bar,
        )
    reference = summarize(times["apply_policy"])["median_s"]
    for variant, values in times.items():
        s = summarize(values)
        records[variant].update(
            step_time_median_s=s["median_s"],
            step_time_min_s=s["min_s"],
            step_time_max_s=s["max_s"],
            n=s["n"],
            ratio_to_apply_policy=s["median_s"] / reference,
        )
    return list(records.values())


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert", help="resnet50 and/or bert")
    parser.add_argument("--resnet-batch", type=int, default=16)
    parser.add_argument("--bert-batch", type=int, default=4)
    parser.add_argument("--bert-layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128, help="BERT's sequence length")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="folder for autocast.json/.md")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"resnet50", "bert"}
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; valid choices: resnet50, bert")

    records = []
    for name in models:
        batch = args.resnet_batch if name == "resnet50" else args.bert_batch
        records += measure(name, batch, args.warmup, args.repeats, args.seq_len, args.bert_layers)
    table = markdown_table(
        records,
        [
            ("model", "model"),
            ("variant", "variant"),
            ("compile_s", "compile s"),
            ("step_time_median_s", "median s"),
            ("step_time_min_s", "min s"),
            ("step_time_max_s", "max s"),
            ("ratio_to_apply_policy", "x apply_policy"),
            ("converts", "converts"),
            ("activation_mib", "activations MiB"),
            ("matmuls_16bit", "bf16 matmuls"),
            ("matmuls", "matmuls"),
        ],
    )
    print(table)
    if args.out:
        env = environment()
        note = (
            f"Training step (forward, backward, Adam) under {POLICY}; ResNet50 28x28x1 batch "
            f"{args.resnet_batch}, BERT 4x256 length 128 batch {args.bert_batch}; "
            f"{env['backend']} ({env['cpu_model'] if env['backend'] == 'cpu' else env['device']})"
        )
        write_results(
            args.out, "autocast", records, f"# Autocast overhead\n\n{note}\n\n" + table, env
        )
    return records


if __name__ == "__main__":
    main()
