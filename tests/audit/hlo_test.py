"""Tests for jaxamp/_src/audit/hlo.py: the compiled-HLO reader."""

import jax
import jax.numpy as jnp
import pytest

from jaxamp._src.audit.hlo import read_compiled, wider_result


@pytest.mark.default_compiler("its subject is the compiled arithmetic: the compiler users get")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_read_compiled_finds_the_dot_and_the_sensitive_ops(dtype):
    def f(x, w):
        return jnp.sum(jnp.exp(x @ w))

    x, w = jnp.ones((4, 8), dtype), jnp.ones((8, 4), dtype)
    matmuls, sensitive, converts = read_compiled(jax.jit(f).lower(x, w).compile().as_text())
    assert len(matmuls) == 1 and matmuls[0]["kind"] in ("dot", "convolution", "custom-call")
    assert matmuls[0]["lhs_shape"] in ((4, 8), (8, 4))
    assert {op.primitive for op in sensitive} >= {"exp"}
    assert converts >= 0


def test_wider_result_states_the_accumulation_only_when_wider():
    assert wider_result("bfloat16", "bfloat16", "float32") == "float32"
    assert wider_result("float32", "float32", "float32") is None
    assert wider_result("bfloat16", "float32", "float32") is None
