"""FP8 across devices: shard_map (data parallel) and explicit sharding, on 4 fake CPU devices
in a subprocess, against the same step on one device."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers import compiler

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np, flax.linen as nn
    from jax.sharding import PartitionSpec as P, AxisType
    import jaxamp
    from jaxamp.ops import fp8_dot_general, init_gemm_fp8_state

    S = jaxamp.ops.FP8_STATE_COLLECTION
    dn = (((1,), (0,)), ((), ()))
    x = jax.random.normal(jax.random.key(0), (8, 8)) * jnp.arange(1.0, 9.0)[:, None]
    w = jax.random.normal(jax.random.key(1), (8, 4))

    # shard_map, data parallel: a replicated weight, the batch split over 4 devices. The
    # amax is the whole batch's (pmax), the weight's gradient summed (as bf16's rule does).
    auto = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    for state in (None, init_gemm_fp8_state(4)):
        def local(w, m, xb):
            def f(w, m):
                return jnp.sum(fp8_dot_general(xb, w, dn, fp8_state=m))
            return jax.grad(f, argnums=(0, 1))(w, m)
        sharded = jax.jit(jax.shard_map(
            local, mesh=auto, in_specs=(P(), P(), P("d")), out_specs=(P(), P())
        ))(w, state, x)
        whole = jax.grad(
            lambda w, m: jnp.sum(fp8_dot_general(x, w, dn, fp8_state=m)), argnums=(0, 1)
        )(w, state)
        np.testing.assert_allclose(sharded[0], whole[0], rtol=1e-5, atol=1e-5)
        if state is not None:
            for a, b in zip(sharded[1], whole[1]):
                np.testing.assert_array_equal(a, b)

    # Explicit sharding (jax.make_mesh's default): the batch-sharded input's weight
    # gradient contracts the sharded dimension.
    explicit = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    for policy in ("mixed_float8", "mixed_float8_delayed"):
        model = jaxamp.linen.apply_policy(nn.Dense(4), policy)
        v = model.init(jax.random.key(1), x)
        def loss(v, x):
            return jnp.mean(model.apply(v, x) ** 2)
        whole = jax.jit(jax.grad(loss))(v, x)
        with jax.set_mesh(explicit):
            xs = jax.device_put(x, P("d"))
            got = jax.jit(jax.grad(loss))(v, xs)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(whole)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    print("ok")
    """
)


def test_fp8_under_shard_map_and_explicit_sharding_equals_one_device():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = compiler.child_flags(4)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-4000:]
