"""Smoke test of benchmarks/layers.py --small (MLP, the default policies, in a subprocess; the
exact policies, the GEMM census and the trace in this process; bad options are refused)."""

import json
import os
import re
import subprocess
import sys

import pytest
from _bench import FAST_COMPILE, load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("fast_compile")


def _refused(capsys, *args):
  """layers.py's stderr for ``args``, which it refuses (exit status 2) before any work; run
  in this process (a subprocess adds a Python and JAX start-up for a parse error)."""
  mod = load_benchmark("layers")
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    mod.main(["--small", "--models", "mlp", *args])
  assert e.value.code == 2
  return capsys.readouterr().err


def test_layers_benchmark_small(tmp_path):
  """The default policies, as a command; with --no-command-buffers, which must act before JAX
  starts a backend (so in a fresh process: see
  test_no_command_buffers_sets_xla_flags_before_the_backend_and_is_refused_after) and says so
  in the header (it changes nothing off a GPU)."""
  out = tmp_path / "layers.json"
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             **FAST_COMPILE)
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "layers.py"), "--small",
                      "--models", "mlp", "--steps", "2", "--no-command-buffers", "--json",
                      str(out)],
                     capture_output=True, text=True, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads(out.read_text())
  assert [row["policy"] for row in rows] == ["fp32", "tf32", "hbfp8", "mxfp8", "float_e4m3"]
  assert all(row["step_ms"] > 0 and row["overhead"] > 0 for row in rows)
  assert "| mlp (batch 32) | hbfp8 |" in r.stdout
  assert ", XLA:GPU command buffers OFF" in r.stdout.splitlines()[0]


def test_layers_benchmark_refuses_an_unknown_policy(capsys):
  err = _refused(capsys, "--policies", "fp32,hbfp9")
  assert "--policies: unknown policy 'hbfp9'" in err and "hbfp8_tiled_exact" in err


def test_layers_benchmark_gemm_census(tmp_path, capsys):
  """--gemm-census lists the exact GEMMs of one step (traced, not run): for the small MLP
  (784-128-128-10 here, batch 32) with the per-sample HBFP8 exact policy, each layer's
  forward, input-gradient and weight-gradient GEMM, their FLOPs summed; --small times them
  (the CPU reference); with --gpu-impl auto (the library's default, given explicitly) it times
  the operand preparation (the Pallas kernel, interpreted here) of the GEMMs that "auto" runs
  by the kernel; --census-top N times only the N largest GEMMs by FLOP (the others read "not
  measured", and the summary names the GFLOP that were timed); a census without an exact
  policy, or with two --gpu-impl, is refused."""
  out = tmp_path / "census.json"
  mod = load_benchmark("layers")
  # --census-top 7 of the 8 distinct GEMMs: the 7th is the one that "auto" runs by the kernel
  # (the others as batched XLA int8 dots), so its operand preparation is timed; the 8th is not
  mod.main(["--small", "--models", "mlp", "--steps", "1", "--gemm-census", "--policies",
            "fp32,hbfp8_exact", "--gpu-impl", "auto", "--census-top", "7", "--json", str(out)])
  text = capsys.readouterr().out
  (row,) = json.loads(out.read_text())
  assert row["policy"] == "hbfp8_exact" and row["gemms"] == 9
  dims = [(32, 784, 128), (32, 128, 128), (32, 128, 10)]  # (batch, in, out) per layer
  flop = sum(2 * b * i * o for b, i, o in dims) * 3  # forward, dlhs, drhs: the same MACs
  assert abs(row["gflop"] * 1e9 - flop) < 1
  assert row["exact_ms"] > 0 and row["f32_ms"] > 0 and row["prep_ms"] > 0
  assert row["first_call_s"] > 0
  assert "| 32 | 784 | 128 | 24 | 33 | 7/7 | 1 |" in text  # the first forward GEMM
  rows = [ln for ln in text.splitlines() if " | 7/7 | " in ln]
  assert len(rows) == 8  # 9 GEMMs, two of one shape
  timed = [ln for ln in rows if "not measured" not in ln]
  assert len(timed) == 7 and rows[:7] == timed  # the largest come first
  assert rows[0].split(" | ")[9] == "- (xla_int8)" and float(rows[6].split(" | ")[9]) > 0
  assert rows[7].startswith("| 128 | 32 | 10 | 1 | 32 | 7/7 | 1 | 0.00 | not measured |")
  assert "GFLOP timed" in text
  err = _refused(capsys, "--steps", "1", "--gemm-census", "--policies", "fp32,hbfp8")
  assert "--gemm-census: --policies names no exact policy" in err
  err = _refused(capsys, "--steps", "1", "--gemm-census", "--policies", "hbfp8_exact",
                 "--gpu-impl", "auto,pallas")
  assert "--gemm-census: give one --gpu-impl" in err


def test_hbfp8_w7_operands_are_exact_in_bfloat16():
  """The premise of "hbfp8_w7_bf16" (BF16_BF16_F32 GEMMs): every operand its GEMMs see --
  per-sample HBFP8 activations and gradients, 7-bit tiled weights -- is a bfloat16 value, so
  the bf16 MMA rounds nothing. (The CPU backend ignores dot algorithms and computes in float32,
  so a CPU run cannot show the MMA side; the GPU benchmark does.) Data over 2**-100..2**100,
  with zeros and a wide spread inside each block."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jaxlp
  from jaxlp import formats as F

  mod = load_benchmark("layers")
  policy, precision = mod.POLICIES["hbfp8_w7_bf16"]
  assert precision == "BF16_BF16_F32"
  assert policy.lhs.fmt == F.hbfp_batched(7) and policy.rhs.fmt == F.hbfp(7, 24)
  assert policy.grad.fmt == F.hbfp_batched(7)
  k1, k2 = jax.random.split(jax.random.key(0))
  x = jax.random.normal(k1, (96, 72)) * 2.0 ** jax.random.randint(k2, (96, 72), -100, 100)
  x = x.at[::7].set(0.0)
  for fmt in (policy.lhs.fmt, policy.rhs.fmt, policy.grad.fmt):
    q = jaxlp.quantize(x, fmt)
    back = q.astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(back).view(np.uint32),
                                  np.asarray(q).view(np.uint32), err_msg=str(fmt))
  # the unquantized float32 weights of "hbfp8" are not
  assert not bool(jnp.all(x.astype(jnp.bfloat16).astype(jnp.float32) == x))


def test_layers_benchmark_trace_top_says_where_the_step_time_goes(capsys):
  """--trace-top N traces the steps and prints the N most expensive XLA ops and source lines
  in ms per step; a negative N is refused. Without an fp32 row there is no ratio: "-" in the
  table, None in the rows."""
  mod = load_benchmark("layers")
  # the MLP (5 s here; the small ResNet-18 took 50 s): the mechanism is the same
  (row,) = mod.main(["--small", "--models", "mlp", "--policies", "hbfp8_exact", "--steps", "1",
                     "--trace-top", "4"])
  out = capsys.readouterr().out
  assert "# trace: CPU thread time, " in out
  ops = re.findall(r"^\| (\S+)(?: \(nesting\))? \| ([\d.]+) \| ([\d.]+)% \| (.+?) \| (.+?) \|$",
                   out, re.M)
  assert len(ops) == 4 and all(float(ms) > 0 for _, ms, _, _, _ in ops)
  srcs = re.findall(r"^\| (\S+\.py:\d+ \(.*?\)) \| ([\d.]+) \| ([\d.]+)% \|$", out, re.M)
  assert len(srcs) == 4
  assert any(s.startswith(("_conv.py:", "_block_dot.py:", "_block.py:", "_dot_general.py:"))
             for s, _, _ in srcs), srcs  # jaxlp's own frames
  assert row["overhead"] is None and "| hbfp8_exact | " in out and "| - (no fp32 row) |" in out
  assert "--trace-top must be >= 0" in _refused(capsys, "--policies", "hbfp8_exact",
                                                "--trace-top", "-1")


def inner_sine(x):
  import jax.numpy as jnp

  return jnp.sin(x) * 3.0


def test_hlo_sources_name_the_line_of_each_op():
  import jax
  import jax.numpy as jnp

  trace = load_benchmark("_trace")
  hlo = jax.jit(inner_sine).lower(jnp.ones(8)).compile().as_text()
  src = trace.hlo_sources(hlo)
  wheres = {w for w, _ in src.values()}
  assert any(w.startswith("test_layers_bench_smoke.py:") and "(inner_sine)" in w
             for w in wheres), src
  assert any(op.endswith(("sin", "mul")) for _, op in src.values()), src


def test_a_failing_trace_is_reported_not_raised(capsys):
  trace = load_benchmark("_trace")

  def run():
    raise RuntimeError("no profiler here")

  assert not trace.report(run, "", 1, 3)
  assert "# trace failed: RuntimeError: no profiler here" in capsys.readouterr().out
  assert trace.report(lambda: None, "", 1, 3)  # an empty trace: empty tables
  assert "ms wall per run under the profiler" in capsys.readouterr().out


def test_no_command_buffers_sets_xla_flags_before_the_backend_and_is_refused_after():
  """--no-command-buffers (layers.py, compressors.py) adds XLA:GPU's empty command-buffer list
  to XLA_FLAGS before JAX starts a backend, and says so in the header; once a backend has
  started the helper refuses (the flag would be ignored silently)."""
  import jax

  # layers.py --no-command-buffers runs in test_layers_benchmark_small
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  # the helper's effect, in a process whose backend has not started: the flag joins XLA_FLAGS
  # once, after what was there
  path = os.path.join(ROOT, "benchmarks", "_trace.py")
  code = ("import importlib.util, os, sys; "
          f"spec = importlib.util.spec_from_file_location('t', {path!r}); "
          "t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t); "
          "t.command_buffers_off(); t.command_buffers_off(); print(os.environ['XLA_FLAGS'])")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     env=dict(env, XLA_FLAGS="--xla_dump_to=/nowhere"), timeout=60)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["--xla_dump_to=/nowhere", "--xla_gpu_enable_command_buffer="]
  trace = load_benchmark("_trace")
  jax.devices()
  with pytest.raises(RuntimeError, match="a JAX backend has started"):
    trace.command_buffers_off()


def test_layers_benchmark_gpu_impl_times_each_exact_policy_with_each(capsys):
  """--gpu-impl pallas,auto: one row per implementation for each exact policy (one for the
  others), each timed with a policy whose gpu_impl is that one (the library's defaults stay
  as they are); --block-route and --fp8-impl are accepted (they only pick GPU kernels: the
  CPU runs the per-sample HBFP8 exact policy's reference); bad values are refused."""
  from jaxlp.ops import _block_dot

  defaults = (_block_dot.GPU_IMPL, _block_dot.GPU_ROUTE, _block_dot.FP8_GPU_IMPL)
  mod = load_benchmark("layers")
  rows = mod.main(["--small", "--models", "mlp", "--policies", "fp32,hbfp8_exact",
                   "--gpu-impl", "auto,pallas", "--block-route", "auto", "--fp8-impl", "pallas",
                   "--steps", "1"])
  assert [r["policy"] for r in rows] == ["fp32", "hbfp8_exact [auto]", "hbfp8_exact [pallas]"]
  assert all(r["step_ms"] > 0 for r in rows)
  assert (_block_dot.GPU_IMPL, _block_dot.GPU_ROUTE, _block_dot.FP8_GPU_IMPL) == defaults
  # the CPU runs the reference with either: the same loss
  assert rows[1]["loss"] == rows[2]["loss"]
  # a run without an fp32 row: test_layers_benchmark_trace_top_says_where_the_step_time_goes;
  # the census with --gpu-impl auto (its operand preparation timed):
  # test_layers_benchmark_gemm_census
  capsys.readouterr()
  for bad in ("pallas,pallas", "xla"):
    with pytest.raises(SystemExit):
      mod.main(["--small", "--gpu-impl", bad])
    assert "--gpu-impl" in capsys.readouterr().err
  assert "--block-route: invalid choice: 'bf16'" in _refused(capsys, "--block-route", "bf16")
  assert "--fp8-impl: invalid choice: 'cublas'" in _refused(capsys, "--fp8-impl", "cublas")


def test_gemm_census_counts_every_call_of_a_repeated_shape():
  """The census records each exact GEMM where the layer calls it, before the jitted dispatch
  (whose trace cache made every repeated shape count once: the full ResNet-18 step listed 36
  GEMMs and 222 GFLOP instead of 63 and 490): a network of convolutions with batch norm makes
  3 GEMMs (forward, input and weight gradients) per convolution and dense layer, repeated
  shapes included. Here a 3-conv network with two convolutions of one shape (tracing the small
  ResNet-18's exact step took 10 s of CPU for the same mechanism); the small ResNet-18 of
  ``--models resnet18`` is built and its layers counted."""
  import collections

  import flax.linen as nn
  import jax

  class Convs(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
      for _ in range(3):  # 3 -> 4 channels, then 4 -> 4 twice: one GEMM shape repeats
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x)))
      return nn.Dense(10)(x.mean(axis=(1, 2)))

  mod = load_benchmark("layers")
  x = jax.numpy.ones((2, 6, 6, 3))
  calls = mod.exact_gemms(Convs(), x, jax.numpy.arange(2), mod.POLICIES["hbfp8_exact"][0])
  assert len(calls) == 3 * 4  # 3 convs and the dense layer
  # the 3 GEMMs of the two 4 -> 4 convs twice each, the other 6 once
  assert sorted(collections.Counter(calls).values()) == [1] * 6 + [2] * 3
  model, x, labels = mod.make_case("resnet18", True)
  assert x.shape == (8, 32, 32, 3) and labels.shape == (8,)
  params = mod.numpy_init(model, x)["params"]
  kernels = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
             if "kernel" in jax.tree_util.keystr(p)]
  assert len(kernels) == 21  # 17 3x3 convs, 3 shortcut 1x1 convs, the dense layer
