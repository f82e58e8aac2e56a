"""Test configuration shared by the doctests in ``jaxamp/`` and the tests in ``tests/``."""

import os

import pytest

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


@pytest.fixture
def jax_flag(request):
    """One of the next JAX's flags (``request.param``, e.g. ``"jax_remat3"``) on for one
    test, and back as it was after; the test is skipped where this jax lacks it."""
    import jax

    name = request.param
    if not hasattr(jax.config, name):
        pytest.skip(f"this jax has no {name}")
    previous = getattr(jax.config, name)
    jax.config.update(name, True)
    yield name
    jax.config.update(name, previous)
