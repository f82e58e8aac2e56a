"""Test configuration shared by the doctests in ``jaxamp/`` and the tests in ``tests/``."""

import os
import sys

import pytest

from tests.helpers import compiler

# The run starts some twenty Python processes (the two workers, and the fresh ones of
# tests/compiler_test.py, next_jax_test.py, sharding_test.py and the benchmarks' twins).
# Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE), each would
# compile jaxamp and rewrite the tests' asserts from source again, about 4 s a process
# that collects the suite; the run writes it, under the __pycache__/ folders git ignores.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Eight CPU devices for the sharding tests; must be set before jax is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# The tests' programs compile fast (tests/helpers/compiler.py): the same HLO, compiled
# 3-4x faster, and compiling is over half of what the suite spends. Programs then run
# slower, which only the few training-bound tests feel. JAXAMP_TEST_XLA_OPT=1 runs the
# tests on the compiler users get, as tests/compiler_test.py does in every run for the
# tests marked ``compiler_sensitive`` (they run on both) and ``default_compiler`` (only
# there: skipped here, with the reason); the benchmarks, run on their own, always do.
COMPILES_FAST = compiler.compiles_fast()
os.environ["XLA_FLAGS"] = compiler.with_fast_flags(os.environ["XLA_FLAGS"], COMPILES_FAST)

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


def pytest_collection_modifyitems(config, items):
    """Under the fast compiler, a ``default_compiler`` test is skipped with its reason
    before any of its fixtures are set up."""
    if not COMPILES_FAST:
        return
    for item in items:
        marker = item.get_closest_marker("default_compiler")
        if marker is None:
            continue
        if len(marker.args) != 1 or not str(marker.args[0]).strip():
            raise pytest.UsageError(f"{item.nodeid}: default_compiler takes one reason")
        slow = item.get_closest_marker("slow") is not None
        item.add_marker(pytest.mark.skip(reason=compiler.skip_reason(marker.args[0], slow)))
