"""The forms of a 16-bit matmul, measured on this machine: single GEMMs and a Dense layer's step.

Times, side by side in one process (alternated, medians after warm-up):

* single ``n x n x n`` GEMMs in each form: float32; 16-bit to 16-bit; the dot
  algorithm ``BF16_BF16_F32`` (jaxamp's form before the matmul rule); 16-bit
  operands with ``preferred_element_type=float32`` in the forward layout
  (contracting dims (1),(0)) and the weight-gradient layout ((0),(0));
* a ``Dense`` layer's forward and backward (``jax.grad`` of both operands, a
  ``[batch, in] x [in, out]`` GEMM and its two transposes) in float32, in the
  dot-algorithm form and under jaxamp's matmul rule, in each form of
  ``jaxamp/_src/ops/forms.py``;
* a BERT-shaped encoder's gradient (2 layers, attention included) in float32 and
  under each form this backend runs.

Sample command::

  python -m benchmarks.matmul_forms --size 2048 --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.common import (
    environment,
    markdown_table,
    summarize,
    time_alternating,
    write_results,
)
from jaxamp._src.backend import dot_algorithm
from jaxamp._src.ops.forms import FORMS
from jaxamp._src.ops.matmul import amp_dot_general

_FWD = (((1,), (0,)), ((), ()))
_DW = (((0,), (0,)), ((), ()))


def _gemms(n: int, dtype) -> dict[str, tuple]:
    """name -> (function, operands)."""
    a32 = jax.random.normal(jax.random.key(0), (n, n))
    b32 = jax.random.normal(jax.random.key(1), (n, n))
    a, b = a32.astype(dtype), b32.astype(dtype)
    name = jnp.dtype(dtype).name
    f32 = jnp.float32
    cases = {
        "float32": (lambda x, y: lax.dot_general(x, y, _FWD, precision="highest"), (a32, b32)),
        f"{name} -> {name}": (lambda x, y: lax.dot_general(x, y, _FWD), (a, b)),
        f"{name}, preferred float32, (1),(0)": (
            lambda x, y: lax.dot_general(x, y, _FWD, preferred_element_type=f32),
            (a, b),
        ),
        f"{name}, preferred float32, (0),(0)": (
            lambda x, y: lax.dot_general(x, y, _DW, preferred_element_type=f32),
            (a, b),
        ),
    }
    algorithm = dot_algorithm(dtype)  # None where the backend refuses it (F16_F16_F32 on CPU)
    if algorithm is not None:
        cases[f"{name}, precision={algorithm.name}"] = (
            lambda x, y: lax.dot_general(x, y, _FWD, precision=algorithm),
            (a, b),
        )
    return cases


def _dense_steps(batch: int, features: int, dtype) -> dict[str, tuple]:
    """A Dense layer's forward and backward in each form; name -> (function, operands)."""
    x32 = jax.random.normal(jax.random.key(2), (batch, features))
    w = 0.02 * jax.random.normal(jax.random.key(3), (features, features))
    x = x32.astype(dtype)
    name = jnp.dtype(dtype).name

    def grad_of(dot, x):
        loss = lambda x, w: jnp.sum(dot(x, w).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1)), (x, w)

    steps = {
        "float32": grad_of(lambda x, w: lax.dot_general(x, w, _FWD, precision="highest"), x32),
    }
    algorithm = dot_algorithm(dtype)
    if algorithm is not None:  # jaxamp's form before the rule
        steps[f"{name}, precision={algorithm.name}"] = grad_of(
            lambda x, w: lax.dot_general(x, w.astype(dtype), _FWD, precision=algorithm), x
        )
    for form in FORMS.values():
        rule = functools.partial(amp_dot_general, compute_dtype=dtype, form=form)
        steps[f"{name}, matmul rule ({form.name})"] = grad_of(
            lambda x, w, rule=rule: rule(x, w, _FWD), x
        )
    return steps


def _model_steps(batch: int, length: int, width: int, dtype) -> tuple[dict[str, tuple], float]:
    """A BERT-shaped encoder's gradient step in float32 and under each form that runs here
    (the native form's bfloat16 attention gradients fail on XLA:CPU); and its FLOPs."""
    from jaxamp._src.flax_policy.linen import apply_policy
    from jaxamp._src.ops.forms import use_matmul_form
    from jaxamp.models import BertClassifier, BertConfig

    config = BertConfig(
        vocab_size=1024, hidden_size=width, num_layers=2, num_heads=width // 64,
        intermediate_size=4 * width, max_position=length, num_classes=2,
    )  # fmt: skip
    ids = jax.random.randint(jax.random.key(0), (batch, length), 0, 1024)
    module = BertClassifier(config)
    params = module.init(jax.random.key(1), ids)["params"]
    name = jnp.dtype(dtype).name

    def grad_of(model):
        loss = lambda p, ids: jnp.sum(model.apply({"params": p}, ids).astype(jnp.float32))
        return jax.grad(loss)

    steps = {"float32": (grad_of(apply_policy(module, "float32")), (params, ids))}
    amp = apply_policy(module, f"p=f32,c={name},o=f32")
    for form in FORMS.values():
        if form.name == "native" and jax.default_backend() == "cpu":
            continue
        with use_matmul_form(form):  # the form is fixed when the step is traced, below
            traced = jax.jit(grad_of(amp)).trace(params, ids)
        steps[f"{name}, matmul rule ({form.name})"] = (traced.lower().compile(), (params, ids))
    gemm_flops = 2 * 3 * batch * length * (12 * width * width + 2 * length * width)
    return steps, config.num_layers * gemm_flops


def _measure(
    cases: dict[str, tuple],
    flops: float,
    warmup: int,
    repeats: int,
    kind: str,
    hlo_dir: str | None = None,
):
    compiled = {
        k: (f if isinstance(f, jax.stages.Compiled) else jax.jit(f), args)
        for k, (f, args) in cases.items()
    }
    if hlo_dir:  # what the backend made of each form (on a GPU: the cuBLAS calls)
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
        for k, (f, args) in compiled.items():
            slug = re.sub(r"[^a-z0-9]+", "_", f"{kind} {k}".lower()).strip("_")
            text = f.as_text() if isinstance(f, jax.stages.Compiled) else None
            text = text or f.lower(*args).compile().as_text()
            (Path(hlo_dir) / f"{slug}.hlo.txt").write_text(text)
    steps = {k: functools.partial(f, *args) for k, (f, args) in compiled.items()}
    times = time_alternating(steps, warmup=warmup, repeats=repeats)
    base = summarize(times["float32"])["median_s"]
    rows = []
    for name, ts in times.items():
        stats = summarize(ts)
        rows.append(
            {
                "kind": kind,
                "form": name,
                **stats,
                "gflops": flops / stats["median_s"] / 1e9,
                "time_over_float32": stats["median_s"] / base,
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="n of the n x n x n GEMMs")
    parser.add_argument("--batch", type=int, default=1024, help="Dense layer batch (tokens)")
    parser.add_argument("--features", type=int, default=768, help="Dense layer width")
    parser.add_argument("--model-batch", type=int, default=8, help="encoder step: batch")
    parser.add_argument("--model-length", type=int, default=128, help="encoder step: length")
    parser.add_argument("--model-width", type=int, default=768, help="encoder step: width")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    parser.add_argument("--hlo-out", default=None, help="folder for each form's compiled HLO")
    args = parser.parse_args(argv)

    rows = []
    for dtype in args.dtypes.split(","):
        dt = jnp.dtype(dtype)
        n, b, f = args.size, args.batch, args.features
        rows += _measure(
            _gemms(n, dt), 2 * n**3, args.warmup, args.repeats, f"GEMM {n}^3", args.hlo_out
        )
        rows += _measure(
            _dense_steps(b, f, dt),
            3 * 2 * b * f * f,
            args.warmup,
            args.repeats,
            f"Dense {b}x{f}x{f}, fwd+bwd",
            args.hlo_out,
        )
        shape = (args.model_batch, args.model_length, args.model_width)
        steps, flops = _model_steps(*shape, dt)
        kind = f"encoder 2x{shape[2]}, batch {shape[0]}x{shape[1]}, grad"
        rows += _measure(steps, flops, args.warmup, args.repeats, kind, args.hlo_out)
    env = environment()
    columns = [
        ("kind", "case"),
        ("form", "form"),
        ("median_s", "median s"),
        ("min_s", "min s"),
        ("max_s", "max s"),
        ("gflops", "GFLOP/s"),
        ("time_over_float32", "time / float32"),
    ]
    flags = ", ".join(env["cpu_bf16_flags"] + env["cpu_fp16_flags"]) or "none"
    markdown = (
        f"# 16-bit matmul forms\n\nMachine: {env['cpu_model']} ({env['cpu_threads']} threads; "
        f"16-bit flags in /proc/cpuinfo: {flags}); backend {env['backend']}; jax {env['jax']}; "
        f"matmul form chosen here: `{env['matmul_form']}`; {env['date']}. Medians of "
        f"{args.repeats} alternated runs after {args.warmup} warm-ups.\n\n"
        + markdown_table(rows, columns)
    )
    print(markdown)
    if args.out:
        write_results(args.out, "matmul_forms", rows, markdown, env)


if __name__ == "__main__":
    main()
