"""Tests for jaxamp/_src/ops/forms.py: matmul_form, use_matmul_form and JAXAMP_MATMUL_FORM."""

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
