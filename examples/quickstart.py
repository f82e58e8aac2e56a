"""Train one unmodified Flax model in float32 and under mixed_bfloat16, side by side.

    python examples/quickstart.py [--steps 300] [--policies float32,mixed_bfloat16]

Data: scikit-learn's handwritten digits (1,797 real 8x8 images, shipped inside
the package, so this runs offline). The model is plain Flax; the only
mixed-precision line is ``jaxamp.linen.apply_policy``.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import jaxamp


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (32, 64):
            x = nn.Conv(features, (3, 3), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10)(x)


def load_digits(seed: int = 0):
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], data.target[order].astype(np.int32)
    split = int(0.8 * len(images))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def train(policy: str, steps: int, batch_size: int, train_data, test_data):
    model = jaxamp.linen.apply_policy(CNN(), policy)  # the mixed-precision line
    variables = model.init(jax.random.key(0), train_data[0][:1])
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(3e-3)
    )

    @jax.jit
    def step(state, batch_stats, images, labels):
        def loss_fn(params):
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), batch_stats, loss

    images, labels = train_data
    rng = np.random.default_rng(0)
    batch_stats = variables["batch_stats"]
    t0 = time.perf_counter()
    compiled = step.lower(state, batch_stats, images[:batch_size], labels[:batch_size]).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        idx = rng.choice(len(images), batch_size, replace=False)
        t0 = time.perf_counter()
        state, batch_stats, loss = jax.block_until_ready(
            compiled(state, batch_stats, images[idx], labels[idx])
        )
        times.append(time.perf_counter() - t0)

    logits = model.apply(
        {"params": state.params, "batch_stats": batch_stats}, test_data[0], train=False
    )
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == test_data[1]))
    report = jaxamp.precision_report(step)(
        state, batch_stats, images[:batch_size], labels[:batch_size]
    )
    return {
        "policy": policy,
        "compile_s": compile_s,
        "step_ms": 1e3 * float(np.median(times[3:])),
        "loss": float(loss),
        "accuracy": accuracy,
        "matmuls": ", ".join(f"{n} {d}" for d, n in report.by_dtype().items()),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--policies", default="float32,mixed_bfloat16")
    args = parser.parse_args(argv)
    train_data, test_data = load_digits()
    rows = [
        train(p, args.steps, args.batch_size, train_data, test_data)
        for p in args.policies.split(",")
    ]
    print(f"{'policy':<16}{'compile s':>10}{'step ms':>9}{'loss':>8}{'test acc':>10}  matmuls")
    for r in rows:
        print(
            f"{r['policy']:<16}{r['compile_s']:>10.1f}{r['step_ms']:>9.2f}{r['loss']:>8.3f}"
            f"{r['accuracy']:>10.3f}  {r['matmuls']}"
        )


if __name__ == "__main__":
    main()
