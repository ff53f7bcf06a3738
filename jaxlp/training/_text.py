"""Text for the language models of ``jaxlp train``: the built-in text, Penn Treebank /
WikiText-2 from a folder, and the batching (BPTT windows) of language-model training.

Built-in text (``--data text``, no ``--data-dir``): the documentation topics that ship with
every CPython in the standard library's ``pydoc_data.topics`` (the text ``help('if')``
shows), joined in sorted topic order with a newline between topics, encoded as UTF-8 and
read byte by byte. The split is fixed: the first 90% of the bytes train, the next 5%
validate, the last 5% test (cut at ``floor(0.90 n)`` and ``floor(0.95 n)``). Its size
depends on the Python version: Python 3.11.7 has 79 topics, 466,195 bytes, split
419,575 / 23,310 / 23,310.

From a folder (``--data text --data-dir DIR``): ``DIR/train.txt``, ``DIR/valid.txt``,
``DIR/test.txt`` (the layout of Penn Treebank as Mikolov's ``simple-examples`` and AWD-LSTM's
``getdata.sh`` ship it, and of WikiText-2). Word level (the default there; ``--tokens
words``) as in PyTorch's ``word_language_model`` example: every line is split on whitespace
and ends with ``<eos>``; the vocabulary is the training words in order of first appearance;
a word of valid/test that training never saw becomes ``<unk>`` (added if the training text
has none; PTB and WikiText-2 already mark rare words ``<unk>`` and have no such words).
``--tokens bytes`` reads the files' UTF-8 bytes instead. Every file must be non-empty UTF-8
text: a missing file, a folder in its place, an empty file, NUL bytes (binary data, or
UTF-16 text) or bytes that are not UTF-8 are refused with a ValueError naming the file.

Every vocabulary ends with one special token, ``<mask>`` (BERT's mask; unused by the
causal models): bytes have ids 0..255 and ``<mask>`` 256.

Batching (:func:`lm_windows`): a split's tokens are cut into ``rows`` equal streams (the
remainder dropped, as AWD-LSTM's ``batchify``) and each training batch is the same window of
``seq_len`` tokens in every stream, the targets shifted by one (AWD-LSTM's ``get_batch``
with a fixed BPTT length). Every window starts from a zero state (no state is carried
between windows), so the order of the windows is shuffled every epoch.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

TOKENS = ("bytes", "words")
SPLITS = ("train", "valid", "test")
MASK = "<mask>"
EOS = "<eos>"
UNK = "<unk>"
#: the built-in split: fractions of the bytes for train and train + valid
SPLIT_AT = (0.90, 0.95)


@dataclasses.dataclass
class TextDataset:
  """A tokenized text corpus: int32 token ids of each split and the vocabulary.

  Attributes:
    train, valid, test: 1-D int32 token ids.
    vocab_size: number of ids (including the ``<mask>`` special).
    num_tokens: ids of real tokens, ``0..num_tokens - 1`` (the specials follow).
    mask_id: the id of ``<mask>``.
    tokens: ``"bytes"`` or ``"words"``.
    name: where the text came from.
    vocab: for words, the word of each id (None for bytes).

  Example:
    >>> from jaxlp.training import load_dataset
    >>> d = load_dataset("text")
    >>> d.vocab_size, d.mask_id, d.tokens, d.train.dtype
    (257, 256, 'bytes', dtype('int32'))
  """

  train: np.ndarray
  valid: np.ndarray
  test: np.ndarray
  vocab_size: int
  num_tokens: int
  mask_id: int
  tokens: str
  name: str
  vocab: tuple | None = None

  def sizes(self) -> str:
    """``"N train / N valid / N test tokens, vocab V"``."""
    return (f"{len(self.train):,} train / {len(self.valid):,} valid / {len(self.test):,} test "
            f"{'bytes' if self.tokens == 'bytes' else 'tokens'}, vocab {self.vocab_size}")


def builtin_text() -> bytes:
  """The built-in text: ``pydoc_data.topics`` in sorted topic order, UTF-8."""
  from pydoc_data import topics  # noqa: PLC0415 -- the standard library's documentation

  t = topics.topics
  return "\n".join(t[k] for k in sorted(t)).encode("utf-8")


def _bytes_dataset(parts, name) -> TextDataset:
  ids = [np.frombuffer(p, np.uint8).astype(np.int32) for p in parts]
  return TextDataset(*ids, vocab_size=257, num_tokens=256, mask_id=256, tokens="bytes",
                     name=name)


def load_builtin() -> TextDataset:
  """The built-in text, byte level, with its fixed 90/5/5 split."""
  data = builtin_text()
  n = len(data)
  a, b = int(n * SPLIT_AT[0]), int(n * SPLIT_AT[1])
  return _bytes_dataset((data[:a], data[a:b], data[b:]), "pydoc_data topics")


def read_text_file(path: str) -> str:
  """A non-empty UTF-8 text file (ValueError naming ``path`` otherwise)."""
  if not os.path.exists(path):
    raise ValueError(f"text file missing: {path} (--data-dir needs train.txt, valid.txt and "
                     "test.txt)")
  if os.path.isdir(path):
    raise ValueError(f"{path} is a folder, not a text file")
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise ValueError(f"{path} cannot be read ({e.strerror or e})") from None
  if not raw.strip():
    raise ValueError(f"{path} is empty: no text to train or evaluate on")
  if b"\0" in raw:
    raise ValueError(f"{path} is not a text file: it holds NUL bytes (binary data, or text "
                     "in UTF-16/UTF-32; convert it to UTF-8)")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                     f"{e.start} (convert it to UTF-8)") from None


def load_folder(data_dir: str, tokens: str = "words") -> TextDataset:
  """``train.txt`` / ``valid.txt`` / ``test.txt`` of ``data_dir``, word or byte level."""
  if tokens not in TOKENS:
    raise ValueError(f"--tokens must be one of {TOKENS}, got {tokens!r}")
  if not data_dir:
    raise ValueError("--data-dir: give the folder holding train.txt, valid.txt and test.txt")
  if not os.path.isdir(data_dir):
    raise ValueError(f"--data-dir {data_dir!r} is not a directory")
  paths = [os.path.join(data_dir, f"{s}.txt") for s in SPLITS]
  texts = [read_text_file(p) for p in paths]
  if tokens == "bytes":
    ds = _bytes_dataset([t.encode("utf-8") for t in texts], data_dir)
    _check_lengths(paths, (ds.train, ds.valid, ds.test))
    return ds
  words = [[w for line in t.splitlines() for w in line.split() + [EOS]] for t in texts]
  index: dict[str, int] = {}
  for w in words[0]:
    index.setdefault(w, len(index))
  if UNK not in index and any(w not in index for ws in words[1:] for w in ws):
    index[UNK] = len(index)
  unk = index.get(UNK)
  ids = [np.asarray([index.get(w, unk) for w in ws], np.int32) for ws in words]
  _check_lengths(paths, ids)
  vocab = tuple(index) + (MASK,)
  return TextDataset(*ids, vocab_size=len(vocab), num_tokens=len(index), mask_id=len(index),
                     tokens="words", name=data_dir, vocab=vocab)


def _check_lengths(paths, ids) -> None:
  for p, a in zip(paths, ids, strict=True):
    if len(a) < 2:  # no (input, target) pair
      raise ValueError(f"{p} holds {len(a)} token(s); a language model needs at least 2")


def load(data_dir: str | None = None, tokens: str | None = None) -> TextDataset:
  """The text of ``--data text``: built in (``data_dir`` None; bytes) or from ``data_dir``
  (``tokens`` None = words)."""
  if data_dir is None:
    if tokens not in (None, "bytes"):
      raise ValueError("--tokens words needs --data-dir (the built-in text is byte level)")
    return load_builtin()
  return load_folder(data_dir, tokens or "words")


def lm_windows(ids: np.ndarray, rows: int, seq_len: int, *, partial: bool = False):
  """Cut a token stream into BPTT windows.

  The inputs ``ids[:-1]`` and targets ``ids[1:]`` are trimmed to a multiple of ``rows`` and
  laid out as ``rows`` streams; window ``j`` is columns ``j*seq_len .. (j+1)*seq_len - 1``
  of every stream.

  Args:
    ids: 1-D token ids.
    rows: streams (the batch size).
    seq_len: tokens per window.
    partial: keep a last, shorter window, padded to ``seq_len`` with weight 0 (evaluation:
      every target counts once); otherwise only full windows.

  Returns:
    ``(inputs, targets, weights)``, each ``(windows, rows, seq_len)`` (int32, int32,
    float32).
  """
  n = (len(ids) - 1) // rows * rows
  cols = n // rows
  x = ids[:n].reshape(rows, cols)
  y = ids[1:n + 1].reshape(rows, cols)
  full = cols // seq_len
  windows = full + (1 if partial and cols % seq_len else 0)
  pad = windows * seq_len - cols
  w = np.ones((rows, cols), np.float32)
  if pad > 0:
    x, y, w = (np.pad(a, ((0, 0), (0, pad))) for a in (x, y, w))
  else:
    x, y, w = (a[:, :windows * seq_len] for a in (x, y, w))
  split = lambda a: a.reshape(rows, windows, seq_len).transpose(1, 0, 2)
  return split(x), split(y), split(w)
