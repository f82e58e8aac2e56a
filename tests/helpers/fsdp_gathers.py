"""Run as a script: one FSDP training step of a Dense layer on 8 CPU devices under a policy;
prints as JSON the dtypes the program all-gathers, read from XLA's dump right after SPMD
partitioning (XLA:CPU converts float8 collectives to wider types in later passes, so the
compiled text would not say what crosses the wire), and whether the sharded step's loss
and gradient equal the step on one device.

  python -m tests.helpers.fsdp_gathers mixed_mxfp8 512
"""

import glob
import json
import os
import re
import sys
import tempfile
from pathlib import Path

from tests.helpers import compiler


def main(policy: str, rows: int) -> dict:
    dump = tempfile.mkdtemp()
    # before jax starts: this process's devices and dump (never set when imported)
    os.environ["XLA_FLAGS"] = compiler.child_flags(
        8, f"--xla_dump_to={dump}", "--xla_dump_hlo_pass_re=spmd-partitioning"
    )
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxamp

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    model = jaxamp.linen.apply_policy(nn.Dense(256, use_bias=False), policy)
    x = jax.random.normal(jax.random.key(0), (rows, 512))
    variables = model.init(jax.random.key(1), x)

    def loss(v, x):
        return jnp.sum(model.apply(v, x).astype(jnp.float32) ** 2)

    fsdp = NamedSharding(mesh, P("fsdp", None))  # the kernel on its input axis, x on its rows
    kernel = {"params": {"kernel": fsdp}}
    value, grads = jax.jit(jax.value_and_grad(loss), in_shardings=(kernel, fsdp))(variables, x)
    one_value, one_grads = jax.jit(jax.value_and_grad(loss))(variables, x)
    gathers = []
    for path in glob.glob(f"{dump}/*jit_loss*after_spmd-partitioning*.txt"):
        text = Path(path).read_text()
        gathers += re.findall(r"=\s*(\w+)\[[^\]]*\][^ ]*\s+all-gather\(", text)
    same = np.array_equal(grads["params"]["kernel"], one_grads["params"]["kernel"])
    return {
        "gathers": sorted(set(gathers)),
        "count": len(gathers),
        "equal_loss": bool(value == one_value),
        "equal_grads": bool(same),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
