"""The public API: every exported name imports (ruff keeps ``__all__`` sorted)."""

import importlib

import pytest

import jaxamp

MODULES = ["jaxamp", "jaxamp.linen", "jaxamp.nnx", "jaxamp.models"]


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_imports(module):
    mod = importlib.import_module(module)
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


@pytest.mark.parametrize("module", MODULES)
def test_all_has_no_duplicates_or_private_names(module):
    names = list(importlib.import_module(module).__all__)
    assert len(names) == len(set(names))
    assert not any(name.startswith("_") for name in names)


def test_version():
    assert isinstance(jaxamp.__version__, str) and jaxamp.__version__.count(".") == 2
