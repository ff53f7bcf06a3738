"""Sparsifiers: DGC, GradDrop, top-k, random-k. Payload = [count][idx x k][val x k]."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlp._util import check_bool, check_int, check_number
from jaxlp.formats._bits import fmix32
from jaxlp.parallel._aggregate import SPARSIFIERS
from jaxlp.parallel._arith import sqrt_f32
from jaxlp.parallel.compressors._base import (
  _SELECT_IMPLS,
  DOWN,
  check_impl,
  det_sum,
  no_fma,
  numel,
  per_platform,
  redo_where,
  sample_threshold,
  select_sparse,
  sparse_capacity,
  sparse_decode,
  sparse_wire_bytes,
  zero_at,
)


def _flat(g):
  return jnp.ravel(g).astype(jnp.float32)


class _Sparse:
  kind = "sparse"
  aggregation = SPARSIFIERS
  elementwise_state = True

  @property
  def _encode_branches(self):
    # encode holds a data-dependent lax.cond (select_sparse) except on the "radix" schedule:
    # the engine then encodes pieces one at a time, not under vmap (which runs both branches;
    # jaxlp.parallel._aggregate._encode_pieces)
    return self.schedule != "radix"

  def _check_schedule(self):
    if self.schedule not in _SELECT_IMPLS:
      raise ValueError(f"{type(self).__name__.lower()}: schedule={self.schedule!r} must be one "
                       f"of {_SELECT_IMPLS}")

  def decode(self, payload, shape):
    return sparse_decode(payload, numel(shape)).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    return sparse_wire_bytes(self.capacity(numel(shape)))


@dataclasses.dataclass(frozen=True)
class DGC(_Sparse):
  """Deep Gradient Compression (Lin et al. 2018; HiPress ``dgc_new``).

  ``ratio`` = fraction of elements KEPT (0.01 = 99% sparsity). Per step: optional local clipping ``g
  *= min(1, clip/||g||)`` (where ``||g||^2`` overflows float32: ``(g * 2**-100) * min(2**100,
  clip/||g * 2**-100||)``, not ``g * 0``); momentum correction ``u = m*u + g; v = v + u``; threshold
  from ``ceil(n*sample_rate)`` sampled |v| (HiPress rule; ``sample_rate=None`` = exact top-k); send
  ``v_i`` for ``|v_i| > thr`` (at most the k largest); momentum factor masking ``u_i = v_i = 0`` on
  sent entries. Warm-up (``warmup > 0``): the kept fraction is ``max(ratio, 0.25**(1 + step //
  warmup))`` (75%, 93.75%, 98.4%, ... sparsity, one stage per ``warmup`` steps, rising exponentially
  to the target; ``step`` is the state's count of encodes). Stage ``s`` keeps ``k_s = ceil(n *
  keep_s)`` values (float32 arithmetic); :attr:`stages` is the first stage at the target.

  Payload capacity (JAX shapes are static; ``wire_bytes`` is the capacity, ``count`` says how
  many slots are used): with ``stage=None`` (the factory's default) one capacity serves every
  step, the first stage's ``ceil(n/4)``; :meth:`at_stage` specialises the compressor to one
  stage, whose capacity is ``k_s`` (after warm-up: ``max(ceil(n*ratio), k_s)``, the target's).
  Either way the aggregation binds the compressor to its W workers (:meth:`for_workers`) and
  the capacity is capped so that the all-gathered message never costs more than the dense
  fp32 ring all-reduce it replaces: ``(W-1)(4 + 8k) <= 8n(W-1)/W``, i.e. at most
  ``k = floor(n/W - 1/2)`` values (with W = 8 the first stage keeps 12.5%, not 25%), and
  never below the target's ``ceil(n*ratio)``. A stage's compressor selects exactly what the
  unspecialised one selects at the steps of that stage unless the latter's capacity binds;
  at a step of an EARLIER stage its smaller capacity truncates the selection. ``jaxlp train``
  compiles one step per stage (:meth:`stage_at`); with :func:`jaxlp.parallel.reduce_gradients`
  build one transform per stage with ``compressor=comp.at_stage(s)`` (they share the state).

  The momentum correction replaces the optimizer's momentum (:attr:`momentum_correction`):
  use plain SGD with it (``jaxlp train`` refuses DGC together with ``--momentum``;
  :func:`jaxlp.parallel.compressed_optimizer` refuses an optimizer with momentum state).

  References:
    Lin et al., "Deep Gradient Compression", ICLR 2018.
  """
  ratio: float = 0.01
  momentum: float = 0.9
  sample_rate: float | None = 0.01
  clip: float | None = None
  warmup: int = 0
  workers: int | None = None
  stage: int | None = None
  schedule: str | None = None

  def __post_init__(self):
    self._check_schedule()
    for name in ("ratio", "momentum", "sample_rate", "clip"):
      check_number("dgc", name, getattr(self, name), none_ok=name in ("sample_rate", "clip"))
    check_int("dgc", "warmup", self.warmup)
    if self.stage is not None:
      check_int("dgc", "stage", self.stage)
    if not 0 < self.ratio <= 1:
      raise ValueError(f"ratio={self.ratio} must be in (0, 1]")
    if self.sample_rate is not None and not 0 < self.sample_rate <= 1:
      raise ValueError(f"sample_rate={self.sample_rate} must be in (0, 1] or None")

  def _max_keep(self):
    return max(self.ratio, 0.25) if self.warmup else self.ratio

  @property
  def momentum_correction(self) -> float:
    """DGC's momentum-correction factor (0: none); an optimizer's own momentum must then be
    off (``jaxlp train --momentum 0``, :func:`jaxlp.parallel.compressed_optimizer`)."""
    return float(self.momentum)

  @property
  def stages(self) -> int:
    """Index of the first warm-up stage at the target ratio (0 without warm-up): stages
    ``0 .. stages-1`` warm up, every later step is at the target."""
    if not self.warmup:
      return 0
    s = 0
    while np.float32(0.25) ** np.float32(1 + s) > np.float32(self.ratio):
      s += 1
    return s

  def stage_at(self, step: int) -> int:
    """The warm-up stage of encode number ``step`` (0-based), at most :attr:`stages`."""
    return min(int(step) // self.warmup, self.stages) if self.warmup else 0

  def at_stage(self, stage: int) -> DGC:
    """This compressor with the static payload capacity of warm-up stage ``stage`` (stages
    past :attr:`stages` are the target's; without warm-up: ``self``). Its encode computes
    the same kept fraction from the state's step as before; see the class docstring."""
    check_int("dgc", "stage", stage)
    if stage < 0:
      raise ValueError(f"dgc: stage={stage} must be >= 0")
    return dataclasses.replace(self, stage=min(stage, self.stages)) if self.warmup else self

  def _stage_count(self, n: int, stage: int) -> int:
    # encode's k_now = ceil(n * max(ratio, 0.25**(1+stage))) in float32 (0.25**j is exact)
    keep = np.maximum(np.float32(self.ratio), np.float32(0.25) ** np.float32(1 + stage))
    return int(np.ceil(np.float32(n) * keep))

  def for_workers(self, w: int) -> DGC:
    """This compressor as used by ``w`` workers (the warm-up capacity cap needs W)."""
    return dataclasses.replace(self, workers=int(w)) if self.warmup else self

  def capacity(self, n):
    if not self.warmup:
      return sparse_capacity(n, self.ratio)
    if self.stage is None:
      cap = sparse_capacity(n, self._max_keep())
    else:
      cap = min(n, self._stage_count(n, self.stage))
    if self.workers and self.workers > 1:
      cap = min(cap, (2 * n - self.workers) // (2 * self.workers))  # floor(n/W - 1/2)
    return max(sparse_capacity(n, self.ratio), cap)

  def init(self, shape, dtype=jnp.float32, key=None):
    n = numel(shape)
    return {"u": jnp.zeros((n,), jnp.float32), "v": jnp.zeros((n,), jnp.float32),
            "step": jnp.zeros((), jnp.int32)}

  def encode(self, g, state, key=None):
    x = _flat(g)
    n = x.shape[0]
    if self.clip is not None:
      ssq = det_sum(no_fma(x * x))
      clip = jnp.float32(self.clip)
      ovf = jnp.isinf(ssq)

      def big():  # squares overflow: the factor for x * 2**-100 (not 0 from norm = inf)
        xs = x * jnp.float32(DOWN)
        ns = sqrt_f32(det_sum(no_fma(xs * xs)))
        return jnp.minimum(jnp.float32(1 / DOWN), clip / jnp.maximum(ns, 1e-30))

      f = redo_where(ovf, big, jnp.minimum(1.0, clip / jnp.maximum(sqrt_f32(ssq), 1e-30)))
      x = (x * jnp.where(ovf, jnp.float32(DOWN), jnp.float32(1.0))) * f
    # m*u rounded before the add (as DGC's reference, mul_ then add_): under jit XLA would
    # contract it into an FMA, one rounding fewer (1 ulp apart)
    u = no_fma(jnp.float32(self.momentum) * state["u"], anchor=x) + x
    v = state["v"] + u
    step = state["step"]
    if self.warmup:
      keep = jnp.maximum(jnp.float32(self.ratio),
                         jnp.float32(0.25) ** (1 + step // self.warmup).astype(jnp.float32))
      k_now = jnp.ceil(n * keep).astype(jnp.int32)
    else:
      keep, k_now = self.ratio, None
    if key is None and self.sample_rate is not None:
      raise ValueError("dgc with sample_rate needs key")
    thr = sample_threshold(jnp.abs(v), key, keep, self.sample_rate)
    payload, idx = select_sparse(v, None, thr, self.capacity(n), k_now, impl=self.schedule)
    return payload, {"u": zero_at(u, idx), "v": zero_at(v, idx), "step": step + 1}


def dgc(ratio=0.01, momentum=0.9, sample_rate=0.01, clip=None, warmup=0,
        schedule=None) -> DGC:
  """Deep Gradient Compression: momentum correction, local accumulation and top-``ratio``
  sparsification by a sampled threshold.

  Args:
    ratio: fraction of elements kept per step (0.01 = 99% sparsity).
    momentum: DGC's momentum-correction factor (use it with plain SGD).
    sample_rate: fraction sampled to estimate the threshold (None: exact top-k).
    clip: local clipping ``g *= min(1, clip/||g||)``; None: no clipping.
    warmup: steps per warm-up stage (0: no warm-up); see the returned object's class.
    schedule: how the selection runs, the same selected elements on every schedule: None
      picks by the platform the program is compiled for ("cpu" on CPU, "gpu" elsewhere);
      "cpu", "gpu" or "radix" force one (see ``jaxlp/parallel/compressors/_base.py``).

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a value out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.dgc(ratio=0.001).ratio
    0.001
  """
  return DGC(ratio, momentum, sample_rate, clip, warmup, schedule=schedule)


@dataclasses.dataclass(frozen=True)
class GradDrop(_Sparse):
  """GradDrop (Aji & Heafield 2017; HiPress ``gd_body.h``): ``R += g``; keep fraction
  ``1 - drop_ratio``; threshold from sampled |R| (as DGC); send ``R_i`` for ``|R_i| > thr``
  (at most ``ceil(n*(1-drop_ratio))`` largest); ``R_i = 0`` on sent entries.

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017.
  """
  drop_ratio: float = 0.99
  sample_rate: float | None = 0.01
  schedule: str | None = None

  def __post_init__(self):
    self._check_schedule()
    check_number("graddrop", "drop_ratio", self.drop_ratio)
    check_number("graddrop", "sample_rate", self.sample_rate, none_ok=True)
    if not 0 <= self.drop_ratio < 1:
      raise ValueError(f"drop_ratio={self.drop_ratio} must be in [0, 1)")

  def capacity(self, n):
    return sparse_capacity(n, 1.0 - self.drop_ratio)

  def init(self, shape, dtype=jnp.float32, key=None):
    return {"residual": jnp.zeros((numel(shape),), jnp.float32)}

  def encode(self, g, state, key=None):
    r = state["residual"] + _flat(g)
    keep = 1.0 - self.drop_ratio
    if key is None and self.sample_rate is not None:
      raise ValueError("graddrop with sample_rate needs key")
    thr = sample_threshold(jnp.abs(r), key, keep, self.sample_rate)
    payload, idx = select_sparse(r, None, thr, self.capacity(r.shape[0]), impl=self.schedule)
    return payload, {"residual": zero_at(r, idx)}


def graddrop(drop_ratio=0.99, sample_rate=0.01, schedule=None) -> GradDrop:
  """GradDrop: accumulate into a residual and send the largest ``1 - drop_ratio`` fraction.

  Args:
    drop_ratio: fraction of elements dropped per step (0 <= drop_ratio < 1).
    sample_rate: fraction sampled to estimate the threshold (None: exact).
    schedule: how the selection runs, the same selected elements on every schedule: None
      picks by the platform the program is compiled for ("cpu" on CPU, "gpu" elsewhere);
      "cpu", "gpu" or "radix" force one (see ``jaxlp/parallel/compressors/_base.py``).

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a value out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.graddrop(drop_ratio=0.99).drop_ratio
    0.99
  """
  return GradDrop(drop_ratio, sample_rate, schedule)


@dataclasses.dataclass(frozen=True)
class TopK(_Sparse):
  """Exact top-k by magnitude (``k = ceil(n*ratio)``), with residual error feedback."""
  ratio: float = 0.01
  error_feedback: bool = True
  schedule: str | None = None

  def __post_init__(self):
    self._check_schedule()
    check_number(type(self).__name__.lower(), "ratio", self.ratio)
    check_bool(type(self).__name__.lower(), "error_feedback", self.error_feedback)
    if not 0 < self.ratio <= 1:
      raise ValueError(f"ratio={self.ratio} must be in (0, 1]")

  def capacity(self, n):
    return sparse_capacity(n, self.ratio)

  def init(self, shape, dtype=jnp.float32, key=None):
    return {"residual": jnp.zeros((numel(shape),), jnp.float32)} if self.error_feedback else ()

  def encode(self, g, state, key=None):
    x = _flat(g)
    if self.error_feedback:
      x = x + state["residual"]
    payload, idx = select_sparse(x, None, -1.0, self.capacity(x.shape[0]), impl=self.schedule)
    if self.error_feedback:
      state = {"residual": zero_at(x, idx)}
    return payload, state


def topk(ratio=0.01, error_feedback=True, schedule=None) -> TopK:
  """Exact top-k by magnitude (``k = ceil(n * ratio)``) with residual error feedback.

  Args:
    ratio: fraction of elements sent per step (0 < ratio <= 1).
    error_feedback: keep what was not sent and add it to the next gradient.
    schedule: how the selection runs, the same selected elements on every schedule: None
      picks by the platform the program is compiled for ("cpu" on CPU, "gpu" elsewhere);
      "cpu", "gpu" or "radix" force one (see ``jaxlp/parallel/compressors/_base.py``).

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a ratio or schedule out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.topk(ratio=0.01).capacity(1000)
    10
  """
  return TopK(ratio, error_feedback, schedule)


_FEISTEL_ROUNDS = 8


def feistel_sample(seed, n: int, k: int, impl=None):
  """``k`` distinct int32 indices in ``[0, n)`` (``k <= n < 2**31``): ``perm(0..k-1)`` for the
  seed-keyed pseudorandom permutation of ``[0, n)`` described in :class:`RandomK`; O(k).

  The cycle walking is a ``while_loop`` until every index is in range, after ``impl``'s
  unrolled steps (None: by platform). "cpu": none. "gpu": ``k.bit_length() + 8`` steps in one
  elementwise pass, after which an index is still out of range with probability below
  ``2**-(k.bit_length() + 8)`` (each step leaves it out with probability ``1 - n/2**w < 1/2``),
  so the loop, whose every step reads its predicate back to the host there, almost never
  runs a step. A step leaves an index in range unchanged: the same indices either way."""
  check_impl(impl)
  if not 0 <= k <= n < 2 ** 31:
    raise ValueError(f"randomk: need 0 <= k={k} <= n={n} < 2**31")
  if k == 0:
    return jnp.zeros((0,), jnp.int32)
  return _feistel_sample(jnp.asarray(seed, jnp.uint32), n, k, impl)


# Jitted with static sizes: the engine decodes every worker's payload of a leaf with the same
# (n, k), and those calls reuse one trace. With the walk below traced once and unrolled by
# fori_loop, RandomK's W = 8 all-gather under vmap traces in 0.5-0.8 s instead of 4.3 s (the
# same program and bits).
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _feistel_sample(seed, n, k, impl):
  w = max(1, (n - 1).bit_length())  # the permuted domain is [0, 2**w), 2**w < 2n
  lo_bits = (w + 1) // 2
  lo_mask = jnp.uint32((1 << lo_bits) - 1)
  hi_mask = jnp.uint32((1 << (w - lo_bits)) - 1)
  # The round keys as one vector, each key sliced where perm uses it (also inside the while
  # loop): as 8 scalars they were 8 small kernels (XLA:CPU compiles each on its own) per
  # sampling, and RandomK's W = 8 all-gather samples W + 1 times: 72 of its program's 148
  # kernels, compile 5.0 -> 3.3 s (2-core CPU, loaded, 2026-11-30). The same integer ops on
  # each key: the same indices.
  rounds = np.array([(0x9E3779B9 * (i + 1)) & 0xFFFFFFFF for i in range(_FEISTEL_ROUNDS)],
                    np.uint32)
  ks = fmix32(seed[0] ^ fmix32(seed[1] + rounds))

  # lax ops, not jnp operators: the same jaxpr, half the tracing time
  shift, bound = np.uint32(lo_bits), np.uint32(n)
  xor, band = lax.bitwise_xor, lax.bitwise_and

  def perm(x):
    hi, lo = lax.shift_right_logical(x, shift), band(x, lo_mask)
    for i in range(_FEISTEL_ROUNDS):  # unbalanced Feistel: the halves take turns
      rk = lax.index_in_dim(ks, i, keepdims=False)
      if i % 2:
        hi = xor(hi, band(fmix32(xor(lo, rk)), hi_mask))
      else:
        lo = xor(lo, band(fmix32(xor(hi, rk)), lo_mask))
    return lax.bitwise_or(lax.shift_left(hi, shift), lo)

  def step(y):
    return lax.select(lax.ge(y, bound), perm(y), y)

  def walk(y, steps):  # straight-line code, no loop (test_gpu_schedule_gives_the_same_indices)
    return lax.fori_loop(0, steps, lambda _, y: step(y), y, unroll=True)

  # CPU: the first perm is the loop's first step (every index), so perm is compiled once per
  # sampling, not twice; GPU: perm and the unrolled walk, then the loop (rarely a step)
  def first_in_loop(y):
    return y, jnp.bool_(True)

  def walked(y):
    return walk(perm(y), k.bit_length() + 8), jnp.bool_(False)

  def body(c):
    y, first = c
    return lax.select(lax.bitwise_or(lax.ge(y, bound), first), perm(y), y), jnp.bool_(False)

  c = per_platform(impl, first_in_loop, walked, lax.iota(jnp.uint32, k))
  y = lax.while_loop(lambda c: c[1] | jnp.any(c[0] >= n), body, c)[0]
  return y.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class RandomK:
  """Random-k with residual error feedback. The k indices (without replacement) come from a
  seed carried in the payload (2 uint32 words), so no index list goes on the wire (BytePS's
  shared-seed trick): payload = ``seed`` + ``k`` float32 values.

  Index sampling, O(k) time and memory: the indices are ``perm(0), ..., perm(k-1)`` for a
  pseudorandom permutation ``perm`` of ``[0, n)`` keyed by the seed -- an 8-round Feistel
  network on ``w``-bit words (``2**(w-1) < n <= 2**w``; the two halves of ``w // 2`` and
  ``w - w // 2`` bits take turns: ``half ^= fmix32(other half ^ round key)``, MurmurHash3's
  finaliser), restricted to ``[0, n)`` by cycle walking (Black & Rogaway,
  "Ciphers with Arbitrary Finite Domains", CT-RSA 2002). So the k indices are distinct, in
  ``[0, n)``, and, to the extent the cipher is pseudorandom, a uniform k-subset in uniform
  order: the same distribution as before (``jax.random.choice(..., replace=False)``, a full
  permutation of n: 102.8M elements did not finish in 420 s), but not the same indices for a
  given seed. Every index has inclusion probability k/n (tested statistically).
  """
  ratio: float = 0.01
  error_feedback: bool = True
  kind = "sparse"
  aggregation = SPARSIFIERS
  elementwise_state = True

  def __post_init__(self):
    check_number(type(self).__name__.lower(), "ratio", self.ratio)
    check_bool(type(self).__name__.lower(), "error_feedback", self.error_feedback)
    if not 0 < self.ratio <= 1:
      raise ValueError(f"ratio={self.ratio} must be in (0, 1]")

  def capacity(self, n):
    return sparse_capacity(n, self.ratio)

  def init(self, shape, dtype=jnp.float32, key=None):
    return {"residual": jnp.zeros((numel(shape),), jnp.float32)} if self.error_feedback else ()

  def _indices(self, seed, n):
    return feistel_sample(seed, n, self.capacity(n))

  def encode(self, g, state, key=None):
    if key is None:
      raise ValueError("randomk needs key")
    x = _flat(g)
    if self.error_feedback:
      x = x + state["residual"]
    seed = jax.random.bits(key, (2,), jnp.uint32)
    idx = self._indices(seed, x.shape[0])
    payload = {"seed": seed, "val": x[idx]}
    if self.error_feedback:
      state = {"residual": x.at[idx].set(0.0)}
    return payload, state

  def decode(self, payload, shape):
    n = numel(shape)
    idx = self._indices(payload["seed"], n)
    return jnp.zeros((n,), jnp.float32).at[idx].set(payload["val"]).reshape(shape)

  def wire_bytes(self, shape, dtype=jnp.float32):
    return 8 + 4 * self.capacity(numel(shape))


def randomk(ratio=0.01, error_feedback=True) -> RandomK:
  """Random-k sparsification with error feedback; the indices come from a seed carried in
  the payload, so no index list goes on the wire.

  Args:
    ratio: fraction of elements sent per step (0 < ratio <= 1).
    error_feedback: keep what was not sent and add it to the next gradient.

  Returns:
    The compressor (a frozen dataclass).

  Raises:
    TypeError: an option of the wrong type (a float or string for an int, a non-bool flag).
    ValueError: a ratio out of range.

  Example:
    >>> from jaxlp.parallel import compressors
    >>> compressors.randomk(ratio=0.1).ratio
    0.1
  """
  return RandomK(ratio, error_feedback)
