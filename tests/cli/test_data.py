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
