"""Training-step time of quantized layers: fp32 / TF32 vs HBFP8, MXFP8, MXINT8, float E4M3.

Models: ResNet-18 (CIFAR shape 32x32x3, batch 128, width 64) and an MLP (784-512-512-10,
batch 128), every Dense/Conv quantized with ``jaxlp.flax.quantize_model``; one jitted SGD step
(forward, backward, update); median wall time over ``--steps`` steps after a warm-up (compile)
step, all policies in the same run. ``--small`` shrinks the models for CI.

Usage: python benchmarks/layers.py [--small] [--models resnet18,mlp] [--policies a,b] [--steps N]
       [--block-route int8|auto] [--fp8-impl xla|pallas] [--gpu-impl pallas,auto]
       [--gemm-census] [--json F] [--trace-top N]

``--policies`` takes the names of :data:`POLICIES` (the exact and fp8 block modes,
``hbfp8_exact`` (per-sample activations, 7-bit tiled weights), ``hbfp8_tiled_exact``,
``mxint8_exact``, ``mxfp8_fp8``, are not in the default set: slow on CPU).
``--block-route int8|auto`` picks the GPU route of the exact mode's Pallas kernel
(``jaxlp/pallas/_block_gemm.py``; ``DotPolicy.gpu_route``, default "auto"); the CPU runs the
reference either way. ``--fp8-impl xla|pallas`` picks the GPU GEMM of ``mxfp8_fp8`` (the
batched XLA fp8 dot, or the Pallas kernel that sums the K-blocks itself;
``DotPolicy.fp8_gpu_impl``, default "pallas"). ``--gpu-impl pallas,auto`` times each exact
policy with each GPU
implementation of its GEMMs in the same run (rows ``policy [impl]``; "auto": GEMMs with few
output tiles as one batched XLA int8 dot, ``jaxlp.ops._block_dot.splits_k_blocks``, the others
by the kernel with its operand preparation as a Pallas kernel); the CPU runs the reference
either way.

``--trace-top N`` also runs ``--steps`` more steps of each policy under ``jax.profiler`` and
prints where the step's device time goes: its N most expensive XLA operations (kernels on a
GPU, thunks on the CPU, whose times are thread time), and the same time summed per source
line (the innermost jaxlp frame of each operation, from the compiled HLO's stack frames),
in ms per step. On a device, kernels the HLO does not name (library kernels) are listed by
their own names, with source "-".

``--no-command-buffers`` switches XLA:GPU's command buffers (CUDA graphs) off first: with them
a trace can show a whole step as one ``command_buffer_N`` op; the times are then not the
default configuration's (the header says so).

``--gemm-census`` lists, for every model and every exact-mode policy (``block_dot="exact"``)
in ``--policies``, the exact GEMMs of one training step (forward and both gradients), found by
tracing the step without running it: shape, K-block, count and GFLOP. On a GPU each distinct
GEMM is also timed alone (``block_dot`` on random block-format operands of that shape,
median of ``--steps``), with the time of its jnp operand preparation alone (what the
kernel's call computes before its ``pallas_call``s), next to the plain float32 dot of the
same shape at JAX's default precision, and the seconds of its first call (its compile: what
the step's compile pays for that shape, about); the sums say how much of the step the exact
GEMMs take. Elsewhere the times read "not measured" (the CPU runs the jnp reference), except with
``--small`` (the CI smoke run; its operand preparation is the GPU's, timed on the CPU).
"""

from __future__ import annotations

import os as _os
import sys as _sys

# Keep this script's folder off sys.path, so that no script name can shadow a module that a
# dependency imports (jax tries `compression.zstd`, for one).
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

import argparse
import collections
import dataclasses
import functools
import importlib.util
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxlp.flax as jf
from jaxlp.flax.models import MLP, ResNet18
from jaxlp.formats import E4M3, E4M3FN, E5M2
from jaxlp.ops import _block_dot
from jaxlp.ops._policy import DotPolicy, float_policy, hbfp_policy, mx_policy

#: name -> (policy, matmul precision of the step's GEMMs, None: JAX's default).
#: "fp32" is float32 arithmetic (``precision="highest"``); "tf32" the same model with TF32
#: tensor-core matmuls (GPU; on CPU it equals fp32). The quantized policies run their GEMMs
#: at JAX's default precision: TF32 on a GPU. That is exact in the products where every
#: operand is quantized to <= 11 significant bits; "hbfp8" (HBFPEmulator v1.0: per-sample
#: activations, weights used as given) leaves the weights in float32, which TF32 rounds
#: in its dX GEMM and forward. "hbfp8_w7" quantizes the weights too (7-bit tiles, the
#: operands of "hbfp8_exact"), so TF32 computes its products exactly; "hbfp8_w7_bf16" runs
#: the same GEMMs as bf16 MMAs with float32 accumulation (``BF16_BF16_F32``: 8-bit
#: significands are exact in bfloat16), twice TF32's tensor-core rate.
POLICIES = {
    "fp32": (DotPolicy(), "highest"),
    "tf32": (DotPolicy(), "tensorfloat32"),
    "hbfp8": (hbfp_policy(7, 24), None),
    "hbfp8_w7": (hbfp_policy(7, 24, weight_man_bits=7), None),
    "hbfp8_w7_bf16": (hbfp_policy(7, 24, weight_man_bits=7), "BF16_BF16_F32"),
    "hbfp8_tiled": (hbfp_policy(7, 24, "tiled"), None),
    "hbfp8_exact": (hbfp_policy(7, 24, weight_man_bits=7, block_dot="exact"), None),
    "hbfp8_tiled_exact": (hbfp_policy(7, 24, "tiled", block_dot="exact"), None),
    "mxint8_exact": (mx_policy("int8", 32, block_dot="exact"), None),
    "mxfp8": (mx_policy(E4M3FN, 32), None),
    "mxfp8_fp8": (mx_policy(E4M3FN, 32, block_dot="fp8"), None),
    "float_e4m3": (float_policy(E4M3, E5M2), None),
}
DEFAULT_POLICIES = "fp32,tf32,hbfp8,mxfp8,float_e4m3"


def load_sibling(name: str):
  """``benchmarks/<name>.py`` as a module (this folder is kept off ``sys.path``)."""
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}",
                                                _os.path.join(_here, f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def numpy_init(model, x, seed=0):
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)

  def make(path, s):
    name = path[-1].key
    if name == "kernel":
      return jnp.asarray(rng.normal(0, np.sqrt(2 / np.prod(s.shape[:-1])), s.shape), s.dtype)
    return jnp.ones(s.shape, s.dtype) if name in ("scale", "var") else jnp.zeros(s.shape, s.dtype)

  return jax.tree_util.tree_map_with_path(make, shapes)


def make_case(name, small):
  if name == "resnet18":
    batch, model = (8, ResNet18(width=4)) if small else (128, ResNet18(width=64))
    x = jax.random.normal(jax.random.key(0), (batch, 32, 32, 3))
  elif name == "mlp":
    batch, model = (32, MLP((128, 128, 10))) if small else (128, MLP((512, 512, 10)))
    x = jax.random.normal(jax.random.key(0), (batch, 784))
  else:
    raise ValueError(f"unknown model {name!r}")
  return model, x, jnp.arange(batch) % 10


def time_step(model, x, labels, policy, steps, trace_top=0):
  q = jf.quantize_model(model, policy)
  v = numpy_init(model, x)
  params = v["params"]
  stats = v.get("batch_stats")
  tx = optax.sgd(0.01, momentum=0.9)
  opt = tx.init(params)
  has_bn = stats is not None

  @jax.jit
  def step(params, stats, opt, x, labels):  # data as arguments: no constant folding
    def loss_fn(p):
      if has_bn:
        logits, upd = q.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        upd = upd["batch_stats"]
      else:
        logits, upd = q.apply({"params": p}, x), stats
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), upd

    (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), upd, opt, loss

  t0 = time.perf_counter()
  hlo = None
  if trace_top:  # one compile, whose optimized HLO names the traced ops
    step = step.lower(params, stats, opt, x, labels).compile()
    hlo = step.as_text()
  state = jax.block_until_ready(step(params, stats, opt, x, labels))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state = jax.block_until_ready(step(*state[:3], x, labels))
    times.append(time.perf_counter() - t0)
  if trace_top:
    def run():
      st = state
      for _ in range(steps):
        st = jax.block_until_ready(step(*st[:3], x, labels))

    T = load_sibling("_trace")
    T.report(run, hlo, steps, trace_top)
  return statistics.median(times), compile_s, float(state[3])


def exact_gemms(model, x, labels, policy):
  """Every exact block GEMM one training step makes: a list of ``(M, K, N, g, bits_a,
  bits_b)``, one per call, found by tracing the step's gradient (nothing runs)."""
  q = jf.quantize_model(model, policy)
  v = numpy_init(model, x)
  stats = v.get("batch_stats")
  calls = []
  # recorded in Python before the jitted dispatch: inside it, a GEMM with the shapes of an
  # earlier one reuses that trace and would go unrecorded (jax 0.11.2 counted 8 of the small
  # MLP's 9 GEMMs that way)
  inner = _block_dot._dispatch

  def record(a, b, g, bits_a, bits_b, *impl):
    calls.append((a.shape[0], a.shape[1], b.shape[1], g, bits_a, bits_b))
    return inner(a, b, g, bits_a, bits_b, *impl)

  def loss_fn(p):
    if stats is None:
      logits = q.apply({"params": p}, x)
    else:
      logits, _ = q.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  jax.clear_caches()  # a cached trace of a layer would skip the recording
  _block_dot._dispatch = record
  try:
    jax.eval_shape(jax.grad(loss_fn), v["params"])
  finally:
    _block_dot._dispatch = inner
    jax.clear_caches()
  return calls


def _kernel_operands(a, b, g, ba, bb, policy):
  """The jnp work the exact GEMM kernel's call does before its ``pallas_call``s, with the
  policy's GPU route and the default tiles (``jaxlp/pallas/_block_gemm.py``)."""
  from jaxlp.pallas import _block_gemm  # noqa: PLC0415

  bf16 = policy.gpu_route == "auto" and _block_gemm.bf16_route_ok(g, ba, bb)
  bm, bn = _block_gemm._tiles(a.shape[0], b.shape[1], None, None, bf16)
  prep = "pallas" if policy.gpu_impl == "auto" else None  # what block_dot_gpu_auto takes
  # off a GPU (the --small smoke run) the Pallas preparation runs in the interpreter
  return _block_gemm.kernel_operands(a, b, g, ba, bb, bm, bn, bf16, prep,
                                     interpret=jax.default_backend() != "gpu")


def _median_ms(f, args, steps, first=None):
  """Median ms of ``steps`` calls of ``f`` after a first call (the compile); ``first``: a list
  that gets that first call's seconds."""
  t0 = time.perf_counter()
  jax.block_until_ready(f(*args))  # compile
  if first is not None:
    first.append(time.perf_counter() - t0)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
  return 1e3 * statistics.median(times)


def gemm_census(mname, model, x, labels, pname, policy, steps, timed, top=0):
  """Print the exact GEMMs of one step of ``model`` under ``policy`` (module docstring),
  each timed alone where ``timed`` (only the ``top`` largest by FLOP where ``top`` > 0)."""
  counts = collections.Counter(exact_gemms(model, x, labels, policy))
  print(f"\n### exact GEMMs of one {mname} step (batch {x.shape[0]}), {pname}\n")
  print("| M | K | N | K-block | K-blocks | bits | calls | GFLOP | exact ms | of which operand "
        "prep ms | f32 dot ms | exact TFLOP/s | exact first call s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  tot_fl = tot_ex = tot_f32 = tot_prep = timed_fl = tot_first = 0.0
  key = jax.random.key(0)
  for i, ((M, K, N, g, ba, bb), c) in enumerate(sorted(
      counts.items(), key=lambda kv: -kv[0][0] * kv[0][1] * kv[0][2] * kv[1])):
    fl = 2.0 * M * K * N * c
    tot_fl += fl
    ex = f32 = prep = first_s = "not measured"
    tf = "-"
    if timed and (top <= 0 or i < top):
      timed_fl += fl
      # integers below 2**7 lie on every block grid of 7-bit significands
      ka, kb = jax.random.split(jax.random.fold_in(key, (M * K * N + g) % 2**32))
      a = jax.random.randint(ka, (M, K), -127, 128).astype(jnp.float32)
      b = jax.random.randint(kb, (K, N), -127, 128).astype(jnp.float32)
      first = []  # the first call: its compile (what a step's compile pays per shape)
      t_ex = _median_ms(jax.jit(lambda a, b, g=g, ba=ba, bb=bb: _block_dot.block_dot(
          a, b, g, ba, bb, gpu_impl=policy.gpu_impl, gpu_route=policy.gpu_route)), (a, b),
          steps, first)
      tot_first += first[0]
      first_s = f"{first[0]:.2f}"
      split = policy.gpu_impl == "auto" and _block_dot.splits_k_blocks(M, N, K, g)
      # a GEMM that "auto" runs as a batched XLA int8 dot has no kernel operands to prepare
      t_prep = 0.0 if split else _median_ms(
          jax.jit(functools.partial(_kernel_operands, g=g, ba=ba, bb=bb, policy=policy)),
          (a, b), steps)
      t_f32 = _median_ms(jax.jit(jnp.dot), (a, b), steps)
      tot_ex += c * t_ex
      tot_prep += c * t_prep
      tot_f32 += c * t_f32
      ex, prep, f32 = f"{t_ex:.3f}", "- (xla_int8)" if split else f"{t_prep:.3f}", f"{t_f32:.3f}"
      tf = f"{fl / c / t_ex / 1e9:.1f}"
    print(f"| {M} | {K} | {N} | {g} | {-(-K // g)} | {ba}/{bb} | {c} | {fl / 1e9:.2f} | {ex} | "
          f"{prep} | {f32} | {tf} | {first_s} |", flush=True)
  sums = (f"{tot_ex:.1f} ms exact (operand prep {tot_prep:.1f} ms), {tot_f32:.1f} ms f32 dot"
          f" for the {timed_fl / 1e9:.1f} GFLOP timed; first calls (compiles) of the exact "
          f"GEMMs {tot_first:.1f} s" if timed
          else "times not measured (no GPU; --small times them)")
  print(f"\n{sum(counts.values())} exact GEMMs, {tot_fl / 1e9:.1f} GFLOP per step; {sums}")
  return dict(model=mname, policy=pname, gemms=sum(counts.values()), gflop=tot_fl / 1e9,
              exact_ms=tot_ex if timed else None, prep_ms=tot_prep if timed else None,
              first_call_s=tot_first if timed else None,
              f32_ms=tot_f32 if timed else None)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="tiny models for CI")
  ap.add_argument("--models", default="resnet18,mlp")
  ap.add_argument("--policies", default=DEFAULT_POLICIES,
                  help=f"comma-separated, from {', '.join(POLICIES)}")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--block-route", choices=("int8", "auto"), default=None,
                  help="GPU route of the exact block GEMM kernel (default: the policy's, auto)")
  ap.add_argument("--gpu-impl", default=None,
                  help="comma-separated GPU implementations of the exact block GEMM, each "
                  "exact policy timed with each: pallas (the kernel everywhere), auto (few-tile "
                  "GEMMs as one batched XLA int8 dot, the others by the kernel with its Pallas "
                  "operand preparation; jaxlp.ops._block_dot.SPLIT_TILES); default: the "
                  "policy's gpu_impl, auto")
  ap.add_argument("--fp8-impl", choices=("xla", "pallas"), default=None,
                  help="GPU GEMM of the fp8 mode with MX scales (default: the policy's, pallas)")
  ap.add_argument("--gemm-census", action="store_true",
                  help="list (and on a GPU time) the exact GEMMs of one step of each exact "
                       "policy instead of timing the steps")
  ap.add_argument("--census-top", type=int, default=0,
                  help="--gemm-census: time only the N largest GEMMs by FLOP (0: all)")
  ap.add_argument("--json", default=None, help="write the results to this file")
  ap.add_argument("--trace-top", type=int, default=0,
                  help="also trace --steps more steps of each policy and print its N most "
                       "expensive XLA ops and source lines (0: no trace)")
  ap.add_argument("--no-command-buffers", action="store_true",
                  help="switch XLA:GPU's command buffers (CUDA graphs) off, so that a trace "
                       "names each kernel (not the default configuration's times)")
  args = ap.parse_args(argv)
  if args.trace_top < 0:
    ap.error(f"--trace-top must be >= 0, got {args.trace_top}")
  if args.no_command_buffers:
    load_sibling("_trace").command_buffers_off()
  steps = args.steps or (3 if args.small else 5)
  # the GPU implementation flags become fields of each timed policy (DotPolicy.gpu_route,
  # fp8_gpu_impl, gpu_impl)
  overrides = {}
  if args.block_route is not None:
    overrides["gpu_route"] = args.block_route
  if args.fp8_impl is not None:
    overrides["fp8_gpu_impl"] = args.fp8_impl

  def policy_for(pname, impl):
    kw = dict(overrides, **({} if impl is None else {"gpu_impl": impl}))
    return dataclasses.replace(POLICIES[pname][0], **kw)

  impls = [None] if args.gpu_impl is None else args.gpu_impl.split(",")
  if args.gpu_impl is not None and (any(i not in ("pallas", "auto") for i in impls)
                                    or len(set(impls)) != len(impls)):
    ap.error(f"--gpu-impl {args.gpu_impl!r}: each once, of pallas, auto")
  rows = []
  print(f"# jaxlp layers benchmark: {jax.devices()[0].device_kind} ({jax.default_backend()}), "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}, "
        f"{time.strftime('%Y-%m-%d')}, small={args.small}, steps={steps}"
        + (", XLA:GPU command buffers OFF" if args.no_command_buffers else ""))
  for pname in args.policies.split(","):
    if pname not in POLICIES:
      ap.error(f"--policies: unknown policy {pname!r}; choose from {', '.join(POLICIES)}")
  if args.gemm_census:
    if len(impls) > 1:
      ap.error("--gemm-census: give one --gpu-impl (the census times the library's dispatch)")
    exact = [p for p in args.policies.split(",") if POLICIES[p][0].block_dot == "exact"]
    if not exact:
      ap.error("--gemm-census: --policies names no exact policy (block_dot='exact'); exact "
               f"ones: {', '.join(p for p in POLICIES if POLICIES[p][0].block_dot == 'exact')}")
    for mname in args.models.split(","):
      model, x, labels = make_case(mname, args.small)
      for pname in exact:
        rows.append(gemm_census(mname, model, x, labels, pname, policy_for(pname, impls[0]),
                                steps,
                                jax.default_backend() == "gpu" or args.small,
                                args.census_top))
    if args.json:
      with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    return rows
  print("| model | policy | step ms (median) | compile s | overhead vs fp32 |")
  print("|---|---|---|---|---|")
  for mname in args.models.split(","):
    model, x, labels = make_case(mname, args.small)
    base = None
    for pname in args.policies.split(","):
      policy, precision = POLICIES[pname]
      for impl in impls if policy.block_dot == "exact" else [None]:
        label = pname if impl is None or len(impls) == 1 else f"{pname} [{impl}]"
        policy = policy_for(pname, impl)
        with jax.default_matmul_precision(precision):
          t, c, loss = time_step(model, x, labels, policy, steps, args.trace_top)
        base = t if pname == "fp32" else base
        ratio = t / base if base else None  # no fp32 row: no ratio
        rows.append(dict(model=mname, policy=label, step_ms=1e3 * t, compile_s=c,
                         overhead=ratio, loss=loss, batch=int(x.shape[0])))
        shown = "- (no fp32 row)" if ratio is None else f"{ratio:.2f}x"
        print(f"| {mname} (batch {x.shape[0]}) | {label} | {1e3 * t:.1f} | {c:.1f} | "
              f"{shown} |", flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=1)
  return rows


if __name__ == "__main__":
  main()
