"""Compiled jaxamp (and hand-written Flax) training steps, ready to time."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jaxamp
from benchmarks.specs import ModelSpec
from jaxamp._src.compare.variants import get_variant

# Program constructs that make the host wait for the device within a step on GPU:
# conditionals and loops read their predicate on the host; callbacks run on it.
_HOST_SYNC_OPS = re.compile(
    r"\b(conditional|while|send|recv|infeed|outfeed)\(|custom_call_target=\"[^\"]*callback"
)


@dataclasses.dataclass
class Step:
    """One compiled training step and what was measured while building it."""

    framework: str
    variant: str
    run: Callable[[], Any]
    compile_s: float
    memory: dict[str, Any]
    activation_bytes: int | None
    converts: int | None
    host_syncs: int
    flops: float | None
    sync: Callable[[Any], Any] = jax.block_until_ready
    hlo_text: str | None = None  # the compiled program, for the profile's per-thunk table
    error: str | None = None  # why the step could not be built (then ``run`` is None)


def _loss_fn(spec: ModelSpec, model: Any, batch_stats: Any, x, y, rng):
    def loss(params):
        if spec.family == "resnet":
            logits, updates = model.apply(
                {"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"]
            )
            new_stats = updates["batch_stats"]
        else:
            logits, new_stats = (
                model.apply({"params": params}, x, train=True, rngs={"dropout": rng}),
                batch_stats,
            )
        logits = logits.astype(jnp.float32)
        if spec.family == "gpt2":
            logits, y_ = logits[:, :-1], y[:, 1:]
        else:
            y_ = y
        return optax.softmax_cross_entropy_with_integer_labels(logits, y_).mean(), new_stats

    return loss


def count_host_syncs(hlo_text: str) -> int:
    """Conditionals, loops, sends/receives and host callbacks in a compiled program."""
    return len(_HOST_SYNC_OPS.findall(hlo_text))


def _setup(spec: ModelSpec, variant_name: str, batch_size: int, framework: str):
    """The model, optimizer, loss scaling, initial params and batch statistics, the fixed
    inputs and the dropout key of ``build``'s step."""
    variant = get_variant(variant_name)
    if framework == "flax":
        if variant_name != "bf16":
            raise ValueError("the hand-written Flax baseline exists for bf16 only")
        model, tx = spec.flax_module(dtype=jnp.bfloat16), optax.adam(1e-4)
        scaled = False
    else:
        model = jaxamp.linen.apply_policy(spec.flax_module(), variant.policy)
        tx = variant.optimizer(optax.adam(1e-4))
        scaled = variant.dynamic_loss_scaling
    x_np, y_np = spec.batch(batch_size)
    x, y = jax.device_put(x_np), jax.device_put(y_np)
    with variant.tracing():
        variables = jax.jit(spec.flax_module().init)(jax.random.key(0), x[:1])
    params = variant.policy.cast_to_param(variables["params"])
    batch_stats = variables.get("batch_stats", {})
    return model, tx, scaled, params, batch_stats, x, y, jax.random.key(1)


def loss_and_grads(
    spec: ModelSpec, variant_name: str, batch_size: int, framework: str = "jaxamp"
) -> tuple[Any, Any]:
    """The loss and gradients of ``build``'s first step: same params, inputs and dropout
    key, compiled on its own (``value_and_grad`` without the optimizer update).

    For a loss-scaled variant the gradients are jaxamp's, unscaled.
    """
    variant = get_variant(variant_name)
    model, tx, scaled, params, batch_stats, x, y, rng = _setup(
        spec, variant_name, batch_size, framework
    )
    loss = _loss_fn(spec, model, batch_stats, x, y, rng)

    def value_and_grads(params, opt_state):
        if scaled:
            (value, _), grads = jaxamp.value_and_grad(loss, has_aux=True)(
                params, opt_state=opt_state
            )
        else:
            (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, grads

    with variant.tracing():
        return jax.block_until_ready(jax.jit(value_and_grads)(params, tx.init(params)))


def build(
    spec: ModelSpec,
    variant_name: str,
    batch_size: int,
    framework: str = "jaxamp",
    measure_activations: bool = True,
) -> Step:
    """Compiles ``spec``'s Adam training step under ``variant_name``.

    ``framework="flax"`` is the same model with ``dtype=bfloat16`` set on every layer
    by hand and plain ``optax.adam`` (bf16 only): the baseline jaxamp's policy is
    measured against.
    """
    variant = get_variant(variant_name)
    model, tx, scaled, params, batch_stats, x, y, rng = _setup(
        spec, variant_name, batch_size, framework
    )
    opt_state = tx.init(params)

    def step(params, batch_stats, opt_state, x, y):
        loss = _loss_fn(spec, model, batch_stats, x, y, rng)
        if scaled:
            (value, stats), grads = jaxamp.value_and_grad(loss, has_aux=True)(
                params, opt_state=opt_state
            )
        else:
            (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, value

    with variant.tracing():
        lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(
            params, batch_stats, opt_state, x, y
        )
        start = time.perf_counter()
        compiled = lowered.compile()
        compile_s = time.perf_counter() - start
        report = jaxamp.debug.PrecisionReport.from_lowered(lowered)
        activation = None
        if measure_activations:
            activation = jaxamp.ops.activation_bytes(
                lambda p: _loss_fn(spec, model, batch_stats, x, y, rng)(p)[0], params
            )
    analysis = compiled.memory_analysis()
    memory = {
        k: getattr(analysis, f"{k}_size_in_bytes", None)
        for k in ("temp", "argument", "output", "alias")
    }
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    state = [params, batch_stats, opt_state]

    def run():
        out = compiled(*state, x, y)
        state[:] = out[:3]
        return out

    return Step(
        framework=framework,
        variant=variant_name,
        run=run,
        compile_s=compile_s,
        memory=memory,
        activation_bytes=activation,
        converts=report.converts,
        host_syncs=count_host_syncs(compiled.as_text()),
        hlo_text=compiled.as_text(),
        flops=float(cost.get("flops", 0.0)) if cost else None,
    )


def compiled_bytes(spec: ModelSpec, variant_name: str, batch_size: int) -> int:
    """Temp + argument + output bytes of the compiled step (no step is run)."""
    step = build(spec, variant_name, batch_size, measure_activations=False)
    return sum(v or 0 for k, v in step.memory.items() if k != "alias")


def matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    """Measured bf16 matmul rate (float32 accumulation), TFLOP/s, for utilisation figures."""
    a = jnp.ones((size, size), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    jax.block_until_ready(f(a, a))
    start = time.perf_counter()
    for _ in range(repeats):
        out = f(a, a)
    jax.block_until_ready(out)
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12
