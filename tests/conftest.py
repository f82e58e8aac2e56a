"""One compilation cache for the whole test run: the controller and its workers (and the
fresh processes some tests start) share a folder made for the run, so a program compiled
in one test is read back, not compiled again, in another. Each run starts empty."""

from __future__ import annotations

import os
import shutil
import tempfile

import jax
import pytest

_FOLDER = "JAXAMP_TEST_COMPILATION_CACHE"


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
