"""Block-scaled GEMMs under FSDP: the partitioned program all-gathers the weights (and the
weight gradient's operands) block-quantized, one byte or half a byte per value with their
scales, never decoded to float32 or bfloat16; the sharded step equals the step on one
device. Each run is a subprocess: XLA's dump and device count are set before jax starts."""

import json
import subprocess
import sys

import pytest

EXPECTED = {
    "mixed_mxfp8": ["f8e4m3fn", "f8e8m0fnu"],  # e4m3 values, e8m0 scales
    "mixed_nvfp4": ["f4e2m1fn", "f8e4m3fn"],  # e2m1 values, e4m3 scales
}


def _run(policy: str, rows: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.fsdp_gathers", policy, str(rows)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("policy", sorted(EXPECTED))
def test_fsdp_all_gathers_block_quantized_weights_and_equals_one_device(policy):
    out = _run(policy, 512)  # 64 rows per device: two blocks of 32
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # forward, activation and weight gradients: values and scales, each gathered
    assert result["gathers"] == EXPECTED[policy] and result["count"] == 6, result
    assert result["equal_loss"] and result["equal_grads"], result
