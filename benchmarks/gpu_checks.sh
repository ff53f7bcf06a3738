#!/usr/bin/env bash
# The GPU checks the open issues wait for, in one call of about 10 minutes.
#
#   bash benchmarks/gpu_checks.sh OUTDIR            # run them; log in OUTDIR/checks.txt
#   bash benchmarks/gpu_checks.sh --dry-run OUTDIR  # print the steps only
#
# Each step has its own time limit, and a step that fails or times out does not stop the
# others. Every log ends with the step's exit status. The checks (what the H200 runs of
# 2026-11-27 left open; benchmarks/RESULTS.md, goals table). Settled there and not repeated: the
# compressors' bucketed rows and the "radix" selection schedule (not adopted), the torch
# bridge's speed table, and gpu_impl="auto" against "pallas" (auto adopted: 37.8 against
# 53.2 ms per exact ResNet-18 step, same bits).
#   block_gpu_bits issue 18: the exact GEMM's GPU implementations (the kernel, gpu_impl="auto",
#                  now the default, "xla_int8") give the CPU reference's bits
#   train_exact_gpu  issue 18, item 5: the exact MLP run's GPU half with the default "auto"
#                  (its small GEMMs are now batched int8 dots), its folder kept in OUTDIR
#                  (compare it with a CPU run here: tools/exact_train_check.py --compare)
#   layers         issue 18: the exact ResNet-18 step (default "auto") against fp32, traced
#                  with command buffers off: where its 37.8 ms go now (its compile took 131 s)
#   census         issue 18: each exact GEMM shape of that step timed alone with its count per
#                  step (63 GEMMs), split ones as "xla_int8", the others kernel + preparation,
#                  with each shape's first call (which half makes the compile 131 s)
#   optimlp_profile  issue 17: where OptimLP's 4K step spends its +178 us over the SGD step
#                  it wraps on CUDA (cProfile; goal <= 50 us)
#   torch_ddp_example  issue 17, item 2: examples/torch_mnist_ddp.py --smoke on a GPU host
#   compression_powersgd  issue 14: PowerSGD r2 bucketed as the engine runs it (batched)
#   torch_ddp_cuda issue 17: the bridge's DDP hooks on CUDA buckets (12 of them did not run
#                  within the last call's limit: the step ran them after the bridge's tests)
# Run from the repository root, with jax (CUDA), torch (CUDA), triton, flax and optax
# installed; the repository is put on PYTHONPATH. QPyTorch (for benchmarks/torch_quantize.py's
# comparison, not run here) is installed from wheels in .whl/ when that folder exists (it
# JIT-builds its CUDA kernels with ninja, in the background):
#   pip wheel qtorch==0.3.0 --no-deps -w .whl   # here (.whl/ is git-ignored)
# and name .whl in the device call's carry list. These steps do not need it.
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
# torch and JAX share the GPU: JAX takes memory as it needs it, not 75% up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# the exact GEMM's GPU implementations against the CPU reference, bit for bit: the kernel,
# gpu_impl="auto" (the default since 2026-11-27) and "xla_int8" alone
step block_gpu_bits 60 "$py" -m pytest -q -p no:cacheprovider tests/ops/test_block_dot_gpu.py
# the exact MLP run's GPU half (same bits as the CPU with "pallas" on the H200, 2026-11-27;
# now "auto"); its folder comes back in OUTDIR: compare it here with
#   python -m jaxlp train --hbfp 8 --exact-blocks --epochs 2 --out /tmp/cpu_run   # the CPU
#   python benchmarks/tools/exact_train_check.py --compare OUTDIR/exact_mlp /tmp/cpu_run
step train_exact_gpu 45 "$py" -m jaxlp train --hbfp 8 --exact-blocks --epochs 2 \
  --out "$out/exact_mlp"
# the exact ResNet-18 step with the default "auto" (37.8 ms against fp32's 18.5-19.5 on the
# H200; compile 131 s), traced with command buffers off: its most expensive kernels and lines
step layers 185 "$py" benchmarks/layers.py --models resnet18 --steps 5 \
  --policies fp32,hbfp8_exact --trace-top 15 --no-command-buffers
# the step's exact GEMMs one shape at a time, with their counts per step (63 GEMMs, 489.7
# GFLOP) and each one's first call (what it adds to the compile): the 16 largest, each by
# "auto"'s pick (xla_int8 or kernel + Pallas preparation)
step census 100 "$py" benchmarks/layers.py --models resnet18 --policies hbfp8_exact \
  --gemm-census --census-top 16
# OptimLP's 4K step: +178 us (nearest) and +202 us (stochastic) over the plain SGD step on
# the H200 (2026-11-27; goal <= 50 us): where the host time goes
step optimlp_profile 40 "$py" benchmarks/torch_quantize.py --device cuda --small \
  --only "OptimLP step,quantizer" --profile
# the DDP example on a GPU host (CPU processes, gloo; one GPU cannot give NCCL two ranks):
# PyTorch's PowerSGD hook synchronizes CUDA on CPU buckets where a GPU exists (fixed in the
# example, tested with a simulated GPU host; not yet run on one)
step torch_ddp_example 45 "$py" examples/torch_mnist_ddp.py --smoke
# PowerSGD r2 as the engine runs it with bucket_mb (batched=True: one square matrix per
# bucket) next to the per-leaf row that reached 0.17x of the copy (62 leaves: launch-bound)
step compression_powersgd 35 "$py" benchmarks/compressors.py --model resnet18 --repeats 3 \
  --bucket-mb 25 --only powersgd2,powersgd2_batched
# the DDP hooks on CUDA buckets (12 of 22 did not run within the last call's 80 s)
step torch_ddp_cuda 80 "$py" -m pytest -q -p no:cacheprovider tests/torch_bridge/test_torch_ddp.py \
  -k cuda
