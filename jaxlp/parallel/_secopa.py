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
  """``c(x) = overhead if x < theta else weight*x + bias``."""
  weight: float
  bias: float
  overhead: float

  @property
  def threshold(self) -> float:
    if self.weight == 0:
      return 0.0
    return max(0.0, (self.overhead - self.bias) / self.weight)

  def __call__(self, x: float) -> float:
    return self.overhead if x < self.threshold else self.weight * x + self.bias


@dataclasses.dataclass(frozen=True)
class SeCoPaCosts:
  """Cost primitives of the SeCoPa model (ms as a function of fp32 element counts)."""
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
  """The constants published in HiPress ``SeCoPa.py`` (N = 4, 8, 16 only; ratio 1/16)."""
  if num_nodes not in _GB:
    raise ValueError(f"{num_nodes=}: HiPress published costs only for 4, 8 and 16 nodes")
  g, b = _GB[num_nodes]
  return SeCoPaCosts(_ENC, _DEC, _AGG, _SEND, g, b)


HIPRESS_COSTS = {n: hipress_costs(n) for n in _GB}


class PlanEntry(NamedTuple):
  """One leaf's decision: compress or not, and the number of partitions K."""
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
    sizes: element counts (ints), or a pytree of arrays/ShapeDtypeStructs (leaf order).
    topology: ``"ps"`` (co-located parameter servers) or ``"ring"`` (case-insensitive).
    num_nodes: N.
    costs: a :class:`SeCoPaCosts` (e.g. from :func:`measure_costs`); default the HiPress
      published constants for ``num_nodes`` (4, 8 or 16).

  Returns:
    A list of :class:`PlanEntry` ``(compress, partitions, t_orig, t_comp)``; pass it as
    ``plan=`` to :func:`jaxlp.parallel.compressed_allreduce`.
  """
  topology = topology.lower()
  if topology not in ("ps", "ring"):
    raise ValueError(f"{topology=} must be 'ps' or 'ring'")
  if num_nodes < 1:
    raise ValueError(f"{num_nodes=} must be >= 1")
  if costs is None:
    costs = hipress_costs(num_nodes)
  if not (isinstance(sizes, (list, tuple)) and all(isinstance(s, (int, np.integer))
                                                    for s in sizes)):
    import jax
    sizes = [int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(sizes)]
  return [plan_one(int(s), costs, topology, num_nodes) for s in sizes]


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
