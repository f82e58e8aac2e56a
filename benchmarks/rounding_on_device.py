"""Whether jaxamp's roundings survive the device's compiler: Kahan and stochastic rounding.

    python -m benchmarks.rounding_on_device [--draws 1000000] [--out DIR]

A compiler allowed excess precision (XLA's ``xla_allow_excess_precision``, on by
default on GPU and TPU) may fold ``x.astype(bfloat16).astype(float32)`` to ``x``.
jaxamp rounds with ``lax.reduce_precision`` instead; this checks, on the default
device, that

* the Kahan recipe keeps a non-zero compensation and follows the float32 sum (400
  updates of 2**-13 to bfloat16 params at 1.0: the naive recipe stays at 1.0);
* stochastic rounding to bfloat16 and float16 is unbiased (the mean of many roundings
  of a value a quarter of a unit in the last place above 1);
* the compiled programs contain ``reduce-precision``.

Writes ``rounding_on_device.json`` and ``.md``, naming the device.
"""

from __future__ import annotations

import argparse
import math
import os

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks.common import environment, markdown_table, write_results
from jaxamp._src.optim.rounding import stochastic_round


def kahan_check(steps: int = 400) -> dict:
    params = jnp.ones(1024, jnp.bfloat16)
    rows = {}
    for recipe in ("kahan", "none"):
        tx = jaxamp.loss_scaled(optax.sgd(2.0**-13), jaxamp.NoOpLossScale(), master_weights=recipe)
        state = tx.init(params)

        @jax.jit
        def step(p, s, tx=tx):
            updates, s = tx.update(-jnp.ones(1024, jnp.float32), s, p)
            return optax.apply_updates(p, updates), s

        p = params
        for _ in range(steps):
            p, state = step(p, state)
        text = jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()
        compensation = (
            0.0
            if state.compensation is None
            else float(jnp.max(jnp.abs(state.compensation.astype(jnp.float32))))
        )
        rows[recipe] = {
            "param": float(p[0]),
            "compensation_max": compensation,
            "reduce_precision_ops": text.count("reduce-precision"),
        }
    want = 1.0 + steps * 2.0**-13
    rows["float32_sum"] = want
    rows["kahan_ok"] = (
        abs(rows["kahan"]["param"] - want) <= 2.0**-7 and rows["kahan"]["reduce_precision_ops"] > 0
    )
    return rows


def stochastic_check(draws: int) -> list[dict]:
    rows = []
    for dtype in (jnp.bfloat16, jnp.float16):
        ulp = float(jnp.finfo(dtype).eps)
        x = jnp.full(draws, 1.0 + ulp / 4, jnp.float32)
        fn = jax.jit(lambda x, key, dtype=dtype: stochastic_round(x, dtype, key))
        y = fn(x, jax.random.key(0)).astype(jnp.float32)
        mean = float(jnp.mean(y))
        # a Bernoulli(1/4) count of ulp steps: standard error ulp * sqrt(3/16 / draws)
        se = ulp * math.sqrt(3 / 16 / draws)
        text = fn.lower(x, jax.random.key(0)).compile().as_text()
        rows.append(
            {
                "dtype": jnp.dtype(dtype).name,
                "target": 1.0 + ulp / 4,
                "mean": mean,
                "error_in_se": (mean - (1.0 + ulp / 4)) / se,
                "reduce_precision_ops": text.count("reduce-precision"),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=1_000_000)
    parser.add_argument("--out", default="benchmarks/results/cpu")
    args = parser.parse_args()
    env = environment()
    kahan = kahan_check()
    sr = stochastic_check(args.draws)
    unbiased = all(abs(r["error_in_se"]) < 4 for r in sr)
    lines = [
        "# Roundings on the device",
        "",
        f"Device: {env['device']} ({env['backend']}); cpu ({env['cpu_model']}); jax {env['jax']}; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        "",
        f"Kahan, 400 updates of 2**-13 to bfloat16 params at 1.0 (float32 sum "
        f"{kahan['float32_sum']}): param {kahan['kahan']['param']}, largest compensation "
        f"{kahan['kahan']['compensation_max']:.3g}, reduce-precision ops "
        f"{kahan['kahan']['reduce_precision_ops']}; the naive recipe ends at "
        f"{kahan['none']['param']}. {'OK' if kahan['kahan_ok'] else 'FAILED'}.",
        "",
        f"Stochastic rounding, {args.draws} draws: {'unbiased' if unbiased else 'BIASED'} "
        "(error within 4 standard errors).",
        "",
        markdown_table(
            sr,
            [
                ("dtype", "dtype"),
                ("target", "target"),
                ("mean", "mean"),
                ("error_in_se", "error / SE"),
                ("reduce_precision_ops", "reduce-precision ops"),
            ],
        ),
    ]
    markdown = "\n".join(lines)
    write_results(args.out, "rounding_on_device", [kahan, *sr], markdown, env)
    print(markdown)
    if not (kahan["kahan_ok"] and unbiased):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
