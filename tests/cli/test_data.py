"""Dataset readers: CIFAR-10 python batches and MNIST IDX files (written here, small)."""

import gzip
import os
import pickle

import numpy as np
import pytest

from jaxlp.cli import main
from jaxlp.training import _data as D


def _write_cifar(root, n=20):
  d = os.path.join(root, "cifar-10-batches-py")
  os.makedirs(d)
  rng = np.random.default_rng(0)
  for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
    batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             b"labels": list(rng.integers(0, 10, n))}
    with open(os.path.join(d, name), "wb") as f:
      pickle.dump(batch, f)
  return batch


def _write_idx(path, arr):
  arr = np.asarray(arr, np.uint8)
  header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in arr.shape)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "wb") as f:
    f.write(header + arr.tobytes())


@pytest.mark.usefixtures("fast_compile")  # the layout, and that a run trains on it
def test_cifar10_reader_layout_and_training(tmp_path):
  last = _write_cifar(str(tmp_path))
  ds = D.load("cifar10", str(tmp_path))
  assert ds.x_train.shape == (100, 32, 32, 3) and ds.x_test.shape == (20, 32, 32, 3)
  # CHW rows -> HWC: pixel (0, 0) of the red plane is byte 0, of the green plane byte 1024.
  raw = last[b"data"][0]
  mean, std = 0.4914, 0.2470
  assert ds.x_test[0, 0, 0, 0] == pytest.approx((raw[0] / 255 - mean) / std, rel=1e-5)
  assert ds.x_test[0, 0, 0, 1] == pytest.approx((raw[1024] / 255 - 0.4822) / 0.2435, rel=1e-5)
  assert list(ds.y_test) == list(last[b"labels"])
  out = str(tmp_path / "run")
  assert main(["train", "--data", "cifar10", "--data-dir", str(tmp_path), "--model", "cnn",
               "--width", "4", "--nodes", "2", "--batch-size", "20", "--epochs", "1",
               "--quiet", "--out", out]) == 0
  assert os.path.exists(os.path.join(out, "metrics.jsonl"))


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_mnist_idx_reader(tmp_path, suffix):
  rng = np.random.default_rng(1)
  xtr, ytr = rng.integers(0, 256, (12, 28, 28)), rng.integers(0, 10, 12)
  xte, yte = rng.integers(0, 256, (4, 28, 28)), rng.integers(0, 10, 4)
  for stem, arr in [("train-images-idx3-ubyte", xtr), ("train-labels-idx1-ubyte", ytr),
                    ("t10k-images-idx3-ubyte", xte), ("t10k-labels-idx1-ubyte", yte)]:
    _write_idx(str(tmp_path / (stem + suffix)), arr)
  ds = D.load("mnist", str(tmp_path))
  assert ds.x_train.shape == (12, 28, 28, 1) and list(ds.y_test) == list(yte)
  assert ds.x_train[3, 5, 7, 0] == pytest.approx((xtr[3, 5, 7] / 255 - 0.1307) / 0.3081, rel=1e-5)


def test_missing_files_are_clear_errors(tmp_path):
  with pytest.raises(ValueError, match="CIFAR-10 file missing"):
    D.load("cifar10", str(tmp_path))
  with pytest.raises(ValueError, match="MNIST file missing"):
    D.load("mnist", str(tmp_path))
  with pytest.raises(ValueError, match="needs --data-dir"):
    D.load("cifar10", None)


def _write_mnist(root, suffix="", ytr=None, n_labels=12):
  rng = np.random.default_rng(1)
  ytr = rng.integers(0, 10, n_labels) if ytr is None else ytr
  for stem, arr in [("train-images-idx3-ubyte", rng.integers(0, 256, (12, 28, 28))),
                    ("train-labels-idx1-ubyte", ytr),
                    ("t10k-images-idx3-ubyte", rng.integers(0, 256, (4, 28, 28))),
                    ("t10k-labels-idx1-ubyte", rng.integers(0, 10, 4))]:
    _write_idx(os.path.join(root, stem + suffix), arr)


def _cli_error(argv, capsys):
  rc = main(argv)
  err = capsys.readouterr().err
  assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
  return err


@pytest.mark.parametrize("damage", ["garbage", "empty", "labels", "count", "shape"])
def test_damaged_cifar_is_a_clear_error_naming_the_file(tmp_path, capsys, damage):
  _write_cifar(str(tmp_path))
  path = os.path.join(str(tmp_path), "cifar-10-batches-py", "data_batch_3")
  rng = np.random.default_rng(2)
  batch = {b"data": rng.integers(0, 256, (20, 3072), dtype=np.uint8),
           b"labels": list(rng.integers(0, 10, 20))}
  if damage == "labels":
    batch[b"labels"][5] = 10
  elif damage == "count":
    batch[b"labels"] = batch[b"labels"][:19]
  elif damage == "shape":
    batch[b"data"] = batch[b"data"][:, :3000]
  with open(path, "wb") as f:
    if damage == "garbage":
      f.write(b"\x80\x04garbage")
    elif damage != "empty":
      pickle.dump(batch, f)
  with pytest.raises(ValueError, match="data_batch_3"):
    D.load("cifar10", str(tmp_path))
  err = _cli_error(["train", "--data", "cifar10", "--data-dir", str(tmp_path), "--quiet"], capsys)
  assert "data_batch_3" in err


@pytest.mark.parametrize("damage", ["gzip", "labels", "count", "truncated"])
def test_damaged_mnist_is_a_clear_error_naming_the_file(tmp_path, capsys, damage):
  root = str(tmp_path)
  if damage == "labels":
    _write_mnist(root, ".gz", ytr=np.array([0, 1, 2, 11] + [0] * 8))
  elif damage == "count":
    _write_mnist(root, ".gz", n_labels=11)
  else:
    _write_mnist(root, ".gz")
  p = os.path.join(root, "train-images-idx3-ubyte.gz")
  if damage == "gzip":
    open(p, "wb").write(b"\x1f\x8b\x08not really gzip")
  elif damage == "truncated":
    raw = gzip.open(p).read()
    with gzip.open(p, "wb") as f:
      f.write(raw[:-5])
  with pytest.raises(ValueError, match="train-"):
    D.load("mnist", root)
  err = _cli_error(["train", "--data", "mnist", "--data-dir", root, "--quiet"], capsys)
  assert "train-" in err and ("label" in err or "images-idx3" in err)


def test_mnist_of_0x0_images_is_a_clear_error_naming_the_file(tmp_path, capsys):
  """IDX files whose images have 0 rows and 0 columns (header and size agree): Flax's
  initializer divided by zero; the reader refuses them naming the file."""
  root = str(tmp_path)
  _write_mnist(root)
  p = os.path.join(root, "train-images-idx3-ubyte")
  _write_idx(p, np.zeros((12, 0, 0)))
  with pytest.raises(ValueError, match="train-images-idx3-ubyte: the images are 0x0 pixels"):
    D.load("mnist", root)
  err = _cli_error(["train", "--data", "mnist", "--data-dir", root, "--quiet"], capsys)
  assert p in err and "0x0" in err
