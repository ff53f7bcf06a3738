"""Smoke test of benchmarks/compression.py --small (two compressors: the cheapest dense one to
compile, and PowerSGD, which skips vectors). Every compressor's bits are tested elsewhere."""

import pathlib
import runpy


def test_compression_bench_small(capsys):
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compression.py"
  mod = runpy.run_path(str(path))
  mod["main"](["--small", "--model", "resnet18", "--only", "onebit,powersgd2"])
  out = capsys.readouterr().out
  assert "| resnet18 | onebit |" in out
  # PowerSGD leaves vectors uncompressed: the bench must not encode them
  assert "| resnet18 | powersgd2 |" in out
  # the copy row (the GPU goal's baseline) and every row's ratio to it
  lines = out.splitlines()
  copy = next(line for line in lines if line.startswith("| resnet18 | copy (per leaf) |"))
  assert float(copy.split("|")[3]) > 0
  row = next(line for line in out.splitlines() if line.startswith("| resnet18 | onebit |"))
  assert row.split("|")[4].strip().endswith("x")
