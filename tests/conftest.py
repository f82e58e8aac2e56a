"""The test run's settings.

* Strict dtype promotion, the bug class an AMP library exists to control: an implicit
  promotion in jaxamp (or in a test) raises. A test whose subject promotes on purpose, or
  that runs a library whose own code promotes, runs under JAX's standard promotion and
  says why: ``@pytest.mark.standard_promotion(REASON)``, with a reason from
  tests/helpers/promotion.py.
* One compilation cache for the whole run: the controller and its workers (and the fresh
  processes some tests start) share a folder made for the run, so a program compiled in
  one test is read back, not compiled again, in another. Each run starts empty.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import jax
import pytest

_FOLDER = "JAXAMP_TEST_COMPILATION_CACHE"

# For the whole process, set as this file is imported: the test modules' own module-level
# code and the threads tests start run under it too; a marked test enters the standard
# mode for its own duration (``_promotion``).
jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_configure(config: pytest.Config) -> None:
    # The controller (or a run without workers) makes the folder; workers and the fresh
    # processes tests start inherit it through the environment.
    if _FOLDER not in os.environ:
        os.environ[_FOLDER] = tempfile.mkdtemp(prefix="jaxamp-test-cache-")
        config.stash[_OWNED] = os.environ[_FOLDER]
    jax.config.update("jax_compilation_cache_dir", os.environ[_FOLDER])
    # Every program, however quick to compile: the fresh processes rerun tests the workers
    # ran (the next-JAX flags), and the two workers compile many of the same small programs.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_OWNED, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[_FOLDER]


_OWNED = pytest.StashKey[str]()


@pytest.fixture(autouse=True)
def _promotion(request: pytest.FixtureRequest) -> Iterator[None]:
    marker = request.node.get_closest_marker("standard_promotion")
    if marker is None:
        yield
        return
    if len(marker.args) != 1 or not str(marker.args[0]).strip():
        raise pytest.UsageError(
            f"{request.node.nodeid}: standard_promotion takes one reason "
            "(a name from tests/helpers/promotion.py)"
        )
    with jax.numpy_dtype_promotion("standard"):
        yield
