"""``jaxlp train --shard zero1|zero2|fsdp`` (jaxlp.training._sharded): the fp32 and
``--grad-format`` sharded runs have the replicated run's bits; the wire flags change the
result; memory is reported; bad combinations are refused; two processes over
``jax.distributed`` on 127.0.0.1 give the single-process run's numbers."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _bench import xla_flags

from jaxlp.cli import main
from jaxlp.training import TrainConfig, Trainer

ROOT = Path(__file__).resolve().parents[2]
# 4 workers on 2 devices, a narrow MLP (16 hidden units; its 10-value bias is flattened and
# padded), 2 steps
BASE = dict(nodes=4, devices=2, width=2, batch_size=32, epochs=1, max_steps_per_epoch=2,
            quiet=True)


def _run(**kw):
  t = Trainer(TrainConfig(**(BASE | kw)))
  m = t.run_epoch()
  p = t._shard.full_params(t.params) if t._shard is not None else t.params
  return m, jax.tree_util.tree_map(np.asarray, p), t


def _same_bits(a, b):
  return all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                             strict=True))


@pytest.fixture(scope="module")
def fp32_runs():
  return {lvl: _run(shard=lvl) for lvl in (None, "fsdp")}


def test_fp32_sharded_runs_equal_the_replicated_run_bit_for_bit(fp32_runs):
  ref_m, ref_p, ref_t = fp32_runs[None]
  for lvl in ("fsdp", "zero1", "zero2"):
    m, p, t = fp32_runs[lvl] if lvl in fp32_runs else _run(shard=lvl)
    assert _same_bits(p, ref_p), lvl
    assert m["train_loss"] == ref_m["train_loss"] and m["test_accuracy"] == ref_m["test_accuracy"]
    # optimizer state too: the momentum of the shards is the replicated momentum's slices
    trace = t._shard.full_params(t.opt_state.inner[1][0].trace) if lvl == "fsdp" else None
    if trace is not None:
      assert _same_bits(trace, ref_t.opt_state[1][0].trace)
  m = fp32_runs["fsdp"][0]
  # per device: the 2 workers' shards and momentum, half of the replicated parameters +
  # momentum (up to the padding of the flattened leaf)
  rep = m["replicated_state_bytes_per_device"]
  assert rep == 2 * 4 * fp32_runs[None][2].n_params
  assert rep / 2 <= m["state_bytes_per_device"] <= rep / 2 + 64
  assert m["state_bytes_per_worker"] <= rep / 4 + 32
  # fp32: a reduce-scatter + an all-gather send what the ring all-reduce sends (+ the padded
  # leaf's all-reduce)
  assert abs(m["wire_bytes"] - ref_m["wire_bytes"]) < 300


@pytest.mark.xla_default_emitters
@pytest.mark.usefixtures("fast_compile")
def test_grad_format_zero2_equals_replicated_bit_for_bit():
  """--grad-format e4m3 --order ring --aps, zero2 against the replicated run, 2 workers on 2
  devices: each step's ring traces a quantizer per hop, so 4 workers traced 3x the hops. The
  ring and APS orders of 4 and 8 workers against the oracle: tests/parallel/test_sharded.py
  (test_every_order_matches_the_oracle_w4, test_vmap_and_shard_map_give_the_oracles_bits).
  Both runs compile with XLA's optimizations off (tests/conftest.py, ``fast_compile``); the
  same claim on normally compiled programs: the trainer's zero2 == replicated in
  test_fp32_sharded_runs_equal_the_replicated_run_bit_for_bit above, and the E4M3 APS
  reduce-scatter + update == jaxlp's psum + the same update in tests/parallel/test_fsdp.py
  (test_sharded_step_equals_replicated_step_bit_for_bit)."""
  kw = dict(grad_format="e4m3", order="ring", aps=True, nodes=2)
  _, ref_p, _ = _run(**kw)
  _, p, _ = _run(shard="zero2", **kw)
  assert _same_bits(p, ref_p)


def test_wire_flags_change_the_result_and_are_reported(fp32_runs, tmp_path, capsys):
  m0, p0, _ = fp32_runs["fsdp"]
  m1, p1, _ = _run(shard="fsdp", grad_wire="int4-block")
  assert not _same_bits(p1, p0)
  assert m1["wire_bytes"] < 0.75 * m0["wire_bytes"]
  out = tmp_path / "run"
  argv = ["train", "--shard", "fsdp", "--grad-wire", "int4-block", "--param-wire",
          "int8-block:32", "--nodes", "4", "--devices", "2", "--width", "2", "--batch-size",
          "32", "--epochs", "1", "--max-steps-per-epoch", "2", "--out", str(out)]
  assert main(argv) == 0
  text = capsys.readouterr().out
  assert re.search(r"--shard fsdp over 4 workers: gradients reduce-scattered \(int4-block, "
                   r"order all_to_all\), parameters all-gathered \(int8-block:32\); parameters "
                   r"\+ optimizer state [\d.]+ MiB per device \(2 device\(s\)\), replicated "
                   r"[\d.]+ MiB", text), text
  m2 = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
  assert m2["train_loss"] != m1["train_loss"]  # --param-wire changed the run
  assert m2["wire_bytes"] < m1["wire_bytes"]
  rec = json.loads((out / "config.json").read_text())
  assert rec["shard"] == "fsdp" and rec["state_bytes_per_device"] == m2["state_bytes_per_device"]
  # the sharded state checkpoints and resumes
  assert main(argv[:-4] + ["--epochs", "2", "--max-steps-per-epoch", "2", "--out", str(out),
                           "--resume"]) == 0
  assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


# a language model: an LSTM of 16 units, windows of 8 tokens, 8 rows over 4 workers
LM = dict(model="lstm", width=2, layers=1, seq_len=8, batch_size=8)


def test_lstm_sharded_runs_equal_the_replicated_run_bit_for_bit():
  """--shard fsdp with --model lstm (fp32 wire, SGD): the replicated run's dropout keys,
  parameters and perplexity (evaluated on the gathered parameters) bit for bit. (fp32 zero2,
  the same gradient reduce-scatter with replicated parameters: the MLP's bits above; an LSTM
  zero2 run traced a third LSTM step for no path of its own.)"""
  ref_m, ref_p, _ = _run(optimizer="sgd", **LM)
  assert np.isfinite(ref_m["perplexity"])
  m, p, _ = _run(shard="fsdp", optimizer="sgd", **LM)
  assert _same_bits(p, ref_p)
  for k in ("train_loss", "valid_loss", "perplexity"):
    assert m[k] == ref_m[k], k
  assert 0 < m["state_bytes_per_device"] < m["replicated_state_bytes_per_device"]


@pytest.mark.usefixtures("fast_compile")  # ranges and reports; no bits
def test_lstm_trains_sharded_from_the_command_line(tmp_path):
  """jaxlp train --model lstm --shard fsdp (Adam, the language models' default; 2 workers on
  one device): perplexity of the gathered parameters and the memory in the metrics."""
  out = tmp_path / "run"
  assert main(["train", "--model", "lstm", "--shard", "fsdp", "--nodes", "2", "--devices", "1",
               "--width", "2", "--layers", "1", "--seq-len", "8", "--batch-size", "8",
               "--epochs", "1", "--max-steps-per-epoch", "2", "--quiet", "--out", str(out)]) == 0
  (m,) = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
  assert 1.0 < m["perplexity"] < 257 * 1.5 and m["nonfinite_steps"] == 0
  # one device holds both workers' shards; a worker about half the replicated state
  assert 0 < m["state_bytes_per_worker"] < 0.6 * m["replicated_state_bytes_per_worker"]
  rec = json.loads((out / "config.json").read_text())
  assert (rec["model"], rec["shard"], rec["optimizer"]) == ("lstm", "fsdp", "adam")


def test_wire_names():
  from jaxlp import formats as F
  from jaxlp.training._sharded import parse_wire
  assert parse_wire("fp32", "--grad-wire") is None and parse_wire(None, "--grad-wire") is None
  assert parse_wire("int4-block", "--grad-wire") == F.BlockFormat(3, axis=-1, block_size=64)
  assert parse_wire("INT8-block:128", "--grad-wire") == F.BlockFormat(7, axis=-1,
                                                                     block_size=128)
  assert parse_wire("mxfp4", "--grad-wire") == F.mx(F.E2M1FN)
  assert parse_wire("mxfp8", "--grad-wire") == F.mx(F.E4M3FN)
  assert parse_wire("mxint8", "--param-wire") == F.mx("int8")
  assert parse_wire("bf16", "--param-wire") == F.BF16
  with pytest.raises(ValueError, match="only int8-block and int4-block take"):
    parse_wire("bf16:32", "--grad-wire")
  with pytest.raises(ValueError, match="block size must be in"):
    parse_wire("int4-block:0", "--grad-wire")


REFUSED = [
    (["--grad-wire", "bf16"], "--grad-wire applies to sharded training"),
    (["--shard", "zero1", "--grad-wire", "bf16"], "--grad-wire applies to --shard zero2/fsdp"),
    (["--shard", "zero2", "--param-wire", "bf16"], "--param-wire applies to --shard fsdp"),
    (["--shard", "fsdp", "--grad-wire", "bf16", "--grad-format", "e4m3"],
     "give one gradient wire"),
    (["--shard", "fsdp", "--grad-wire", "int9-block"], "--grad-wire: unknown wire"),
    (["--shard", "fsdp", "--grad-wire", "int4-block:x"], "block size"),
    (["--shard", "fsdp", "--compress", "topk:ratio=0.1"], "top-k selects"),
    (["--shard", "fsdp", "--compress", "cgx:bits=4,bucket_mb=4"], "bucket_mb"),
    (["--shard", "fsdp", "--lars"], "--lars"),
    (["--shard", "fsdp", "--coordinator", "127.0.0.1:1", "--num-processes", "2"],
     "go together"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"],
     "add --shard"),
    (["--shard", "fsdp", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "2"], "below --num-processes"),
    (["--shard", "fsdp", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
      "--process-id", "0", "--out", "x"], "--out is not implemented"),
]


@pytest.mark.parametrize("args, needle", REFUSED)
def test_bad_combinations_are_one_line(args, needle, capsys):
  rc = main(["train", "--epochs", "1", "--quiet"] + args)
  err = capsys.readouterr().err
  assert rc == 2 and needle in err and err.count("\n") == 1, err


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_over_jax_distributed(capsys):
  flags = ["train", "--shard", "fsdp", "--grad-wire", "int8-block", "--nodes", "2", "--width",
           "2", "--batch-size", "32", "--epochs", "1", "--max-steps-per-epoch", "2"]
  env = dict(os.environ)
  env["XLA_FLAGS"] = xla_flags()  # one CPU device per process
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "jaxlp", *flags, "--coordinator",
                             f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                             str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=str(ROOT)) for i in range(2)]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=420)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for rc, out, err in outs:
    assert rc == 0, out + err[-3000:]
  # the same run in this process: 2 workers on 2 of the forced CPU devices
  assert main(flags + ["--devices", "2"]) == 0
  local = capsys.readouterr().out

  def result(text):  # the epoch line without its time; the sharding line
    epoch = [re.sub(r"\s+[\d.]+s$", "", ln) for ln in text.splitlines()
             if ln.startswith("epoch ")]
    shard = [ln for ln in text.splitlines() if "--shard fsdp over 2 workers" in ln]
    assert len(epoch) == 1 and len(shard) == 1, text
    return epoch + shard

  assert result(outs[0][1]) == result(outs[1][1]) == result(local)
  assert "2 worker(s) on 2 device(s)" in outs[0][1]


@pytest.mark.usefixtures("fast_compile")  # what the summary reports
def test_compare_summary_reports_sharded_memory(tmp_path, capsys):
  out = tmp_path / "cmp"
  assert main(["compare", "--config", "fsdp=--shard fsdp", "--out", str(out), "--no-plot", "--",
               "--nodes", "4", "--width", "2", "--batch-size", "32", "--epochs", "1",
               "--max-steps-per-epoch", "1"]) == 0
  (row,) = json.loads((out / "summary.json").read_text())
  assert row["config"] == "fsdp"
  assert 0 < row["state_bytes_per_device"] <= row["replicated_state_bytes_per_device"]
