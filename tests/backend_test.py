"""Tests for jaxamp/_src/backend.py against its references: the table the docs give
(``docs/guides/matmul-rule.md``), what this machine's XLA compiles, and /proc/cpuinfo."""

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxamp
from jaxamp._src import backend
from jaxamp._src.backend import auto_policy, dot_algorithm

DOCS = pathlib.Path(__file__).parents[1] / "docs" / "guides" / "matmul-rule.md"


@dataclasses.dataclass
class FakeClient:
    platform_version: str = "cuda 12.8"


@dataclasses.dataclass
class FakeDevice:
    platform: str
    compute_capability: str | None = None
    client: FakeClient = dataclasses.field(default_factory=FakeClient)
    device_kind: str = "a fake device"


def _documented_table() -> dict[str, str]:
    """Each row of the docs' "What each backend gives" table: its backend, and the preset
    its ``auto_policy()`` cell names first."""
    section = DOCS.read_text().split("## What each backend gives", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and (preset := re.match(r"`(\w+)`", cells[1])):
            rows[cells[0]] = preset.group(1)
    return rows


# Devices each documented row stands for; a row added to the docs must be added here.
BF16_CPU = ("Test CPU 9000", {"avx2", "fma", "avx512f", "avx512_bf16"})
AVX2_CPU = ("Test CPU 8000", {"avx", "avx2", "fma", "f16c"})
ROWS = {
    "NVIDIA GPU, compute capability 8.0 and newer": [
        (FakeDevice("gpu", c), None) for c in ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0")
    ],
    "NVIDIA GPU, compute capability 7.x": [(FakeDevice("gpu", c), None) for c in ("7.0", "7.5")],
    "NVIDIA GPU before compute capability 7.0": [
        (FakeDevice("gpu", c), None) for c in ("5.2", "6.0", "6.1")
    ],
    "AMD GPU (ROCm), TPU": [
        (FakeDevice("gpu", None, FakeClient("rocm 6.2")), None),
        (FakeDevice("rocm"), None),
        (FakeDevice("tpu"), None),
    ],
    "CPU with bf16 units (`avx512_bf16`, `amx_bf16`)": [(FakeDevice("cpu"), BF16_CPU)],
    "CPU without bf16 units": [(FakeDevice("cpu"), AVX2_CPU)],
}


def test_every_documented_backend_is_tested():
    assert set(_documented_table()) == set(ROWS)


@pytest.mark.parametrize("row", list(ROWS))
def test_auto_policy_is_the_documented_preset(row, monkeypatch):
    documented = _documented_table()[row]
    for device, cpu in ROWS[row]:
        if cpu is not None:
            monkeypatch.setattr(backend, "cpu_info", lambda cpu=cpu: cpu)
        assert auto_policy(device) == jaxamp.PRESETS[documented], (row, device)
        policy, reason = auto_policy(device, explain=True)
        assert policy == jaxamp.PRESETS[documented] and reason


def _this_cpu() -> tuple[str, set[str]]:
    """The first processor's model name and flags, read from /proc/cpuinfo here."""
    text = pathlib.Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return (model.group(1).strip() if model else ""), set(flags.group(1).split() if flags else ())


@pytest.mark.skipif(not pathlib.Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo")
def test_cpu_info_and_the_reason_name_this_machine():
    model, flags = _this_cpu()
    assert backend.cpu_info() == (model, flags)
    units = {"avx512_bf16", "amx_bf16"} & flags
    assert set(backend.cpu_16bit_units("bfloat16")) == units
    if jax.default_backend() == "cpu":
        policy, reason = auto_policy(explain=True)
        row = (
            "CPU with bf16 units (`avx512_bf16`, `amx_bf16`)" if units else "CPU without bf16 units"
        )
        assert policy == jaxamp.PRESETS[_documented_table()[row]]
        assert model in reason and all(u in reason for u in units)


def _accumulating_operands(dtype):
    """16-bit operands whose dot a 16-bit accumulator gets wrong: 4096 products of about 1,
    whose running sum passes 256 (where bfloat16 stops adding 1) and 2048 (float16)."""
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = (1 + 0.1 * jax.random.normal(key_a, (2, 4096))).astype(dtype)
    b = (1 + 0.1 * jax.random.normal(key_b, (4096, 3))).astype(dtype)
    return a, b


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dot_algorithm_is_what_this_backend_compiles_and_accumulates_in_float32(dtype):
    """The algorithm ``dot_algorithm`` gives compiles here and sums in float32: the 16-bit
    result is the exact dot (float64 of the same operands) rounded once. Where it gives
    ``None``, this backend refuses the algorithm (XLA:CPU and ``F16_F16_F32``)."""
    a, b = _accumulating_operands(dtype)
    algorithm = dot_algorithm(dtype)
    preset = {jnp.bfloat16: "BF16_BF16_F32", jnp.float16: "F16_F16_F32"}[dtype]
    if algorithm is None:
        refused = getattr(lax.DotAlgorithmPreset, preset)
        with pytest.raises(Exception, match=preset):  # its type varies with the jax version
            jax.jit(lambda a, b: lax.dot(a, b, precision=refused)).lower(a, b).compile()
        return
    assert algorithm == getattr(lax.DotAlgorithmPreset, preset)
    got = jax.jit(lambda a, b: lax.dot(a, b, precision=algorithm))(a, b)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    half_ulp = float(jnp.finfo(dtype).eps) / 2 * np.abs(exact)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= half_ulp + 1e-3)


def test_dot_algorithm_for_other_backends():
    """What XLA:GPU and TPUs take, which this machine cannot compile (see the docstring)."""
    assert (
        dot_algorithm(jnp.float16, FakeDevice("gpu", "7.0")) == lax.DotAlgorithmPreset.F16_F16_F32
    )
    assert dot_algorithm(jnp.bfloat16, FakeDevice("gpu", "7.5")) is None  # no bf16 tensor cores
    assert dot_algorithm(jnp.bfloat16, FakeDevice("gpu", "9.0")) == (
        lax.DotAlgorithmPreset.BF16_BF16_F32
    )
    assert dot_algorithm(jnp.bfloat16, FakeDevice("tpu")) == lax.DotAlgorithmPreset.BF16_BF16_F32
    assert dot_algorithm(jnp.float32, FakeDevice("cpu")) is None


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


@pytest.mark.parametrize("cpu", [BF16_CPU, AVX2_CPU], ids=["bf16 units", "AVX2 only"])
def test_the_cpu_reason_says_what_the_units_change(cpu, monkeypatch):
    monkeypatch.setattr(backend, "cpu_info", lambda: cpu)
    _, reason = auto_policy(FakeDevice("cpu"), explain=True)
    assert cpu[0] in reason
    if "avx512_bf16" in cpu[1]:
        assert "speeds up matmul-heavy models" in reason and "mixed_bfloat16" in reason
    else:
        assert "no avx512_bf16 or amx_bf16" in reason and "no faster than float32" in reason


def test_auto_policy_reason_on_gpus_and_tpus():
    _, reason = auto_policy(FakeDevice("gpu", "7.5"), explain=True)
    assert "float16 tensor cores" in reason and "loss scaling" in reason
    _, reason = auto_policy(FakeDevice("gpu", "6.1"), explain=True)
    assert "no tensor cores" in reason


def test_the_block_scaled_gemm_runs_in_hardware_on_blackwell_only():
    from jaxamp._src.backend import has_block_scaled_gemm

    blackwell = [FakeDevice("gpu", c) for c in ("10.0", "10.3", "12.0")]
    assert has_block_scaled_gemm(blackwell)
    older = ("7.0", "8.0", "8.9", "9.0", None, "n/a")
    for device in (*(FakeDevice("gpu", c) for c in older), FakeDevice("cpu"), FakeDevice("tpu")):
        assert not has_block_scaled_gemm([device]), device
        assert not has_block_scaled_gemm([blackwell[0], device]), device  # every device
    assert not has_block_scaled_gemm([FakeDevice("gpu", "10.0", FakeClient("rocm 7.0"))])
    assert not has_block_scaled_gemm([])
