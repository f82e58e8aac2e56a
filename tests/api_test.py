"""The public API: every exported name imports (ruff keeps ``__all__`` sorted), and the
core imports without the ``compare`` extra."""

import importlib
import os
import subprocess
import sys

import pytest

import jaxamp

MODULES = [
    "jaxamp",
    "jaxamp.linen",
    "jaxamp.nnx",
    "jaxamp.optim",
    "jaxamp.debug",
    "jaxamp.ops",
    "jaxamp.models",
]


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


BLOCK_COMPARE_EXTRA = (
    "import sys\n"
    "for m in ('tqdm', 'matplotlib', 'tensorflow_datasets', 'sklearn', 'PIL'):\n"
    "    sys.modules[m] = None\n"
)


def test_the_core_imports_without_the_compare_extra():
    code = BLOCK_COMPARE_EXTRA + (
        "import jaxamp, jaxamp.models, jaxamp.optim, jaxamp.debug, jaxamp.ops\n"
        "assert not any(m in sys.modules and sys.modules[m] for m in ('tqdm', 'matplotlib'))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


RUN_COMPARE = "from jaxamp._src.compare import cli\nsys.exit(cli.main(['compare', '--help']))\n"


@pytest.mark.parametrize(
    "blocked",
    [
        ("tqdm", "matplotlib", "tensorflow_datasets", "sklearn", "PIL"),
        # tqdm was a core dependency of 0.1, so an upgrade keeps it: the rest is missing
        ("matplotlib", "tensorflow_datasets", "sklearn", "PIL"),
        ("sklearn",),
    ],
)
def test_jaxamp_compare_without_the_extra_names_the_extra_to_install(blocked):
    code = f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n" + RUN_COMPARE
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "needs the 'compare' extra" in result.stderr
    assert "pip install 'jaxamp[compare]'" in result.stderr
    assert blocked[0] in result.stderr and "Traceback" not in result.stderr


def test_jaxamp_compare_with_a_broken_extra_names_the_extra_to_install(tmp_path):
    (tmp_path / "tqdm.py").write_text("raise ImportError('tqdm is broken here')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    code = "import sys\n" + RUN_COMPARE
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "tqdm is broken here" in result.stderr and "jaxamp[compare]" in result.stderr


def _imported_modules(path):
    import ast

    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_autocast_depends_on_jax_alone():
    """``jaxamp.autocast`` is for any JAX function: its modules import neither Flax nor
    the Flax policies (NNX arguments are split by flax_policy/graph.py, which it plugs in)."""
    from pathlib import Path

    root = Path(jaxamp.__file__).parent / "_src" / "autocast"
    for path in root.glob("*.py"):
        for name in _imported_modules(path):
            assert not name.startswith(("flax", "jaxamp._src.flax_policy")), (path.name, name)


_LAYERS = ("errors", "dtypes", "jaxprs", "policy", "backend", "ops", "autocast")
_LAYERS += ("flax_policy", "optim", "checkpoint", "audit", "numerics", "advisor", "compare")


def test_the_layers_import_downward():
    """jaxamp/_src's concepts import only those before them (CONTRIBUTING's order): no
    cycle, and autocast below the Flax policies."""
    from pathlib import Path

    root = Path(jaxamp.__file__).parent / "_src"
    for path in root.rglob("*.py"):
        me = path.relative_to(root).parts[0].removesuffix(".py")
        for name in _imported_modules(path):
            parts = name.split(".")
            if parts[:2] != ["jaxamp", "_src"] or len(parts) < 3 or me not in _LAYERS:
                continue
            if parts[2] in _LAYERS:
                assert _LAYERS.index(parts[2]) <= _LAYERS.index(me), (str(path), name)
