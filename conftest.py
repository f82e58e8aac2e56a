"""Test configuration shared by the doctests in ``jaxamp/`` and the tests in ``tests/``."""

import os

# Eight CPU devices for the sharding tests; must be set before jax is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The next JAX: flags that change JAX's internals before they become the default
# (checkpoint and custom_vjp as "hi" primitives...), switched on for a whole run by
# tests/next_jax_test.py, which runs the transformation-sensitive tests again with them.
NEXT_JAX_FLAGS = os.environ.get("JAXAMP_TEST_JAX_FLAGS", "")
if NEXT_JAX_FLAGS:
    import jax

    for _flag in NEXT_JAX_FLAGS.split(","):
        jax.config.update(_flag, True)
