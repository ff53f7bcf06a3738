"""The typed compressor protocol: what a compressor and its family's aggregation provide.

Modelled on optax's ``GradientTransformation`` (a typed interface of pure functions over an
explicit state): a :class:`Compressor` encodes one worker's flat gradient; its
:class:`Aggregation` (one object per compressor family, ``compressor.aggregation``) reduces
the encodings across workers, owns the per-leaf/per-bucket state and counts the bytes its
collectives send. :func:`jaxlp.parallel.compressed_allreduce` only filters leaves, cuts them
into buckets and calls the aggregation.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable


class Bucket(NamedTuple):
  """Leaves that one aggregation call reduces together (in tree order).

  Attributes:
    index: the bucket's number (0, 1, ... in the order the engine reduces them).
    leaves: the leaf numbers (tree-flatten order) in the bucket.
    shapes: their shapes.
    parts: SeCoPa partitions of a single-leaf bucket (``plan``); 1 otherwise.
    fused: True when the buckets come from ``bucket_mb`` fusion (then a family may keep one
      state per bucket, see :meth:`Aggregation.init_bucket`).

  Example:
    >>> from jaxlp.parallel.compressors import Bucket
    >>> b = Bucket(0, (0, 2), ((8, 4), (4, 4)), 1, True)
    >>> b.leaves, b.fused
    ((0, 2), True)
  """
  index: int
  leaves: tuple
  shapes: tuple
  parts: int = 1
  fused: bool = False


class ReduceContext(NamedTuple):
  """What an aggregation needs to know about the workers and the step.

  Attributes:
    axis_name: the named axis (or tuple of names) being reduced over.
    w: the number of workers (static int).
    me: this worker's index (int32 scalar, worker-major over a tuple of axes).
    step_key: the step's typed PRNG key, the same on every worker.
    worker_key: ``fold_in(step_key, me)``.
    mean: return the mean (each family defines where the division by W happens).
    algorithm: the requested algorithm (``"auto"``, ``"sra"``, ``"ring"``, ``"allgather"``).

  Example:
    >>> import jax
    >>> from jaxlp.parallel.compressors import ReduceContext
    >>> k = jax.random.key(0)
    >>> ReduceContext("w", 4, 0, k, k, True, "auto").w
    4
  """
  axis_name: Any
  w: int
  me: Any
  step_key: Any
  worker_key: Any
  mean: bool
  algorithm: str


@runtime_checkable
class Aggregation(Protocol):
  """A compressor family's reduction across workers, its state and its byte count.

  Built-in families (``compressor.aggregation``): dense quantizers (``cgx``, ``qsgd``,
  ``onebit``, ``tbq``, ``terngrad``: scatter-reduce-allgather, compressed ring or
  all-gather), sparsifiers (``topk``, ``randomk``, ``dgc``, ``graddrop``: all-gather),
  low rank (``powersgd``: two fused all-reduces) and casts (``cast``: a ring in the narrow
  type, or gathered codes).

  Attributes:
    algorithms: the ``algorithm=`` values the family accepts (``"auto"`` first).

  Methods (all pure; ``comp`` is the compressor):

  * ``compresses(comp, shape) -> bool``: the family's own filter (PowerSGD: the leaf has a
    matrix view worth compressing); leaves it refuses are reduced in fp32.
  * ``init_leaf(comp, shape, dtype, key) -> state``: per-leaf state (every leaf gets one).
  * ``init_bucket(comp, bucket, key) -> state or None``: the state of a fused bucket, for
    families that keep state per bucket (batched PowerSGD); None otherwise.
  * ``reduce(comp, xs, states, bucket_state, bucket, ctx) -> (outs, states, bucket_state)``:
    ``xs`` are this worker's float32 leaves of ``bucket``; ``outs`` the reduced leaves (the
    same bits on every worker). Non-finite values need no care here: the engine makes the
    bucket NaN and keeps its old states when any worker's ``xs`` or the ``outs`` are not
    finite (:func:`jaxlp.parallel.compressed_allreduce`).
  * ``wire_bytes(comp, bucket, w, algorithm) -> int``: the bytes one worker sends through
    the collectives of ``reduce`` for that bucket (what ``reduce`` puts into
    ``all_gather``/``all_to_all``/``ppermute``, counting an all-gather of P bytes as (W-1)*P
    and an all-to-all of W rows of P bytes as (W-1)*P).

  Example:
    >>> from jaxlp.parallel import compressors
    >>> agg = compressors.cgx(bits=4).aggregation
    >>> isinstance(agg, compressors.Aggregation), agg.algorithms
    (True, ('auto', 'sra', 'ring', 'allgather'))
  """
  algorithms: tuple

  def compresses(self, comp, shape) -> bool: ...

  def init_leaf(self, comp, shape, dtype, key): ...

  def init_bucket(self, comp, bucket: Bucket, key): ...

  def reduce(self, comp, xs, states, bucket_state, bucket: Bucket, ctx: ReduceContext): ...

  def wire_bytes(self, comp, bucket: Bucket, w: int, algorithm: str) -> int: ...


@runtime_checkable
class Compressor(Protocol):
  """The interface of every compressor of :mod:`jaxlp.parallel.compressors`.

  A frozen config object whose methods are pure functions of explicit state:

  * ``init(shape, dtype=float32, key=None) -> state``: residuals, momenta, P/Q. Elementwise
    state arrays are FLAT (length ``prod(shape)``) so that the aggregation can fuse leaves
    into buckets and cut them into per-worker chunks.
  * ``encode(g, state, key) -> (payload, state)``: ``payload`` is a dict of arrays (packed
    ``uint8`` codes, ``float32`` metadata, ``int32`` indices): what goes on the wire.
  * ``decode(payload, shape) -> float32 array``.
  * ``wire_bytes(shape, dtype=float32) -> int``: the payload size of one encoding, equal to
    :func:`payload_nbytes` of the payload.
  * ``elementwise_state``: every non-scalar state array is flat and elementwise.
  * ``aggregation``: the family's :class:`Aggregation`.
  * ``kind``: a descriptive family name (``"quantizer"``, ``"sparse"``, ``"lowrank"``,
    ``"cast"``); the engine does not read it.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> isinstance(compressors.topk(0.1), compressors.Compressor)
    True
  """
  elementwise_state: bool

  @property
  def aggregation(self) -> Aggregation: ...

  def init(self, shape, dtype=..., key=None): ...

  def encode(self, g, state, key=None): ...

  def decode(self, payload, shape): ...

  def wire_bytes(self, shape, dtype=...) -> int: ...
