"""HiPress SeCoPa: selective compression and partitioning plan (cost model).

A primitive's cost is ``c(x) = o if x < theta else w*x + b`` with
``theta = max(0, (o - b)/w)`` (``theta = 0`` when ``w == 0``); x = fp32 element count, costs
in ms. For a gradient of S elements, N nodes and K = 1..N partitions (r = compression ratio):

* PS (co-located):  ``T_orig(K) = gather(S/K) + bcast(S/K) + (N-1)*aggr(S/K)``;
  ``T_comp(K) = gather(rS/K) + bcast(rS/K) + min(K+1, N)*enc(S/K)
  + min(N-1+K, 2(N-1))*dec(rS/K) + (N-1)*aggr(S/K)``.
* Ring: ``T_orig(K) = 2(N-1)*send(S/K) + (N-1)*aggr(S/K)``;
  ``T_comp(K) = 2(N-1)*send(rS/K) + N*enc(S/K) + N*dec(rS/K) + (N-1)*aggr(S/K)``.

Each branch takes its minimum over K (smallest K on ties); compress iff
``min T_orig > min T_comp`` (strict); K = argmin of the chosen branch. With the published
constants (:data:`HIPRESS_COSTS`) this reproduces HiPress's shipped ``SeCoPaPlan.txt``.

References:
  Bai et al., "Gradient Compression Supercharged High-Performance Data Parallel DNN Training",
  SOSP 2021; mark14wu/hipress ``src/SeCoPa``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class LinearCost:
  """A SeCoPa cost primitive: ``c(x) = overhead if x < theta else weight*x + bias``.

  ``theta`` is :attr:`threshold`; x is an fp32 element count and the cost is in ms.

  Attributes:
    weight: ms per element above the threshold.
    bias: ms at x = 0 of the linear part.
    overhead: ms of every call below the threshold (a fixed launch/latency cost).

  Example:
    >>> from jaxlp import parallel as P
    >>> c = P.LinearCost(weight=0.001, bias=0.5, overhead=1.0)
    >>> c.threshold, c(100), c(1000)
    (500.0, 1.0, 1.5)
  """
  weight: float
  bias: float
  overhead: float

  @property
  def threshold(self) -> float:
    """``theta = max(0, (overhead - bias)/weight)``; 0 when ``weight == 0``."""
    if self.weight == 0:
      return 0.0
    return max(0.0, (self.overhead - self.bias) / self.weight)

  def __call__(self, x: float) -> float:
    return self.overhead if x < self.threshold else self.weight * x + self.bias


@dataclasses.dataclass(frozen=True)
class SeCoPaCosts:
  """Cost primitives of the SeCoPa model (ms as a function of fp32 element counts).

  Attributes:
    encode: compressing x elements.
    decode: decompressing a payload of x fp32-element equivalents (``r * S / K``).
    aggregate: adding two gradients of x elements.
    ring_send: one ring hop of x elements.
    gather: parameter-server gather of x elements (from the other N-1 nodes).
    broadcast: parameter-server broadcast of x elements (to the other N-1 nodes).
    ratio: compression ratio r (compressed bytes / fp32 bytes).

  Example:
    >>> from jaxlp import parallel as P
    >>> costs = P.hipress_costs(4)
    >>> costs.ratio, costs.aggregate
    (0.0625, LinearCost(weight=0.0, bias=0.0, overhead=0.0))
  """
  encode: LinearCost
  decode: LinearCost
  aggregate: LinearCost
  ring_send: LinearCost
  gather: LinearCost
  broadcast: LinearCost
  ratio: float = 1.0 / 16


_ENC = LinearCost(1.4133e-8, 5.8938e-2, 0.05408)
_DEC = LinearCost(6.2041e-9, 1.3956e-1, 0.07287)
_AGG = LinearCost(0.0, 0.0, 0.0)
_SEND = LinearCost(8.5005e-7, 2.0337e-1, 0.09766)
_GB = {
    4: (LinearCost(2.7156e-6, 4.1930e-1, 0.15573), LinearCost(2.7157e-6, 2.2156e-1, 0.14820)),
    8: (LinearCost(6.1167e-6, 8.0768e-1, 0.28778), LinearCost(6.1172e-6, 2.7285e-1, 0.29666)),
    16: (LinearCost(1.2937e-5, 1.4406, 0.59503), LinearCost(1.2915e-5, 4.5538e-1, 0.58353)),
}


def hipress_costs(num_nodes: int) -> SeCoPaCosts:
  """The constants published in HiPress ``SeCoPa.py`` (N = 4, 8, 16 only; ratio 1/16).

  :data:`HIPRESS_COSTS` holds the three of them, keyed by ``num_nodes``.

  Args:
    num_nodes: N, one of 4, 8, 16.

  Returns:
    A :class:`SeCoPaCosts`.

  Raises:
    ValueError: ``num_nodes`` is not 4, 8 or 16.

  Example:
    >>> from jaxlp import parallel as P
    >>> P.hipress_costs(8).ring_send
    LinearCost(weight=8.5005e-07, bias=0.20337, overhead=0.09766)
    >>> sorted(P.HIPRESS_COSTS)
    [4, 8, 16]
  """
  if num_nodes not in _GB:
    raise ValueError(f"{num_nodes=}: HiPress published costs only for 4, 8 and 16 nodes")
  g, b = _GB[num_nodes]
  return SeCoPaCosts(_ENC, _DEC, _AGG, _SEND, g, b)


HIPRESS_COSTS = {n: hipress_costs(n) for n in _GB}


class PlanEntry(NamedTuple):
  """One leaf's decision: compress or not, and the number of partitions K.

  Attributes:
    compress: True when the compressed branch is strictly cheaper.
    partitions: K, the argmin over 1..N of the chosen branch (smallest K on ties).
    t_orig: minimum modelled time (ms) of the uncompressed branch.
    t_comp: minimum modelled time (ms) of the compressed branch.

  Example:
    >>> from jaxlp import parallel as P
    >>> entry = P.secopa_plan([2 ** 22], num_nodes=4)[0]
    >>> entry.compress, entry.partitions, round(entry.t_orig, 3), round(entry.t_comp, 3)
    (True, 4, 6.336, 2.132)
  """
  compress: bool
  partitions: int
  t_orig: float
  t_comp: float


def _argmin(vals):
  best = min(vals)
  return best, vals.index(best) + 1


def plan_one(size: int, costs: SeCoPaCosts, topology: str, num_nodes: int) -> PlanEntry:
  n, c, r = num_nodes, costs, costs.ratio
  orig, comp = [], []
  for k in range(1, n + 1):
    s, rs = size / k, size * r / k
    aggr = (n - 1) * c.aggregate(s)
    if topology == "ps":
      orig.append(c.gather(s) + c.broadcast(s) + aggr)
      comp.append(c.gather(rs) + c.broadcast(rs) + min(k + 1, n) * c.encode(s)
                  + min(n - 1 + k, 2 * (n - 1)) * c.decode(rs) + aggr)
    else:
      orig.append(2 * (n - 1) * c.ring_send(s) + aggr)
      comp.append(2 * (n - 1) * c.ring_send(rs) + n * c.encode(s) + n * c.decode(rs) + aggr)
  to, ko = _argmin(orig)
  tc, kc = _argmin(comp)
  if to > tc:
    return PlanEntry(True, kc, to, tc)
  return PlanEntry(False, ko, to, tc)


def secopa_plan(sizes, *, topology: str = "ps", num_nodes: int, costs: SeCoPaCosts | None = None):
  """Per-gradient SeCoPa decisions.

  Args:
    sizes: element counts (ints >= 0, numpy integers included), or a pytree of
      arrays/ShapeDtypeStructs (leaf order; a leaf may also be an int count).
    topology: ``"ps"`` (co-located parameter servers) or ``"ring"`` (case-insensitive).
    num_nodes: N.
    costs: a :class:`SeCoPaCosts` (e.g. from :func:`measure_costs`); default the HiPress
      published constants for ``num_nodes`` (4, 8 or 16).

  Returns:
    A list of :class:`PlanEntry` ``(compress, partitions, t_orig, t_comp)``; pass it as
    ``plan=`` to :func:`jaxlp.parallel.compressed_allreduce`.

  Raises:
    TypeError: a size that is not an int (a float such as ``2.5`` or ``nan``, a bool, a
      string; an array-like leaf without a shape), ``sizes`` None or a str, ``num_nodes``
      not an int, ``topology`` not a str, ``costs`` neither None nor a
      :class:`SeCoPaCosts`. The message names the leaf (``sizes[1]``, ``sizes['w']``).
    ValueError: a negative size (named, e.g. ``sizes[0]=-5``); ``topology`` is not
      ``"ps"``/``"ring"``; ``num_nodes < 1``; ``costs=None`` and ``num_nodes`` is not 4, 8
      or 16.

  Example:
    A 1000-element bias stays uncompressed, a 2048 x 2048 weight is compressed in 6 parts:

    >>> import jax.numpy as jnp
    >>> from jaxlp import parallel as P
    >>> params = {"b": jnp.zeros(1000), "w": jnp.zeros((2048, 2048))}
    >>> [(e.compress, e.partitions) for e in P.secopa_plan(params, num_nodes=16)]
    [(False, 16), (True, 6)]
    >>> [(e.compress, e.partitions) for e in P.secopa_plan([1000, 2 ** 22], topology="ring",
    ...                                                     num_nodes=8)]
    [(False, 8), (True, 8)]
  """
  if not isinstance(topology, str):
    raise TypeError(f"secopa_plan: topology must be 'ps' or 'ring', got {topology=}")
  if topology.lower() not in ("ps", "ring"):
    raise ValueError(f"secopa_plan: topology must be 'ps' or 'ring', got {topology=}")
  topology = topology.lower()
  if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
    raise TypeError(f"secopa_plan: num_nodes must be an int, got {num_nodes!r} of type "
                    f"{type(num_nodes).__name__}")
  if num_nodes < 1:
    raise ValueError(f"secopa_plan: num_nodes must be >= 1, got {num_nodes=}")
  num_nodes = int(num_nodes)
  if costs is None:
    costs = hipress_costs(num_nodes)
  elif not isinstance(costs, SeCoPaCosts):
    raise TypeError(f"secopa_plan: costs must be a SeCoPaCosts (hipress_costs(...), "
                    f"measure_costs(...)) or None, got {type(costs).__name__}")
  return [plan_one(n, costs, topology, num_nodes) for n in _element_counts(sizes)]


def _element_counts(sizes) -> list[int]:
  """The element count of each leaf of ``sizes`` (ints >= 0, or arrays / ShapeDtypeStructs),
  in leaf order; a clear error naming the leaf (``sizes[1]``, ``sizes['w']``) otherwise."""
  import jax
  if sizes is None or isinstance(sizes, (str, bytes)):
    raise TypeError("secopa_plan: sizes must be a list of element counts (ints) or a pytree "
                    f"of arrays / ShapeDtypeStructs, got {sizes!r}")
  leaves = jax.tree_util.tree_leaves_with_path(sizes, is_leaf=lambda x: x is None)
  counts = []
  for path, leaf in leaves:
    where = "sizes" + jax.tree_util.keystr(path)
    if isinstance(leaf, (bool, np.bool_)):
      raise TypeError(f"secopa_plan: {where}={leaf!r} is a bool, not an element count")
    if isinstance(leaf, (int, np.integer)):
      if leaf < 0:
        raise ValueError(f"secopa_plan: {where}={leaf} is negative; element counts are >= 0")
      counts.append(int(leaf))
    elif isinstance(leaf, (float, complex, np.floating, np.complexfloating)):
      raise TypeError(f"secopa_plan: {where}={leaf!r} is a {type(leaf).__name__}; element "
                      "counts are ints (e.g. int(np.prod(shape)))")
    elif isinstance(getattr(leaf, "shape", None), tuple):
      counts.append(int(np.prod(leaf.shape, dtype=np.int64)))
    else:
      raise TypeError(f"secopa_plan: {where}={leaf!r:.60} is neither an element count (int) "
                      "nor an array / ShapeDtypeStruct")
  return counts


def fit_linear(xs, ts) -> LinearCost:
  """Least-squares ``t = b + w*x``; the overhead is the smallest measured time."""
  xs, ts = np.asarray(xs, np.float64), np.asarray(ts, np.float64)
  w, b = np.polyfit(xs, ts, 1)
  return LinearCost(float(max(w, 0.0)), float(b), float(ts.min()))


def measure_costs(compressor, *, sizes=(2 ** 12, 2 ** 15, 2 ** 18, 2 ** 20), repeats: int = 5,
                  bandwidth_gbps: float = 10.0, latency_ms: float = 0.05, num_nodes: int = 4,
                  ratio: float | None = None) -> SeCoPaCosts:
  """Fit the SeCoPa cost primitives on this machine.

  Encode and decode of ``compressor`` are timed (jitted, median of ``repeats``) for each size
  and fitted as ``b + w*x`` (ms). Send/gather/broadcast are not measurable on one host: they are
  modelled from ``bandwidth_gbps`` and ``latency_ms`` (``send(x) = latency + 4x/bandwidth``,
  gather/broadcast = ``(N-1)`` sends into/out of one node). ``ratio`` defaults to the
  compressor's ``wire_bytes / (4*numel)`` at the largest size.

  Args:
    compressor: a compressor from :mod:`jaxlp.parallel.compressors`.
    sizes: element counts to time (at least two distinct ones, for the linear fit).
    repeats: timed runs per size (the median is used).
    bandwidth_gbps: modelled link bandwidth in Gbit/s.
    latency_ms: modelled per-message latency in ms.
    num_nodes: N of the modelled gather/broadcast.
    ratio: compression ratio r; None = measured from ``compressor.wire_bytes``.

  Returns:
    A :class:`SeCoPaCosts` (pass it as ``costs=`` to :func:`secopa_plan`). The encode and
    decode fits are timings, so they differ between runs and machines.

  Example:
    >>> from jaxlp import parallel as P
    >>> costs = P.measure_costs(P.compressors.cgx(bits=4), sizes=(1024, 4096), repeats=1)
    >>> costs.ratio  # (4 bits + 8 bytes per 512-element bucket) / 32 bits
    0.12890625
    >>> costs.ring_send  # 10 Gbit/s, 0.05 ms
    LinearCost(weight=3.2000000000000003e-06, bias=0.05, overhead=0.05)
  """
  import jax
  import jax.numpy as jnp
  enc_t, dec_t = [], []
  key = jax.random.key(0)
  for n in sizes:
    g = jax.random.normal(key, (n,), jnp.float32)
    st = compressor.init((n,))
    enc = jax.jit(compressor.encode)
    p, _ = enc(g, st, key)
    dec = jax.jit(lambda p, n=n: compressor.decode(p, (n,)))
    jax.block_until_ready(dec(p))
    te, td = [], []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(enc(g, st, key))
      t1 = time.perf_counter()
      jax.block_until_ready(dec(p))
      t2 = time.perf_counter()
      te.append(t1 - t0)
      td.append(t2 - t1)
    enc_t.append(1e3 * float(np.median(te)))
    dec_t.append(1e3 * float(np.median(td)))
  if ratio is None:
    ratio = compressor.wire_bytes((sizes[-1],)) / (4 * sizes[-1])
  enc = fit_linear(sizes, enc_t)
  decw = fit_linear([s * ratio for s in sizes], dec_t)
  per_elem_ms = 4 / (bandwidth_gbps * 1e9 / 8) * 1e3
  send = LinearCost(per_elem_ms, latency_ms, latency_ms)
  coll = LinearCost((num_nodes - 1) * per_elem_ms, latency_ms, latency_ms)
  return SeCoPaCosts(enc, decw, LinearCost(0.0, 0.0, 0.0), send, coll, coll, ratio)
