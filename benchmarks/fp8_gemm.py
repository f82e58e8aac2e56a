"""Float8 matmuls against bfloat16 on this device: time, and whether XLA runs float8 GEMMs.

Times, side by side in one process (alternated, medians after warm-up,
``jax.block_until_ready`` around every step):

* single ``n x n x n`` GEMMs, forward, for each ``--sizes`` n: bfloat16 under jaxamp's
  matmul rule (the ``mixed_bfloat16`` policy's matmul); ``fp8`` (``jaxamp.ops.fp8_dot_general``,
  current scaling: amax, quantize, GEMM, dequantize); ``fp8-delayed`` (scales from an amax
  history given as state); and the bare float8 GEMM of already quantized e4m3 operands
  (the ceiling the scaling work is measured against);
* a training step of a stack of ``Dense`` layers (``--dense-layers`` x
  ``[--dense-batch, --dense-features] x [features, features]``, GELU between, SGD; by
  default as wide as the smallest GEMM size, 4 times as many tokens) under
  ``mixed_bfloat16``, ``mixed_float8`` and ``mixed_float8_delayed`` (whose scaling state is
  differentiated apart and overwritten with its gradient, as a training step does).

Each program's compiled HLO is written under ``--hlo-out`` and searched for float8 GEMMs:
``dot`` or GEMM custom calls with ``f8e4m3fn``/``f8e5m2`` operands, and cuBLASLt's float8
GEMM (``__cublas$lt$matmul$f8``). On a GPU with float8 tensor cores (Hopper, Ada) that
answers whether FP8 runs and how much faster; on a CPU XLA converts float8 operands to a
wider type first, so no float8 GEMM appears and the times say nothing of float8.

Sample commands::

  python -m benchmarks.fp8_gemm --out benchmarks/results/h200           # sizes 4096,8192
  python -m benchmarks.fp8_gemm --sizes 64 --warmup 1 --repeats 2 --out /tmp/fp8g  # CPU
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

import flax.linen as nn
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
from jaxamp._src.backend import cpu_info
from jaxamp._src.flax_policy.linen import apply_policy
from jaxamp._src.ops.block_gemm import block_dot_general
from jaxamp._src.ops.fp8 import fp8_dot_general
from jaxamp._src.ops.fp8_scaling import E4M3, quantize, scale_from_amax
from jaxamp._src.ops.fp8_state import init_gemm_fp8_state
from jaxamp._src.ops.matmul import amp_dot_general
from jaxamp.ops import FP8_STATE_COLLECTION as FP8_STATE

_FWD = (((1,), (0,)), ((), ()))
BASELINE = "bf16"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16")
_F8 = re.compile(r"f8e4m3fn|f8e5m2|f8e4m3fnuz|f8e5m2fnuz")
_GEMM_OP = re.compile(r"(dot|custom-call)\(")
_BLOCK_KERNEL = re.compile(r"custom-call\(.*(block_?scaled|blockScaled|mxfp8|nvfp4)", re.I)


# name = result type (an array, or a tuple of arrays) op(operands), ...
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^()]*\)|\S+)\s+(.*)$")


def _operands(call: str) -> str:
    """The text between an instruction's first ``(`` and its matching ``)``."""
    depth, begin = 0, call.index("(")
    for i in range(begin, len(call)):
        depth += {"(": 1, ")": -1}.get(call[i], 0)
        if depth == 0:
            return call[begin + 1 : i]
    return call[begin + 1 :]


def hlo_facts(text: str) -> dict[str, int]:
    """What a compiled program does with float8, read from its HLO text: GEMMs (``dot`` or
    custom calls naming a GEMM) taking float8 operands, cuBLASLt float8 GEMMs, all GEMMs, and
    instructions whose result or operands are float8. Operands printed by name are looked
    up in their computation.

    Examples:
      >>> hlo = '''%f {
      ...   %a = f8e4m3fn[8,8]{1,0} parameter(0)
      ...   %b = f8e4m3fn[8,8]{1,0} parameter(1)
      ...   ROOT %d = f32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}
      ... }'''
      >>> hlo_facts(hlo)["f8_gemms"]
      1
    """
    facts = {
        "f8_gemms": 0,
        "cublaslt_f8": 0,
        "gemms": 0,
        "f8_instructions": 0,
        "block_scaled_kernels": 0,
    }
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            types = {}  # a new computation: its own names
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        name, result, call = match.groups()
        types[name] = result
        operands = _operands(call) if "(" in call else ""
        named = [types.get(n, "") for n in re.findall(r"%([\w.\-]+)", operands)]
        f8_in = bool(_F8.search(operands)) or any(_F8.search(t) for t in named)
        is_gemm = bool(_GEMM_OP.match(call)) and (
            call.startswith("dot(") or "matmul" in call or "gemm" in call.lower()
        )
        if "__cublas$lt$matmul$f8" in call:
            facts["cublaslt_f8"] += 1
        if _BLOCK_KERNEL.search(call):  # cuDNN's / cuBLASLt's block-scaled GEMM
            facts["block_scaled_kernels"] += 1
        if is_gemm:
            facts["gemms"] += 1
            facts["f8_gemms"] += f8_in
        if f8_in or _F8.search(result):
            facts["f8_instructions"] += 1
    return facts


def _gemms(n: int) -> dict[str, tuple[Any, tuple]]:
    """Forward ``n x n x n`` GEMMs in each form; name -> (function, operands)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(jnp.bfloat16)
    b = (0.02 * jax.random.normal(jax.random.key(1), (n, n), jnp.float32)).astype(jnp.bfloat16)
    bf16 = jnp.bfloat16
    amax = lambda x: jnp.max(jnp.abs(x.astype(jnp.float32)))
    s_a, s_b = scale_from_amax(amax(a), E4M3), scale_from_amax(amax(b), E4M3)
    state = init_gemm_fp8_state(16)._replace(
        input_scale=s_a.reshape(1), kernel_scale=s_b.reshape(1)
    )
    state = state._replace(  # a history that gives the same scales: no saturation
        input_amax_history=state.input_amax_history.at[0].set(amax(a)),
        kernel_amax_history=state.kernel_amax_history.at[0].set(amax(b)),
    )
    q_a, q_b = quantize(a, E4M3, s_a), quantize(b, E4M3, s_b)
    return {
        "bf16": (
            lambda x, y: amp_dot_general(
                x, y, _FWD, preferred_element_type=bf16, compute_dtype=bf16
            ),
            (a, b),
        ),
        "fp8": (lambda x, y: fp8_dot_general(x, y, _FWD, preferred_element_type=bf16), (a, b)),
        "fp8-delayed": (
            lambda x, y, m: fp8_dot_general(x, y, _FWD, preferred_element_type=bf16, fp8_state=m),
            (a, b, state),
        ),
        # block-scaled: emulated on every backend today (guides/block-scaling.md); the HLO
        # says whether a block-scaled kernel ran (block_scaled_kernels)
        "mxfp8": (lambda x, y: block_dot_general(x, y, _FWD, "mxfp8", bf16), (a, b)),
        "nvfp4": (lambda x, y: block_dot_general(x, y, _FWD, "nvfp4", bf16), (a, b)),
        "float8 GEMM alone (e4m3 in, float32 out)": (
            lambda x, y: lax.dot_general(x, y, _FWD, preferred_element_type=jnp.float32),
            (q_a, q_b),
        ),
    }


class DenseStack(nn.Module):
    """``layers`` Dense layers of ``features``, GELU between."""

    layers: int
    features: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            x = nn.Dense(self.features, use_bias=False, name=f"dense_{i}")(x)
            if i < self.layers - 1:
                x = nn.gelu(x)
        return x


_POLICIES = {
    "bf16": "mixed_bfloat16",
    "fp8": "mixed_float8",
    "fp8-delayed": "mixed_float8_delayed",
    "mxfp8": "mixed_mxfp8",
    "nvfp4": "mixed_nvfp4",
}


def _dense_steps(batch: int, features: int, layers: int) -> dict[str, tuple[Any, tuple]]:
    """A Dense stack's SGD training step under each policy; name -> (function, arguments)."""
    module = DenseStack(layers, features)
    x = jax.random.normal(jax.random.key(2), (batch, features), jnp.float32)
    target = jax.random.normal(jax.random.key(3), (batch, features), jnp.float32)
    steps = {}
    for name, policy in _POLICIES.items():
        model = apply_policy(module, policy)
        variables = model.init(jax.random.key(4), x)
        params, state = variables["params"], variables.get(FP8_STATE, {})

        def step(params, state, x, target, model=model):
            def loss(params, state):
                variables = {"params": params, **({FP8_STATE: state} if state else {})}
                y = model.apply(variables, x).astype(jnp.float32)
                return jnp.mean((y - target) ** 2)

            # the delayed state is differentiated apart; its gradient is its next value
            grads, state = jax.grad(loss, argnums=(0, 1))(params, state)
            params = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
            return params, state

        steps[name] = (step, (params, state, x, target))
    return steps


def _measure(
    cases: dict[str, tuple[Any, tuple]],
    flops: float,
    warmup: int,
    repeats: int,
    kind: str,
    hlo_dir: str | None,
) -> list[dict[str, Any]]:
    compiled, facts = {}, {}
    for name, (fn, args) in cases.items():
        exe = jax.jit(fn).lower(*args).compile()
        compiled[name] = functools.partial(exe, *args)
        text = exe.as_text() or ""
        facts[name] = hlo_facts(text)
        if hlo_dir:
            Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            slug = re.sub(r"[^a-z0-9]+", "_", f"{kind} {name}".lower()).strip("_")
            (Path(hlo_dir) / f"{slug}.hlo.txt").write_text(text)
    times = time_alternating(compiled, warmup=warmup, repeats=repeats)
    base = summarize(times[BASELINE])["median_s"]
    rows = []
    for name, ts in times.items():
        stats = summarize(ts)
        rows.append(
            {
                "kind": kind,
                "variant": name,
                **stats,
                "tflops": flops / stats["median_s"] / 1e12,
                "time_over_bf16": stats["median_s"] / base,
                "speedup_vs_bf16": base / stats["median_s"],
                **facts[name],
            }
        )
    return rows


def _sizes(value: str) -> list[int]:
    sizes = [int(v) for v in value.split(",") if v.strip()]
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"--sizes wants positive integers, got {value!r}")
    return sizes


def main(argv=None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_sizes, default=[4096, 8192], help="GEMM n, comma-sep.")
    parser.add_argument(
        "--dense-batch", type=int, default=None, help="Dense stack: tokens (default 4 x width)"
    )
    parser.add_argument(
        "--dense-features",
        type=int,
        default=None,
        help="Dense stack: width (default: the smallest of --sizes)",
    )
    parser.add_argument("--dense-layers", type=int, default=4, help="Dense stack: layers")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--hlo-out",
        default=None,
        help="folder for each program's compiled HLO (default: out/fp8_hlo)",
    )
    args = parser.parse_args(argv)
    hlo_dir = args.hlo_out or (str(Path(args.out) / "fp8_hlo") if args.out else None)

    rows = []
    for n in args.sizes:
        rows += _measure(_gemms(n), 2 * n**3, args.warmup, args.repeats, f"GEMM {n}^3", hlo_dir)
    f = args.dense_features or min(args.sizes)
    b, layers = args.dense_batch or 4 * f, args.dense_layers
    rows += _measure(
        _dense_steps(b, f, layers),
        layers * 3 * 2 * b * f * f,
        args.warmup,
        args.repeats,
        f"Dense stack {layers}x[{b}x{f}x{f}], train step",
        hlo_dir,
    )

    env = environment()
    model, flags = cpu_info()
    env["cpu_model"] = model or env["cpu_model"]
    env["cpu_flags"] = {flag: flag in flags for flag in CPU_FLAGS}
    device = jax.devices()[0]
    env["compute_capability"] = getattr(device, "compute_capability", None)
    fp8_rows = [r for r in rows if r["variant"].startswith("fp8")]
    verdict = (
        "float8 GEMMs run: "
        + ", ".join(
            f"{r['kind']} {r['variant']} {r['speedup_vs_bf16']:.2f}x bf16" for r in fp8_rows
        )
        if all(r["f8_gemms"] > 0 for r in fp8_rows)
        else "no float8 GEMM in "
        + ", ".join(f"{r['kind']} {r['variant']}" for r in fp8_rows if r["f8_gemms"] == 0)
        + " (XLA converts the float8 operands to a wider type first)"
    )
    block_rows = [r for r in rows if r["variant"] in ("mxfp8", "nvfp4")]
    if block_rows:
        ran = [r for r in block_rows if r["block_scaled_kernels"] > 0]
        verdict += (
            "; block-scaled kernels run in " + ", ".join(f"{r['kind']} {r['variant']}" for r in ran)
            if ran
            else "; no block-scaled kernel in the compiled programs: MXFP8 and NVFP4 are "
            "emulated here (guides/block-scaling.md)"
        )
    columns = [
        ("kind", "case"),
        ("variant", "variant"),
        ("median_s", "median s"),
        ("min_s", "min s"),
        ("max_s", "max s"),
        ("tflops", "TFLOP/s"),
        ("speedup_vs_bf16", "speed-up vs bf16"),
        ("f8_gemms", "float8 GEMMs"),
        ("cublaslt_f8", "cuBLASLt f8"),
        ("block_scaled_kernels", "block-scaled kernels"),
        ("gemms", "GEMMs"),
    ]
    cpu_flags = ", ".join(k for k, on in env["cpu_flags"].items() if on) or "none"
    capability = (
        f", compute capability {env['compute_capability']}" if env["compute_capability"] else ""
    )
    markdown = (
        f"# Float8 against bfloat16 matmuls\n\nDevice: {env['device']} (backend {env['backend']}"
        f"{capability}); CPU: {env['cpu_model']} ({env['cpu_threads']} threads; flags of "
        f"{', '.join(CPU_FLAGS)} listed: {cpu_flags}); jax {env['jax']}, flax {env['flax']}; "
        f"{env['date']}. Medians of {args.repeats} alternated runs after {args.warmup} "
        "warm-ups; speed-ups against bf16 of the same case. Float8 GEMMs: GEMMs of the "
        "compiled program whose operands are float8 (cuBLASLt f8: its `__cublas$lt$matmul$f8` "
        f"calls).\n\n{markdown_table(rows, columns)}\n\nVerdict: {verdict}."
    )
    print(markdown)
    if args.out:
        write_results(args.out, "fp8_gemm", rows, markdown, {**env, "verdict": verdict})
    return rows


if __name__ == "__main__":
    main()
