#!/usr/bin/env bash
# The GPU checks the open issues wait for, in one call of about 10 minutes.
#
#   bash benchmarks/gpu_checks.sh OUTDIR            # run them; logs in OUTDIR/<step>.txt
#   bash benchmarks/gpu_checks.sh --dry-run OUTDIR  # print the steps only
#
# Each step has its own time limit, and a step that fails or times out does not stop the
# others. Every log ends with the step's exit status. The checks:
#   block_gemm     issue 18: the exact kernel's routes (int8, and bf16 with its bit check
#                  against the reference) and the fp8 kernel at 8192^3
#   layers         issue 18: ResNet-18 steps with the exact and fp8 modes, bf16 route and
#                  fp8 kernel selected (their GEMM bits are checked by block_gemm)
#   torch_tests    issue 17: the CUDA tests, including DDP hooks on CUDA buckets
#   torch_quantize issue 17: the bridge against QPyTorch on CUDA (needs qtorch installed)
#   compression    issue 14: encode+decode against the copy row (GPU goal: >= 0.5x)
# Run from the repository root, with jax (CUDA), torch (CUDA), triton, flax and optax
# installed; the repository is put on PYTHONPATH. QPyTorch (for torch_quantize) is installed
# from wheels in .whl/ when that folder exists (it JIT-builds its CUDA kernels with ninja):
#   pip wheel qtorch==0.3.0 --no-deps -w .whl   # here, with .whl/ in .git/info/exclude
# and name .whl in the device call's carry list.
set -u
dry=0
if [ "${1:-}" = "--dry-run" ]; then
  dry=1
  shift
fi
out=${1:-gpu_checks_out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=cuda,cpu
export PYTHONUNBUFFERED=1  # a step stopped at its limit keeps the rows it printed
py=${PYTHON:-python3}      # the device image's python3 holds torch and jax; it may have no 'python'

step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  if [ "$dry" = 1 ]; then
    return
  fi
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "exit status $?" >> "$out/$name.txt"
  tail -n 30 "$out/$name.txt"
}

if [ "$dry" = 0 ]; then
  mkdir -p "$out"
  if ls .whl/*.whl > /dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/gpu_checks_site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/gpu_checks_site"
  fi
  nvidia-smi -L > "$out/device.txt" 2>&1
  cat "$out/device.txt"
  # QPyTorch JIT-builds its CUDA extension (about a minute of nvcc) at first import: build it
  # now, on a few CPU cores, while the GPU steps run, so torch_quantize only loads it.
  if "$py" -c "import qtorch" > /dev/null 2>&1; then
    (cd /tmp && MAX_JOBS=4 TORCH_CUDA_ARCH_LIST=9.0 timeout 400 "$py" -c \
      "import time; t = time.time(); import qtorch.quant; print(f'qtorch built in {time.time() - t:.0f} s')" \
      > "$out/qtorch_build.txt" 2>&1 &)
  fi
fi
step block_gemm 150 "$py" benchmarks/block_gemm.py --size 8192 --repeats 3 --skip-layers \
  --skip-conv --tiles 128x64x4 --tiles 64x128x4
step layers 150 "$py" benchmarks/layers.py --models resnet18 --steps 5 --block-route auto \
  --fp8-impl pallas --policies fp32,tf32,hbfp8,hbfp8_exact,mxint8_exact,mxfp8,mxfp8_fp8
# torch and JAX share the GPU from here on: JAX takes memory as it needs it, not 75% up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step torch_tests 110 "$py" -m pytest -q tests/torch/test_torch_cuda.py \
  tests/torch/test_torch_ddp.py -k "cuda"
step torch_quantize 60 "$py" benchmarks/torch_quantize.py --device cuda
# one compressor of each family first (rows print as they finish; a GPU compile of the
# 62-leaf program takes seconds each), then the rest
step compression 110 "$py" benchmarks/compression.py --model resnet18 --repeats 3 \
  --only 'bf16,cgx4,topk1%,powersgd2,onebit,qsgd15,terngrad,dgc1%,tbq,cgx8,randomk1%,graddrop99%,terngrad_hp2'
