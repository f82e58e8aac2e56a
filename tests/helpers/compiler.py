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
    """``xla_flags`` with the fast-compile flags set if ``fast`` (replacing another value
    given to the same flag), and removed otherwise, whatever value they were given: the
    suite owns these two flags, so a run on XLA's defaults is on the defaults."""
    names = {_name(flag) for flag in FAST_COMPILE}
    flags = [flag for flag in xla_flags.split() if _name(flag) not in names]
    return " ".join([*flags, *FAST_COMPILE] if fast else flags)


def child_flags(devices: int, *extra: str) -> str:
    """XLA_FLAGS for a fresh process the run starts (a script that sets its own): ``devices``
    CPU devices and ``extra`` flags, compiled as this run compiles."""
    flags = " ".join([f"--xla_force_host_platform_device_count={devices}", *extra])
    return with_fast_flags(flags, compiles_fast())


def fast_flags_set(xla_flags: str) -> dict[str, bool]:
    """For each fast-compile flag, whether ``xla_flags`` gives it the fast value (its last
    occurrence, as XLA reads them; booleans in any of XLA's spellings)."""
    given = {_name(flag): flag.partition("=")[2] for flag in xla_flags.split()}
    return {
        flag: _name(flag) in given
        and _normal(given[_name(flag)]) == _normal(flag.partition("=")[2])
        for flag in FAST_COMPILE
    }


def _name(flag: str) -> str:
    return flag.partition("=")[0]


def _normal(value: str) -> str:
    lowered = value.strip().lower()
    return {"0": "false", "f": "false", "1": "true", "t": "true"}.get(lowered, lowered)


def skip_reason(reason: str, slow: bool) -> str:
    """Why a ``default_compiler`` test is skipped under the fast flags, and where it runs:
    ``tests/compiler_test.py`` runs the CI's tests, a slow one runs with the variable set."""
    if slow:
        return f"runs on XLA's defaults: {DEFAULTS_VARIABLE}=1 python -m pytest -m slow ({reason})"
    return f"runs on XLA's default compiler, in tests/compiler_test.py: {reason}"
