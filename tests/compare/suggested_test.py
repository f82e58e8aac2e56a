"""``jaxamp compare --variants auto`` (jaxamp/_src/compare/suggested.py): the policy
``jaxamp.suggest_policy`` measures on the first batch, trained beside fp32 and the presets."""

import numpy as np
import pytest

import jaxamp
from jaxamp._src.advisor.suggest import PolicySuggestion
from jaxamp._src.compare.app import compare
from jaxamp._src.compare.config import CompareConfig, OptionError
from jaxamp._src.compare.report import format_markdown
from jaxamp._src.compare.suggested import variant_of
from jaxamp._src.compare.variants import expand_variants
from tests.helpers.promotion import OPTAX

TINY = dict(
    model="bert",
    layers=1,
    heads=2,
    hidden=16,
    seq_len=8,
    vocab_size=64,
    epochs=1,
    batch_size=8,
    train_examples=16,
    test_examples=8,
)


@pytest.mark.standard_promotion(OPTAX)
def test_auto_trains_the_suggestion_beside_fp32_and_the_presets():
    """On a clean BERT the suggestion is bf16 with nothing kept wider: the bf16 run,
    trained once and reported under both names."""
    said = []
    config = CompareConfig(variants=("auto",), data="embedded", numerics=False, **TINY)
    report = compare(config, log=said.append)
    runs = {r["variant"]: r for r in report["runs"]}
    assert list(runs) == ["fp32", "bf16", "auto"]  # the CPU default variants, and auto
    suggestion = runs["auto"]["suggestion"]
    assert suggestion["policy"] == str(jaxamp.get_policy("mixed_bfloat16"))
    assert suggestion["overrides"] == {} and runs["auto"]["overrides"] == {}
    assert "accepted" in suggestion["verdicts"]["mixed_bfloat16"]
    assert runs["auto"]["policy"] == runs["bf16"]["policy"]
    assert runs["auto"]["same_as"] == "bf16" and "trained once" in runs["auto"]["description"]
    np.testing.assert_array_equal(runs["auto"]["losses"], runs["bf16"]["losses"])
    assert runs["auto"]["accuracy_verdict"] == runs["bf16"]["accuracy_verdict"]
    assert any(line.startswith("auto: suggested by jaxamp.suggest_policy") for line in said)
    markdown = format_markdown(report)
    assert "- `auto`: `jaxamp.suggest_policy` on the first batch suggests" in markdown


def test_a_suggestion_becomes_a_variant_with_its_overrides_and_loss_scaling():
    policy = jaxamp.get_policy("mixed_float16")
    advice = PolicySuggestion(policy, {"head": "float32"}, {"head": "why"}, 2.0**15, ())
    variant = variant_of(advice)
    assert variant.name == "auto" and variant.policy == policy
    assert variant.overrides == (("head", "float32"),) and variant.dynamic_loss_scaling
    assert "head kept in float32" in variant.description


def test_auto_alone_expands_and_is_checked_like_any_variant():
    assert expand_variants(("auto",)) == ["fp32", "bf16", "auto"]  # on a CPU
    assert expand_variants(("fp32", "auto")) == ["fp32", "auto"]
    with pytest.raises(OptionError, match="more than once"):
        CompareConfig(variants=("fp32", "auto", "auto"))
    with pytest.raises(OptionError, match="lack fp32"):
        CompareConfig(variants=("bf16", "auto"))
