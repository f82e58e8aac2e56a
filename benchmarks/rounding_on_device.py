"""Whether jaxamp's roundings survive the device's compiler: Kahan and stochastic rounding.

    python -m benchmarks.rounding_on_device [--draws 1000000] [--out DIR]

A compiler allowed excess precision (XLA's ``xla_allow_excess_precision``, on by
default on GPU and TPU) may fold ``x.astype(bfloat16).astype(float32)`` to ``x``.
jaxamp rounds with ``lax.reduce_precision`` or on the bits instead; this checks, on the
default device, that

* the Kahan recipe keeps a non-zero compensation and follows the float32 sum (400
  updates of 2**-13 to bfloat16 params at 1.0: the naive recipe stays at 1.0);
* stochastic rounding to bfloat16 and float16 is unbiased over a grid of fractions of a
  unit in the last place (0, 1/8, ..., 7/8) above 0, a subnormal, 1, -3 and the value
  below the max, and rounds to nearest past the max, at inf and at NaN;
* the Kahan program contains ``reduce-precision``, and the stochastic one converts no
  16-bit value back to float32 (it rounds on the bits, which no compiler may fold).

``--draws 256`` runs it on a CPU in seconds.

Writes ``rounding_on_device.json`` and ``.md``, naming the device.
"""

from __future__ import annotations

import argparse
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

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


FRACTIONS = tuple(k / 8 for k in range(8))  # of a unit in the last place above lo
WIDENING = re.compile(
    r"stablehlo\.convert [^\n]*\(tensor<(?:[\d?]+x)*(?:bf16|f16)>\) -> tensor<(?:[\d?]+x)*f32>"
)


def grid(dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x, lo, hi, p)``, from numpy and ml_dtypes alone: float32 values ``lo + p * (hi - lo)``
    for each fraction ``p`` in ``FRACTIONS`` above 0, a subnormal, 1, -3 and the value below
    the max (rounding up lands on the max), and, rounded to nearest (``lo == hi``, ``p == 0``),
    the max plus each fraction of its ulp (the max, or inf from half a unit on), inf and NaN."""
    dtype = np.dtype(dtype)
    big = np.asarray(jnp.finfo(dtype).max, dtype)
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    below_max = float(np.nextafter(big, np.asarray(0, dtype)))
    xs, los, his, ps = [], [], [], []
    for base in (0.0, 5 * tiny, 1.0, 3.0, below_max):
        for sign in (1.0, -1.0) if base == 3.0 else (1.0,):
            lo = np.asarray(base, dtype)
            hi = float(np.nextafter(lo, np.asarray(np.inf, dtype)))
            for p in FRACTIONS:
                xs.append(sign * (float(lo) + p * (hi - float(lo))))  # exact in float64
                los.append(sign * float(lo))
                his.append(sign * hi)
                ps.append(p)
    ulp = float(big) - below_max
    beyond = [float(big) + p * ulp for p in FRACTIONS] + [np.inf, np.nan]
    x = np.asarray(xs + beyond, np.float32)
    assert np.array_equal(x[: len(xs)].astype(np.float64), np.asarray(xs))  # exact in float32
    with np.errstate(over="ignore"):
        nearest = x[len(xs) :].astype(dtype).astype(np.float64)
    lo = np.concatenate([los, nearest])
    hi = np.concatenate([his, nearest])
    return x, lo, hi, np.concatenate([ps, np.zeros(len(beyond))])


def stochastic_check(draws: int) -> list[dict]:
    """For each 16-bit dtype and grid value, ``draws`` roundings: the share that went up
    against the fraction (within 5 standard errors; exactly 0 where the result is
    determined), and every rounding one of the two neighbours (NaN for NaN)."""
    rows = []
    for dtype in (jnp.bfloat16, jnp.float16):
        x, lo, hi, p = grid(dtype)
        fn = jax.jit(
            lambda x, key, dtype=dtype: jax.vmap(lambda k: stochastic_round(x, dtype, k))(
                jax.random.split(key, draws)
            )
        )

        @jax.jit
        def counts(y, lo, hi, nan, determined, inf):
            # on the bits: XLA:CPU flushes float32 subnormals (bfloat16's) in comparisons
            y = lax.bitcast_convert_type(y, jnp.uint16)
            ups = jnp.sum((y == hi) & ~determined, axis=0, dtype=jnp.int32)
            inside = (y == lo) | (y == hi) | (nan & ((y & 0x7FFF) > inf))  # NaN for NaN
            return ups, jnp.sum(~inside, axis=0, dtype=jnp.int32)

        y = fn(jnp.asarray(x), jax.random.key(0))
        lo_bits, hi_bits, inf_bits = (
            np.asarray(a).astype(dtype).view(np.uint16) for a in (lo, hi, np.inf)
        )
        ups, outside = counts(y, lo_bits, hi_bits, np.isnan(x), p == 0, inf_bits)
        ups, outside = np.asarray(ups), np.asarray(outside)
        widening = len(WIDENING.findall(fn.lower(jnp.asarray(x), jax.random.key(0)).as_text()))
        for i in range(len(x)):
            share = ups[i] / draws
            se = math.sqrt(p[i] * (1 - p[i]) / draws)
            ok = outside[i] == 0 and (ups[i] == 0 if p[i] == 0 else abs(share - p[i]) <= 5 * se)
            rows.append(
                {
                    "dtype": jnp.dtype(dtype).name,
                    "x": float(x[i]),
                    "fraction": float(p[i]),
                    "share_up": float(share),
                    "mean": float(lo[i] + share * (hi[i] - lo[i])) if p[i] else float(lo[i]),
                    "error_in_se": (share - p[i]) / se if se else 0.0,
                    "outside": int(outside[i]),
                    "widening_converts": widening,
                    "ok": bool(ok and widening == 0),
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
    unbiased = all(r["ok"] for r in sr)
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
        f"Stochastic rounding, {args.draws} draws of each value: "
        f"{'unbiased' if unbiased else 'BIASED'} (the share rounded up within 5 standard "
        "errors of the fraction, none where the result is determined, every rounding one "
        "of the two neighbours, no 16-bit value converted back to float32).",
        "",
        markdown_table(
            sr,
            [
                ("dtype", "dtype"),
                ("x", "x"),
                ("fraction", "fraction of an ulp"),
                ("share_up", "share rounded up"),
                ("mean", "mean"),
                ("error_in_se", "error / SE"),
                ("outside", "outside"),
                ("widening_converts", "16 -> 32 converts"),
                ("ok", "ok"),
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
