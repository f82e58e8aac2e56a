"""What loss scaling costs: a loss-scaled Adam step against a plain optax Adam step.

    python -m benchmarks.loss_scaling [--batch-size 32] [--repeats 20] [--out benchmarks/results]

Two figures, each from variants alternated in one process:

* ``update``: the optimizer update alone (``tx.update`` + ``apply_updates``) on
  ResNet18's 11.7M parameters, where the unscale, the finiteness check and the
  conditional skip are all the extra work there is;
* ``train_step``: a whole jitted training step (forward, backward, update) of
  the same ResNet18, plain Flax + ``optax.adam`` against jaxamp's ``float32``
  policy + ``jaxamp.loss_scaled(optax.adam)`` + ``jaxamp.value_and_grad``.
"""

from __future__ import annotations

import argparse

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
from jaxamp.models import ResNet18


def build(batch_size: int, image_size: int):
    images = jax.random.normal(jax.random.key(0), (batch_size, image_size, image_size, 3))
    labels = jnp.arange(batch_size) % 10
    plain_model = ResNet18(num_classes=10)
    variables = plain_model.init(jax.random.key(1), images)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def make_step(model, tx, scaled: bool):
        def loss_fn(params, batch_stats):
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        @jax.jit
        def step(params, batch_stats, opt_state):
            if scaled:
                (loss, batch_stats), grads = jaxamp.value_and_grad(loss_fn, has_aux=True)(
                    params, batch_stats, opt_state=opt_state
                )
            else:
                (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    params, batch_stats
                )
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), batch_stats, opt_state, loss

        return step

    def make_update(tx):
        @jax.jit
        def update(params, grads, opt_state):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return update

    plain_tx = optax.adam(1e-3)
    scaled_tx = jaxamp.loss_scaled(optax.adam(1e-3))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    states = {"plain": plain_tx.init(params), "loss_scaled": scaled_tx.init(params)}
    scaled_model = jaxamp.linen.apply_policy(plain_model, "float32")
    steps = {
        "plain": make_step(plain_model, plain_tx, False),
        "loss_scaled": make_step(scaled_model, scaled_tx, True),
    }
    updates = {"plain": make_update(plain_tx), "loss_scaled": make_update(scaled_tx)}
    return params, batch_stats, grads, states, steps, updates


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for loss_scaling.json/.md")
    args = parser.parse_args(argv)

    params, batch_stats, grads, states, steps, updates = build(args.batch_size, args.image_size)
    records = []
    with tqdm(total=2 * args.repeats, desc="loss scaling") as bar:
        times = time_alternating(
            {
                name: (lambda f=f, s=states[name]: f(params, grads, s))
                for name, f in updates.items()
            },
            args.warmup,
            args.repeats,
            progress=bar,
        )
        records += _records("update", times)
        times = time_alternating(
            {
                name: (lambda f=f, s=states[name]: f(params, batch_stats, s))
                for name, f in steps.items()
            },
            args.warmup,
            args.repeats,
            progress=bar,
        )
        records += _records("train_step", times)

    table = markdown_table(
        records,
        [
            ("scope", "scope"),
            ("variant", "variant"),
            ("step_time_median_s", "median s"),
            ("min_s", "min s"),
            ("max_s", "max s"),
            ("ratio_to_plain", "x plain"),
        ],
    )
    print(table)
    if args.out:
        env = environment()
        note = (
            f"ResNet18, batch {args.batch_size}, {args.image_size}x{args.image_size}x3, "
            f"{env['backend']} ({env['cpu_model'] if env['backend'] == 'cpu' else env['device']})"
        )
        write_results(
            args.out, "loss_scaling", records, f"# Loss scaling overhead\n\n{note}\n\n" + table, env
        )


def _records(scope: str, times: dict[str, list[float]]) -> list[dict]:
    plain = summarize(times["plain"])["median_s"]
    rows = []
    for name, values in times.items():
        s = summarize(values)
        rows.append(
            {
                "scope": scope,
                "variant": name,
                "step_time_median_s": s["median_s"],
                "min_s": s["min_s"],
                "max_s": s["max_s"],
                "n": s["n"],
                "ratio_to_plain": s["median_s"] / plain,
            }
        )
    return rows


if __name__ == "__main__":
    main()
