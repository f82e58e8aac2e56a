"""What a policy costs at trace time: tracing, lowering and compiling a GPT-2 training step.

    python -m benchmarks.tracing [--layers 12 48] [--repeats 3] [--out DIR] [--tiny]

For GPT-2 from transformers (``FlaxGPT2LMHeadModel``: width 768, 12 heads, 128
positions, a vocabulary of 1024), one ``jax.value_and_grad`` step of the language
model loss, in four ways:

* ``fp32``: the model alone, in float32;
* ``flax_bf16``: the model built with transformers' ``dtype=jnp.bfloat16`` (Flax's
  own 16-bit layers, float32 params);
* ``apply_policy``: ``jaxamp.linen.apply_policy(module, "mixed_bfloat16")``;
* ``apply_policy_saving_all``: the same with ``residuals="all"``: no ``jax.checkpoint``
  around the interpreted program (the backward pass saves float32 temporaries too), which
  shows what choosing the residuals costs;
* ``autocast``: ``jaxamp.autocast(loss_fn, "mixed_bfloat16")``.

Each repetition clears JAX's caches (``jax.clear_caches()``) and builds a fresh step
function, so no cache hides the cost, then times ``jax.jit(step).trace(...)``,
``.lower()`` and ``.compile()`` apart. The variants alternate round by round; the
median of the repetitions, and its ratio to ``flax_bf16`` (measured in the same
process), are reported. Trace time is Python work: it depends on the CPU, not on
the accelerator. ``--tiny`` (2 layers, width 64) is a quick check on a CPU.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import jaxamp
from benchmarks.common import environment, markdown_table, summarize, write_results

VARIANTS = ("fp32", "flax_bf16", "apply_policy", "apply_policy_saving_all", "autocast")
POLICY = "mixed_bfloat16"
PHASES = ("trace", "lower", "compile")


def _config(layers: int, tiny: bool) -> Any:
    from transformers import GPT2Config

    width, heads = (64, 2) if tiny else (768, 12)
    return GPT2Config(
        vocab_size=1024,
        n_positions=128,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _module(config: Any, dtype: Any = jnp.float32) -> Any:
    from transformers import FlaxGPT2LMHeadModel

    return FlaxGPT2LMHeadModel(config, dtype=dtype, _do_init=False).module


def step_factory(config: Any, batch: int, seq_len: int) -> tuple[Callable[[str], Any], tuple]:
    """``(make_step, args)``: ``make_step(variant)`` builds a fresh step function (a new
    module and loss, so no cache keyed on them is reused); ``args`` are its arguments."""
    ids = jax.random.randint(jax.random.key(0), (batch, seq_len), 0, config.vocab_size)
    mask = jnp.ones((batch, seq_len), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
    params = jax.jit(lambda: _module(config).init(jax.random.key(1), ids, mask, positions))()

    def make_step(variant: str) -> Any:
        module = _module(config, jnp.bfloat16 if variant == "flax_bf16" else jnp.float32)
        apply = module.apply
        if variant == "apply_policy":
            apply = jaxamp.linen.apply_policy(module, POLICY).apply
        elif variant == "apply_policy_saving_all":
            apply = jaxamp.linen.apply_policy(module, POLICY, residuals="all").apply

        def loss_fn(variables, ids, mask, positions):
            logits = apply(variables, ids, mask, positions, deterministic=True).logits
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype(jnp.float32), ids[:, 1:]
            ).mean()

        if variant == "autocast":
            loss_fn = jaxamp.autocast(loss_fn, POLICY)
        return jax.value_and_grad(loss_fn)

    return make_step, (params, ids, mask, positions)


def time_phases(step: Any, args: tuple) -> dict[str, float]:
    """Seconds to trace, lower and compile ``jax.jit(step)`` on ``args``, from cold caches.

    A full garbage collection first, so that each measurement starts from the same heap
    (a full collection inside a trace costs tenths of a second here, and falls at random).
    """
    jax.clear_caches()
    gc.collect()
    start = time.perf_counter()
    traced = jax.jit(step).trace(*args)
    traced_at = time.perf_counter()
    lowered = traced.lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    compiled_at = time.perf_counter()
    return {
        "trace": traced_at - start,
        "lower": lowered_at - traced_at,
        "compile": compiled_at - lowered_at,
    }


def measure(
    layers: int, tiny: bool, repeats: int, batch: int, seq_len: int, progress: Any
) -> list[dict[str, Any]]:
    """One record per variant: each phase's median, min and max, and ratios to Flax bf16."""
    config = _config(layers, tiny)
    make_step, args = step_factory(config, batch, seq_len)
    for variant in VARIANTS:  # untimed: imports and first calls
        time_phases(make_step(variant), args)
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:  # alternated, so noise spreads evenly over the variants
            phases = time_phases(make_step(variant), args)
            for phase, seconds in phases.items():
                times[variant][phase].append(seconds)
            progress.update(1)
    records = []
    for variant in VARIANTS:
        total = [sum(t) for t in zip(*times[variant].values(), strict=True)]
        record: dict[str, Any] = {
            "model": f"gpt2-{layers}x{config.n_embd}",
            "variant": variant,
            "batch": batch,
            "seq_len": seq_len,
        }
        for phase, values in [*times[variant].items(), ("total", total)]:
            record[phase] = summarize(values)
        records.append(record)
    base = next(r for r in records if r["variant"] == "flax_bf16")
    for record in records:
        for phase in (*PHASES, "total"):
            record[f"{phase}_vs_flax_bf16"] = record[phase]["median_s"] / base[phase]["median_s"]
    return records


def _table(records: list[dict[str, Any]]) -> str:
    rows = [
        {
            "model": r["model"],
            "variant": r["variant"],
            **{f"{p}_s": r[p]["median_s"] for p in (*PHASES, "total")},
            "trace_ratio": r["trace_vs_flax_bf16"],
            "total_ratio": r["total_vs_flax_bf16"],
        }
        for r in records
    ]
    columns = [
        ("model", "model"),
        ("variant", "variant"),
        ("trace_s", "trace s"),
        ("lower_s", "lower s"),
        ("compile_s", "compile s"),
        ("total_s", "total s"),
        ("trace_ratio", "trace / flax bf16"),
        ("total_ratio", "total / flax bf16"),
    ]
    return markdown_table(rows, columns)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="2 layers, width 64: a CPU check")
    parser.add_argument("--out", default="benchmarks/results/tracing")
    args = parser.parse_args(argv)
    layers = [2] if args.tiny else args.layers
    seq_len = min(args.seq_len, 16) if args.tiny else args.seq_len
    records = []
    with tqdm(total=len(layers) * args.repeats * len(VARIANTS), desc="trace") as progress:
        for n in layers:
            records += measure(n, args.tiny, args.repeats, args.batch, seq_len, progress)
    markdown = _table(records)
    write_results(args.out, "tracing", records, markdown, environment())
    print(markdown)
    return records


if __name__ == "__main__":
    main()
