"""The ops PyTorch's autocast runs in 16 bits and jaxamp runs in float32: their cost and error.

For each op family (GELU with ``erf`` and with ``tanh``, sigmoid, SiLU, ReLU, a batch
norm's output, mean, variance, max) two rule tables are compared under ``autocast``:

* ``float32``: jaxamp's rules (the op's sensitive primitives in float32);
* ``16-bit``: the same primitives moved to the ``promote`` set (they run in the dtype
  their inputs arrive in, as PyTorch's CUDA autocast runs them).

Error: the op alone on 16-bit inputs (a grid over [-8, 8] and normal samples), its output
and its gradient against float64, in units of the 16-bit dtype's spacing at the result
(ulps): the maximum over values at least a thousandth of the largest, the 99.9th
percentile, and the largest absolute error in ulps of the largest value. Time: the op
between two 16-bit matmuls (``op(x @ w) @ w``, forward and backward under ``jax.jit``),
medians of steps alternated
in one process, as a ratio of the two rule tables.

Sample command::

  python -m benchmarks.sensitive_ops --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    environment,
    markdown_table,
    summarize,
    time_alternating,
    write_results,
)
from jaxamp._src.autocast.api import autocast
from jaxamp._src.autocast.rules import AUTOCAST_RULES


def _batch_norm_output(x):
    """Normalised over a batch of 64 (the rows of ``x`` regrouped), scaled and shifted."""
    batch = x.reshape(64, -1)
    mean = jnp.mean(batch, axis=0, keepdims=True)
    var = jnp.var(batch, axis=0, keepdims=True)
    return ((batch - mean) * jax.lax.rsqrt(var + 1e-5) * 1.5 + 0.1).reshape(x.shape)


# name -> (function of a 2-D activation, the primitives PyTorch would leave in 16 bits)
OPS = {
    "gelu (erf)": (lambda x: jax.nn.gelu(x, approximate=False), {"erf"}),
    "gelu (tanh)": (jax.nn.gelu, {"integer_pow"}),
    "sigmoid": (jax.nn.sigmoid, {"logistic"}),
    "silu": (jax.nn.silu, {"logistic"}),
    "relu": (jax.nn.relu, set()),
    "batch norm output": (_batch_norm_output, {"reduce_sum", "rsqrt"}),
    "mean": (lambda x: jnp.mean(x, axis=-1), {"reduce_sum"}),
    "var": (lambda x: jnp.var(x, axis=-1), {"reduce_sum", "square", "integer_pow"}),
    "max": (lambda x: jnp.max(x, axis=-1), {"reduce_max"}),
}


def sixteen_bit_rules(names: set[str]):
    """``AUTOCAST_RULES`` with ``names`` moved from the float32 set to the promote set."""
    return dataclasses.replace(
        AUTOCAST_RULES,
        float32=AUTOCAST_RULES.float32 - names,
        promote=AUTOCAST_RULES.promote | names,
    )


def _inputs(dtype, n: int = 4096) -> np.ndarray:
    grid = np.linspace(-8, 8, n)
    normal = np.random.default_rng(0).standard_normal(n) * 2
    x = np.stack([grid, normal]).astype(np.float32)
    return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32), np.float64)


def _error_ulps(ours: np.ndarray, exact: np.ndarray, dtype) -> dict[str, float]:
    """The error in ulps of the 16-bit dtype: pointwise, where the exact value is at least
    a thousandth of the largest (smaller values' ulps are not what the model sees), and
    the largest absolute error in ulps of the largest exact value."""
    finfo = jnp.finfo(dtype)
    ours, exact = np.asarray(ours, np.float64), np.asarray(exact, np.float64)
    error = np.abs(ours - exact)
    largest = float(np.max(np.abs(exact)))
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(exact), 1e-30))) - finfo.nmant)
    keep = np.abs(exact) >= 1e-3 * largest
    pointwise = error[keep] / spacing[keep]
    return {
        "max_ulps": float(np.max(pointwise)) if pointwise.size else 0.0,
        "p999_ulps": float(np.quantile(pointwise, 0.999)) if pointwise.size else 0.0,
        "abs_ulps_of_max": float(
            np.max(error) / 2.0 ** (np.floor(np.log2(max(largest, 1e-30))) - finfo.nmant)
        ),
    }


def op_error(fun, names: set[str], dtype) -> dict[str, dict[str, float]]:
    """Output and gradient errors of ``fun`` on 16-bit inputs, per rule table, in ulps. The
    gradient is that of ``sum(fun(x) * r)`` for a fixed random ``r`` (a plain sum of a
    normalisation is constant, and its gradient zero)."""
    x = _inputs(dtype)
    weights = np.random.default_rng(1).standard_normal(np.shape(jax.eval_shape(fun, x)))
    with jax.enable_x64(True):
        exact = np.asarray(fun(jnp.asarray(x, jnp.float64)))
        exact_grad = np.asarray(
            jax.grad(lambda x: (fun(x) * weights).sum())(jnp.asarray(x, jnp.float64))
        )
    policy = f"p=f32,c={np.dtype(dtype).name},o={np.dtype(dtype).name}"
    r = jnp.asarray(weights, jnp.float32)
    out = {}
    for choice, rules in (("float32", AUTOCAST_RULES), ("16-bit", sixteen_bit_rules(names))):
        run = autocast(lambda x: fun(x.astype(dtype)), policy, rules=rules)
        y = np.asarray(jax.jit(run)(jnp.asarray(x, jnp.float32)).astype(jnp.float32))
        loss = lambda x, run=run: (run(x).astype(jnp.float32) * r).sum()
        g = np.asarray(jax.jit(jax.grad(loss))(jnp.asarray(x, jnp.float32)))
        out[choice] = {
            "output": _error_ulps(y, exact, dtype),
            "gradient": _error_ulps(g, exact_grad, dtype),
        }
    return out


def op_time(fun, names: set[str], dtype, rows: int, width: int, warmup: int, repeats: int):
    """Median step times of ``op(x @ w) @ w`` (forward and backward), per rule table."""
    policy = f"p=f32,c={np.dtype(dtype).name},o=f32"
    x = jax.random.normal(jax.random.key(0), (rows, width))
    w = jax.random.normal(jax.random.key(1), (width, width)) / np.sqrt(width)

    def model(w, x):
        h = fun(x @ w)
        return (h @ w[: h.shape[-1]]) if h.ndim == 2 else h

    steps = {}
    for choice, rules in (("float32", AUTOCAST_RULES), ("16-bit", sixteen_bit_rules(names))):
        step = autocast(model, policy, rules=rules)
        grad = jax.jit(jax.grad(lambda w, x, step=step: step(w, x).sum()))
        jax.block_until_ready(grad(w, x))
        steps[choice] = lambda grad=grad: grad(w, x)
    times = time_alternating(steps, warmup=warmup, repeats=repeats)
    return {choice: summarize(t) for choice, t in times.items()}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    records = []
    for dtype_name in args.dtypes.split(","):
        dtype = jnp.dtype(dtype_name)
        for name, (fun, names) in OPS.items():
            errors = op_error(fun, names, dtype)
            timing = op_time(fun, names, dtype, args.rows, args.width, args.warmup, args.repeats)
            ratio = timing["16-bit"]["median_s"] / timing["float32"]["median_s"]
            records.append(
                {
                    "op": name,
                    "dtype": dtype_name,
                    "primitives": sorted(names),
                    "errors": errors,
                    "times": timing,
                    "time_16bit_over_float32": ratio,
                }
            )
            print(name, dtype_name, f"time 16-bit/float32 {ratio:.3f}", errors, flush=True)

    env = environment()

    def ulps(errors):
        output, gradient = errors["output"], errors["gradient"]
        return f"{output['max_ulps']:.3g} / {gradient['max_ulps']:.3g}"

    rows = [
        {
            "op": r["op"],
            "dtype": r["dtype"],
            "f32": ulps(r["errors"]["float32"]),
            "b16": ulps(r["errors"]["16-bit"]),
            "ms": r["times"]["float32"]["median_s"] * 1e3,
            "ratio": r["time_16bit_over_float32"],
        }
        for r in records
    ]
    columns = [
        ("op", "op"),
        ("dtype", "dtype"),
        ("f32", "float32 rules: max ulps, output / gradient"),
        ("b16", "16-bit rules: max ulps, output / gradient"),
        ("ms", "step ms, float32 rules"),
        ("ratio", "step time 16-bit / float32"),
    ]
    units = ", ".join(env["cpu_bf16_flags"]) or "no bf16 units"
    markdown = "\n".join(
        [
            "# Sensitive ops: float32 or 16 bits",
            "",
            f"Machine: {env['cpu_model']} ({env['cpu_threads']} threads; {units}); backend "
            f"{env['backend']}; jax {env['jax']}; {env['date']}. Errors of the op alone on "
            "16-bit inputs against float64, in ulps of the 16-bit dtype; times of "
            f"`op(x @ w) @ w` forward and backward, x {args.rows}x{args.width}, medians of "
            f"{args.repeats} alternated steps after {args.warmup} warm-ups.",
            "",
            markdown_table(rows, columns),
        ]
    )
    print(markdown)
    if args.out:
        write_results(args.out, "sensitive_ops", records, markdown, env)
    return records


if __name__ == "__main__":
    main()
