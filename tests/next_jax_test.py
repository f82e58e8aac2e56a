"""The transformation-sensitive tests again, under the flags of the next JAX.

JAX changes its internals behind flags before it flips them: under ``jax_remat3``
``jax.checkpoint`` is a "hi" primitive, under ``jax_custom_vjp3`` ``jax.custom_vjp``
is one, under ``jax_use_simplified_jaxpr_constants`` closed-over arrays are written
inline. The flags are not hand-picked: ``next_jax_flags`` reads, from the installed
jax's own config module, every flag declared ``upgrade=True`` or whose help calls it
temporary, and keeps those still off (the next JAX turns them on). The sensitive suite
runs with all of them on at once, and a smaller one under each alone; the float64 tests
run with ``jax_enable_x64`` on from import on.
"""

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp
from tests.helpers.compiler import DEFAULTS_VARIABLE

# Words by which jax's config calls a flag temporary.
_TEMPORARY = ("temporary", "only briefly", "while we transition")
# Flags read from jax that these runs leave off, each with the reason.
LEFT_OFF = {
    # Its scan carries state in Refs, which autocast refuses by name
    # (test_scan3_is_refused_by_name); with it on, every scan under autocast would be.
    "jax_scan3": "autocast refuses its scan by name",
}


def next_jax_flags() -> tuple[str, ...]:
    """The boolean flags the installed jax declares with ``upgrade=True`` or calls
    temporary in their help, that are off in this process: read from the source of
    ``jax._src.config`` (the declarations keep no other record of either)."""
    from jax._src import config

    found = []
    for node in ast.walk(ast.parse(inspect.getsource(config))):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "bool_state"):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        name = keywords.get("name")
        if not isinstance(name, ast.Constant) or not hasattr(jax.config, name.value):
            continue
        upgrade = keywords.get("upgrade")
        try:
            help_text = ast.literal_eval(keywords["help"]) if "help" in keywords else ""
        except ValueError:  # a help text built at import: read its source
            help_text = ast.unparse(keywords["help"])
        temporary = any(word in str(help_text).lower() for word in _TEMPORARY)
        upgraded = isinstance(upgrade, ast.Constant) and upgrade.value is True
        if (upgraded or temporary) and not getattr(jax.config, name.value):
            found.append(name.value)
    return tuple(sorted(found))


ALL_NEXT = next_jax_flags()
NEXT_FLAGS = tuple(flag for flag in ALL_NEXT if flag not in LEFT_OFF)
ROOT = Path(__file__).resolve().parent.parent
# The tests that trace through transformations: autocast's interpreter and rules, and
# the policies that evaluate models with them.
SENSITIVE = (
    "tests/autocast/api_test.py",
    "tests/autocast/interpreter_test.py",
    "tests/autocast/constants_test.py",
    "tests/transformations_test.py",
    "tests/flax_policy/nnx_test.py",
    "tests/flax_policy/zoo_test.py",
    "tests/flax_policy/fp8_test.py",
)
# Under each flag alone, in CI: the interpreter's own tests, the constants' and the custom
# rules' that the flags reach (checkpoint, custom derivatives, inline constants,
# softmax's rule); the whole sensitive suite under each flag alone is the slow run.
SENSITIVE_ALONE = (
    *(
        f"tests/autocast/interpreter_test.py::{name}"
        for name in (
            "test_checkpoint_is_entered_under_remat3",
            "test_a_custom_jvp_function_with_an_integer_output",
            "test_a_custom_vjp_forward_is_entered_and_its_backward_runs_as_written",
            "test_a_custom_vjp_with_static_arguments_is_entered",
            "test_a_higher_order_primitive_it_does_not_enter_is_refused_by_name",
            "test_a_gradient_taken_inside_keeps_float32_weight_gradients",
        )
    ),
    "tests/autocast/constants_test.py::test_a_closed_over_mask_bias_keeps_its_value_under_simplified_constants",
    "tests/autocast/constants_test.py::test_gradients_through_the_mask_idiom_stay_finite",
    "tests/autocast/rules_test.py::test_a_custom_jvp_rule_sums_its_tangents_in_float32",
    "tests/ops/fp8_test.py::test_a_gemm_inside_checkpoint_matches_it_outside",
)


def test_the_flags_are_read_from_jax():
    """The reader finds the flags this jax declares as upgrades or temporary (a parser
    that found none would make every run below vacuous)."""
    assert ALL_NEXT, "no next-JAX flag found in jax._src.config"
    declared = {"jax_remat3", "jax_custom_vjp3", "jax_use_simplified_jaxpr_constants"}
    assert {f for f in declared if hasattr(jax.config, f)} <= set(ALL_NEXT)
    assert "jax_enable_x64" not in ALL_NEXT or not jax.config.jax_enable_x64


# In CI, all the flags at once over the interpreter's, the constants' and the rules' own
# tests, and the zoo's layers that the flags reach in another way than the layers kept:
# the lifted transforms (checkpoint, custom derivatives), softmax (softmax's rule) and the
# large constants (inline constants). The whole sensitive suite under the flags (models,
# transformations, float8, the whole zoo) is the slow run below.
_ZOO_UNDER_FLAGS = "scan or remat or vmap or jit or masked or softmax"
SENSITIVE_CI = (
    "tests/autocast/interpreter_test.py",
    "tests/autocast/constants_test.py",
    "tests/autocast/rules_test.py",
)


@pytest.mark.xdist_group("next_jax")
@pytest.mark.skipif(not NEXT_FLAGS, reason="this jax has none of the next-JAX flags")
def test_transformation_sensitive_tests_pass_under_the_next_jax_flags():
    # one process: every test of the three files, and the zoo's selected by name
    files = " or ".join(Path(f).stem for f in SENSITIVE_CI)
    selected = f"{files} or (zoo_test and ({_ZOO_UNDER_FLAGS}))"
    zoo = "tests/flax_policy/zoo_test.py"
    _pytest_under(NEXT_FLAGS, *SENSITIVE_CI, zoo, "-k", selected, timeout=1800)


@pytest.mark.slow
@pytest.mark.skipif(not NEXT_FLAGS, reason="this jax has none of the next-JAX flags")
def test_the_whole_sensitive_suite_passes_under_the_next_jax_flags():
    _whole_sensitive_suite_under(NEXT_FLAGS)


@pytest.mark.slow
@pytest.mark.parametrize("flag", NEXT_FLAGS)
def test_all_sensitive_tests_pass_under_each_next_jax_flag_alone(flag):
    _whole_sensitive_suite_under((flag,))


def _whole_sensitive_suite_under(flags):
    """The sensitive suite under ``flags``, and its ``default_compiler`` tests (Flax's
    float8 numbers to the bit), which the fast compiler skips, on XLA's defaults."""
    _pytest_under(flags, *SENSITIVE, timeout=3600)
    selected = ("-m", "default_compiler")
    _pytest_under(flags, *SENSITIVE, *selected, timeout=3600, xla_defaults=True)


@pytest.mark.parametrize("flag", NEXT_FLAGS)
def test_sensitive_tests_pass_under_each_next_jax_flag_alone(flag):
    """Each flag on its own, from import on: under jax_custom_vjp3 without jax_remat3, a
    custom_vjp defined with nondiff_argnums fails inside jax.checkpoint (in JAX: safe_zip
    lengths), so the float8 GEMMs close over their static arguments instead."""
    _pytest_under((flag,), *SENSITIVE_ALONE, timeout=900)


def test_the_x64_tests_pass_with_x64_on_from_import_on():
    """``jax_enable_x64`` from import on, not only around each test's body: the float64
    tests (each a float64 function or model against itself without a policy) and the
    float32 policy's identity. The transformation tests are not run under it: they make
    their inputs with ``jnp.ones`` and friends, float64 under x64, which a policy leaves
    as written."""
    tests = ("tests/x64_test.py", "tests/float32_identity_test.py")
    _pytest_under(("jax_enable_x64",), *tests, "-k", "not without_x64", timeout=900)


def _pytest_under(flags, *tests, timeout, xla_defaults=False):
    """Runs ``tests`` in a fresh process with ``flags`` on from import on, compiled as
    this run compiles, or on XLA's defaults."""
    env = {**os.environ, "JAXAMP_TEST_JAX_FLAGS": ",".join(flags)}
    if xla_defaults:
        env[DEFAULTS_VARIABLE] = "1"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, f"under {flags}:\n{run.stdout[-6000:]}"


@pytest.mark.parametrize("jax_flag", ["jax_scan3"], indirect=True)
def test_scan3_is_refused_by_name(jax_flag):
    """Under jax_scan3 a scan is a "hi" primitive whose carry lives in Refs: autocast
    does not enter it yet, and says so rather than leave its matmuls as traced."""

    def f(w, xs):
        return lax.scan(lambda c, x: (jnp.tanh(c @ w + x), c.sum()), jnp.ones(4), xs)

    with pytest.raises(NotImplementedError, match="'Scan3'"):
        jaxamp.autocast(f, "mixed_bfloat16")(jnp.ones((4, 4)), jnp.ones((3, 4)))
