#!/usr/bin/env bash
# The GPU checks the open issues wait for, in one call of about 10 minutes.
#
#   bash benchmarks/gpu_checks.sh OUTDIR            # run them; log in OUTDIR/checks.txt
#   bash benchmarks/gpu_checks.sh --dry-run OUTDIR  # print the steps only
#
# Each step has its own time limit, and a step that fails or times out does not stop the
# others. Every log ends with the step's exit status. The checks (what the H200 runs of
# 2026-11-27 left open; benchmarks/RESULTS.md, top). Settled there and not repeated: the
# exact MLP and CNN runs' checkpoints (GPU = CPU, bit for bit) and the sparsifiers' GPU
# selection schedule (2.0-3.3x the CPU schedule on one bucket).
#   compression_buckets  issue 14: encode+decode on the engine's fused 25 MB buckets against
#                  the copy row (GPU goal: >= 0.5x): the sparsifiers (below the goal), each
#                  also on the "radix" selection schedule, and the compressors not measured
#                  bucketed yet
#   compression_nocb  issue 14: top-k and DGC again with XLA:GPU's command buffers off, traced
#                  (their wall time was 2-3x their device time, 5-6x under the profiler)
#   torch_quantize issue 17: the bridge against QPyTorch on CUDA (needs qtorch installed), each
#                  jaxlp row also timed through JITFunction.run, OptimLP next to the plain
#                  SGD step it wraps
#   torch_cuda     issue 17: the CUDA tests of the bridge and its DDP hooks, direct launches on
#                  (they passed on the H200, 2026-11-27, after the launcher fix; not the
#                  all-formats spec check: it compiles every kernel variant, and passed on 4M
#                  patterns on the H100, 2026-11-26)
#   block_gpu_bits issue 18: the exact GEMM's GPU implementations (the kernel, GPU_IMPL="auto",
#                  "xla_int8") give the CPU reference's bits, before they are timed
#   layers         issue 18: the exact ResNet-18 step against fp32, traced with command
#                  buffers off (the step's most expensive kernels and source lines), with
#                  the library's GEMM implementation and with GPU_IMPL="auto"
#   train_exact_gpu  issue 18, item 5: the exact MLP run's GPU half, its folder kept in OUTDIR
#                  (compare it with a CPU run here: exact_train_check.py --compare)
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

status=0  # the exit status of the last step run
step() {
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit} s): $*"
  if [ "$dry" = 1 ]; then
    return
  fi
  # one log for every step (a device call brings back at most 8 files), written as it runs
  echo "== $name (limit ${limit} s): $*" >> "$out/checks.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$out/checks.txt" > "/tmp/gpu_checks_$name.txt"
  status=${PIPESTATUS[0]}
  echo "exit status $status" | tee -a "$out/checks.txt" >> "/tmp/gpu_checks_$name.txt"
  tail -n 30 "/tmp/gpu_checks_$name.txt"
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
      >> "$out/device.txt" 2>&1 &)
  fi
fi
# the engine's fused 25 MB buckets (reduce_gradients(bucket_mb=25)), the GPU configuration:
# the sparsifiers again (the GPU schedule gave topk1% 0.44x and dgc1% 0.31x of the copy on
# the H200, 2026-11-27; goal 0.5x), each next to the same selection on the "radix" schedule
# (no conditional; not measured on a GPU yet), then the compressors not measured bucketed yet
step compression_buckets 100 "$py" benchmarks/compression.py --model resnet18 --repeats 3 \
  --bucket-mb 25 --only 'topk1%,topk1%_radix,dgc1%,dgc1%_radix,randomk1%,graddrop99%,powersgd2,terngrad_hp2,terngrad,tbq,bf16'
# the sparsifiers' wall time was 2-3x their device time (5-6x under the profiler): the same
# rows with XLA:GPU's command buffers off, traced (what the CUDA graphs and conditionals cost)
step compression_nocb 50 "$py" benchmarks/compression.py --model resnet18 --repeats 3 \
  --bucket-mb 25 --only 'topk1%,topk1%_radix,dgc1%' --trace-top 8 --no-command-buffers
# torch and JAX share the GPU from here on: JAX takes memory as it needs it, not 75% up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
step torch_quantize 75 "$py" benchmarks/torch_quantize.py --device cuda
step torch_cuda 80 "$py" -m pytest -q -p no:cacheprovider tests/torch/test_torch_cuda.py \
  tests/torch/test_torch_ddp.py -k 'cuda and not match_the_spec'
# the exact GEMM's GPU implementations against the CPU reference, bit for bit: the kernel, the
# new GPU_IMPL="auto" (few-tile GEMMs as batched XLA int8 dots, the Pallas operand
# preparation for the others) and "xla_int8" alone; before the layers step times them
step block_gpu_bits 60 "$py" -m pytest -q -p no:cacheprovider tests/ops/test_block_dot_gpu.py
# the exact ResNet-18 step (60.4 ms against fp32's 19.5 on the H200) traced as one 52 ms
# command buffer: with command buffers off, where its time goes; each exact GEMM by the
# kernel ("pallas", the default), then with the few-tile GEMMs (the weight gradients: 1-9
# output tiles over 128 K-blocks) as batched XLA int8 dots ("auto", not measured yet)
step layers 150 "$py" benchmarks/layers.py --models resnet18 --steps 5 \
  --policies fp32,hbfp8_exact --gpu-impl pallas,auto --trace-top 15 --no-command-buffers
# the exact MLP run's GPU half (same bits as the CPU on the H200, 2026-11-27); its folder comes
# back in OUTDIR: compare it here with
#   python -m jaxlp train --hbfp 8 --exact-blocks --epochs 2 --out /tmp/cpu_run   # the CPU
#   python benchmarks/exact_train_check.py --compare OUTDIR/exact_mlp /tmp/cpu_run
# (the CPU half on the device host ran past its limits: jax 0.11's CPU backend compiled the
# exact step for > 10 minutes, fixed the same day; jaxlp.training._portable.materialize)
step train_exact_gpu 45 "$py" -m jaxlp train --hbfp 8 --exact-blocks --epochs 2 \
  --out "$out/exact_mlp"
