"""The transformation-sensitive tests again, under the flags of the next JAX.

JAX changes its internals behind flags before it flips them: under ``jax_remat3``
``jax.checkpoint`` is a "hi" primitive, under ``jax_custom_vjp3`` ``jax.custom_vjp``
is one, under ``jax_scan3`` ``lax.scan`` changes. The autocast interpreter must enter
each higher-order primitive or refuse it by name; these runs show it does, on the
flags this jax has.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp

# jax_scan3 is left out: its scan carries state in Refs, which autocast refuses by name
# (test_scan3_is_refused_by_name); with it on, every scan under autocast would be.
NEXT_FLAGS = tuple(flag for flag in ("jax_remat3", "jax_custom_vjp3") if hasattr(jax.config, flag))
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


@pytest.mark.xdist_group("next_jax")
@pytest.mark.skipif(not NEXT_FLAGS, reason="this jax has none of the next-JAX flags")
def test_transformation_sensitive_tests_pass_under_the_next_jax_flags():
    _pytest_under(NEXT_FLAGS, *SENSITIVE, timeout=1800)


def _pytest_under(flags, *tests, timeout):
    """Runs ``tests`` in a fresh process with ``flags`` on from import on."""
    env = {**os.environ, "JAXAMP_TEST_JAX_FLAGS": ",".join(flags)}
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


@pytest.mark.xdist_group("next_jax")
@pytest.mark.parametrize("flag", NEXT_FLAGS)
def test_float8_gemms_inside_checkpoint_under_each_flag_alone(flag):
    """Each flag on its own, from import on: under jax_custom_vjp3 without jax_remat3, a
    custom_vjp defined with nondiff_argnums fails inside jax.checkpoint (in JAX: safe_zip
    lengths), so the float8 GEMMs close over their static arguments instead."""
    test = "tests/ops/fp8_test.py::test_a_gemm_inside_checkpoint_matches_it_outside"
    _pytest_under((flag,), test, timeout=600)
