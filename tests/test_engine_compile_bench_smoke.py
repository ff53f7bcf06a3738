"""Smoke test of benchmarks/engine_compile.py --model tiny (in this process): one row per
reduction with its three stages timed, and bad options refused."""

import pytest
from _bench import load_benchmark

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_engine_compile_tiny(capsys):
  mod = load_benchmark("engine_compile")
  assert mod.main(["--model", "tiny", "--workers", "2", "--only", "e4m3-psum,topk"]) == 0
  out = capsys.readouterr().out
  assert "tiny: 3 leaves, W = 2" in out, out
  rows = [ln for ln in out.splitlines() if ln.startswith("| ") and not ln.startswith("| red")]
  assert [ln.split(" | ")[0] for ln in rows] == [
      "| fp32 psum (reduce_gradients without a compressor)",
      "| E4M3 ring psum + Kahan + APS (reduce_gradients(fmt=E4M3))", "| topk, per leaf",
      "| topk, bucket_mb=25"], out
  # the low-precision psum sums the 3 leaves in one bucket; topk compresses the conv and the
  # matrix (the vector goes in fp32): 2 leaves, in one bucket
  assert [ln.split(" | ")[1:3] for ln in rows] == [["-", "-"], ["3", "1"], ["2", "2"],
                                                   ["2", "1"]], out
  for ln in rows:
    trace, lower, comp, total = (float(v) for v in ln.strip("| ").split(" | ")[3:])
    assert min(trace, lower, comp) >= 0 and total == pytest.approx(trace + lower + comp,
                                                                   abs=0.15)


@pytest.mark.parametrize("args,needle", [
    (["--workers", "1"], "--workers must be >= 2"),
    (["--bucket-mb", "0"], "--bucket-mb must be > 0"),
    (["--only", "cgx4,zip"], "unknown compressor(s) ['zip']"),
    (["--only", ","], "unknown compressor(s)"),
    (["--model", "bert"], "invalid choice: 'bert'"),
])
def test_engine_compile_refuses_bad_options(args, needle, capsys):
  mod = load_benchmark("engine_compile")
  with pytest.raises(SystemExit) as e:
    mod.main(args)
  assert e.value.code == 2 and needle in capsys.readouterr().err
