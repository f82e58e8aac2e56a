"""The tests whose subject is the compiled arithmetic, on the compiler users get.

The suite's programs compile with LLVM's optimisations off and XLA:CPU's older fusion
emitters (the root conftest.py), 3-4x faster. Tests marked ``compiler_sensitive`` (the
rounding and its folded convert pair, the float8 and block-scaled formats against their
numpy emulations, the non-finite check under fast math, the audit of compiled programs)
run again here, and tests marked ``default_compiler`` run only here: a fresh process
with ``JAXAMP_TEST_XLA_OPT=1``, XLA's defaults, as a user's program gets. The older
emitters change the last bits of some float8 products (Flax's to the bit no longer) and
NVFP4's rounding, so those claims are tested on the default compiler alone.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.compiler import DEFAULTS_VARIABLE, FAST_COMPILE, compiles_fast, skip_reason

ROOT = Path(__file__).resolve().parent.parent
_MARKED = re.compile(r"pytest\.mark\.(default_compiler|compiler_sensitive)\b")


def marked_files() -> list[str]:
    """The test files that mark a test ``default_compiler`` or ``compiler_sensitive``."""
    tests = sorted((ROOT / "tests").rglob("*_test.py"))
    return [str(p.relative_to(ROOT)) for p in tests if _MARKED.search(p.read_text())]


@pytest.mark.compiler_sensitive
def test_the_run_compiles_fast_unless_told_otherwise():
    """The flags are in XLA_FLAGS exactly when JAXAMP_TEST_XLA_OPT is not 1 (in this
    process, and in the fresh one below, which runs this test too)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    assert all((flag in flags) == compiles_fast() for flag in FAST_COMPILE), flags


def test_the_marked_tests_pass_on_the_default_compiler():
    files = marked_files()
    assert "tests/compiler_test.py" in files and len(files) > 3, files
    env = {**os.environ, DEFAULTS_VARIABLE: "1"}
    selection = ["-m", "(default_compiler or compiler_sensitive) and not slow"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection, *files],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-6000:]
    summary = run.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


def test_a_slow_default_compiler_test_says_how_to_run_it():
    """compiler_test runs the CI's tests only: a slow one's reason must not send the reader
    there, but to the slow run on XLA's defaults."""
    assert "compiler_test" in skip_reason("r", slow=False)
    slow = skip_reason("r", slow=True)
    assert "compiler_test" not in slow and f"{DEFAULTS_VARIABLE}=1" in slow and "-m slow" in slow
