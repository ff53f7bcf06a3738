"""Every flag of ``jaxlp train`` with a bad value: exit code 2, one line on stderr naming the
flag, no traceback (issue 15). Runs the command in process (``main``), not in a subprocess."""

import argparse
import functools

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
import jaxlp.pallas
from jaxlp import formats as F
from jaxlp.cli import build_parser, main
from jaxlp.parallel import compressors as C
from jaxlp.training import TrainConfig, Trainer

QUICK = ["--epochs", "1", "--max-steps-per-epoch", "1", "--batch-size", "16", "--nodes", "2",
         "--quiet"]

# flag -> (bad arguments, text the one-line message must contain)
BAD = {
    "--model": (["--model", "nope"], "--model"),
    "--data": (["--data", "nope"], "--data"),
    "--data-dir": (["--data-dir", "/nonexistent"], "--data-dir"),
    "--tokens": (["--tokens", "chars"], "--tokens"),
    "--width": (["--width", "0"], "--width"),
    "--seq-len": (["--seq-len", "0"], "--seq-len"),
    "--layers": (["--layers", "65"], "--layers"),
    "--dropout": (["--dropout", "1.0"], "--dropout"),
    "--nodes": (["--nodes", "0"], "--nodes"),
    "--devices": (["--devices", "-1"], "--devices"),
    "--grad-exp": (["--grad-exp", "4.5", "--grad-man", "3"], "--grad-exp"),
    "--grad-man": (["--grad-exp", "4", "--grad-man", "x"], "--grad-man"),
    "--grad-format": (["--grad-format", "E9M9"], "--grad-format"),
    "--order": (["--order", "spiral"], "--order"),
    "--aps": (["--aps"], "--aps"),
    "--kahan": (["--kahan=yes"], "--kahan"),
    "--lars": (["--lars=1"], "--lars"),
    "--compress": (["--compress", "cgx:bits=4.5"], "--compress"),
    "--shard": (["--shard", "zero4"], "--shard"),
    "--grad-wire": (["--grad-wire", "int4-block"], "--grad-wire"),  # needs --shard
    "--param-wire": (["--shard", "fsdp", "--param-wire", "int5-block"], "--param-wire"),
    "--coordinator": (["--coordinator", "127.0.0.1:1"], "--coordinator"),  # alone
    "--num-processes": (["--num-processes", "0"], "--num-processes"),
    "--process-id": (["--process-id", "-1"], "--process-id"),
    "--hbfp": (["--hbfp", "0"], "--hbfp"),
    "--tile": (["--tile", "-1"], "--tile"),
    "--weight-man": (["--weight-man", "16"], "--weight-man"),
    "--policy": (["--policy", "fp3"], "--policy"),
    "--exact-blocks": (["--exact-blocks", "--policy", "mxfp8"], "--exact-blocks"),
    "--optimizer": (["--optimizer", "rmsprop"], "--optimizer"),
    "--epochs": (["--epochs", "0"], "--epochs"),
    "--batch-size": (["--batch-size", "0"], "--batch-size"),
    "--lr": (["--lr", "nan"], "--lr"),
    "--schedule": (["--schedule", "cosine"], "--schedule"),
    "--warmup-epochs": (["--warmup-epochs", "-1"], "--warmup-epochs"),
    "--momentum": (["--momentum", "1.5"], "--momentum"),
    "--weight-decay": (["--weight-decay", "-0.1"], "--weight-decay"),
    "--seed": (["--seed", "-1"], "--seed"),
    "--max-steps-per-epoch": (["--max-steps-per-epoch", "0"], "--max-steps-per-epoch"),
    "--out": (["--out", "FILE"], "--out"),
    "--resume": (["--resume", "--out", "EMPTY"], "--resume"),
    "--overwrite": (["--overwrite=1"], "--overwrite"),
    "--migrate-pickle": (["--migrate-pickle"], "--migrate-pickle"),
    "--quiet": (["--quiet=no"], "--quiet"),
}

# the cases beyond one per flag
MORE = [
    (["--epochs", "-3"], "--epochs"),
    (["--batch-size", "2.5"], "--batch-size"),
    (["--compress", "cgx:bucket=2.5"], "bucket_size"),
    (["--compress", "powersgd:rank=1.5"], "rank"),
    (["--compress", "cgx:min_size=abc"], "min_size"),
    (["--compress", "cgx:bits=9"], "bits"),
    (["--tile", "4"], "--tile"),  # no HBFP: the tile would be ignored
    (["--hbfp", "8", "--weight-man", "99"], "--weight-man"),
    (["--warmup-epochs", "1"], "--warmup-epochs"),  # constant schedule: unused
    (["--nodes", "3", "--batch-size", "64"], "--batch-size"),
    # issue 49: integers past what JAX/XLA take were tracebacks or crashes of the process
    (["--seed", "99999999999999999999"], "--seed"),  # OverflowError in jax.random.key
    (["--seed", "4294967296"], "--seed"),  # would alias seed 0 (32-bit seeds)
    (["--tile", "2147483647", "--hbfp", "7"], "--tile"),  # XLA aborted the process
    (["--tile", "4294967296", "--hbfp", "7"], "--tile"),  # segmentation fault
    (["--epochs", "99999999999999999999"], "--epochs"),
    (["--nodes", "99999999999999999999", "--batch-size", "99999999999999999999"], "--nodes"),
    (["--batch-size", "1440"], "--batch-size"),  # more than digits' 1,438 training images
    (["--compress", "powersgd:start_iter=99999999999999999999"], "start_iter"),
    (["--compress", "dgc:warmup=99999999999999999999", "--momentum", "0"], "warmup"),
    # a model that cannot fit: refused from its shapes before allocating (the issue's
    # --width 20000 needs 382 GiB with 2 workers; this one TiBs, beyond any machine's memory)
    (["--width", "100000"], "--width"),
    # issue 45: the language models and their text
    (["--seq-len", "16"], "--seq-len"),  # the mlp has no sequence
    (["--dropout", "0.2"], "--dropout"),
    (["--data", "text"], "--data text"),  # text is for the language models
    (["--model", "lstm", "--data", "digits"], "--model lstm"),
    (["--model", "lstm", "--tokens", "words"], "--tokens words"),  # words need --data-dir
    (["--model", "lstm", "--lars"], "--lars"),  # LARS is SGD; the LMs default to Adam
    (["--model", "bert", "--data-dir", "/nonexistent"], "--data-dir"),
    (["--model", "transformer", "--batch-size", "8000"], "--batch-size"),  # > the text
    (["--model", "lstm", "--width", "100000"], "--width"),
]


def _train_flags():
  p = build_parser()
  sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
  return sorted(o for a in sub.choices["train"]._actions for o in a.option_strings
                if o.startswith("--") and o != "--help")


def _run(argv, capsys):
  try:
    rc = main(argv)
  except SystemExit as e:
    rc = e.code
  return rc, capsys.readouterr().err


def _materialize(args, tmp_path):
  f = tmp_path / "file"
  f.write_text("not a folder")
  (tmp_path / "empty").mkdir(exist_ok=True)
  return [str(f) if a == "FILE" else str(tmp_path / "empty") if a == "EMPTY" else a
          for a in args]


def test_every_flag_is_walked():
  assert sorted(BAD) == _train_flags()


@pytest.mark.parametrize("args,needle", list(BAD.values()) + MORE,
                         ids=list(BAD) + [" ".join(a) for a, _ in MORE])
def test_bad_flag_value_is_one_line_exit_2(args, needle, capsys, tmp_path):
  rc, err = _run(["train"] + QUICK + _materialize(args, tmp_path), capsys)
  assert rc == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxlp train: error: "), err
  assert needle in lines[0] and "Traceback" not in err


@pytest.mark.usefixtures("fast_compile")  # two runs of this test differ; any level
def test_hbfp_tile_defines_the_run():
  """--hbfp with tiles 4 and 24 gives two different runs (the tile was ignored)."""
  losses = []
  for tile in (4, 24):
    t = Trainer(TrainConfig(nodes=1, batch_size=32, hbfp=3, tile=tile, max_steps_per_epoch=1,
                            quiet=True))
    losses.append(t.run_epoch()["train_loss"])
  assert losses[0] != losses[1], losses
  # tile 0 (one exponent per tensor) is a third format; -1 is refused (test above)
  from jaxlp.training._loop import _policy

  fmts = {_policy(TrainConfig(hbfp=3, tile=tile)).lhs.fmt for tile in (0, 4, 24)}
  assert len(fmts) == 3


def test_width_is_used_by_every_model():
  import jax

  from jaxlp.training import build_model

  n = {}
  for model in ("mlp", "cnn"):
    for w in (4, 16):
      m = build_model(model, 10, width=w)
      v = jax.eval_shape(lambda m=m: m.init(jax.random.key(0), jnp.zeros((2, 8, 8, 1))))
      n[model, w] = sum(x.size for x in jax.tree_util.tree_leaves(v["params"]))
  assert n["mlp", 4] < n["mlp", 16] and n["cnn", 4] < n["cnn", 16]
  assert n["mlp", 16] == 8 * 8 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10  # the default


def test_a_policy_or_the_portable_layers_change_no_parameter():
  """The trainer initialises the plain model for every run (jaxlp.training._loop): a model
  built with a policy's dot_general / conv_general_dilated, or with the portable layers,
  has the plain model's parameters, bit for bit."""
  import jax

  from jaxlp.training import build_model

  pol = jaxlp.hbfp_policy(7, 24)
  x = jnp.zeros((2, 8, 8, 1))

  def init(m):
    v = jax.jit(lambda k, x: m.init(k, x, train=False))(jax.random.key(3), x)
    return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(v)]

  for model in ("mlp", "cnn"):
    plain = init(build_model(model, 10, width=1))
    assert init(build_model(model, 10, width=1, portable=True)) == plain, model
    assert init(build_model(model, 10, width=1, dot_general=jaxlp.dot_general(pol),
                            conv_general_dilated=jaxlp.conv_general_dilated(pol))) == plain


@pytest.mark.usefixtures("fast_compile")  # a count of NaN losses
def test_nonfinite_steps_counts_a_nan_loss():
  t = Trainer(TrainConfig(nodes=2, batch_size=32, max_steps_per_epoch=2, quiet=True))
  t.ds.y_train[:] = 99  # out of range (loaders refuse this; the count must still see it)
  m = t.run_epoch()
  assert not np.isfinite(m["train_loss"]) and m["nonfinite_steps"] == 2


def test_config_types_are_checked():
  with pytest.raises(TypeError, match="--batch-size"):
    Trainer(TrainConfig(batch_size=64.0))
  with pytest.raises(TypeError, match="--aps"):
    Trainer(TrainConfig(aps=1))
  with pytest.raises(ValueError, match="--epochs"):
    Trainer(TrainConfig(epochs=0))
  with pytest.raises(ValueError, match="--seed must be at most 4294967295"):
    Trainer(TrainConfig(seed=2**40))
  with pytest.raises(ValueError, match="--tile must be at most 4096"):
    Trainer(TrainConfig(hbfp=7, tile=5000))
  with pytest.raises(ValueError, match="--epochs 1073741824: the triangle schedule"):
    Trainer(TrainConfig(epochs=2**30, schedule="triangle", max_steps_per_epoch=2))


@pytest.mark.usefixtures("fast_compile")  # errors and their messages
def test_out_of_device_memory_at_run_time_is_one_line(monkeypatch, capsys):
  """XLA's RESOURCE_EXHAUSTED while a step or the evaluation runs (which the estimate from
  the shapes cannot see: activations, fragmentation) becomes one line naming the flags."""
  import jax

  def oom(*a, **k):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                     "allocate 123456789 bytes.\nBufferAssignment: ...")

  monkeypatch.setattr(Trainer, "evaluate", oom)
  rc, err = _run(["train"] + QUICK, capsys)
  line = err.strip()
  assert rc == 2 and len(line.splitlines()) == 1 and "Traceback" not in err, err
  assert line.startswith("jaxlp train: error: out of device memory while evaluating "
                         "(RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                         "123456789 bytes.)") and "--width" in line and "--batch-size" in line
  t = Trainer(TrainConfig(nodes=2, width=2, batch_size=16, max_steps_per_epoch=1, quiet=True))
  t._make_train_step = lambda comp: oom
  with pytest.raises(ValueError, match="out of device memory while running step 1"):
    t.run_epoch()

  def other(*a, **k):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  t._train_steps.clear()
  t._make_train_step = lambda comp: other
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # not hidden
    t.run_epoch()


@pytest.mark.parametrize("factory,kw,name", [
    (C.cgx, dict(bits=4.5), "bits"), (C.cgx, dict(bucket_size=2.5), "bucket_size"),
    (C.cgx, dict(bits="4"), "bits"), (C.powersgd, dict(rank=1.5), "rank"),
    (C.powersgd, dict(start_iter="0"), "start_iter"), (C.qsgd, dict(levels=3.0), "levels"),
    (C.dgc, dict(warmup=0.5), "warmup"), (C.topk, dict(ratio="0.1"), "ratio"),
    (C.terngrad, dict(bits=2.0), "bits"), (C.tbq, dict(threshold="1"), "threshold"),
])
def test_compressor_int_options_reject_floats_and_strings(factory, kw, name):
  with pytest.raises(TypeError, match=name):
    factory(**kw)


def test_block_axes_out_of_range_are_errors():
  x = jnp.ones((4, 6), jnp.float32)
  for fmt in (F.BlockFormat(8, tile=None, axis=5), F.mx(F.E4M3FN, 2, axis=3),
              F.mx(F.E4M3FN, 2, axis=-3)):
    for q in (jaxlp.quantize, F.quantize):
      with pytest.raises(ValueError, match="axis .* out of range"):
        q(x, fmt)
  # in range (negative too) is fine and the same as the positive spelling
  np.testing.assert_array_equal(jaxlp.quantize(x * 3.3, F.mx(F.E4M3FN, 2, axis=-2)),
                                jaxlp.quantize(x * 3.3, F.mx(F.E4M3FN, 2, axis=0)))


@pytest.mark.parametrize("mm", ["jaxlp", "pallas"])
def test_matmul_follows_quantize_dtype_rules_and_checks_axes(mm):
  # jaxlp.pallas.matmul shares jaxlp.matmul's operand checks (one prologue, pallas/_gemm.py)
  matmul = (jaxlp.matmul if mm == "jaxlp"
            else functools.partial(jaxlp.pallas.matmul, interpret=True))
  a64, b64 = np.ones((2, 3)), np.ones((3, 2))
  with pytest.raises(TypeError, match="float64") as e1:
    matmul(a64, b64)
  with pytest.raises(TypeError, match="float64") as e2:
    jaxlp.quantize(a64, F.BF16)
  assert type(e1.value) is type(e2.value)  # the same DTypeError
  a, b = a64.astype(np.float32), b64.astype(np.float32)
  with pytest.raises(ValueError, match="out of range"):
    matmul(a, b, dimension_numbers=(((3,), (0,)), ((), ())))
  with pytest.raises(ValueError, match="twice"):
    matmul(a, b, dimension_numbers=(((1, -1), (0, 0)), ((), ())))
  np.testing.assert_array_equal(matmul(a, b, dimension_numbers=(((-1,), (0,)), ((), ()))),
                                np.full((2, 2), 3.0, np.float32))
