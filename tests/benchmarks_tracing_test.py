"""benchmarks/tracing.py runs at its tiny size and writes well-formed records (no timing
assertions: the trace-time figures are the lead engineer's, on a quiet machine)."""

import json

import pytest

from tests.helpers.promotion import FLAX

pytest.importorskip("transformers")


@pytest.mark.standard_promotion(FLAX)
def test_tracing_benchmark_at_tiny_size(tmp_path):
    from benchmarks import tracing

    records = tracing.main(["--tiny", "--repeats", "1", "--out", str(tmp_path)])
    assert [r["variant"] for r in records] == list(tracing.VARIANTS)
    for r in records:
        assert r["model"] == "gpt2-2x64"
        for phase in (*tracing.PHASES, "total"):
            assert 0 < r[phase]["min_s"] <= r[phase]["median_s"] <= r[phase]["max_s"]
    flax_bf16 = next(r for r in records if r["variant"] == "flax_bf16")
    assert flax_bf16["total_vs_flax_bf16"] == 1.0
    data = json.loads((tmp_path / "tracing.json").read_text())
    assert data["records"] and "jax" in data["environment"]
    assert "| gpt2-2x64 | apply_policy |" in (tmp_path / "tracing.md").read_text()
