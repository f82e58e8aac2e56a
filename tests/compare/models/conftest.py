"""The token batch shared by the tests of jaxamp/_src/compare/models."""

import jax
import pytest


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(2), (2, 8), 1, 64)
