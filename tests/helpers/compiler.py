"""The XLA flags the suite compiles its programs with, and the switch back to XLA's defaults.

LLVM's optimisations off and XLA:CPU's older (non-MLIR) fusion emitters: the same HLO,
optimised by XLA as always, compiled 3-4x faster (a small fused program: 80 ms -> 22 ms
on a 2-core AVX2-only AMD EPYC), and compiling is over half of what the suite spends.
"""

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# JAXAMP_TEST_XLA_OPT=1: XLA's defaults, the compiler users get.
DEFAULTS_VARIABLE = "JAXAMP_TEST_XLA_OPT"


def compiles_fast() -> bool:
    return os.environ.get(DEFAULTS_VARIABLE) != "1"


def with_fast_flags(xla_flags: str, fast: bool) -> str:
    """``xla_flags`` with the fast-compile flags added (where the same flag is not set to
    another value) if ``fast``, removed otherwise."""
    flags = [flag for flag in xla_flags.split() if flag not in FAST_COMPILE]
    if fast:
        names = {flag.split("=")[0] for flag in flags}
        flags += [flag for flag in FAST_COMPILE if flag.split("=")[0] not in names]
    return " ".join(flags)


def skip_reason(reason: str, slow: bool) -> str:
    """Why a ``default_compiler`` test is skipped under the fast flags, and where it runs:
    ``tests/compiler_test.py`` runs the CI's tests, a slow one runs with the variable set."""
    if slow:
        return f"runs on XLA's defaults: {DEFAULTS_VARIABLE}=1 python -m pytest -m slow ({reason})"
    return f"runs on XLA's default compiler, in tests/compiler_test.py: {reason}"
