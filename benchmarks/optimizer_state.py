"""Optimizer-state precision: bytes per parameter, the stall, and accuracy of each recipe.

Four measurements, written to ``optimizer_state.json``/``.md`` and ``stall.png``:

1. bytes per parameter of params, master and Adam state for GPT-2 small, read from
   the state pytree (shapes only, nothing allocated) and from the compiled update
   step's argument memory (less the gradients);
2. the stall: weights at 1 receiving updates below half a bfloat16 ulp, per recipe;
3. test accuracy of a digits classifier (the 8x8 digits scikit-learn ships, upsampled
   to 28x28; offline) trained with bfloat16 params under each recipe, over seeds;
4. held-out loss of a small byte-level GPT trained on the text of Python's reference
   manual (``pydoc_data``, shipped with Python; offline) under each recipe, over seeds.

    python -m benchmarks.optimizer_state --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jaxamp
from benchmarks.common import markdown_table
from jaxamp._src.compare import data as data_lib
from jaxamp._src.compare.environment import describe_hardware, environment
from jaxamp.models import GPT2Config, GPT2LMHeadModel

ADAM = dict(learning_rate=1e-3)


def recipes() -> dict[str, tuple[str, Any, Any]]:
    """name -> (param dtype, optimizer factory, description)."""
    adam = lambda: optax.adam(**ADAM)
    bf16_sr_adam = lambda: jaxamp.with_state_dtype(adam(), jnp.bfloat16, rounding="stochastic")
    return {
        "fp32": ("float32", lambda: optax.adam(**ADAM), "float32 params, float32 Adam"),
        "bf16 + fp32 master": (
            "bfloat16",
            lambda: jaxamp.loss_scaled(adam(), jaxamp.NoOpLossScale()),
            "bfloat16 params, float32 master, float32 moments",
        ),
        "bf16 + Kahan": (
            "bfloat16",
            lambda: jaxamp.loss_scaled(adam(), jaxamp.NoOpLossScale(), master_weights="kahan"),
            "bfloat16 params, bfloat16 compensation, float32 moments",
        ),
        "bf16 + stochastic, bf16 moments": (
            "bfloat16",
            lambda: jaxamp.loss_scaled(
                bf16_sr_adam(), jaxamp.NoOpLossScale(), master_weights="stochastic"
            ),
            "bfloat16 params and moments, stochastic rounding, no master",
        ),
        "bf16, no master (naive)": (
            "bfloat16",
            lambda: jaxamp.loss_scaled(adam(), jaxamp.NoOpLossScale(), master_weights="none"),
            "bfloat16 params rounded to nearest, float32 moments",
        ),
    }


BYTES_MODELS = {
    "gpt2-small": GPT2Config(),
    "gpt2-tiny": GPT2Config(
        vocab_size=256, max_position=16, hidden_size=32, num_layers=1, num_heads=2
    ),
}


def bytes_per_parameter(model_name: str = "gpt2-small") -> list[dict[str, Any]]:
    model = GPT2LMHeadModel(BYTES_MODELS[model_name])
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    rows = []
    for name, (dtype, make, description) in recipes().items():
        tx = make()
        params = jax.tree.map(lambda s, d=dtype: jax.ShapeDtypeStruct(s.shape, d), shapes)
        grads = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32), shapes)
        state = jax.eval_shape(tx.init, params)
        nbytes = lambda tree: sum(
            int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(tree)
        )

        def step(p, s, g, tx=tx):  # a whole update, so that no argument goes unused
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = jax.jit(step).lower(params, state, grads)
        memory = compiled.compile().memory_analysis()
        argument = getattr(memory, "argument_size_in_bytes", None)
        rows.append(
            {
                "recipe": name,
                "description": description,
                "parameters": n,
                "bytes_per_param_pytree": (nbytes(params) + nbytes(state)) / n,
                "bytes_per_param_compiled": (argument - nbytes(grads)) / n if argument else None,
                "bytes_per_param_with_grads": (nbytes(params) + nbytes(state) + nbytes(grads)) / n,
            }
        )
    return rows


def stall(steps: int = 400) -> dict[str, list[float]]:
    """Weights at 1, sgd updates of 2**-10 (bfloat16's spacing below 1 is 2**-8)."""
    lr = 2.0**-10
    params = {"w": jnp.ones(4096, jnp.bfloat16)}
    out = {"float32 sum": [1.0 - lr * i for i in range(steps + 1)]}
    for name in ("float32", "kahan", "stochastic", "none"):
        tx = jaxamp.loss_scaled(optax.sgd(lr), jaxamp.NoOpLossScale(), master_weights=name)

        def body(carry, _, tx=tx):
            p, s = carry
            g = {"w": jnp.ones(4096, jnp.float32)}
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
            return (p, s), p["w"].astype(jnp.float32).mean()

        _, means = jax.jit(lambda p, tx=tx, body=body: jax.lax.scan(
            body, (p, tx.init(p)), None, length=steps))(params)  # fmt: skip
        out[name] = [1.0, *np.asarray(means).tolist()]
    return out


class DigitsNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(10)(x)


def digits_accuracy(seeds: int, epochs: int, progress: tqdm) -> list[dict[str, Any]]:
    dataset = data_lib.load_digits_28x28()
    rows = []
    for name, (dtype, make, _) in recipes().items():
        policy = "float32" if dtype == "float32" else "p=bf16,c=bf16,o=f32"
        model = jaxamp.linen.apply_policy(DigitsNet(), policy)
        accuracies = []
        for seed in range(seeds):
            params = jax.jit(model.init)(jax.random.key(seed), dataset.train_x[:2])["params"]
            tx = make()
            state = jax.jit(tx.init)(params)  # one program each, not one per operation

            @jax.jit
            def step(params, state, x, y, tx=tx, model=model):
                def loss(p):
                    logits = model.apply({"params": p}, x)
                    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

                grads = jax.grad(loss)(params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            for x, y in data_lib.batches(dataset.train_x, dataset.train_y, 64, seed, epochs):
                params, state = step(params, state, x, y)
            logits = model.apply({"params": params}, dataset.test_x)
            accuracies.append(float(jnp.mean(jnp.argmax(logits, -1) == dataset.test_y)))
            progress.update()
        rows.append(
            {
                "recipe": name,
                "seeds": seeds,
                "epochs": epochs,
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_sd": statistics.stdev(accuracies) if seeds > 1 else 0.0,
                "accuracies": accuracies,
            }
        )
    fp32 = rows[0]["accuracy_mean"]
    for r in rows:
        r["points_vs_fp32"] = 100 * (r["accuracy_mean"] - fp32)
    return rows


def python_docs_bytes() -> np.ndarray:
    """The text of Python's reference manual topics (``pydoc_data``, shipped with
    Python; offline) as bytes: a byte-level language-modelling corpus."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


GPT_CONFIGS = {
    "small": GPT2Config(
        vocab_size=256,
        max_position=64,
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
    ),
    # the tests' quick check of the code path
    "tiny": GPT2Config(
        vocab_size=256, max_position=16, hidden_size=32, num_layers=1, num_heads=2, dropout_rate=0.0
    ),
}
GPT_CONFIG = GPT_CONFIGS["small"]


def gpt_loss(
    seeds: int,
    steps: int,
    progress: tqdm,
    batch_size: int = 16,
    config: GPT2Config = GPT_CONFIG,
) -> list[dict[str, Any]]:
    """Held-out loss of a small byte-level GPT trained under each recipe, over seeds.

    The last tenth of the text is held out; the loss is the mean next-byte
    cross-entropy over 64 fixed held-out windows after ``steps`` Adam steps.
    """
    tokens = python_docs_bytes()
    split = int(0.9 * len(tokens))
    train, held_out = tokens[:split], tokens[split:]
    length = config.max_position + 1
    starts = np.linspace(0, len(held_out) - length, 64).astype(np.int64)
    eval_windows = jnp.asarray(np.stack([held_out[i : i + length] for i in starts]))

    def next_byte_loss(model, params, windows):
        logits = model.apply({"params": params}, windows[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), windows[:, 1:]
        ).mean()

    rows = []
    for name, (dtype, make, _) in recipes().items():
        policy = "float32" if dtype == "float32" else "p=bf16,c=bf16,o=f32"
        model = jaxamp.linen.apply_policy(GPT2LMHeadModel(config), policy)
        losses = []
        for seed in range(seeds):
            params = jax.jit(model.init)(jax.random.key(seed), eval_windows[:1, :-1])["params"]
            tx = make()
            state = jax.jit(tx.init)(params)  # one program each, not one per operation

            @jax.jit
            def step(params, state, windows, tx=tx, model=model):
                grads = jax.grad(lambda p: next_byte_loss(model, p, windows))(params)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            rng = np.random.default_rng(seed)
            for _ in range(steps):
                idx = rng.integers(0, len(train) - length, batch_size)
                windows = jnp.asarray(np.stack([train[i : i + length] for i in idx]))
                params, state = step(params, state, windows)
            losses.append(
                float(jax.jit(next_byte_loss, static_argnums=0)(model, params, eval_windows))
            )
            progress.update()
        rows.append(
            {
                "recipe": name,
                "seeds": seeds,
                "steps": steps,
                "loss_mean": statistics.mean(losses),
                "loss_sd": statistics.stdev(losses) if seeds > 1 else 0.0,
                "losses": losses,
            }
        )
    by_name = {r["recipe"]: r["loss_mean"] for r in rows}
    for r in rows:
        r["relative_vs_fp32"] = r["loss_mean"] / by_name["fp32"] - 1
        r["relative_vs_master"] = r["loss_mean"] / by_name["bf16 + fp32 master"] - 1
    return rows


def _plot(curves: dict[str, list[float]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, values in curves.items():
        ax.plot(values, label=name, linestyle="--" if name == "float32 sum" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("mean bfloat16 weight")
    ax.set_title("Updates of 2^-10 to weights at 1 (half a bfloat16 ulp is 2^-9)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--gpt-steps", type=int, default=1000, help="small GPT training steps")
    parser.add_argument(
        "--bytes-model",
        choices=list(BYTES_MODELS),
        default="gpt2-small",
        help="the model whose bytes per parameter are counted (gpt2-tiny: a quick check)",
    )
    parser.add_argument(
        "--gpt-size",
        choices=list(GPT_CONFIGS),
        default="small",
        help="the small GPT's size (tiny: a quick check)",
    )
    parser.add_argument("--out", default=None, help="folder for the results")
    args = parser.parse_args(argv)
    env = environment()
    with tqdm(total=len(recipes()) * args.seeds, desc="digits, per recipe and seed") as bar:
        accuracy = digits_accuracy(args.seeds, args.epochs, bar)
    with tqdm(total=len(recipes()) * args.seeds, desc="small GPT, per recipe and seed") as bar:
        gpt = gpt_loss(args.seeds, args.gpt_steps, bar, config=GPT_CONFIGS[args.gpt_size])
    memory = bytes_per_parameter(args.bytes_model)
    curves = stall()
    result = {
        "environment": env,
        "bytes_model": args.bytes_model,
        "bytes": memory,
        "accuracy": accuracy,
        "gpt": gpt,
        "stall": curves,
    }
    md = "# Optimizer-state precision\n\n"
    md += f"Hardware: {describe_hardware(env)}; jax {jax.__version__}.\n\n"
    md += f"Bytes per parameter, {args.bytes_model} "
    md += "(params + master/compensation + Adam state):\n\n"
    md += markdown_table(
        memory,
        [
            ("recipe", "recipe"),
            ("bytes_per_param_pytree", "state pytree"),
            ("bytes_per_param_compiled", "compiled step's arguments less grads"),
            ("bytes_per_param_with_grads", "with float32 grads"),
        ],
    )
    md += (
        f"\n\nDigits (8x8 scikit-learn digits at 28x28, MLP 784-256-128-10, Adam 1e-3, "
        f"batch 64, {args.epochs} epochs), test accuracy over {args.seeds} seeds; bfloat16 "
        "recipes under the policy p=bf16,c=bf16,o=f32:\n\n"
    )
    md += markdown_table(
        accuracy,
        [
            ("recipe", "recipe"),
            ("accuracy_mean", "accuracy mean"),
            ("accuracy_sd", "sd"),
            ("points_vs_fp32", "points vs fp32"),
        ],
    )
    cfg = GPT_CONFIGS[args.gpt_size]
    md += (
        f"\n\nSmall GPT (byte-level, {cfg.num_layers} layers, width {cfg.hidden_size}, "
        f"{cfg.num_heads} heads, context {cfg.max_position}) on the text of Python's reference "
        f"manual topics (pydoc_data, offline; last tenth held out), Adam 1e-3, batch 16, "
        f"{args.gpt_steps} steps: held-out next-byte loss over {args.seeds} seeds, relative to "
        "fp32 and to the float32-master recipe:\n\n"
    )
    md += markdown_table(
        gpt,
        [
            ("recipe", "recipe"),
            ("loss_mean", "loss mean"),
            ("loss_sd", "sd"),
            ("relative_vs_fp32", "relative vs fp32"),
            ("relative_vs_master", "relative vs bf16 + fp32 master"),
        ],
    )
    final = {k: v[-1] for k, v in curves.items()}
    md += "\n\nThe stall (stall.png): mean weight after 400 steps of 2^-10: " + ", ".join(
        f"{k} {v:.4f}" for k, v in final.items()
    )
    md += ".\n"
    print(md)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "optimizer_state.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "optimizer_state.md").write_text(md)
        _plot(curves, out / "stall.png")
    return result


if __name__ == "__main__":
    main()
