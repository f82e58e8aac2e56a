"""Mixed-precision training beyond one device: data-parallel, FSDP and multi-process.

A Flax MLP classifier under ``mixed_bfloat16`` with ``jaxamp.loss_scaled`` (dynamic
loss scaling), trained on a synthetic task whose global batches are the same
whatever the number of devices or processes, so runs can be compared.

    # data-parallel over all local devices (here: 8 fake CPU devices)
    export XLA_FLAGS=--xla_force_host_platform_device_count=8
    python examples/distributed_train.py --mode dp
    # FSDP: params and optimizer state sharded along the mesh axis
    python examples/distributed_train.py --mode fsdp
    # two processes on one machine (run both; CPU collectives over gloo)
    unset XLA_FLAGS
    python examples/distributed_train.py --mode dp --num-processes 2 --process-id 0 &
    python examples/distributed_train.py --mode dp --num-processes 2 --process-id 1
    # a GPU cluster: one process per host, all GPUs of the host each
    python examples/distributed_train.py --mode fsdp --coordinator HOST0:1234 \\
        --num-processes NUM_HOSTS --process-id HOST_INDEX

``--poison-step S --poison-process P`` puts an infinity into process P's part of
the batch at step S: every process then skips that step and backs the loss
scale off identically. ``--save-checkpoint DIR --save-at K`` writes the sharded
train state (scaler included) with Orbax after step K; ``--restore DIR`` resumes
from it on any number of devices.
"""

from __future__ import annotations

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

FEATURES, CLASSES = 64, 8


class MLP(nn.Module):
    hidden: int = 512

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.LayerNorm()(x)
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(CLASSES)(x)


def fsdp_shardings(tree, mesh: Mesh, axis: str = "data", min_size: int = 2**14):
    """FSDP with plain ``jax.sharding``: each leaf split along its largest dimension that
    ``axis`` divides; leaves under ``min_size`` elements (and scalars) stay replicated.
    Applied to the optimizer state too, whose moments have the params' shapes."""
    devices = mesh.shape[axis]

    def sharding(x):
        shape = tuple(getattr(x, "shape", ()))
        spec = [None] * len(shape)
        if int(np.prod(shape, dtype=np.int64)) >= min_size:
            divisible = [d for d in range(len(shape)) if shape[d] % devices == 0]
            if divisible:
                spec[max(divisible, key=lambda d: shape[d])] = axis
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(sharding, tree)


def shard_batch(batch, mesh: Mesh, axis: str = "data"):
    """Each process's part of the global batch, as global arrays split along ``axis``."""
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)


def global_batch(step: int, batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The same global batch at ``step`` in every run, however many devices or processes."""
    rng = np.random.default_rng([seed, step])
    centers = np.random.default_rng(seed).standard_normal((CLASSES, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, batch_size).astype(np.int32)
    x = centers[y] + 2.0 * rng.standard_normal((batch_size, FEATURES)).astype(np.float32)
    return x, y


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["single", "dp", "fsdp"], default="dp")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--policy", default="mixed_bfloat16")
    p.add_argument("--learning-rate", type=float, default=0.05)
    p.add_argument("--coordinator", default=None, help="host:port of process 0")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--poison-step", type=int, default=None)
    p.add_argument("--poison-process", type=int, default=0)
    p.add_argument("--save-checkpoint", default=None)
    p.add_argument("--save-at", type=int, default=None)
    p.add_argument("--restore", default=None)
    p.add_argument("--out", default=None, help="write final params and scaler counters (.npz)")
    return p.parse_args(argv)


def initialize(args) -> None:
    """``jax.distributed.initialize`` for multi-process runs (gloo collectives on CPU)."""
    if args.num_processes > 1:
        # CPU collectives across processes; no effect on GPU collectives (NCCL).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator or "127.0.0.1:12355",
            num_processes=args.num_processes,
            process_id=args.process_id,
        )


def main(argv=None) -> dict:
    args = parse(argv)
    initialize(args)
    import jaxamp  # after jax.distributed.initialize, before any device is used

    devices = jax.devices()[:1] if args.mode == "single" else jax.devices()
    mesh = Mesh(np.asarray(devices), ("data",))
    model = jaxamp.linen.apply_policy(MLP(), args.policy)
    # SGD with momentum: unlike Adam, it does not magnify the last-bit differences that
    # another reduction order gives near-zero gradients, so runs on different device
    # counts stay comparable.
    tx = jaxamp.loss_scaled(
        optax.sgd(args.learning_rate, momentum=0.9),
        jaxamp.DynamicLossScale(init_scale=2.0**10, growth_interval=10),
    )
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]
    opt_state = tx.init(params)
    if args.mode == "fsdp":
        param_sharding = fsdp_shardings(params, mesh)
        opt_sharding = fsdp_shardings(opt_state, mesh)
    else:
        param_sharding = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
        opt_sharding = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), opt_state)
    params = jax.device_put(params, param_sharding)
    opt_state = jax.device_put(opt_state, opt_sharding)
    start_step = 0
    if args.restore:
        params, opt_state, start_step = restore(args.restore, params, opt_state)

    @jax.jit
    def step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jaxamp.value_and_grad(loss_fn)(params, opt_state=opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        params = jax.lax.with_sharding_constraint(params, param_sharding)
        opt_state = jax.lax.with_sharding_constraint(opt_state, opt_sharding)
        return params, opt_state, loss

    per_process = args.batch_size // jax.process_count()
    losses, scales = [], []
    begin = time.perf_counter()
    for i in range(start_step, args.steps):
        x, y = global_batch(i, args.batch_size)
        lo = jax.process_index() * per_process
        x, y = x[lo : lo + per_process].copy(), y[lo : lo + per_process]
        if i == args.poison_step and jax.process_index() == args.poison_process:
            x[0, 0] = np.inf
        batch = shard_batch((x, y), mesh)
        params, opt_state, loss = step(params, opt_state, *batch)
        losses.append(float(loss))
        scales.append(float(jaxamp.optim.get_loss_scale(opt_state)))
        if args.save_checkpoint and args.save_at is not None and i + 1 == args.save_at:
            save(args.save_checkpoint, params, opt_state, i + 1)
    metrics = jaxamp.optim.loss_scale_metrics(opt_state)
    result = {
        "mode": args.mode,
        "devices": len(devices),
        "processes": jax.process_count(),
        "losses": losses,
        "loss_scales": scales,
        "skipped_steps": int(metrics["skipped_steps"]),
        "seconds": time.perf_counter() - begin,
    }
    if jax.process_index() == 0:
        print(
            json.dumps(
                {k: v for k, v in result.items() if k not in ("losses", "loss_scales")}
                | {"final_loss": losses[-1] if losses else None}
            )
        )
    if args.out:
        flat = {
            jax.tree_util.keystr(k): np.asarray(jax.device_get(v))
            for k, v in jax.tree_util.tree_flatten_with_path(
                multihost_utils.process_allgather(params, tiled=True)
            )[0]
        }
        np.savez(
            args.out,
            losses=np.asarray(losses),
            loss_scales=np.asarray(scales),
            skipped=result["skipped_steps"],
            **flat,
        )
    return result


def save(directory: str, params, opt_state, step: int) -> None:
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(
        f"{directory}/step_{step}",
        {"params": params, "opt_state": opt_state, "step": step},
        force=True,
    )
    checkpointer.wait_until_finished()


def restore(directory: str, params, opt_state):
    """Restores onto the shardings of ``params`` and ``opt_state`` (any device count)."""
    import os

    import orbax.checkpoint as ocp

    steps = sorted(int(d.split("_")[1]) for d in os.listdir(directory) if d.startswith("step_"))
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
        {"params": params, "opt_state": opt_state},
    )
    target["step"] = 0
    restored = ocp.StandardCheckpointer().restore(f"{directory}/step_{steps[-1]}", target)
    return restored["params"], restored["opt_state"], int(restored["step"])


if __name__ == "__main__":
    main()
