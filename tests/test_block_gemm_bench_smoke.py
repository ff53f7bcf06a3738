"""Smoke test of benchmarks/block_gemm.py --small (GEMM, block-scaled and conv rows, one repeat,
in this process) and of its --tiles option."""

import json
import pathlib
import runpy

import pytest

pytestmark = pytest.mark.usefixtures("fast_compile")

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "block_gemm.py"


def test_block_gemm_bench_small(capsys, tmp_path):
  """One run: the HBFP8 / MXINT8 / fp8 GEMM rows, the block-scaled rows (NVFP4, MXFP4, MXFP8:
  emulation, reference and the interpreted Pallas kernel with the reference's bits; GPU rows
  "not measured") and the conv rows; ``--tiles`` is accepted (its rows are GPU-only: nothing
  to time here). The layer rows (--skip-layers) are left out."""
  mod = runpy.run_path(str(PATH))
  out_json = tmp_path / "rows.json"
  mod["main"](["--small", "--size", "48", "--scaled-size", "32", "--repeats", "1",
               "--skip-layers", "--tiles", "128x64x4", "--json", str(out_json)])
  out = capsys.readouterr().out
  gemm_out, scaled_out = out.split("32^3, block-scaled formats:")
  assert gemm_out.count("same bits as reference") == 3  # XLA int8 = reference (HBFP8 x2, MXINT8)
  assert "| HBFP8 hbfp(7,24) | exact: reference" in gemm_out
  assert "fp8 fast mode (fp8 dot, fp32 out)" in gemm_out
  data = json.loads(out_json.read_text())
  rows = data["gemm"]
  assert data["size"] == 48
  assert all(r["ms"] is None or r["ms"] > 0 for r in rows)
  assert any(r["ms"] is None and "not measured" in r["bits"] for r in rows)  # no GPU here
  # both Pallas routes get a row; the auto route says how many tiles take bf16; --tiles adds
  # none off a GPU
  assert gemm_out.count("exact: Pallas kernel, route=int8 (GPU)") == 3
  assert gemm_out.count("route=auto (GPU) | not measured | not measured | bf16 route on 100% of "
                        "the tiles; not measured (no GPU)") == 3
  assert "tiles 128x64" not in out
  scaled = data["scaled"]
  kernels = [r for r in scaled if "interpret=True" in r["path"]]
  assert len(kernels) == 3 and all("same bits as reference" in r["bits"] for r in kernels)
  assert ("| NVFP4 nvfp4() (two-level) | exact: Pallas kernel limb_gemm (GPU) | not measured"
          in scaled_out)
  assert "2 x 2 limb dots per K-block" in scaled_out  # MXFP8
  conv = data["conv"]
  assert conv and all(r["ms"] is None or r["ms"] > 0 for r in conv)
  assert "| conv layer | path |" in scaled_out and data["layers"] == []


def test_block_gemm_bench_tiles_flag(capsys):
  """Bad --tiles values are refused (a good one is run by test_block_gemm_bench_small)."""
  mod = runpy.run_path(str(PATH))
  for bad, msg in (("128x64", "expected BMxBNxWARPS"), ("96x64x4", "powers of two >= 16"),
                   ("64x64x3", "warps 1/2/4/8/16")):
    with pytest.raises(SystemExit):
      mod["main"](["--small", "--tiles", bad])
    assert msg in capsys.readouterr().err
