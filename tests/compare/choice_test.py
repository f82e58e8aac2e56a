"""Tests for jaxamp/_src/compare/choice.py: the model ``auto`` picks, and why."""

import pytest

from jaxamp._src import backend
from jaxamp._src.compare.choice import CPU_CONVNET, CPU_TRANSFORMER, choose_model
from jaxamp._src.compare.config import CompareConfig, OptionError, check_options


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


@pytest.mark.parametrize(
    "given",
    [
        {"hidden": 768, "heads": 12},  # the guide's width-768 run: auto's own shape before
        {"hidden": 768},
        {"heads": 12},
        {"layers": 12},
        {"seq_len": 128},
        {"vocab_size": 30522},
    ],
)
def test_auto_keeps_a_shape_given_at_the_models_own_value(given, monkeypatch):
    """A shape option given equal to BERT-base's value was taken for one left alone and
    replaced by auto's (``--hidden 768 --heads 12`` trained width 384, silently)."""
    flags = {"avx", "avx2", "fma", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    config, reason = choose_model(CompareConfig(**given))
    assert {k: getattr(config, k) for k in given} == given
    assert "as given: " + ", ".join(f"{k}={v}" for k, v in given.items()) in reason
    check_options(config, reason)


@pytest.mark.parametrize("model", ["auto", "bert"])
@pytest.mark.parametrize("hidden, heads", [(512, 8), (256, 4), (768, 12), (128, 2)])
def test_heads_left_out_beside_a_hidden_given_are_heads_of_64(model, hidden, heads, monkeypatch):
    """``--hidden 512`` alone failed against auto's 6 heads, which the user never gave."""
    flags = {"avx", "avx2", "fma", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    config, reason = choose_model(CompareConfig(model=model, hidden=hidden))
    assert (config.model, config.hidden, config.heads) == ("bert", hidden, heads)
    check_options(config, reason)


def test_heads_that_do_not_divide_hidden_are_refused_naming_those_that_do(monkeypatch):
    flags = {"avx", "avx2", "fma", "avx512f", "avx512_bf16"}
    monkeypatch.setattr(backend, "cpu_info", lambda: ("a CPU", flags))
    refused = r"hidden \(384\) must be divisible by heads \(7\); heads that divide 384: 1, 2, 3,"
    with pytest.raises(OptionError, match=refused):
        check_options(*choose_model(CompareConfig(heads=7)))
    with pytest.raises(OptionError, match="heads that divide 100: 1, 2, 4, 5, 10, 20, 25, 50, 100"):
        CompareConfig(model="bert", hidden=100, heads=12)


def test_the_explicit_models_take_their_own_shapes():
    bert, _ = choose_model(CompareConfig(model="bert"))
    assert (bert.layers, bert.hidden, bert.heads, bert.seq_len) == (12, 768, 12, 128)
    resnet, _ = choose_model(CompareConfig(model="resnet50"))
    assert resnet.width == 64 and resnet.hidden is None
