"""A float16 run that skips every step, and how jaxamp finds out why.

    python examples/float16_overflow.py [--steps 20] [--out transcript.txt]

A small GPT (byte-level, trained on the text of Python's reference manual, which
ships with Python) stands in for a model pretrained in bfloat16 whose activations
grew past float16's range: one MLP's input projection is scaled up, as outlier
features in large pretrained models are. The script then:

1. trains it under ``mixed_float16`` with dynamic loss scaling: every step is
   skipped and ``jaxamp.optim.raise_if_stuck`` stops the run;
2. asks ``jaxamp.find_nonfinite`` which operation made the first inf;
3. runs ``jaxamp.range_report`` on one batch (the values the float16 policy holds in
   16 bits, computed in float32 so that their size shows) and asks it to recommend;
4. trains the same model under ``mixed_bfloat16``: no step is skipped.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxamp
from jaxamp.models import GPT2Config, GPT2LMHeadModel

CONFIG = GPT2Config(
    vocab_size=256, max_position=64, hidden_size=128, num_layers=2, num_heads=4, dropout_rate=0.0
)
LARGE_LAYER = ("h_1", "c_fc")  # the layer whose kernel is scaled
SCALE = 1e5


def text_batches(batch_size: int, seed: int = 0):
    """Windows of 65 bytes of Python's reference manual (pydoc_data, offline)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    tokens = np.frombuffer(text, np.uint8).astype(np.int32)
    rng = np.random.default_rng(seed)
    length = CONFIG.max_position + 1
    while True:
        starts = rng.integers(0, len(tokens) - length, batch_size)
        yield jnp.asarray(np.stack([tokens[s : s + length] for s in starts]))


def large_model_params():
    """The GPT's params, with one MLP's input projection scaled up by ``SCALE``."""
    model = GPT2LMHeadModel(CONFIG)
    params = model.init(jax.random.key(0), jnp.zeros((1, CONFIG.max_position), jnp.int32))
    block, layer = LARGE_LAYER
    kernel = params["params"][block][layer]["kernel"]
    params["params"][block][layer]["kernel"] = kernel * SCALE
    return model, params


def loss_of(model):
    def loss(params, windows):
        logits = model.apply(params, windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), windows[:, 1:]
        ).mean()

    return loss


def train(policy: str, steps: int, batch_size: int, say) -> dict:
    """Trains under ``policy`` with loss_scaled Adam; stops when raise_if_stuck raises."""
    model, params = large_model_params()
    loss = loss_of(jaxamp.linen.apply_policy(model, policy))
    tx = jaxamp.loss_scaled(optax.adam(1e-3), record_nonfinite=True)
    state = tx.init(params)

    @jax.jit
    def step(params, state, windows):
        value, grads = jaxamp.value_and_grad(loss)(params, windows, opt_state=state)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    batches = text_batches(batch_size)
    losses, stuck = [], None
    for i in range(steps):
        windows = next(batches)
        params, state, value = step(params, state, windows)
        losses.append(float(value))
        try:
            jaxamp.optim.raise_if_stuck(state, max_consecutive_skips=min(10, steps))
        except jaxamp.optim.LossScaleStuckError as error:
            stuck = str(error)
            say(f"[{policy}] step {i + 1}: LossScaleStuckError: {stuck}")
            break
    skipped = int(state.skipped_steps)
    say(
        f"[{policy}] {len(losses)} steps, {skipped} skipped, loss scale "
        f"{float(jaxamp.optim.get_loss_scale(state)):g}, losses {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    return {
        "losses": losses,
        "skipped": skipped,
        "stuck": stuck,
        "state": state,
        "params": params,
        "loss": loss,
        "windows": windows,
    }


def main(argv=None, out=sys.stdout) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", default=None, help="also write the transcript here")
    args = parser.parse_args(argv)
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, file=out)
        lines.append(text)

    layer = "/".join(LARGE_LAYER)
    say(f"1. {CONFIG.num_layers}-layer byte GPT, {layer} kernel x{SCALE:g}, float16:")
    f16 = train("mixed_float16", args.steps, args.batch_size, say)
    bad = jaxamp.optim.nonfinite_gradients(f16["state"])
    say(f"   non-finite gradients at the last skip: {len(bad)} leaves")

    say("\n2. jaxamp.find_nonfinite(loss, loss_scale=opt_state)(params, batch):")
    fault = jaxamp.find_nonfinite(f16["loss"], loss_scale=f16["state"])(
        f16["params"], f16["windows"]
    )
    say("   " + str(fault).replace("\n", "\n   "))

    say(
        "\n3. jaxamp.range_report(loss, policy=float16 loss)(params, batch): the values the "
        "float16 policy holds in 16 bits, computed in float32; the largest layers:"
    )
    model, params = large_model_params()
    mixed = loss_of(jaxamp.linen.apply_policy(model, "mixed_float16"))
    report = jaxamp.range_report(loss_of(model), policy=mixed)(params, f16["windows"])
    rows = sorted(report.layers, key=lambda r: -r.max_abs)[:5]
    for r in rows:
        say(f"   {r.phase:8s} {r.layer or '(no layer)':32s} max |x| {r.max_abs:.3g}")
    overflowing = sorted({r.layer for r in report.overflows("float16") if r.phase == "forward"})
    say(f"   forward layers past float16's range: {', '.join(overflowing)}")
    advice = report.recommend()
    say(f"   recommend(): {advice.dtype}: {advice.reason}")

    say("\n4. The same model under mixed_bfloat16:")
    bf16 = train("mixed_bfloat16", args.steps, args.batch_size, say)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return {"float16": f16, "fault": fault, "report": report, "advice": advice, "bfloat16": bf16}


if __name__ == "__main__":
    main()
