"""Tests for examples/distributed_train.py (mixed precision on a mesh, in plain
``jax.sharding``) and ``jaxamp.optim.reduce_gradients``.

In-process tests use the 8 fake CPU devices the root conftest sets up; runs with
other device counts, and the two-process run, are subprocesses.
"""

import functools
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxamp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "distributed_train.py"
sys.path.insert(0, str(EXAMPLE.parent))
import distributed_train  # noqa: E402

from tests.helpers import compiler  # noqa: E402
from tests.helpers.promotion import FLAX  # noqa: E402

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")


def _params(path: Path) -> dict[str, np.ndarray]:
    data = np.load(path)
    return {k: data[k] for k in data.files if k.startswith("[")}


def _assert_close(a: Path, b: Path, atol=2e-2):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], atol=atol, rtol=atol, err_msg=k)


def _run(args, devices=None, env_extra=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices:
        env["XLA_FLAGS"] = compiler.child_flags(devices)
    env.update(env_extra or {})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@needs_8
def test_the_examples_fsdp_shardings_split_the_largest_divisible_dimension():
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    tree = {
        "kernel": jnp.zeros((64, 512)),
        "odd": jnp.zeros((129, 131)),
        "bias": jnp.zeros((512,)),
        "count": jnp.zeros([], jnp.int32),
    }
    specs = {
        k: s.spec for k, s in distributed_train.fsdp_shardings(tree, mesh, min_size=256).items()
    }
    assert specs["kernel"] == PartitionSpec(None, "data")
    assert specs["bias"] == PartitionSpec("data")
    assert specs["odd"] == PartitionSpec(None, None)  # nothing divides by 8
    assert specs["count"] == PartitionSpec()


@needs_8
@pytest.mark.parametrize(
    "policy, expected", [("mixed_bfloat16", "f32"), ("p=f32,c=bf16,o=f32,r=bf16", "bf16")]
)
def test_gradients_are_all_reduced_in_the_policys_dtype(policy, expected):
    mesh = Mesh(np.asarray(jax.devices()), ("data",))

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec("data")),
        out_specs=PartitionSpec(),
        check_vma=False,
    )
    def grads(w, x):
        g = jax.grad(
            lambda w: jnp.sum((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))
        )(w)
        return jaxamp.optim.reduce_gradients(g, "data", policy)

    w, x = jnp.ones((4, 3)), jnp.ones((16, 4))
    # under autocast too: the reduction runs in the dtype the policy asks for
    for fun in (grads, jaxamp.autocast(grads, "mixed_bfloat16")):
        lines = jax.jit(fun).lower(w, x).as_text().splitlines()
        # an all_reduce spans several lines; its type closes its reduction region: "}) : (...)"
        types = [
            next(t for t in lines[i:] if t.strip().startswith("}) :"))
            for i, line in enumerate(lines)
            if "all_reduce" in line
        ]
        assert types and all(f"x{expected}>" in t for t in types), types
        np.testing.assert_allclose(jax.jit(fun)(w, x), jnp.full((4, 3), 2.0))


@pytest.mark.standard_promotion(FLAX)
@needs_8
def test_data_parallel_and_fsdp_equal_one_device(tmp_path):
    outs = {}
    for mode in ("single", "dp", "fsdp"):
        outs[mode] = tmp_path / f"{mode}.npz"
        result = distributed_train.main(["--mode", mode, "--steps", "12", "--out", str(outs[mode])])
        assert result["skipped_steps"] == 0 and result["losses"][-1] < result["losses"][0]
    _assert_close(outs["single"], outs["dp"])
    _assert_close(outs["single"], outs["fsdp"])


@pytest.mark.standard_promotion(FLAX)
@needs_8
@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_a_non_finite_shard_skips_everywhere(tmp_path, mode):
    clean = distributed_train.main(["--mode", mode, "--steps", "6"])
    poisoned = distributed_train.main(["--mode", mode, "--steps", "6", "--poison-step", "3"])
    assert poisoned["skipped_steps"] == 1
    assert poisoned["loss_scales"][3] == clean["loss_scales"][3] / 2
    assert poisoned["losses"][:3] == clean["losses"][:3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_skip_the_same_step_and_agree(tmp_path):
    port = _free_port()
    common = [
        "--mode",
        "dp",
        "--steps",
        "10",
        "--poison-step",
        "4",
        "--poison-process",
        "1",
        "--num-processes",
        "2",
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = compiler.child_flags(1)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLE),
                *common,
                "--process-id",
                str(i),
                "--out",
                str(tmp_path / f"p{i}.npz"),
            ],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    # both processes skipped step 4, backed off the same way and hold the same params
    runs = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    for run in runs:
        assert int(run["skipped"]) == 1
    np.testing.assert_array_equal(runs[0]["loss_scales"], runs[1]["loss_scales"])
    assert runs[0]["loss_scales"][4] == runs[0]["loss_scales"][3] / 2
    _assert_close(tmp_path / "p0.npz", tmp_path / "p1.npz", atol=0)
    # ...and match a single-process run over two devices
    _run(
        [
            "--mode",
            "dp",
            "--steps",
            "10",
            "--poison-step",
            "4",
            "--out",
            str(tmp_path / "single.npz"),
        ],
        devices=2,
    )
    _assert_close(tmp_path / "p0.npz", tmp_path / "single.npz")


def test_sharded_checkpoint_restores_on_4_and_1_devices(tmp_path):
    ckpt = tmp_path / "ckpt"
    _run(
        [
            "--mode",
            "fsdp",
            "--steps",
            "12",
            "--save-checkpoint",
            str(ckpt),
            "--save-at",
            "6",
            "--poison-step",
            "3",
            "--out",
            str(tmp_path / "full.npz"),
        ],
        devices=8,
    )
    for devices in (4, 1):
        out = tmp_path / f"resumed{devices}.npz"
        _run(
            ["--mode", "fsdp", "--steps", "12", "--restore", str(ckpt), "--out", str(out)],
            devices=devices,
        )
        resumed = np.load(out)
        assert len(resumed["losses"]) == 6 and int(resumed["skipped"]) == 1  # scaler restored
        _assert_close(tmp_path / "full.npz", out)


@pytest.mark.standard_promotion(FLAX)
@needs_8
def test_jit_data_parallel_all_reduces_float32_gradients_on_cpu():
    """Under jit with a sharded batch, XLA places the gradient all-reduce itself; on CPU it
    reduces the float32 gradients of float32 params (GPU placement is XLA:GPU's choice;
    reduce_gradients inside shard_map fixes the dtype explicitly)."""
    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    model = jaxamp.linen.apply_policy(distributed_train.MLP(), "mixed_bfloat16")
    params = model.init(jax.random.key(0), jnp.zeros((1, distributed_train.FEATURES)))["params"]
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
    x, y = distributed_train.shard_batch(distributed_train.global_batch(0, 64), mesh)

    def grads(p, x, y):
        logits = model.apply({"params": p}, x)
        return jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(p), logits

    text = jax.jit(grads, out_shardings=(replicated, None)).lower(params, x, y).compile().as_text()
    reductions = [
        line.split("=", 1)[1].split("all-reduce(")[0]
        for line in text.splitlines()
        if " all-reduce(" in line
    ]
    assert reductions and not any("bf16[" in r for r in reductions), reductions
