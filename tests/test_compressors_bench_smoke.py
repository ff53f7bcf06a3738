"""Smoke test of benchmarks/compressors.py --small (in this process): the cheapest dense
compressor to compile through the whole script; PowerSGD, which skips vectors, through the same
timing function on one matrix and one vector; --bucket-mb and --trace-top. Every compressor's
bits are tested elsewhere."""

import pathlib
import runpy

import pytest

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_compressors_bench_small(capsys):
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compressors.py"
  mod = runpy.run_path(str(path))
  mod["main"](["--small", "--model", "resnet18", "--only", "onebit"])
  out = capsys.readouterr().out
  assert "| resnet18 | onebit |" in out
  # the copy row (the GPU goal's baseline) and every row's ratio to it
  lines = out.splitlines()
  copy = next(line for line in lines if line.startswith("| resnet18 | copy (per leaf) |"))
  assert float(copy.split("|")[3]) > 0
  row = next(line for line in out.splitlines() if line.startswith("| resnet18 | onebit |"))
  assert row.split("|")[4].strip().endswith("x")
  # PowerSGD leaves vectors uncompressed: the bench must not encode them (they travel, and are
  # counted, as fp32). bench() is what main() times for every row; the --small ResNet-18's 12
  # matrices would compile 12 PowerSGD round trips (about 20 s of CPU here) for the same path
  comp = mod["COMPRESSORS"]["powersgd2"]
  shapes = [(16, 8, 3, 3), (16,)]
  gbps, wire, n = mod["bench"](comp, shapes, 1)
  assert gbps > 0 and n == 16 * 8 * 9 + 16
  assert comp.matrix_shape((16,)) is None and wire == comp.wire_bytes((16, 8, 3, 3)) + 4 * 16


def test_compressors_bench_buckets_decode_every_leaf(capsys):
  """--bucket-mb fuses consecutive leaves into flat buckets (the engine's grouping): the
  round trip returns every leaf in its shape, with the same values as per leaf for a
  compressor without buckets' own statistics (bf16), and a bad size is refused."""
  import jax
  import numpy as np

  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compressors.py"
  mod = runpy.run_path(str(path))
  shapes = [(3, 4), (5,), (2, 2, 2), (7, 1)]
  # 13 fp32 values per bucket at most: 12 | 5 + 8 | 7
  assert mod["buckets"](shapes, 52 / 2**20) == [[0], [1, 2], [3]]
  assert mod["buckets"](shapes, None) == [[0], [1], [2], [3]]
  gs = [jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes)]
  big = mod["buckets"](shapes, 1.0)
  assert big == [[0, 1, 2, 3]]
  back = mod["_split"](mod["_fuse"](gs, big), big, shapes)
  for a, b in zip(back, gs, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mod["main"](["--small", "--model", "resnet18", "--only", "bf16,powersgd2_batched",
               "--bucket-mb", "25"])
  out = capsys.readouterr().out
  assert "| resnet18 | copy (per bucket of <= 25 MB) |" in out and "| resnet18 | bf16 |" in out
  # batched PowerSGD fuses its buckets as the engine does: one square matrix per bucket, so
  # its wire bytes are those of the buckets' matrices, not of the leaves'
  comp = mod["COMPRESSORS"]["powersgd2_batched"]
  small = mod["small_shapes"](mod["resnet18_shapes"]())  # as --small scales them
  units = [(sum(int(np.prod(small[i])) for i in g),) for g in mod["buckets"](small, 25)]
  row = next(line for line in out.splitlines()
             if line.startswith("| resnet18 | powersgd2_batched |"))
  assert float(row.split("|")[8]) == pytest.approx(
      sum(comp.wire_bytes(u) for u in units) / 1e6, abs=1e-3)
  with pytest.raises(SystemExit):
    mod["main"](["--small", "--model", "resnet18", "--only", "bf16", "--bucket-mb", "0"])


def test_compressors_bench_trace_top(capsys):
  """--trace-top N traces each compressor's runs: N ops and N source lines with their time,
  control-flow ops marked as nesting (not summed again); a negative N is refused."""
  import re

  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "compressors.py"
  mod = runpy.run_path(str(path))
  mod["main"](["--small", "--model", "resnet18", "--only", "topk1%", "--bucket-mb", "25",
               "--trace-top", "3"])
  out = capsys.readouterr().out
  assert "# trace: CPU thread time, " in out and "ms wall per run under the profiler" in out
  ops = re.findall(r"^\| (\S+)( \(nesting\))? \| ([\d.]+) \| [\d.]+% \| (.+?) \| .+? \|$", out,
                   re.M)
  assert len(ops) == 3 and all(float(ms) > 0 for _, _, ms, _ in ops)
  srcs = re.findall(r"^\| (\S+\.py:\d+ \(.*?\)) \| ([\d.]+) \| [\d.]+% \|$", out, re.M)
  assert len(srcs) == 3 and any(s.startswith(("_base.py:", "_sparse.py:")) for s, _ in srcs)
  assert "| resnet18 | topk1% |" in out
  with pytest.raises(SystemExit):
    mod["main"](["--small", "--model", "resnet18", "--only", "topk1%", "--trace-top", "-2"])
  assert "--trace-top=-2 must be >= 0" in capsys.readouterr().err
