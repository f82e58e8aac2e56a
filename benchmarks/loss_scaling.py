"""What loss scaling costs: a loss-scaled Adam step against a plain optax Adam step.

    python -m benchmarks.loss_scaling [--model resnet18|mlp] [--repeats 20] [--out DIR]

Two figures per model, each from variants alternated in one process:

* ``update``: the optimizer update alone (``tx.update`` + ``apply_updates``),
  where the unscale, the finiteness check and the skip are all the extra work
  there is;
* ``train_step``: a whole jitted training step (forward, backward, update),
  plain ``jax.value_and_grad`` + ``optax.adam`` against
  ``jaxamp.value_and_grad`` + ``jaxamp.loss_scaled(optax.adam)``.

Models: ``resnet18`` (11.7M parameters, batch 32 of 32x32x3; the loss-scaled
step also runs under jaxamp's ``float32`` policy) and ``mlp`` (4 dense layers of
1024x1024 with ReLU, batch 256, float32, the same model in both variants: an
update-heavy step where the optimizer is a large share of the time). For the
MLP, analysis variants (``ANALYSIS_CHECKS``) split the extra time into the wait
for the finiteness check and the check's own read of the gradients, and
``loss_scaled(record_nonfinite=True)`` is timed beside the default, and the update of
the same MLP with float16 params and a float32 master (``loss_scaled``'s default
recipe for 16-bit params) beside plain optax's float32 one. Every update row also
gives the bytes its compiled program reads and writes (XLA's cost analysis) in units
of the float32 gradients' size: plain Adam reads and writes 10 (the gradient twice;
params, mu and nu read and written). With
``--torch``, the same MLP in PyTorch is timed too, a plain ``torch.optim.Adam`` step
against the same step with ``torch.amp.GradScaler`` (float32, as PyTorch's loss
scaling runs it on a CPU: unscale and check in place, then skip or step), the two
alternated with each other in the same process: GradScaler's own overhead, the
figure to hold jaxamp's against.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import statistics
from typing import Any

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
from jaxamp._src.optim import loss_scaled as loss_scaled_module
from jaxamp.models import ResNet18


def build_mlp(batch_size: int, width: int = 1024, depth: int = 4):
    """The update-heavy MLP: the same plain function in both variants."""
    keys = jax.random.split(jax.random.key(0), depth + 2)
    params = [
        {
            "w": jax.random.normal(k, (width, width)) / jnp.sqrt(width),
            "b": jnp.zeros(width),
        }
        for k in keys[:depth]
    ]
    inputs = jax.random.normal(keys[-2], (batch_size, width))
    targets = jax.random.normal(keys[-1], (batch_size, width))

    def loss_fn(params):
        h = inputs
        for i, layer in enumerate(params):
            h = h @ layer["w"] + layer["b"]
            h = jax.nn.relu(h) if i < depth - 1 else h
        return jnp.mean((h - targets) ** 2)

    def make_step(tx, scaled: bool, donate: bool = False):
        @functools.partial(jax.jit, donate_argnums=(0, 1) if donate else ())
        def step(params, opt_state):
            if scaled:
                loss, grads = jaxamp.value_and_grad(loss_fn)(params, opt_state=opt_state)
            else:
                loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    plain_tx = optax.adam(1e-3)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    txs: dict[str, Any] = {"plain": plain_tx}
    txs.update({name: jaxamp.loss_scaled(optax.adam(1e-3)) for name in ANALYSIS_CHECKS})
    # the opt-in record of which gradient leaves were non-finite (a variant users run)
    txs[RECORDING] = jaxamp.loss_scaled(optax.adam(1e-3), record_nonfinite=True)
    states = {name: tx.init(params) for name, tx in txs.items()}
    steps, updates = {}, {}
    for name, tx in txs.items():
        step, update = make_step(tx, name != "plain"), _make_update(tx)
        with _finiteness_check(ANALYSIS_CHECKS.get(name)):  # traced and compiled here
            jax.block_until_ready((step(params, states[name]), update(params, grads, states[name])))
        steps[name], updates[name] = step, update
    # float16 params with a float32 master (the update alone: its own params and gradients)
    half = jax.tree.map(lambda x: x.astype(jnp.float16), (params, grads))
    master_tx = jaxamp.loss_scaled(optax.adam(1e-3))
    update = _make_update(master_tx)
    states[FP16_MASTER] = master_tx.init(half[0])
    jax.block_until_ready(update(*half, states[FP16_MASTER]))
    updates[FP16_MASTER] = (update, half)
    for name, tx in DONATED.items():  # buffers donated, as a training loop does
        step = make_step(tx, name.startswith("loss_scaled"), donate=True)
        holder = [jax.tree.map(jnp.copy, params), tx.init(params)]
        steps[name] = _threaded(step, holder)
        jax.block_until_ready(steps[name]())
    return params, grads, states, steps, updates


def _threaded(step, holder):
    """A donating step as a callable of no arguments: each call passes the params and
    state the last one returned (a donated buffer cannot be passed twice)."""

    def run():
        holder[0], holder[1], loss = step(*holder)
        return loss

    return run


# The whole step with params and optimizer state donated (``donate_argnums``), as
# training loops write it: XLA then updates the moments in place, and the select of
# a skipped step must not overwrite a moment the params' update still reads.
DONATED = {
    "plain, donated": optax.adam(1e-3),
    "loss_scaled, donated": jaxamp.loss_scaled(optax.adam(1e-3)),
    "loss_scaled(skip_with='cond'), donated": jaxamp.loss_scaled(
        optax.adam(1e-3), skip_with="cond"
    ),
    "optax.apply_if_finite, donated": optax.apply_if_finite(optax.adam(1e-3), 10**9),
}


RECORDING = "loss_scaled, record_nonfinite"
FP16_MASTER = "loss_scaled, float16 params + float32 master"


def passes_over_gradients(update, params, grads, state) -> float:
    """Bytes the compiled update reads and writes (XLA's cost analysis), in units of the
    float32 gradients' size: plain Adam reads the gradient twice and each of params, mu
    and nu once, and writes the three (10)."""
    cost = update.lower(params, grads, state).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    size = sum(x.size * 4 for x in jax.tree.leaves(grads))
    return float(cost["bytes accessed"]) / size


# Where the loss-scaled step's extra time goes (mlp only): the same step traced with
# loss_scaled's finiteness check (all(isfinite(g * inv_scale)) per leaf) replaced.
# "sum(u - u) check" reads each gradient once and writes no boolean, but XLA's fast
# math folds it to 0; "three-reduction check" is an older form (max, min and sum of
# each gradient). "check one leaf"
# keeps the barrier (every
# update waits for a reduction over the gradient computed last, the first layer's
# bias) without reading the other gradients; "no check" has neither, and XLA drops
# the selects. Analysis variants, not ways to train: they never skip a step.
ANALYSIS_CHECKS = {
    "loss_scaled": None,
    "loss_scaled, sum(u - u) check": lambda grads, inv_scale: _difference_sums(grads, inv_scale),
    "loss_scaled, three-reduction check": lambda grads, inv_scale: _three_reductions(
        grads, inv_scale
    ),
    "loss_scaled, check one leaf": lambda grads, inv_scale: jaxamp.optim.all_finite(
        jax.tree.leaves(grads)[0]
    ),
    "loss_scaled, no check": lambda grads, inv_scale: jnp.asarray(True),
}


def _difference_sums(grads, inv_scale):
    """The one-read check that XLA's fast math folds to 0: per leaf, whether
    ``sum(u - u)`` over the unscaled gradient ``u`` is not NaN."""
    ok = []
    for g in jax.tree.leaves(grads):
        own = inv_scale * (g.reshape(-1)[0] * 0 + 1)  # a scalar of the leaf's own
        u = g.astype(jnp.float32) * own
        ok.append(~jnp.isnan(jnp.sum(u - u)))
    return jnp.stack(ok).all()


def _three_reductions(grads, inv_scale):
    """The check before the one-read form: per leaf, the max and the min unscaled (an
    overflow) and the sum (a NaN), three reads of each gradient."""
    ok = [
        jnp.isfinite(jnp.max(g) * inv_scale)
        & jnp.isfinite(jnp.min(g) * inv_scale)
        & ~jnp.isnan(jnp.sum(g))
        for g in jax.tree.leaves(grads)
    ]
    return jnp.stack(ok).all()


def torch_mlp_steps(batch_size: int, width: int = 1024, depth: int = 4) -> dict[str, Any]:
    """The MLP in PyTorch: ``{"plain": step, "GradScaler": step}``, Adam on float32."""
    import torch

    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        layers.append(torch.nn.Linear(width, width))
        if i < depth - 1:
            layers.append(torch.nn.ReLU())
    initial = torch.nn.Sequential(*layers)
    inputs, targets = torch.randn(batch_size, width), torch.randn(batch_size, width)
    steps = {}
    for name in ("plain", "GradScaler"):
        model = copy.deepcopy(initial)  # the same initial weights, parameters of its own
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", enabled=name == "GradScaler")

        def step(model=model, optimizer=optimizer, scaler=scaler):
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

        steps[f"torch {name}"] = step
    return steps


@contextlib.contextmanager
def _finiteness_check(check):
    """Replaces loss_scaled's check while a step is traced (``None``: the real one)."""
    original = loss_scaled_module._unscaled_finite
    loss_scaled_module._unscaled_finite = check or original
    try:
        yield
    finally:
        loss_scaled_module._unscaled_finite = original


def _make_update(tx):
    @jax.jit
    def update(params, grads, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


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

    plain_tx = optax.adam(1e-3)
    scaled_tx = jaxamp.loss_scaled(optax.adam(1e-3))
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    states = {"plain": plain_tx.init(params), "loss_scaled": scaled_tx.init(params)}
    scaled_model = jaxamp.linen.apply_policy(plain_model, "float32")
    steps = {
        "plain": make_step(plain_model, plain_tx, False),
        "loss_scaled": make_step(scaled_model, scaled_tx, True),
    }
    updates = {"plain": _make_update(plain_tx), "loss_scaled": _make_update(scaled_tx)}
    return params, batch_stats, grads, states, steps, updates


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet18", "mlp"), default="resnet18")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="default: 32 (resnet18), 256 (mlp)"
    )
    parser.add_argument("--width", type=int, default=1024, help="mlp layer width")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="folder for loss_scaling.json/.md")
    parser.add_argument(
        "--torch", action="store_true", help="mlp: also PyTorch's Adam with and without GradScaler"
    )
    args = parser.parse_args(argv)

    if args.model == "mlp":
        batch_size = args.batch_size or 256
        params, grads, states, steps, updates = build_mlp(batch_size, args.width)
        step_args = lambda s: (params, s)
        described = f"MLP 4x{args.width}x{args.width}, batch {batch_size}, float32, Adam"
        name = "loss_scaling_mlp"
    else:
        batch_size = args.batch_size or 32
        params, batch_stats, grads, states, steps, updates = build(batch_size, args.image_size)
        step_args = lambda s: (params, batch_stats, s)
        described = f"ResNet18, batch {batch_size}, {args.image_size}x{args.image_size}x3"
        name = "loss_scaling"
    records = []
    torch_steps = torch_mlp_steps(batch_size, args.width) if args.torch else {}
    if torch_steps and args.model != "mlp":
        parser.error("--torch is for --model mlp")
    rounds = (3 if torch_steps else 2) * args.repeats
    with tqdm(total=rounds, desc=f"loss scaling ({args.model})") as bar:
        calls = {name: _update_call(f, params, grads, states[name]) for name, f in updates.items()}
        times = time_alternating(
            {name: (lambda c=c: c[0](*c[1])) for name, c in calls.items()},
            args.warmup,
            args.repeats,
            progress=bar,
        )
        passes = {name: passes_over_gradients(c[0], *c[1]) for name, c in calls.items()}
        records += _records("update", times, passes=passes)
        times = time_alternating(
            {
                name: (f if name in DONATED else lambda f=f, s=states[name]: f(*step_args(s)))
                for name, f in steps.items()
            },
            args.warmup,
            args.repeats,
            progress=bar,
        )
        donated = {name: times.pop(name) for name in list(times) if name in DONATED}
        records += _records("train_step", times)
        if donated:
            records += _records("train_step", donated, plain="plain, donated")
        if torch_steps:  # eager PyTorch on the CPU returns when the step is done
            times = time_alternating(
                torch_steps, args.warmup, args.repeats, sync=lambda _: None, progress=bar
            )
            records += _records("train_step", times, plain="torch plain")

    table = markdown_table(
        records,
        [
            ("scope", "scope"),
            ("variant", "variant"),
            ("step_time_median_s", "median s"),
            ("min_s", "min s"),
            ("max_s", "max s"),
            ("ratio_to_plain", "x plain (medians)"),
            ("paired_ratio_median", "x plain (median of paired rounds)"),
            ("passes", "bytes / gradient bytes"),
        ],
    )
    print(table)
    if args.out:
        env = environment()
        where = env["cpu_model"] if env["backend"] == "cpu" else env["device"]
        note = f"{described}, {env['backend']} ({where}), {args.repeats} alternating rounds"
        write_results(
            args.out, name, records, f"# Loss scaling overhead\n\n{note}\n\n" + table, env
        )


def _update_call(update, params, grads, state):
    """``(jitted update, its arguments)``: a variant with params of its own carries them."""
    if isinstance(update, tuple):
        update, (params, grads) = update
    return update, (params, grads, state)


def _records(
    scope: str,
    times: dict[str, list[float]],
    plain: str = "plain",
    passes: dict[str, float] | None = None,
) -> list[dict]:
    baseline = times[plain]
    plain = summarize(baseline)["median_s"]
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
                # the median of the round-by-round ratios: each round's two steps ran
                # back to back, so drift in the machine's speed cancels in the ratio
                "paired_ratio_median": statistics.median(
                    v / p for v, p in zip(values, baseline, strict=True)
                ),
                # the compiled update's bytes read and written, in gradient sizes
                "passes": (passes or {}).get(name, ""),
            }
        )
    return rows


if __name__ == "__main__":
    main()
