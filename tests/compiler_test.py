"""The tests whose subject is the compiled arithmetic, on the compiler users get.

The suite's programs compile with LLVM's optimisations off and XLA:CPU's older fusion
emitters (the root conftest.py), 3-4x faster. Tests marked ``default_compiler`` (the
rounding and its folded convert pair, the float8 and block-scaled formats against their
numpy emulations, the non-finite check under fast math, the audit of compiled programs,
Flax's float8 numbers to the bit, the training-bound parity run) run only here: a fresh
process with ``JAXAMP_TEST_XLA_OPT=1``, XLA's defaults, as a user's program gets. Tests
marked ``compiler_sensitive`` run here and under the fast flags: the older emitters
convert float32 to e2m1 wrongly (-5.0019 to -4, not -6), which jaxamp sidesteps by
rounding to the grid itself, so NVFP4's rounding is tested under both.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import compiler
from tests.helpers.compiler import DEFAULTS_VARIABLE, compiles_fast, fast_flags_set, skip_reason

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
    flags = os.environ.get("XLA_FLAGS", "")
    assert all(on == compiles_fast() for on in fast_flags_set(flags).values()), flags


@pytest.mark.parametrize(
    "given",
    [
        "--xla_cpu_use_fusion_emitters=0",
        "--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true",
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=FALSE",
    ],
)
def test_the_suite_owns_the_fast_flags_whatever_value_they_were_given(given):
    """A run on XLA's defaults removes the two flags in any spelling (else its programs
    would not be the defaults), a fast run sets them (else it would not be fast)."""
    other = "--xla_force_host_platform_device_count=8"
    defaults = compiler.with_fast_flags(f"{other} {given}", fast=False)
    assert defaults == other
    assert not any(compiler.fast_flags_set(defaults).values())
    fast = compiler.with_fast_flags(f"{given} {other}", fast=True)
    assert all(compiler.fast_flags_set(fast).values()) and other in fast.split()


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
