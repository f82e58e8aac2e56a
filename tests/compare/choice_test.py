"""Tests for jaxamp/_src/compare/choice.py: the model ``auto`` picks, and why."""

import pytest

from jaxamp._src import backend
from jaxamp._src.compare.app import CompareConfig
from jaxamp._src.compare.choice import CPU_CONVNET, CPU_TRANSFORMER, choose_model


@pytest.mark.parametrize("units", [True, False])
def test_auto_picks_a_transformer_on_a_cpu_with_bf16_units(units, monkeypatch):
    flags = {"avx", "avx2", "fma", "f16c", *(["avx512f", "avx512_bf16"] if units else [])}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    config, reason = choose_model(CompareConfig())
    if units:
        assert config.model == "bert" and "bf16 GEMM units" in reason
        assert {k: getattr(config, k) for k in CPU_TRANSFORMER} == CPU_TRANSFORMER
    else:
        assert config.model == "resnet18" and config.width == 32 and "no bf16 units" in reason
        assert {k: getattr(config, k) for k in CPU_CONVNET} == CPU_CONVNET
    asked, reason = choose_model(CompareConfig(model="resnet18"))
    assert asked.model == "resnet18" and "as asked" in reason


@pytest.mark.parametrize("units", [True, False])
def test_auto_keeps_the_shape_a_user_gave(units, monkeypatch):
    flags = {"avx", "avx2", "fma", *(["avx512f", "avx512_bf16"] if units else [])}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    given = {"layers": 1, "seq_len": 32} if units else {"width": 16}
    config, reason = choose_model(CompareConfig(**given))
    assert {k: getattr(config, k) for k in given} == given
    for k, v in (CPU_TRANSFORMER if units else CPU_CONVNET).items():
        if k not in given:
            assert getattr(config, k) == v, k
    assert "as given: " + ", ".join(f"{k}={v}" for k, v in given.items()) in reason
