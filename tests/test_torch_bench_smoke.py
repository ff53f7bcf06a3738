"""Smoke test: benchmarks/torch_quantize.py --small runs and prints its table (as a command;
its --device cuda and --profile runs in this process)."""

import os
import pathlib
import subprocess
import sys

import pytest
from _bench import load_benchmark

torch = pytest.importorskip("torch", reason="the torch benchmark needs torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args):
  # torch's OpenMP threads sleep when idle instead of spinning: on the shared 2-core machine
  # the spinning took the run from 9 s to 24-29 s of CPU (and as much wall time) in about half
  # of the runs, with the same load (2026-11-29); the smoke run does not check the times
  env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE")
  r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "torch_quantize.py"), *args],
                     capture_output=True, text=True, timeout=300, env=env, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  return r.stdout


def _run_here(monkeypatch, capsys, *args):
  """The script's output for ``args``, run in this process (its main() reads sys.argv)."""
  bench = load_benchmark("torch_quantize")
  monkeypatch.setattr(sys, "argv", ["torch_quantize.py", *args])
  capsys.readouterr()
  bench.main()
  return capsys.readouterr().out


def test_torch_bench_small():
  out = _run("--small", "--only", "float_quantize,OptimLP step")
  assert "| float_quantize | nearest | 4096 |" in out
  assert "| OptimLP step | stochastic | 65536 |" in out
  # OptimLP's baseline (the SGD step it wraps), once per size, and its 4K cost over it
  assert out.count("| torch.optim.SGD step alone (OptimLP's baseline) | - |") == 2
  assert "<= 50 us over SGD: +" in out
  assert "zero-copy=True" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU rows")
def test_torch_bench_cuda_rows_say_not_measured_without_a_gpu(monkeypatch, capsys):
  out = _run_here(monkeypatch, capsys, "--small", "--device", "cuda")
  assert "| quantize | nearest | 4096 | not measured | not measured |" in out
  assert "torch.cuda.is_available() is False" in out


def test_torch_bench_profile_lists_each_entry_points_host_time(monkeypatch, capsys):
  """--profile adds, per timed entry point and rounding, the functions its calls spend their
  host time in (cProfile), the entry point's own wrapper among them."""
  out = _run_here(monkeypatch, capsys, "--small", "--only", "quantizer", "--profile")
  for r in ("nearest", "stochastic"):
    assert f"# profile: quantizer {r}, 4096 elements, 2000 calls:" in out
  assert "| function | calls per call | own us per call | cumulative us per call |" in out
  assert "_qpytorch.py:" in out and "(quantize) | 1.00 |" in out


def test_torch_bench_times_the_jitfunction_run_column_with_the_jit_launcher():
  """On CUDA each jaxlp row is timed twice: with the bridge's launcher, then with one that
  always takes JITFunction.run; the bridge's launcher is back in place afterwards."""
  pytest.importorskip("triton", reason="the launcher column needs the triton package")
  from jaxlp.torch import _triton as T

  bench = load_benchmark("torch_quantize")
  launchers = bench._launchers()
  assert launchers[0] is T.LAUNCHER and launchers[1].disabled is not None
  seen = []
  t = bench._time_with(launchers, lambda: seen.append(T.LAUNCHER), 1, lambda: None, 2)
  assert t >= 0 and seen and all(s is launchers[1] for s in seen)
  assert T.LAUNCHER is launchers[0]
  assert bench._time_with(None, lambda: None, 1, lambda: None, 1) is None
