"""DGC's warm-up never sends more than the dense all-reduce it replaces: the payload capacity
is capped at floor(n/W - 1/2) values once the compressor knows its W workers."""

import math

import pytest
from test_engine_families import PARAMS, W, _measured_bytes

import jaxlp.parallel.compressors as C
from jaxlp.parallel import compressed_wire_bytes


def _ring_fp32(n, w):  # bytes one worker sends in a ring all-reduce of n fp32 values
  return 2 * (w - 1) * 4 * n // w


@pytest.mark.parametrize("w", [2, 4, 8, 64])
@pytest.mark.parametrize("n", [1, 7, 1000, 102_760_448])
def test_warmup_capacity_never_costs_more_than_dense(n, w):
  comp = C.dgc(0.001, momentum=0.0, warmup=5).for_workers(w)
  k = comp.capacity(n)
  assert k >= min(n, max(1, -(-n // 1000)))  # never below the target's capacity
  if C.dgc(0.001).capacity(n) * 8 + 4 <= 8 * n / w:  # the target itself fits under dense
    assert (w - 1) * comp.wire_bytes((n,)) <= _ring_fp32(n, w) + (w - 1) * 4
  # without W (or without warm-up) the capacity is the first stage's / the target's
  assert C.dgc(0.001, warmup=5).capacity(n) == min(n, math.ceil(n * 0.25))
  assert C.dgc(0.001).for_workers(w) == C.dgc(0.001)


def test_warmup_bytes_from_the_collectives_equal_the_accounting(cpu_devices):
  del cpu_devices
  comp = C.dgc(0.1, momentum=0.0, warmup=3)
  want = compressed_wire_bytes(PARAMS, comp, W, min_size=64)
  assert _measured_bytes(comp, min_size=64) == want
  big = {"big": PARAMS["big"]}
  n = 24 * 40
  assert compressed_wire_bytes(big, comp, W, min_size=64) <= _ring_fp32(n, W) + (W - 1) * 4
  # the first stage alone (25% of 960 = 240 values) would cost (W-1)*(4+8*240) > dense
  assert (W - 1) * C.dgc(0.1, warmup=3).wire_bytes((n,)) > _ring_fp32(n, W)
