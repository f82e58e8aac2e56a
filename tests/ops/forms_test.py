"""Tests for jaxamp/_src/ops/forms.py: matmul_form, use_matmul_form and JAXAMP_MATMUL_FORM."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxamp
from jaxamp._src.ops import forms as matmul_forms
from jaxamp._src.ops.forms import FORMS


def test_matmul_form_per_backend_and_dtype():
    assert matmul_forms.matmul_form("gpu") is FORMS["native"]
    assert matmul_forms.matmul_form("tpu") is FORMS["native"]
    assert matmul_forms.matmul_form("cpu") is FORMS["canonical"]
    assert matmul_forms.matmul_form("cpu", jnp.float16) is FORMS["upcast"]


def test_the_form_can_be_overridden(monkeypatch):
    with jaxamp.ops.use_matmul_form("upcast"):
        assert matmul_forms.matmul_form("gpu") is FORMS["upcast"]
        with jaxamp.ops.use_matmul_form(FORMS["native"]):
            assert matmul_forms.matmul_form("tpu") is FORMS["native"]
        assert matmul_forms.matmul_form("cpu") is FORMS["upcast"]
    assert matmul_forms.matmul_form("cpu") is FORMS["canonical"]
    monkeypatch.setenv("JAXAMP_MATMUL_FORM", "upcast")
    assert matmul_forms.matmul_form("cpu") is FORMS["upcast"]
    monkeypatch.setenv("JAXAMP_MATMUL_FORM", "fastest")
    with pytest.raises(
        ValueError, match=r"JAXAMP_MATMUL_FORM='fastest'.*native, canonical, upcast"
    ):
        matmul_forms.matmul_form("cpu")
    with pytest.raises(ValueError, match="Unknown matmul form 'cpu-bf16-units'"):
        jaxamp.ops.use_matmul_form("cpu-bf16-units").__enter__()


def test_native_override_on_cpu_warns():
    with jaxamp.ops.use_matmul_form("native"), pytest.warns(UserWarning, match="canonical"):
        matmul_forms.matmul_form("cpu", jnp.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_program_lowered_for_cpu_in_the_native_form_warns_for_bfloat16(dtype):
    """The warning comes where the form takes effect, when a program is lowered for the
    CPU (not only when ``matmul_form`` is asked), and the lowered dot is the native one."""
    loss = jaxamp.autocast(lambda w, x: jnp.tanh(x @ w).sum(), f"p=f32,c={dtype},o=f32")
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    with jaxamp.ops.use_matmul_form("native"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = jax.jit(jax.grad(loss)).lower(w, x).as_text()
    warned = [w for w in caught if "'native' matmul form on XLA:CPU" in str(w.message)]
    assert bool(warned) == (dtype == "bfloat16")
    short = "bf16" if dtype == "bfloat16" else "f16"
    assert f"tensor<2x4x{short}>" in text and "dot_general" in text
