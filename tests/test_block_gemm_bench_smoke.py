"""Smoke test of benchmarks/block_gemm.py --small (GEMM paths only, one repeat)."""

import json
import pathlib
import runpy


def test_block_gemm_bench_small(capsys, tmp_path):
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "block_gemm.py"
  mod = runpy.run_path(str(path))
  out_json = tmp_path / "rows.json"
  mod["main"](["--small", "--size", "48", "--repeats", "1", "--skip-layers", "--skip-scaled",
               "--json", str(out_json)])
  out = capsys.readouterr().out
  assert out.count("same bits as reference") == 3  # XLA int8 = reference (HBFP8 x2, MXINT8)
  assert "| HBFP8 hbfp(7,24) | exact: reference" in out
  assert "fp8 fast mode (fp8 dot, fp32 out)" in out
  rows = json.loads(out_json.read_text())["gemm"]
  assert all(r["ms"] is None or r["ms"] > 0 for r in rows)
  assert any(r["ms"] is None and "not measured" in r["bits"] for r in rows)  # no GPU here
  # both Pallas routes get a row; the auto route says how many tiles take bf16
  assert out.count("exact: Pallas kernel, route=int8 (GPU)") == 3
  assert out.count("route=auto (GPU) | not measured | not measured | bf16 route on 100% of the "
                   "tiles; not measured (no GPU)") == 3


def test_block_gemm_bench_tiles_flag(capsys):
  """--tiles is parsed (GPU-only rows: nothing to time here) and bad values are refused."""
  import pytest

  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "block_gemm.py"
  mod = runpy.run_path(str(path))
  mod["main"](["--small", "--size", "32", "--repeats", "1", "--skip-layers", "--skip-conv",
               "--skip-scaled", "--tiles", "128x64x4"])
  for bad, msg in (("128x64", "expected BMxBNxWARPS"), ("96x64x4", "powers of two >= 16"),
                   ("64x64x3", "warps 1/2/4/8/16")):
    with pytest.raises(SystemExit):
      mod["main"](["--small", "--tiles", bad])
    assert msg in capsys.readouterr().err


def test_block_gemm_bench_scaled_rows(capsys, tmp_path):
  """The block-scaled rows (NVFP4, MXFP4, MXFP8): emulation, reference and the interpreted
  Pallas kernel with the reference's bits; GPU rows "not measured"."""
  path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "block_gemm.py"
  mod = runpy.run_path(str(path))
  out_json = tmp_path / "rows.json"
  mod["main"](["--small", "--size", "16", "--scaled-size", "32", "--repeats", "1",
               "--skip-layers", "--skip-conv", "--json", str(out_json)])
  out = capsys.readouterr().out
  rows = json.loads(out_json.read_text())["scaled"]
  kernels = [r for r in rows if "interpret=True" in r["path"]]
  assert len(kernels) == 3 and all("same bits as reference" in r["bits"] for r in kernels)
  assert "| NVFP4 nvfp4() (two-level) | exact: Pallas kernel limb_gemm (GPU) | not measured" in out
  assert "2 x 2 limb dots per K-block" in out  # MXFP8
