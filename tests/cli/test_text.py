"""Text for the language models (built-in pydoc_data topics, Penn Treebank / WikiText-2 layout
from a folder; crafted small files here), BPTT windows, and ``jaxlp train --model
lstm|transformer|bert`` end to end: perplexity in the metrics, resume, every quantization and
reduction, compare and plot."""

import json
import os

import numpy as np
import pytest

from jaxlp.cli import main
from jaxlp.training import TrainConfig, Trainer, train
from jaxlp.training import _text as T

# XLA's optimizations off for every test here (tests/conftest.py, ``fast_compile``): the runs
# check metrics, ranges, reports and files, and the one bit comparison (resume == one run) is
# between two runs of the same test. Resume's bits on a normally compiled program:
# tests/cli/test_cli.py (test_resume_equals_uninterrupted) and tests/cli/test_runs.py.
pytestmark = pytest.mark.usefixtures("fast_compile")

# the smallest language models: width 1 (8 units), one layer, windows of 8, 2 workers
TINY = ["--width", "1", "--layers", "1", "--seq-len", "8", "--batch-size", "4", "--nodes", "2",
        "--epochs", "1", "--max-steps-per-epoch", "2", "--quiet"]
TINY_CFG = dict(width=1, layers=1, seq_len=8, batch_size=4, nodes=2, max_steps_per_epoch=2,
                quiet=True)
LM_KEYS = {"epoch", "train_loss", "valid_loss", "valid_perplexity", "test_loss", "perplexity",
           "wire_bytes", "steps", "nonfinite_steps", "seconds"}


def _metrics(d):
  with open(os.path.join(d, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _write_corpus(root, train=None, valid=None, test=None):
  """A tiny PTB-like folder: lines of words (train has 60 tokens per 5 lines of 11 words)."""
  os.makedirs(root, exist_ok=True)
  words = ["the", "cat", "sat", "on", "a", "mat", "<unk>", "dog", "ran", "N"]
  rng = np.random.default_rng(0)
  line = lambda: " " + " ".join(rng.choice(words, 11)) + " \n"
  texts = {"train": train if train is not None else "".join(line() for _ in range(40)),
           "valid": valid if valid is not None else "".join(line() for _ in range(4)),
           "test": test if test is not None else "".join(line() for _ in range(4))}
  for name, text in texts.items():
    mode = "wb" if isinstance(text, bytes) else "w"
    with open(os.path.join(root, f"{name}.txt"), mode) as f:
      f.write(text)
  return texts


def test_builtin_text_is_the_pydoc_topics_with_a_fixed_split():
  data = T.builtin_text()
  ds = T.load()
  assert (ds.vocab_size, ds.num_tokens, ds.mask_id, ds.tokens) == (257, 256, 256, "bytes")
  n = len(data)
  a, b = int(n * 0.90), int(n * 0.95)
  assert (len(ds.train), len(ds.valid), len(ds.test)) == (a, b - a, n - b)
  joined = np.concatenate([ds.train, ds.valid, ds.test]).astype(np.uint8).tobytes()
  assert joined == data and ds.train.dtype == np.int32
  assert n > 400_000  # CPython's topics: 466,195 bytes in 3.11.7
  from pydoc_data import topics

  assert data.decode("utf-8").startswith(topics.topics[sorted(topics.topics)[0]])


def test_word_corpus_follows_the_pytorch_example(tmp_path):
  """Words split on whitespace, <eos> per line, ids in order of first appearance in
  train.txt; a valid/test word that train never saw is <unk>, <mask> last."""
  _write_corpus(str(tmp_path), train="a b\nb c a\n", valid="a zz\n", test="c\n")
  ds = T.load(str(tmp_path))
  assert ds.vocab == ("a", "b", "<eos>", "c", "<unk>", "<mask>")
  assert (ds.vocab_size, ds.num_tokens, ds.mask_id, ds.tokens) == (6, 5, 5, "words")
  assert ds.train.tolist() == [0, 1, 2, 1, 3, 0, 2]
  assert ds.valid.tolist() == [0, 4, 2] and ds.test.tolist() == [3, 2]
  # a training text with <unk> keeps its id; bytes read the same files byte by byte
  _write_corpus(str(tmp_path), train="<unk> x\n", valid="y\n", test="x\n")
  assert T.load(str(tmp_path)).valid.tolist() == [0, 2]
  b = T.load(str(tmp_path), "bytes")
  assert b.tokens == "bytes" and bytes(b.test.astype(np.uint8)) == b"x\n"


def test_lm_windows_are_bptt_windows():
  """rows streams of (n - 1) // rows tokens; window j = columns j*T..(j+1)*T-1 of each stream,
  the targets one token later; partial=True pads the last window with weight 0."""
  ids = np.arange(23, dtype=np.int32)  # 22 input/target pairs -> 2 rows of 11
  x, y, w = T.lm_windows(ids, 2, 4)
  assert x.shape == (2, 2, 4)  # 2 full windows of 4 (the last 3 columns dropped)
  assert x[0].tolist() == [[0, 1, 2, 3], [11, 12, 13, 14]]
  assert x[1].tolist() == [[4, 5, 6, 7], [15, 16, 17, 18]]
  np.testing.assert_array_equal(y, x + 1)
  assert w.min() == 1.0
  x, y, w = T.lm_windows(ids, 2, 4, partial=True)
  assert x.shape == (3, 2, 4) and x[2].tolist() == [[8, 9, 10, 0], [19, 20, 21, 0]]
  assert w[2].tolist() == [[1, 1, 1, 0]] * 2 and float(w.sum()) == 22  # each target once


@pytest.mark.parametrize("which, content, needle", [
    ("train", None, "text file missing: {path}"),
    ("valid", "", "{path} is empty"),
    ("test", " \n\n", "{path} is empty"),
    ("train", b"\x00\x01\x02garbage\xff", "{path} is not a text file: it holds NUL bytes"),
    ("valid", "the cat sat\n".encode("utf-16"), "{path} is not a text file"),
    ("test", "caf\xe9 au lait\n".encode("latin-1"), "{path} is not UTF-8 text: byte 0xe9"),
    ("train", "folder", "{path} is a folder, not a text file"),
])
def test_damaged_text_files_are_one_error_naming_the_file(tmp_path, capsys, which, content,
                                                           needle):
  root = str(tmp_path / "ptb")
  _write_corpus(root)
  path = os.path.join(root, f"{which}.txt")
  os.remove(path)
  if content == "folder":
    os.mkdir(path)
  elif content is not None:
    with open(path, "wb" if isinstance(content, bytes) else "w") as f:
      f.write(content)
  rc = main(["train", "--model", "lstm", "--data-dir", root] + TINY)
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
  assert err.startswith("jaxlp train: error: ") and needle.format(path=path) in err, err


def test_data_dir_that_is_not_a_folder(tmp_path, capsys):
  f = tmp_path / "train.txt"
  f.write_text("a b c\n")
  for bad in (str(f), str(tmp_path / "missing")):
    assert main(["train", "--model", "bert", "--data-dir", bad] + TINY) == 2
    assert f"--data-dir {bad!r} is not a directory" in capsys.readouterr().err


def test_split_with_one_token_is_refused(tmp_path, capsys):
  """--tokens bytes and a test.txt of one byte: no (input, target) pair to evaluate, refused
  naming the file (a word file always has 2: every line ends with <eos>)."""
  _write_corpus(str(tmp_path), test="x")
  assert main(["train", "--model", "lstm", "--data-dir", str(tmp_path), "--tokens", "bytes"]
              + TINY) == 2
  path = os.path.join(str(tmp_path), "test.txt")
  err = capsys.readouterr().err
  assert f"{path} holds 1 token(s); a language model needs at least 2" in err, err
  assert len(err.strip().splitlines()) == 1


def test_text_too_short_for_a_batch(tmp_path, capsys):
  _write_corpus(str(tmp_path), train="a b c d e f\n")
  assert main(["train", "--model", "transformer", "--data-dir", str(tmp_path)] + TINY) == 2
  err = capsys.readouterr().err
  assert "--batch-size 4 x --seq-len 8" in err and "7 tokens" in err


def test_lstm_train_and_resume_equal_one_run(tmp_path):
  """jaxlp train --model lstm on the built-in text: perplexity metrics; a run resumed after
  epoch 1 equals the uninterrupted 2-epoch run bit for bit (the same metrics and state)."""
  full, part = str(tmp_path / "full"), str(tmp_path / "part")
  two = TINY[:TINY.index("--epochs")] + ["--epochs", "2"] + TINY[TINY.index("--epochs") + 2:]
  assert main(["train", "--model", "lstm", "--out", full] + two) == 0
  assert main(["train", "--model", "lstm", "--out", part] + TINY) == 0
  assert main(["train", "--model", "lstm", "--out", part, "--resume"] + two) == 0
  mf, mp = _metrics(full), _metrics(part)
  assert [m["epoch"] for m in mf] == [1, 2] and set(mf[0]) == LM_KEYS
  for m in mf:
    assert m["perplexity"] == pytest.approx(np.exp(m["test_loss"]), rel=1e-12)
    assert m["valid_perplexity"] == pytest.approx(np.exp(m["valid_loss"]), rel=1e-12)
    assert 1.0 < m["perplexity"] < 257 * 1.5 and m["nonfinite_steps"] == 0
  strip = lambda ms: [{k: v for k, v in m.items() if k != "seconds"} for m in ms]
  assert strip(mf) == strip(mp)
  from test_cli import _checkpoint_state

  sf, sp = _checkpoint_state(full), _checkpoint_state(part)
  assert sorted(sf) == sorted(sp) and any("['embed']" in k for k in sf)
  for k in sf:  # the same bits (Adam's step count is a 0-d int)
    assert np.asarray(sf[k]).tobytes() == np.asarray(sp[k]).tobytes(), k
  cfg = json.load(open(os.path.join(full, "config.json")))
  assert (cfg["model"], cfg["data"], cfg["tokens"], cfg["optimizer"], cfg["seq_len"]) == (
      "lstm", "text", "bytes", "adam", 8)


# The compressors' and the low-precision sums' cases run with elementwise (or no) policies:
# the block policies cost 10-20x as many traced equations per matmul, and their paths on the
# language models are run elsewhere: HBFP8 (--hbfp 8 --weight-man 16) and E5M2 training of
# the LSTM and BERT in tests/cli/test_reproduce.py (toy rows), HBFP8's forward and backward of
# all three models below (test_lm_step_has_no_unquantized_matmul_under_hbfp8) and the transformer's
# HBFP8 (exact) step in tests/test_sequence_bench_smoke.py, MXFP8's LSTM gradients there and
# MX blocks in attention in tests/flax_integration/test_whole_model.py; MX (mxint8) training
# of a language model in the last case here.
@pytest.mark.parametrize("model, flags", [
    ("transformer", ["--policy", "e4m3", "--compress", "cgx:bits=4"]),
    ("bert", ["--policy", "bf16", "--compress", "powersgd:rank=1"]),
    ("transformer", ["--policy", "e5m2", "--compress", "dgc:ratio=0.01", "--momentum", "0",
                     "--tokens", "words"]),
    # exact integer block dots on every (batch, sequence, features) GEMM, low-precision sums
    # (APS, Kahan); a folder's bytes. (A named --grad-format: tests/cli/test_shard.py; APS and
    # Kahan were a case of their own, a second LSTM run traced, compiled and run.)
    ("lstm", ["--policy", "mxint8", "--exact-blocks", "--grad-exp", "4", "--grad-man", "3",
              "--aps", "--kahan", "--tokens", "bytes"]),
])
def test_every_policy_and_reduction_runs_on_the_language_models(tmp_path, model, flags):
  """The CNNs' quantization policies (elementwise, a recipe's BF16, MX with exact block dots),
  low-precision sums (APS, Kahan) and compressors on the language models (words from a folder
  for one of them): a finite perplexity and wire bytes."""
  out = str(tmp_path / "run")
  data = ["--data-dir", _corpus(tmp_path)] if "--tokens" in flags else []
  assert main(["train", "--model", model, "--out", out] + data + TINY + flags) == 0
  (m,) = _metrics(out)
  assert set(m) == LM_KEYS and np.isfinite(m["perplexity"]) and m["wire_bytes"] > 0
  cfg = json.load(open(os.path.join(out, "config.json")))
  assert cfg["wire_bytes_per_step"] > 0


def _corpus(tmp_path):
  root = str(tmp_path / "ptb")
  _write_corpus(root)
  return root


def test_lm_step_has_no_unquantized_matmul_under_hbfp8():
  """The trainer's model under --policy hbfp8 (through jaxlp.flax.quantize_model): the loss +
  gradient step of each language model leaves no matmul in fp32."""
  import jax
  import jax.numpy as jnp

  for model in ("lstm", "transformer", "bert"):
    t = Trainer(TrainConfig(model=model, policy="hbfp8", **TINY_CFG))
    x = jnp.zeros((2, 8), jnp.int32)
    r = t.qmodel.matmul_report({"params": t.params}, x, train=True,
                               rngs={"dropout": jax.random.key(0)}, loss_fn=jnp.sum)
    assert len(r) > 0 and r.unquantized_ops() == [], (model, r.unquantized_ops())
    assert r.count(status="quantized") == len(r)


def test_compare_and_plot_show_perplexity(tmp_path, capsys):
  out = str(tmp_path / "cmp")
  assert main(["compare", "--out", out, "--config", "fp32=", "--config", "E4M3=--policy e4m3",
               "--", "--model", "lstm"] + TINY[:-1]) == 0
  text = capsys.readouterr().out
  assert "final ppl" in text and "best ppl" in text and "final acc" not in text
  summary = json.load(open(os.path.join(out, "summary.json")))
  assert [s["config"] for s in summary] == ["fp32", "E4M3"]
  assert all(s["final_perplexity"] > 1 and "final_test_accuracy" not in s for s in summary)
  for name in ("perplexity_vs_epoch.png", "perplexity_vs_wire_bytes.png"):
    assert os.path.getsize(os.path.join(out, name)) > 1000
  assert not os.path.exists(os.path.join(out, "accuracy_vs_epoch.png"))
  pdir = str(tmp_path / "plots")
  assert main(["plot", os.path.join(out, "fp32"), "--out", pdir]) == 0
  assert os.path.getsize(os.path.join(pdir, "perplexity_vs_epoch.png")) > 1000


def test_compare_table_mixes_classifiers_and_language_models():
  from jaxlp.cli import compare_table

  cls = [{"epoch": 1, "train_loss": 0.5, "test_accuracy": 0.9, "wire_bytes": 10, "seconds": 1}]
  lm = [{"epoch": 1, "train_loss": 2.0, "perplexity": 7.5, "wire_bytes": 10, "seconds": 1}]
  table = compare_table([("mlp", cls), ("lstm", lm)]).splitlines()
  assert table[0].split() == ["config", "final", "acc", "best", "acc", "final", "ppl", "best",
                              "ppl", "final", "loss", "wire", "MB", "seconds"]
  assert table[2].split()[:5] == ["mlp", "0.9000", "0.9000", "-", "-"]
  assert table[3].split()[:5] == ["lstm", "-", "-", "7.500", "7.500"]


def test_library_defaults_of_the_language_models():
  c = TrainConfig(model="bert", data_dir="/x")
  assert (c.data, c.tokens, c.optimizer, c.batch_size, c.lr) == ("text", "words", "adam", 32,
                                                                   0.002)
  assert (c.seq_len, c.layers, c.dropout) == (64, 2, 0.1)
  c = TrainConfig()
  assert (c.data, c.tokens, c.optimizer, c.batch_size, c.lr, c.seq_len) == (
      "digits", None, "sgd", 128, 0.05, None)
  h = train(TrainConfig(model="lstm", epochs=1, **TINY_CFG))
  assert set(h[0]) == LM_KEYS
