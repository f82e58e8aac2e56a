"""The benchmark suite runs and writes well-formed records (no timing assertions)."""

import json
import math

import pytest

from benchmarks import autocast as autocast_benchmark
from benchmarks import run
from tests.helpers.expected_warnings import NATIVE_FORM_ON_CPU
from tests.helpers.promotion import FLAX, OPTAX

REQUIRED = (
    "framework",
    "model",
    "variant",
    "batch_size",
    "step_time_median_s",
    "step_time_min_s",
    "step_time_max_s",
    "examples_per_s",
    "compile_s",
    "speedup_vs_fp32",
    "speedup_vs_tf32",
    "host_syncs_per_step",
)


def _check(records):
    assert records
    for r in records:
        assert all(k in r for k in REQUIRED), set(REQUIRED) - set(r)
        if r.get("error"):  # only torch.compile may fail to build here: a row saying why
            assert r["framework"] == "torch.compile" and r["step_time_median_s"] is None
            continue
        assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
        assert r["examples_per_s"] > 0 and math.isfinite(r["examples_per_s"])
        if r["framework"] == "jaxamp":
            assert r["temp_bytes"] is not None and r["activation_bytes"] > 0
            assert r["converts"] is not None
            # skipping is decided on device: the step has exactly the fp32 step's
            # conditionals, loops and callbacks (a difference of counts, not floored)
            assert isinstance(r["control_flow_ops"], int)
            assert r["host_syncs_per_step"] == 0
        if r["framework"].startswith("torch"):
            assert r["host_syncs_per_step"] is None  # not measured
        if r["variant"] == "fp32" and r["framework"] in ("jaxamp", "torch"):
            assert r["speedup_vs_fp32"] == 1.0


@pytest.mark.standard_promotion(OPTAX)
def test_cpu_smoke_suite_on_one_model(tmp_path):
    """The smoke suite's small twin: one model, every variant and framework, one repeat
    (torch.compile, minutes of inductor compilation, is tested on its own)."""
    argv = ["--suite", "cpu-smoke", "--models", "bert-tiny:2", "--warmup", "1", "--repeats", "1"]
    argv += ["--no-torch-compile"]
    records = run.main([*argv, "--out", str(tmp_path)])
    _check(records)
    assert {r["model"] for r in records} == {"bert-tiny"}
    assert {r["variant"] for r in records if r["framework"] == "jaxamp"} == {
        "fp32",
        "tf32",
        "bf16",
        "fp16",
    }
    frameworks = {r["framework"] for r in records}
    assert {"jaxamp", "flax"} <= frameworks
    bf16 = [r for r in records if r["framework"] == "jaxamp" and r["variant"] == "bf16"]
    assert bf16 and all(r["jaxamp_over_handwritten_flax"] > 0 for r in bf16)
    if "torch" in frameworks:
        assert all(r["jaxamp_over_torch"] > 0 for r in records if r["framework"] == "jaxamp")
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    assert data["records"] == json.loads(json.dumps(records, default=str))
    assert (tmp_path / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_cpu_smoke_suite(tmp_path):
    records = run.main(["--suite", "cpu-smoke", "--out", str(tmp_path)])
    _check(records)
    frameworks = {r["framework"] for r in records}
    assert {"jaxamp", "flax"} <= frameworks
    assert {r["model"] for r in records} == {"resnet-tiny", "bert-tiny", "gpt2-tiny"}
    assert {r["variant"] for r in records if r["framework"] == "jaxamp"} == {
        "fp32",
        "tf32",
        "bf16",
        "fp16",
    }
    bf16 = [r for r in records if r["framework"] == "jaxamp" and r["variant"] == "bf16"]
    assert all(r["jaxamp_over_handwritten_flax"] > 0 for r in bf16)
    if "torch" in frameworks:
        assert all(r["jaxamp_over_torch"] > 0 for r in records if r["framework"] == "jaxamp")
    data = json.loads((tmp_path / "benchmarks.json").read_text())
    assert data["records"] == json.loads(json.dumps(records, default=str))
    assert "jax" in data["environment"]
    assert "| model |" in (tmp_path / "benchmarks.md").read_text()
    assert (tmp_path / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # inductor compiles the model's forward and backward: minutes on 2 cores
def test_cpu_smoke_suite_times_torch_compile_beside_eager_autocast(tmp_path):
    pytest.importorskip("torch")
    argv = ["--suite", "cpu-smoke", "--models", "bert-tiny:2", "--variants", "fp32,bf16"]
    argv += ["--frameworks", "jaxamp,torch", "--warmup", "1", "--repeats", "2"]
    records = run.main([*argv, "--out", str(tmp_path)])
    _check(records)
    rows = {(r["framework"], r["variant"]): r for r in records}
    compiled = rows[("torch.compile", "bf16")]  # bf16 only, beside eager's
    assert ("torch.compile", "fp32") not in rows and ("torch", "bf16") in rows
    if compiled["error"] is None:  # inductor ran here
        assert compiled["step_time_median_s"] > 0 and compiled["compile_s"] > 0
        assert rows[("jaxamp", "bf16")]["jaxamp_over_torch_compile"] > 0
        assert "jaxamp/torch.compile time" in (tmp_path / "benchmarks.md").read_text()
    else:  # recorded, not raised
        assert "error" in (tmp_path / "benchmarks.md").read_text()


@pytest.mark.standard_promotion(OPTAX)
def test_torch_compile_failure_is_a_row_not_a_crash(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    from benchmarks import torch_bench

    real_build = torch_bench.build

    def build(spec, variant, batch_size, compile=False, **kwargs):
        if compile:
            raise RuntimeError("no C++ compiler here")
        return real_build(spec, variant, batch_size, compile=compile, **kwargs)

    monkeypatch.setattr(torch_bench, "build", build)
    argv = ["--suite", "cpu-smoke", "--models", "bert-tiny:2", "--variants", "fp32,bf16"]
    argv += ["--frameworks", "jaxamp,torch", "--warmup", "1", "--repeats", "1"]
    records = run.main([*argv, "--out", str(tmp_path)])
    _check(records)
    failed = [r for r in records if r["error"]]
    assert [(r["framework"], r["variant"]) for r in failed] == [("torch.compile", "bf16")]
    assert "no C++ compiler here" in failed[0]["error"]
    assert "no C++ compiler here" in (tmp_path / "benchmarks.md").read_text()
    assert (tmp_path / "benchmarks.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.standard_promotion(OPTAX)
def test_gpu_suite_code_path_at_tiny_size(tmp_path):
    """The GPU suite's extras (largest batch, utilisation), exercised on CPU at tiny sizes."""
    records = run.main(
        [
            "--suite",
            "gpu",
            "--models",
            "resnet-tiny:4",
            "--variants",
            "fp32,bf16",
            "--frameworks",
            "jaxamp",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--memory-limit-gb",
            "0.5",
            "--out",
            str(tmp_path),
        ]
    )
    _check(records)
    for r in records:
        assert r["largest_batch_estimate"] > 4
        assert r["mfu"] > 0 and r["flops_per_step"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "vgg:8"],
        ["--variants", "fp8"],
        ["--models", "resnet-tiny"],
        ["--frameworks", "jax"],
    ],
)
def test_bad_flags(argv):
    with pytest.raises((SystemExit, ValueError)):
        run.main(["--suite", "cpu-smoke", *argv])


@pytest.mark.standard_promotion(FLAX)
def test_autocast_benchmark_at_small_size(tmp_path):
    argv = ["--models", "bert", "--bert-batch", "1", "--warmup", "1", "--repeats", "1"]
    argv += ["--bert-layers", "1", "--seq-len", "16"]
    records = autocast_benchmark.main([*argv, "--out", str(tmp_path)])
    assert [r["variant"] for r in records] == ["autocast", "apply_policy", "by_hand"]
    for r in records:
        assert r["matmuls"] > 0 and r["matmuls_16bit"] == r["matmuls"], r
        assert r["converts"] > 0 and r["activation_mib"] > 0 and r["step_time_median_s"] > 0
    assert records[1]["ratio_to_apply_policy"] == 1.0
    saved = json.loads((tmp_path / "autocast.json").read_text())
    assert len(saved["records"]) == 3
    assert "Autocast overhead" in (tmp_path / "autocast.md").read_text()


# the benchmark times every form, the native one on XLA:CPU included
@pytest.mark.standard_promotion(FLAX)
@NATIVE_FORM_ON_CPU
def test_matmul_forms_at_tiny_size(tmp_path):
    from benchmarks import matmul_forms

    argv = ["--size", "32", "--batch", "16", "--features", "8", "--warmup", "1", "--repeats", "2"]
    argv += ["--model-batch", "2", "--model-length", "8", "--model-width", "64"]
    matmul_forms.main([*argv, "--out", str(tmp_path), "--hlo-out", str(tmp_path / "hlo")])
    result = json.loads((tmp_path / "matmul_forms.json").read_text())
    forms = {r["form"] for r in result["records"]}
    assert {f"bfloat16, matmul rule ({name})" for name in ("canonical", "upcast")} <= forms
    assert "float32" in forms
    assert all(
        r["gflops"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in result["records"]
    )
    assert result["environment"]["matmul_form"] == "canonical"  # bfloat16 on any CPU
    assert "cpu_fp16_flags" in result["environment"]
    assert any(p.name.endswith(".hlo.txt") for p in (tmp_path / "hlo").iterdir())


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize(
    "bytes_model",
    ["gpt2-tiny", pytest.param("gpt2-small", marks=pytest.mark.slow)],
)
def test_optimizer_state_benchmark_at_small_size(tmp_path, bytes_model):
    from benchmarks import optimizer_state

    argv = ["--seeds", "1", "--epochs", "1", "--gpt-steps", "2", "--gpt-size", "tiny"]
    result = optimizer_state.main([*argv, "--bytes-model", bytes_model, "--out", str(tmp_path)])
    by_recipe = {r["recipe"]: r for r in result["bytes"]}
    parameters = by_recipe["fp32"]["parameters"]
    assert parameters > 100e6 if bytes_model == "gpt2-small" else parameters < 1e6
    for r in result["bytes"]:  # the pytree and the compiled update agree
        assert abs(r["bytes_per_param_pytree"] - r["bytes_per_param_compiled"]) < 0.05
    assert {r["recipe"] for r in result["accuracy"]} == set(by_recipe)
    assert {r["recipe"] for r in result["gpt"]} == set(by_recipe)
    for r in result["gpt"]:  # a loss near ln(256) after 2 steps, finite for every recipe
        assert 0 < r["loss_mean"] < 10 and r["steps"] == 2
    assert result["stall"]["none"][-1] == 1.0  # the naive recipe stalls
    for name in ("optimizer_state.json", "optimizer_state.md", "stall.png"):
        assert (tmp_path / name).exists()


@pytest.mark.standard_promotion(OPTAX)
@pytest.mark.parametrize("model", ["mlp", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_loss_scaling_benchmark_at_tiny_size(tmp_path, model):
    from benchmarks import loss_scaling

    argv = ["--model", model, "--warmup", "1", "--repeats", "2", "--out", str(tmp_path)]
    argv += ["--width", "32", "--batch-size", "4"] if model == "mlp" else ["--batch-size", "2"]
    loss_scaling.main(argv)
    name = "loss_scaling_mlp" if model == "mlp" else "loss_scaling"
    records = json.loads((tmp_path / f"{name}.json").read_text())["records"]
    variants = ["plain", *loss_scaling.ANALYSIS_CHECKS, loss_scaling.RECORDING]
    variants = variants if model == "mlp" else ["plain"]
    variants += [] if model == "mlp" else ["loss_scaled"]
    expected = {(scope, variant) for scope in ("update", "train_step") for variant in variants}
    if model == "mlp":  # float16 params with a float32 master: the update alone
        expected.add(("update", loss_scaling.FP16_MASTER))
        expected |= {("train_step", name) for name in loss_scaling.DONATED}
    assert {(r["scope"], r["variant"]) for r in records} == expected
    for r in records:
        assert r["min_s"] <= r["step_time_median_s"] <= r["max_s"] and r["n"] == 2
    passes = {r["variant"]: r["passes"] for r in records if r["scope"] == "update"}
    if model == "mlp":  # plain Adam: 10 gradient sizes read and written; the check reads one
        assert passes["plain"] == pytest.approx(10, abs=0.2)
        assert passes["plain"] < passes["loss_scaled"] <= passes["plain"] + 2.2
    assert (tmp_path / f"{name}.md").exists()


@pytest.mark.standard_promotion(OPTAX)
def test_loss_scaling_benchmark_times_pytorch_gradscaler_beside_plain_adam(tmp_path):
    pytest.importorskip("torch")
    from benchmarks import loss_scaling

    argv = ["--model", "mlp", "--width", "32", "--batch-size", "4", "--torch"]
    loss_scaling.main([*argv, "--warmup", "1", "--repeats", "2", "--out", str(tmp_path)])
    records = json.loads((tmp_path / "loss_scaling_mlp.json").read_text())["records"]
    torch_rows = {r["variant"]: r for r in records if r["variant"].startswith("torch")}
    assert set(torch_rows) == {"torch plain", "torch GradScaler"}
    assert torch_rows["torch plain"]["ratio_to_plain"] == 1.0  # against torch's own plain
    assert torch_rows["torch GradScaler"]["scope"] == "train_step"
    steps = loss_scaling.torch_mlp_steps(4, 32)
    for step in steps.values():  # each step trains a model of its own
        step()


@pytest.mark.standard_promotion(OPTAX)
def test_profile_puts_each_thunk_of_a_compiled_step_in_a_category(tmp_path):
    from benchmarks import profile

    argv = ["--models", "bert-tiny:2", "--warmup", "1", "--steps", "2", "--no-torch"]
    profile.main([*argv, "--out", str(tmp_path)])
    records = json.loads((tmp_path / "profile.json").read_text())["records"]
    assert [(r["framework"], r["variant"]) for r in records] == [
        ("jaxamp", "fp32"),
        ("jaxamp", "bf16"),
        ("flax", "bf16"),
    ]
    for r in records:
        categories = r["profile"]["categories"]
        assert categories["gemm"]["ms"] > 0 and categories["gemm"]["thunks"] > 0
        assert categories["norm"]["thunks"] > 0 and categories["optimizer"]["thunks"] > 0
        assert r["profile"]["unmatched_s"] == 0.0  # every traced thunk found in the HLO
    bf16 = records[1]["profile"]["categories"]
    assert sum(c["converts"] for c in bf16.values()) > 0
    assert "| gemm |" in (tmp_path / "profile.md").read_text()
    assert "| convert or copy |" in (tmp_path / "profile.md").read_text()


def test_profile_categories_from_hlo_and_aten_names():
    from benchmarks import profile

    hlo = """HloModule m

%fused_dot (p0: bf16[4,4], p1: bf16[4,4]) -> f32[4,4] {
  %p0 = bf16[4,4]{1,0} parameter(0)
  %p1 = bf16[4,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/jvp(M)/dense/dot_general"}
}

%fused_cast (p0: f32[4,4]) -> bf16[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %c = bf16[4,4]{1,0} convert(%p0), metadata={op_name="jit(step)/jvp(M)/convert_element_type"}
}

%fused_norm (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %r = f32[4,4]{1,0} rsqrt(%p0), metadata={op_name="jit(step)/jvp(M)/ln_1/rsqrt"}
}

%fused_adam (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %m = f32[4,4]{1,0} multiply(%p0, %p0), metadata={op_name="jit(step)/mul"}
}

%fused_grad_and_adam (p0: bf16[4,4]) -> f32[4,4] {
  %p0 = bf16[4,4]{1,0} parameter(0)
  %g = f32[4,4]{1,0} convert(%p0), metadata={op_name="jit(step)/transpose(jvp(M))/dense/convert_element_type"}
  ROOT %nu = f32[4,4]{1,0} multiply(%g, %g), metadata={op_name="jit(step)/integer_pow"}
}

%fused_keys (p0: u32[4,4]) -> u32[4,4] {
  %p0 = u32[4,4]{1,0} parameter(0)
  ROOT %x = u32[4,4]{1,0} xor(%p0, %p0), metadata={op_name="jit(step)/threefry2x32"}
}

ENTRY %main (a: bf16[4,4], b: bf16[4,4]) -> f32[4,4] {
  %a = bf16[4,4]{1,0} parameter(0)
  %b = bf16[4,4]{1,0} parameter(1)
  %gemm = f32[4,4]{1,0} fusion(%a, %b), kind=kOutput, calls=%fused_dot
  %cast = bf16[4,4]{1,0} fusion(%gemm), kind=kLoop, calls=%fused_cast
  %norm = f32[4,4]{1,0} fusion(%gemm), kind=kLoop, calls=%fused_norm
  %adam = f32[4,4]{1,0} fusion(%norm), kind=kLoop, calls=%fused_adam
  %keys = u32[4,4]{1,0} fusion(%adam), kind=kLoop, calls=%fused_keys
  ROOT %fused_update = f32[4,4]{1,0} fusion(%cast), kind=kLoop, calls=%fused_grad_and_adam
}
"""
    thunks = profile.thunk_categories(hlo)
    shown = ("gemm", "cast", "norm", "adam", "keys", "fused_update")
    assert {k: v[0] for k, v in thunks.items() if k in shown} == {
        "gemm": "gemm",
        "cast": "convert",
        "norm": "norm",
        "adam": "optimizer",
        "keys": "dropout",  # a dropout key split outside the gradient is still dropout
        "fused_update": "optimizer",  # an Adam update with the gradient's last cast fused in
    }
    assert thunks["cast"][1] == 1  # one convert inside
    assert profile.torch_category("aten::addmm") == "gemm"
    assert profile.torch_category("aten::native_layer_norm_backward") == "norm"
    assert profile.torch_category("aten::_to_copy") == "convert"
    assert profile.torch_category("aten::_foreach_addcdiv_") == "optimizer"
    assert profile.torch_category("aten::add_") == "other"


@pytest.mark.standard_promotion(FLAX)
@pytest.mark.parametrize("model", ["gpt", "bert"])  # one model each: two short tests
def test_fp8_training_benchmark_at_tiny_size(tmp_path, model):
    from benchmarks import fp8_training

    argv = ["--steps", "3", "--hidden", "16", "--layers", "1", "--heads", "2", "--seq-len", "8"]
    argv += ["--vocab", "32", "--batch", "4", "--eval-examples", "8", "--tag", "t"]
    argv += ["--variants", "bf16,fp8-delayed", "--models", model]
    result = fp8_training.main([*argv, "--out", str(tmp_path)])
    assert [m["model"] for m in result["models"]] == [model]
    saved = json.loads((tmp_path / "fp8_training_t.json").read_text())
    assert saved["tolerance"] == fp8_training.TOLERANCE == 0.05
    assert set(saved["environment"]["cpu_flags"]) >= {"avx2", "avx512_bf16", "amx_bf16"}
    assert saved["environment"]["jax"] and saved["environment"]["flax"]
    for model in saved["models"]:
        bf16, delayed = model["runs"]
        assert len(delayed["losses"]) == 3 and all(map(math.isfinite, delayed["losses"]))
        assert delayed["nonfinite_steps"] == 0 and delayed["follows_bf16"] is True
        assert (
            math.isfinite(delayed["held_out_loss"]) and "held_out_relative_gap_to_bf16" in delayed
        )
        assert delayed["final_loss"] == pytest.approx(sum(delayed["losses"]) / 3)
        assert delayed["gap_to_bf16"] == delayed["final_loss"] - bf16["final_loss"]
        # the first step quantizes with scales of 1 and no history: nothing clips
        assert set(delayed["saturations"]) == {"input", "kernel", "output_grad"}
        assert 0 <= delayed["saturated_steps"] <= 2 and bf16["saturated_steps"] is None
        assert all(s != 1.0 for s in delayed["final_scales"].values())  # the scales moved
        # the audit of the step: every GEMM of the layers in float8, none block-scaled
        assert delayed["gemm_formats"]["float8"] > 0 and bf16["gemm_formats"] == {"float8": 0}
    assert "fp8-delayed" in (tmp_path / "fp8_training_t.md").read_text()
    assert (tmp_path / "fp8_training_t.png").stat().st_size > 0


@pytest.mark.standard_promotion(FLAX)
def test_fp8_training_benchmark_runs_the_block_formats_with_their_tolerances(tmp_path):
    from benchmarks import fp8_training

    argv = ["--steps", "2", "--hidden", "16", "--layers", "1", "--heads", "2", "--seq-len", "8"]
    argv += ["--vocab", "32", "--batch", "4", "--eval-examples", "8", "--tag", "t"]
    argv += ["--variants", "bf16,mxfp8,nvfp4", "--models", "gpt", "--out", str(tmp_path)]
    (model,) = fp8_training.main(argv)["models"]
    bf16, mx, nv = model["runs"]
    assert bf16["gemm_formats"] == {"float8": 0}
    assert (mx["tolerance"], nv["tolerance"]) == (0.05, fp8_training.NVFP4_TOLERANCE) == (0.05, 0.1)
    for r, fmt in ((mx, "mxfp8"), (nv, "nvfp4")):
        assert r["nonfinite_steps"] == 0 and all(map(math.isfinite, r["losses"]))
        # every float8 GEMM of the step ran in the block format, forward and both gradients
        assert r["gemm_formats"][fmt] == r["gemm_formats"]["float8"] > 0
    text = (tmp_path / "fp8_training_t.md").read_text()
    assert "nvfp4" in text and f"{mx['gemm_formats']['float8']} mxfp8" in text


def test_fp8_training_saturation_is_amax_over_the_scale_used():
    import jax.numpy as jnp

    from benchmarks.fp8_training import saturated

    layer = {
        "input_amax_history": jnp.array([900.0, 0.0]),  # 900 > 448 x 1: clipped
        "input_scale": jnp.array([1.0]),
        "kernel_amax_history": jnp.array([0.5, 0.0]),
        "kernel_scale": jnp.array([0.5 / 448]),  # exactly at the maximum: not clipped
        "output_grad_amax_history": jnp.array([1.0, 0.0]),
        "output_grad_scale": jnp.array([0.5 / 57344]),  # twice the e5m2 maximum
    }
    counts = {k: (int(n), float(r)) for k, (n, r) in saturated({"a": {"b": layer}}).items()}
    assert counts["input"] == (1, pytest.approx(900 / 448))
    assert counts["kernel"][0] == 0 and counts["kernel"][1] == pytest.approx(1.0)
    assert counts["output_grad"] == (1, pytest.approx(2.0))


def saved_verdict(path):
    return json.loads((path / "fp8_gemm.json").read_text())["environment"]["verdict"]


def test_fp8_gemm_benchmark_at_tiny_size(tmp_path):
    from benchmarks import fp8_gemm

    argv = ["--sizes", "64", "--dense-batch", "32", "--dense-features", "32"]
    argv += ["--dense-layers", "2", "--warmup", "1", "--repeats", "2"]
    rows = fp8_gemm.main([*argv, "--out", str(tmp_path)])
    assert {(r["kind"].split()[0], r["variant"]) for r in rows} >= {
        ("GEMM", "bf16"),
        ("GEMM", "fp8"),
        ("GEMM", "fp8-delayed"),
        ("Dense", "bf16"),
        ("Dense", "fp8"),
        ("Dense", "fp8-delayed"),
        ("GEMM", "mxfp8"),
        ("Dense", "nvfp4"),
    }
    for r in rows:
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["gemms"] > 0, r
        assert r["speedup_vs_bf16"] > 0 and r["tflops"] > 0
        low = r["variant"].startswith(("fp8", "float8")) or r["variant"] in ("mxfp8", "nvfp4")
        assert (r["f8_instructions"] > 0) == low, r
        assert r["block_scaled_kernels"] == 0  # emulated on a CPU
    assert "MXFP8 and NVFP4 are emulated here" in saved_verdict(tmp_path)
    saved = json.loads((tmp_path / "fp8_gemm.json").read_text())
    assert saved["environment"]["verdict"] and "cpu_flags" in saved["environment"]
    assert any(p.name.endswith(".hlo.txt") for p in (tmp_path / "fp8_hlo").iterdir())
    assert "Float8 against bfloat16" in (tmp_path / "fp8_gemm.md").read_text()


def test_fp8_gemm_reads_float8_gemms_from_hlo_text():
    from benchmarks.fp8_gemm import hlo_facts

    hlo = """
  %p0 = f8e4m3fn[64,64]{1,0} parameter(0)
  %c = f32[64,64]{1,0} convert(f8e4m3fn[64,64]{1,0} %p0)
  %d = f32[64,64]{1,0} dot(f32[64,64]{1,0} %c, f32[64,64]{1,0} %c), lhs_contracting_dims={1}
  %g = (bf16[64,64]{1,0}, s8[0]{0}) custom-call(f8e4m3fn[64,64]{1,0} %p0, f8e4m3fn[64,64]{1,0} %p0, f32[] %s, f32[] %s), custom_call_target="__cublas$lt$matmul$f8"
"""
    facts = hlo_facts(hlo)
    assert facts == {
        "f8_gemms": 1,
        "cublaslt_f8": 1,
        "gemms": 2,
        "f8_instructions": 3,
        "block_scaled_kernels": 0,
    }
    # compiled HLO names its operands without their types: looked up in the computation
    named = """%fused (param_0: f8e4m3fn[8,8], param_1: f8e5m2[8,8]) -> f32[8,8] {
  %param_0 = f8e4m3fn[8,8]{1,0} parameter(0)
  %param_1 = f8e5m2[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}
}

%other (param_0: f32[8,8]) -> f32[8,8] {
  %param_0 = f32[8,8]{1,0} parameter(0)
  ROOT %dot.2 = f32[8,8]{1,0} dot(%param_0, %param_0), lhs_contracting_dims={1}
}
"""
    assert hlo_facts(named) == {
        "f8_gemms": 1,
        "cublaslt_f8": 0,
        "gemms": 2,
        "f8_instructions": 3,
        "block_scaled_kernels": 0,
    }
    block = '  %g = f32[64,64]{1,0} custom-call(f8e4m3fn[64,64]{1,0} %a, f8e4m3fn[64,64]{1,0} %b, f8e8m0fnu[64,2]{1,0} %s, f8e8m0fnu[64,2]{1,0} %t), custom_call_target="__cudnn$blockScaledDot"'
    assert hlo_facts(block)["block_scaled_kernels"] == 1


def test_xla_cpu_paths_counts_where_each_dot_runs():
    from benchmarks.xla_cpu_paths import hlo_paths

    hlo = """%inner (p0: bf16[4,4]) -> f32[4,4] {
  %p0 = bf16[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%onednn_body (p0: bf16[4,4]) -> f32[4,4] {
  %p0 = bf16[4,4]{1,0} parameter(0)
  ROOT %f = f32[4,4]{1,0} fusion(%p0), kind=kLoop, calls=%inner
}

%ynn_body (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%xnn_body (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %e = f32[4,4]{1,0} exponential(%p0)
}

ENTRY %main (a: bf16[4,4], b: f32[4,4]) -> (f32[4,4], f32[4,4]) {
  %a = bf16[4,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %o = f32[4,4]{1,0} fusion(%a), kind=kCustom, calls=%onednn_body, backend_config={"fusion_config":{"kind":"__onednn_fusion"},"outer_dimension_partitions":[]}
  %y = f32[4,4]{1,0} fusion(%b), kind=kCustom, calls=%ynn_body, backend_config={"fusion_config":{"kind":"__ynn_fusion"},"outer_dimension_partitions":[]}
  %x = f32[4,4]{1,0} fusion(%y), kind=kCustom, calls=%xnn_body, backend_config={"fusion_config":{"kind":"__xnn_fusion"}}
  %c = f32[4,4]{1,0} custom-call(%x, %x), custom_call_target="__onednn$matmul"
  %d = f32[4,4]{1,0} dot(bf16[4,4]{1,0} %a, bf16[4,4]{1,0} %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[4,4]{1,0}, f32[4,4]{1,0}) tuple(%c, %d)
}
"""
    facts = hlo_paths(hlo)
    assert facts == {
        "dots_xla": 1,  # the entry's own dot
        "bf16_dots_xla": 1,  # typed operands, as in HLO before compilation
        "dots_onednn": 1,  # a dot nested one fusion deeper still runs in oneDNN's
        "bf16_dots_onednn": 1,
        "dots_ynn": 1,
        "bf16_dots_ynn": 0,
        "dots_xnn": 0,
        "bf16_dots_xnn": 0,
        "fusions_onednn": 1,
        "fusions_ynn": 1,
        "fusions_xnn": 1,  # a fusion without a dot is still a library fusion
        "onednn_custom_calls": 1,
    }


def test_xla_cpu_paths_records_a_setting_xla_refuses():
    """A flag this jaxlib does not know makes XLA abort: recorded, not raised."""
    from benchmarks import xla_cpu_paths

    config = dict(model="bert-tiny", batch=2, flags="--xla_cpu_no_such_flag=true")
    result = xla_cpu_paths.run_one(config, timeout=120)
    assert [(r["framework"], r["variant"]) for r in result["records"]] == [
        ("jaxamp", "fp32"),
        ("jaxamp", "bf16"),
        ("torch", "bf16"),
    ]
    for r in result["records"]:
        assert "Unknown flag" in r["error"] and "--xla_cpu_no_such_flag" in r["error"]
        assert r["xla_flags"] == "--xla_cpu_no_such_flag=true"


def test_xla_cpu_paths_compares_each_setting_with_the_default_path(tmp_path, monkeypatch):
    """The parent's side, with the subprocesses replaced: the default path runs first, each
    setting's loss and gradients are compared with its, a failed setting keeps its rows."""
    import numpy as np

    from benchmarks import xla_cpu_paths

    grads = {"grad/dense/kernel": np.array([1.0, -2.0]), "grad/key/bias": np.array([1e-9])}
    noise = {"": 0.0, "--a=1": 1e-3}
    seen = []

    def fake_run_one(config, timeout):
        seen.append(config["flags"])
        if config["flags"] == "--bad=1":
            return xla_cpu_paths.failed(config, "exit 1: Unknown flag")
        records = []
        for variant in xla_cpu_paths.VARIANTS:
            shift = noise[config["flags"]] + (0.01 if variant == "bf16" else 0.0)
            arrays = {k: v * (1 + shift) for k, v in grads.items()}
            np.savez(f"{config['numerics_dir']}/{variant}.npz", loss=np.float32(2.0), **arrays)
            record = xla_cpu_paths._base(config, "jaxamp", variant)
            record.update(step_time_median_s=0.2, step_time_min_s=0.1, step_time_max_s=0.3)
            record.update(xla_cpu_paths.hlo_paths(""))
            records.append(record)
        records.append(dict(xla_cpu_paths._base(config, "torch", "bf16"), error="not run"))
        return {"environment": {"cpu_model": "test", "jax": "0"}, "records": records}

    monkeypatch.setattr(xla_cpu_paths, "run_one", fake_run_one)
    argv = ["--models", "bert-tiny:2", "--flags=--a=1", "--flags=--bad=1", "--out", str(tmp_path)]
    records = xla_cpu_paths.main(argv)
    assert seen == ["", "--a=1", "--bad=1"]  # the default path first, added when not given
    rows = {(r["xla_flags"], r["framework"], r["variant"]): r for r in records}
    assert len(rows) == len(records) == 9
    assert rows[("", "jaxamp", "fp32")]["grad_max_rel_err"] == 0.0
    assert rows[("", "jaxamp", "bf16")]["loss_rel_err"] == 0.0
    assert rows[("", "jaxamp", "bf16")]["grad_rel_err_vs_default_fp32"] > 0
    other = rows[("--a=1", "jaxamp", "fp32")]
    assert other["grad_rel_err_global"] == pytest.approx(1e-3)
    assert other["grad_max_rel_err"] == pytest.approx(1e-3)
    assert other["grad_worst_leaf"] in ("dense/kernel", "key/bias")
    assert all(r["error"] for r in records if r["xla_flags"] == "--bad=1")
    saved = json.loads((tmp_path / "xla_cpu_paths.json").read_text())
    assert len(saved["records"]) == 9 and saved["environment"]["cpu_model"] == "test"
    table = (tmp_path / "xla_cpu_paths.md").read_text()
    assert "| bert-tiny | (default) | jaxamp fp32 |" in table and "`--bad=1`" in table


@pytest.mark.slow  # two fresh JAX processes at tiny size: about 2 minutes on 2 busy cores
def test_xla_cpu_paths_at_tiny_size(tmp_path):
    from benchmarks import xla_cpu_paths

    argv = ["--tiny", "--models", "bert-tiny:2", "--warmup", "1", "--repeats", "2"]
    argv += ["--flags", "", "--flags=--xla_cpu_use_onednn=true", "--out", str(tmp_path)]
    records = xla_cpu_paths.main(argv)
    keys = {(r["xla_flags"], r["model"], r["framework"], r["variant"]) for r in records}
    assert keys == {
        (flags, "bert-tiny", framework, variant)
        for flags in ("", "--xla_cpu_use_onednn=true")
        for framework, variant in (("jaxamp", "fp32"), ("jaxamp", "bf16"), ("torch", "bf16"))
    }
    for r in records:
        if r["framework"] == "torch" and r["error"]:
            continue  # PyTorch is optional: its row says why it is missing
        assert r["error"] is None, r
        assert r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"]
        assert r["timed_steps"] == 2 and r["compile_s"] > 0
        if r["framework"] != "jaxamp":
            continue
        errors = [r[k] for k in ("loss_rel_err", "grad_max_rel_err", "grad_rel_err_global")]
        assert all(math.isfinite(e) for e in errors)
        assert math.isfinite(r["grad_rel_err_vs_default_fp32"])
        if r["xla_flags"] == "":
            assert errors == [0.0, 0.0, 0.0]
        dots = [r[f"dots_{k}"] for k in ("xla", *xla_cpu_paths.LIBRARIES)]
        assert sum(dots) > 0 and all(isinstance(d, int) for d in dots)
        bf16_dots = sum(r[f"bf16_dots_{k}"] for k in ("xla", *xla_cpu_paths.LIBRARIES))
        assert (bf16_dots > 0) == (r["variant"] == "bf16"), r
    saved = json.loads((tmp_path / "xla_cpu_paths.json").read_text())
    assert saved["environment"]["cpu_model"] and "cpu_bf16_flags" in saved["environment"]
    assert "| bert-tiny |" in (tmp_path / "xla_cpu_paths.md").read_text()


def test_the_seeds_verdict_reads_the_mean_over_seeds():
    from benchmarks import fp8_training_seeds as seeds

    def result(accuracies, nonfinite=0):
        runs = [
            {
                "variant": v,
                "held_out_accuracy": a,
                "nonfinite_steps": nonfinite if v == "nvfp4" else 0,
            }
            for v, a in accuracies.items()
        ]
        return {"models": [{"runs": runs}]}

    # nvfp4 misses by 2 points on one seed and is 1 point ahead on the other: mean -0.5
    per_seed = {
        3: result({"bf16": 0.96, "nvfp4": 0.94, "mxfp8": 0.90}),
        4: result({"bf16": 0.95, "nvfp4": 0.96, "mxfp8": 0.92}),
    }
    rows = {r["variant"]: r for r in seeds.aggregate(per_seed)}
    assert rows["nvfp4"]["mean_accuracy"] == pytest.approx(0.95)
    assert rows["nvfp4"]["gap_to_bf16_points"] == pytest.approx(-0.5)
    assert rows["nvfp4"]["follows_bf16"] and not rows["mxfp8"]["follows_bf16"]
    assert "follows_bf16" not in rows["bf16"]
    per_seed[4] = result({"bf16": 0.95, "nvfp4": 0.96, "mxfp8": 0.92}, nonfinite=1)
    assert not {r["variant"]: r for r in seeds.aggregate(per_seed)}["nvfp4"]["follows_bf16"]


def test_the_seeds_run_writes_its_table_from_each_seeds_run(tmp_path, monkeypatch):
    """The command's plumbing, each seed's training replaced by a stub (the training code
    path is tested above): a run per seed, with its seed and steps, and the table."""
    from benchmarks import fp8_training
    from benchmarks import fp8_training_seeds as seeds

    calls = []

    def one_seed(argv):
        calls.append(argv)
        seed = int(argv[argv.index("--seed") + 1])
        runs = [
            {"variant": v, "held_out_accuracy": 0.9 + 0.01 * seed, "nonfinite_steps": 0}
            for v in ("bf16", "nvfp4")
        ]
        env = {"cpu_model": "a CPU", "cpu_flags": {"avx2": True, "avx512_bf16": False}}
        return {"environment": {**env, "jax": "0"}, "models": [{"runs": runs}]}

    monkeypatch.setattr(fp8_training, "main", one_seed)
    argv = ["--seeds", "0,1", "--variants", "bf16,nvfp4", "--steps", "2", "--tag", "t"]
    result = seeds.main([*argv, "--out", str(tmp_path)])
    assert [c[c.index("--seed") + 1] for c in calls] == ["0", "1"]
    assert all(c[c.index("--steps") + 1] == "2" and "digits" in c for c in calls)
    (nvfp4,) = [r for r in result["rows"] if r["variant"] == "nvfp4"]
    assert nvfp4["accuracies"] == [0.9, 0.91] and nvfp4["follows_bf16"]
    md = (tmp_path / "fp8_training_seeds_t.md").read_text()
    assert "fixed before" in md and "0.9000 0.9100" in md and "not avx512_bf16" in md
    for bad in (["--seeds", "3"], ["--seeds", "a,b"], ["--variants", "nvfp4"]):
        with pytest.raises(SystemExit):
            seeds.main(bad)
