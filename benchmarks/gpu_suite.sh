#!/usr/bin/env bash
# The GPU benchmark suite, prepared for one NVIDIA H200 (about 8 minutes):
# ResNet50 224x224 batch 256, BERT-base length 128 batch 64, GPT-2 small length 1024
# batch 8; fp32/tf32/bf16/fp16 for jaxamp and PyTorch eager, hand-written Flax bf16,
# torch.compile bf16; utilisation against a measured bf16 matmul rate; largest-batch
# estimates for fp32 and bf16. Writes benchmarks.json/.md/.png into OUT_DIR. Before it:
# the 16-bit matmul forms, rounding on the device, and FP8 (fp8_gemm.json/.md, fp8_hlo/):
# float8 current and delayed scaling and the block-scaled MXFP8 and NVFP4 against bf16 on
# 4096^3 and 8192^3 GEMMs and a Dense stack's training step, and whether the compiled
# programs run float8 GEMMs (cuBLASLt f8) and block-scaled kernels (cuDNN/cuBLASLt).
#
#   benchmarks/gpu_suite.sh OUT_DIR [extra flags for benchmarks.run]
#
# Needs jax[cuda12|cuda13], flax, optax, jmp and torch. Packages missing on the machine
# may be given as wheels in .whl/ (installed with --no-index). At tiny sizes on a CPU:
#   MATMUL_SIZE=64 DENSE_BATCH=64 DENSE_FEATURES=32 FP8_SIZES=64 \
#   benchmarks/gpu_suite.sh /tmp/gpu-test --models resnet-tiny:4 --frameworks jaxamp \
#       --warmup 1 --repeats 2 --memory-limit-gb 1
set -euo pipefail
out=${1:?usage: benchmarks/gpu_suite.sh OUT_DIR [flags]}
shift
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/jaxamp-site .whl/*.whl
  export PYTHONPATH="/tmp/jaxamp-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
# JAX and PyTorch share the GPU in one process: JAX takes half, not its default 75%.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.45}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv" 2>/dev/null || true
# The largest-batch estimate is for the whole device, not JAX's share of it.
limit=$(python3 -c "import jax; s = jax.devices()[0].memory_stats() or {}; print(round(s.get('bytes_limit', 0) / ${XLA_PYTHON_CLIENT_MEM_FRACTION} / 2**30, 1))")
extra=()
if [ "$limit" != "0.0" ]; then extra=(--memory-limit-gb "$limit"); fi
# The 16-bit matmul forms first (about a minute): which runs fastest here, and the compiled
# HLO of each (cuBLAS/cuDNN calls and their dtypes), to decide the GPU form from.
python3 -m benchmarks.matmul_forms --size "${MATMUL_SIZE:-8192}" --batch "${DENSE_BATCH:-16384}" \
  --features "${DENSE_FEATURES:-4096}" --warmup 5 --repeats 20 --out "$out" \
  --hlo-out "$out/matmul_hlo" 2>&1 | tee "$out/matmul_forms.log"
# FP8, MXFP8, NVFP4 (about two minutes): does XLA run float8 GEMMs here (the compiled HLO
# of each program, grepped for f8e4m3fn GEMMs, __cublas$lt$matmul$f8 calls and block-scaled
# custom calls), and how fast against bf16, alone and in a training step; a failure is
# reported, not fatal.
python3 -m benchmarks.fp8_gemm --sizes "${FP8_SIZES:-4096,8192}" \
  --dense-batch "${DENSE_BATCH:-16384}" --dense-features "${DENSE_FEATURES:-4096}" \
  --warmup 5 --repeats 20 --out "$out" --hlo-out "$out/fp8_hlo" 2>&1 | tee "$out/fp8_gemm.log" || true
# Kahan's compensation and stochastic rounding's bias under the GPU compiler, which may
# fold a convert pair (xla_allow_excess_precision): seconds; a failure is reported, not fatal.
python3 -m benchmarks.rounding_on_device --out "$out" 2>&1 | tee "$out/rounding_on_device.log" || true
python3 -m benchmarks.run --suite gpu --out "$out" "${extra[@]}" "$@" 2>&1 | tee "$out/log.txt"
