"""Tests for jaxamp/_src/backend.py: auto_policy and the dot algorithm per backend."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxamp
from jaxamp._src.backend import auto_policy, dot_algorithm


@dataclasses.dataclass
class FakeClient:
    platform_version: str = "cuda 12.8"


@dataclasses.dataclass
class FakeDevice:
    platform: str
    compute_capability: str | None = None
    client: FakeClient = dataclasses.field(default_factory=FakeClient)
    device_kind: str = "a fake device"


@pytest.mark.parametrize(
    "device, preset",
    [
        (FakeDevice("gpu", "9.0"), "mixed_bfloat16"),  # H100/H200
        (FakeDevice("gpu", "8.0"), "mixed_bfloat16"),  # A100
        (FakeDevice("gpu", "8.6"), "mixed_bfloat16"),
        (FakeDevice("gpu", "7.5"), "mixed_float16"),  # T4
        (FakeDevice("gpu", "7.0"), "mixed_float16"),  # V100
        (FakeDevice("gpu", "6.1"), "float32"),  # Pascal: no tensor cores
        (FakeDevice("gpu", None, FakeClient("rocm 6.2")), "mixed_bfloat16"),
        (FakeDevice("tpu"), "mixed_bfloat16"),
        (FakeDevice("cpu"), "float32"),
        (FakeDevice("METAL"), "float32"),
    ],
)
def test_auto_policy_table(device, preset):
    assert auto_policy(device) == jaxamp.PRESETS[preset]


def _expected_preset(device) -> str:
    """The README's table, restated for the device this runs on (any backend)."""
    platform = device.platform
    if platform == "cpu":
        return "float32"
    if platform == "tpu" or platform == "rocm":
        return "mixed_bfloat16"
    capability = float(getattr(device, "compute_capability", "8.0"))
    return (
        "mixed_bfloat16" if capability >= 8 else "mixed_float16" if capability >= 7 else "float32"
    )


def test_auto_policy_on_this_machine():
    device = jax.devices()[0]
    assert auto_policy() == auto_policy(device) == jaxamp.PRESETS[_expected_preset(device)]


@pytest.mark.parametrize(
    "device, dtype, expected",
    [
        (FakeDevice("cpu"), jnp.bfloat16, lax.DotAlgorithmPreset.BF16_BF16_F32),
        (FakeDevice("cpu"), jnp.float16, None),  # XLA:CPU refuses F16_F16_F32
        (FakeDevice("gpu", "9.0"), jnp.float16, lax.DotAlgorithmPreset.F16_F16_F32),
        (FakeDevice("gpu", "9.0"), jnp.bfloat16, lax.DotAlgorithmPreset.BF16_BF16_F32),
        (FakeDevice("gpu", "7.0"), jnp.bfloat16, None),
        (FakeDevice("tpu"), jnp.bfloat16, lax.DotAlgorithmPreset.BF16_BF16_F32),
        (FakeDevice("cpu"), jnp.float32, None),
    ],
)
def test_dot_algorithm(device, dtype, expected):
    assert dot_algorithm(dtype, device) == expected


def test_dot_algorithm_keeps_backward_dots_16_bit():
    """The reason for the dot algorithm: float32 accumulation without float32 backward dots."""
    algorithm = dot_algorithm(jnp.bfloat16, FakeDevice("cpu"))

    def loss(a, b):
        return jnp.sum(lax.dot(a, b, precision=algorithm).astype(jnp.float32))

    a, b = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.bfloat16)
    report = jaxamp.precision_report(jax.grad(loss, argnums=(0, 1)))(a, b)
    assert report.all_operands_in("bfloat16")
    assert {op.accumulation_dtype for op in report.ops} == {"float32"}
    assert {op.result_dtype for op in report.ops} == {"bfloat16"}

    def loss_preferred(a, b):  # what preferred_element_type=float32 would do instead
        out = lax.dot(a, b, preferred_element_type=jnp.float32)
        return jnp.sum(out.astype(jnp.bfloat16).astype(jnp.float32))

    report = jaxamp.precision_report(jax.grad(loss_preferred, argnums=(0, 1)))(a, b)
    assert report.count("float32") == len(report.ops) > 0


# The three kinds of CPU seen here, by the 16-bit flags of their /proc/cpuinfo.
CPU_KINDS = {
    "AMD EPYC, AVX2 only": {"avx", "avx2", "fma", "f16c"},
    "AMD EPYC, avx512_bf16": {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16"},
    "Intel Xeon, AMX": {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16"},
}


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_auto_policy_says_why_naming_the_cpu(kind, monkeypatch):
    from jaxamp._src import backend

    monkeypatch.setattr(backend, "cpu_info", lambda: ("Test CPU 9000", CPU_KINDS[kind]))
    policy, reason = auto_policy(FakeDevice("cpu"), explain=True)
    assert policy == jaxamp.PRESETS["float32"]
    assert "Test CPU 9000" in reason
    if "avx512_bf16" in CPU_KINDS[kind]:
        assert "speeds up matmul-heavy models" in reason and "mixed_bfloat16" in reason
    else:
        assert "no avx512_bf16 or amx_bf16" in reason and "no faster than float32" in reason
    assert auto_policy(FakeDevice("cpu")) == policy  # without explain, the policy alone


def test_auto_policy_reason_on_gpus_and_tpus():
    _, reason = auto_policy(FakeDevice("gpu", "7.5"), explain=True)
    assert "float16 tensor cores" in reason and "loss scaling" in reason
    assert auto_policy(FakeDevice("gpu", "6.1"), explain=True)[0] == jaxamp.PRESETS["float32"]
