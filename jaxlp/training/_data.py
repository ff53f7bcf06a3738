"""Datasets for the ``jaxlp`` command: built-in digits/synthetic, CIFAR-10 and MNIST from disk,
and text for the language models (:mod:`jaxlp.training._text`)."""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import pickle
import zlib

import numpy as np

DATASETS = ("digits", "synthetic", "cifar10", "mnist", "text")


@dataclasses.dataclass
class Dataset:
  """A classification dataset in memory: float32 NHWC images and int32 labels.

  Example:
    >>> from jaxlp.training import load_dataset
    >>> d = load_dataset("synthetic")
    >>> d.x_train.shape, d.num_classes
    ((1638, 8, 8, 1), 10)
  """

  x_train: np.ndarray  # float32, NHWC
  y_train: np.ndarray  # int32
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  name: str


def _split(x, y, test_fraction, seed):
  rng = np.random.default_rng(seed)
  idx = rng.permutation(len(x))
  n_test = int(round(len(x) * test_fraction))
  te, tr = idx[:n_test], idx[n_test:]
  return x[tr], y[tr], x[te], y[te]


def load_digits(seed: int = 0) -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits (1797 real images, no download)."""
  try:
    from sklearn.datasets import load_digits as _ld
  except ImportError as e:  # pragma: no cover
    raise ImportError("--data digits needs scikit-learn: pip install 'jaxlp[examples]'") from e
  d = _ld()
  x = (d.images.astype(np.float32) / 16.0)[..., None]  # (N, 8, 8, 1) in [0, 1]
  x = (x - 0.3) / 0.4
  y = d.target.astype(np.int32)
  xtr, ytr, xte, yte = _split(x, y, 0.2, seed=1234)  # fixed split, independent of --seed
  return Dataset(xtr, ytr, xte, yte, 10, "digits")


def load_synthetic(seed: int = 0, n: int = 2048, shape=(8, 8, 1), classes: int = 10) -> Dataset:
  """Gaussian clusters: a quick, learnable, download-free problem."""
  rng = np.random.default_rng(seed + 99)
  centers = rng.normal(size=(classes, int(np.prod(shape)))).astype(np.float32)
  y = rng.integers(0, classes, size=n).astype(np.int32)
  x = centers[y] + 0.8 * rng.normal(size=(n, centers.shape[1])).astype(np.float32)
  x = x.reshape((n,) + tuple(shape))
  xtr, ytr, xte, yte = _split(x, y, 0.2, seed=1234)
  return Dataset(xtr, ytr, xte, yte, classes, "synthetic")


def _need_dir(data_dir, name):
  if not data_dir:
    raise ValueError(f"--data {name} needs --data-dir pointing at the dataset files")
  if not os.path.isdir(data_dir):
    raise ValueError(f"--data-dir {data_dir!r} is not a directory")


def _check_split(x, y, num_classes, what):
  """Counts and label range of one split (``what`` names the files)."""
  if len(x) != len(y):
    raise ValueError(f"{what}: {len(x)} images but {len(y)} labels")
  if len(y) == 0:
    raise ValueError(f"{what}: no examples")
  if y.min() < 0 or y.max() >= num_classes:
    bad = int(y[(y < 0) | (y >= num_classes)][0])
    raise ValueError(f"{what}: label {bad} is outside 0..{num_classes - 1}")


def load_cifar10(data_dir: str) -> Dataset:
  """CIFAR-10 python pickle batches (``data_batch_1..5``, ``test_batch``) from ``data_dir``."""
  _need_dir(data_dir, "cifar10")
  base = data_dir
  if os.path.isdir(os.path.join(data_dir, "cifar-10-batches-py")):
    base = os.path.join(data_dir, "cifar-10-batches-py")

  def read(name):
    path = os.path.join(base, name)
    if not os.path.exists(path):
      raise ValueError(f"CIFAR-10 file missing: {path}")
    # The CIFAR-10 distribution format is a pickle (trusted data the user downloaded).
    try:
      with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")  # noqa: S301
    except Exception as e:  # pickle raises many types for damaged input
      raise ValueError(f"{path} is not a CIFAR-10 batch ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict) or b"data" not in d or b"labels" not in d:
      raise ValueError(f"{path} is not a CIFAR-10 batch (no b'data'/b'labels' entries)")
    try:
      x = np.asarray(d[b"data"])
      y = np.asarray(d[b"labels"])
    except Exception as e:
      raise ValueError(f"{path}: unreadable data/labels ({e})") from None
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072:
      raise ValueError(f"{path}: data must be uint8 of shape (N, 3072), got {x.dtype} "
                       f"{x.shape}")
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
      raise ValueError(f"{path}: labels must be a list of ints, got {y.dtype} {y.shape}")
    _check_split(x, y, 10, path)
    return x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), y.astype(np.int32)

  parts = [read(f"data_batch_{i}") for i in range(1, 6)]
  xtr = np.concatenate([p[0] for p in parts])
  ytr = np.concatenate([p[1] for p in parts])
  xte, yte = read("test_batch")
  mean = np.array([0.4914, 0.4822, 0.4465], np.float32)
  std = np.array([0.2470, 0.2435, 0.2616], np.float32)
  norm = lambda a: ((a.astype(np.float32) / 255.0) - mean) / std
  return Dataset(norm(xtr), ytr, norm(xte), yte, 10, "cifar10")


def _read_idx(path, ndim):
  """An IDX file of unsigned bytes with ``ndim`` dimensions (ValueError naming ``path``)."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rb") as f:
      data = f.read()
  except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
    raise ValueError(f"{path} is not a readable {'gzip ' if path.endswith('.gz') else ''}"
                     f"file ({type(e).__name__}: {e})") from None
  if len(data) < 4 or data[0:2] != b"\0\0" or data[2] != 0x08:
    raise ValueError(f"{path} is not an IDX file of unsigned bytes (bad magic number)")
  if data[3] != ndim:
    raise ValueError(f"{path}: expected {ndim} dimension(s), the file has {data[3]}")
  head = 4 + 4 * ndim
  if len(data) < head:
    raise ValueError(f"{path}: truncated header")
  dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
  if len(data) - head != math.prod(dims):
    raise ValueError(f"{path}: the header says {dims} ({math.prod(dims)} bytes), the file "
                     f"holds {len(data) - head} bytes of data")
  return np.frombuffer(data, np.uint8, offset=head).reshape(dims)


def load_mnist(data_dir: str) -> Dataset:
  """MNIST IDX files (``train-images-idx3-ubyte[.gz]`` etc.) from ``data_dir``."""
  _need_dir(data_dir, "mnist")

  def find(stem):
    for suffix in ("", ".gz"):
      p = os.path.join(data_dir, stem + suffix)
      if os.path.exists(p):
        return p
    raise ValueError(f"MNIST file missing: {os.path.join(data_dir, stem)}[.gz]")

  def split(images, labels):
    pi, pl = find(images), find(labels)
    x, y = _read_idx(pi, 3), _read_idx(pl, 1).astype(np.int32)
    if 0 in x.shape[1:]:
      raise ValueError(f"{pi}: the images are {x.shape[1]}x{x.shape[2]} pixels; MNIST images "
                       "need at least 1x1 (the file is damaged or not MNIST)")
    _check_split(x, y, 10, f"{pi} / {pl}")
    return x, y

  xtr, ytr = split("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
  xte, yte = split("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
  if xtr.shape[1:] != xte.shape[1:]:
    raise ValueError(f"MNIST in {data_dir}: train images are {xtr.shape[1:]}, test images "
                     f"{xte.shape[1:]}")
  norm = lambda a: ((a.astype(np.float32) / 255.0 - 0.1307) / 0.3081)[..., None]
  return Dataset(norm(xtr), ytr, norm(xte), yte, 10, "mnist")


def load(name: str, data_dir: str | None = None, seed: int = 0, tokens: str | None = None):
  """Load a built-in dataset (exported as ``jaxlp.training.load_dataset``).

  Args:
    name: ``"digits"`` (scikit-learn's bundled 8x8 digits, no download), ``"synthetic"``,
      ``"cifar10"`` (the python pickles) or ``"mnist"`` (the IDX files) from ``data_dir``;
      ``"text"`` for the language models: the standard library's ``pydoc_data`` topics
      (byte level, no download) or ``train.txt`` / ``valid.txt`` / ``test.txt`` (Penn
      Treebank, WikiText-2) from ``data_dir`` (see :mod:`jaxlp.training._text`).
    data_dir: the folder holding CIFAR-10, MNIST or the text files (unused for the others).
    seed: the train/test split of digits and the draw of synthetic.
    tokens: text only: ``"bytes"`` or ``"words"`` (None: bytes for the built-in text, words
      for ``data_dir``).

  Returns:
    The :class:`Dataset`, or a :class:`~jaxlp.training._text.TextDataset` for ``"text"``.

  Raises:
    ValueError: an unknown name; a missing ``data_dir`` or file for CIFAR-10, MNIST or text;
      a damaged file (not a pickle/gzip/IDX file, wrong shapes, images of 0 pixels, image and
      label counts that differ, a label outside 0..9; a text file that is a folder, empty,
      binary or not UTF-8); the message names the file.

  Example:
    >>> from jaxlp.training import load_dataset
    >>> d = load_dataset("digits")
    >>> d.x_train.shape, d.x_test.shape
    ((1438, 8, 8, 1), (359, 8, 8, 1))
    >>> t = load_dataset("text")
    >>> n = len(t.train) + len(t.valid) + len(t.test)  # 466,195 bytes on Python 3.11.7
    >>> round(len(t.train) / n, 3), round(len(t.valid) / n, 3), t.vocab_size
    (0.9, 0.05, 257)
  """
  if name == "digits":
    return load_digits(seed)
  if name == "synthetic":
    return load_synthetic(seed)
  if name == "cifar10":
    return load_cifar10(data_dir)
  if name == "mnist":
    return load_mnist(data_dir)
  if name == "text":
    from jaxlp.training import _text

    return _text.load(data_dir, tokens)
  raise ValueError(f"unknown dataset {name!r}; choose from {DATASETS}")
