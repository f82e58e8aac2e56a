"""Test configuration shared by the doctests in ``jaxamp/`` and the tests in ``tests/``."""

import os

# Eight CPU devices for the sharding tests; must be set before jax is imported.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
