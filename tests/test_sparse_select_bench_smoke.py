"""Smoke test of benchmarks/tools/sparse_select.py: every case in every schedule prints a row with
its ratio to the copy row, and bad options are refused."""

import pytest
from _bench import load_benchmark

pytestmark = pytest.mark.usefixtures("fast_compile")


def test_sparse_select_bench_small(capsys):
  mod = load_benchmark("sparse_select")
  mod.main(["--small"])
  rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
          if line.startswith("| 65536 |")]
  seen = {(r[1].strip(), r[2].strip()) for r in rows}
  assert {("copy", "-"), ("full top_k", "-")} <= seen
  for case in ("topk1%", "dgc1%/graddrop99%", "randomk1%"):
    for sched in ("platform", "cpu", "gpu", "radix"):
      # "radix" is a schedule of select_sparse only: no RandomK row
      assert ((case, sched) in seen) == (case != "randomk1%" or sched != "radix")
  for r in rows:
    assert float(r[3]) > 0 and r[5].strip().endswith("x")
    # the ratio to the CPU schedule on every other schedule's row
    assert r[6].strip().endswith("x") == (r[2].strip() in ("platform", "gpu", "radix"))


@pytest.mark.parametrize("argv", [["--sizes", "12,x"], ["--sizes", "0"], ["--repeats", "0"],
                                  ["--schedules", "cpu,tpu"], ["--schedules", "cpu,cpu"]])
def test_sparse_select_bench_refuses_bad_options(argv, capsys):
  mod = load_benchmark("sparse_select")
  with pytest.raises(SystemExit):
    mod.main(argv)
  assert "error" in capsys.readouterr().err
