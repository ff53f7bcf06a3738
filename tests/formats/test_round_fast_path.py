"""FloatFormat's field-based rounding path == the generic floor_log2 + round_to_quantum path.

``FloatFormat._round_mag`` derives the dropped-bit count from the exponent field and prunes
branches with static bounds (``_bits.round_dropped_bits(d_range=...)``); this checks it bit
for bit against the direct formula ``qe = max(floor_log2|x|, emin) - m`` on every exponent
field with fractions that hit every tie / half-ulp boundary.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _bits as B
from jaxlp.formats._float_format import FloatFormat

FORMATS = [F.FP32, F.TF32, F.BF16, F.FP16, F.E5M2, F.E4M3, F.E4M3FNUZ, F.E2M1FN,
           FloatFormat(8, 0), FloatFormat(8, 22), FloatFormat(4, 3, subnormals=False),
           FloatFormat(8, 7, subnormals=False), FloatFormat(8, 23, subnormals=False),
           FloatFormat(7, 12, bias=100)]


def _patterns():
  rng = np.random.default_rng(5)
  fr = {0, 1, 0x7FFFFF, 0x400000}
  for d in range(1, 24):
    h = 1 << (d - 1)
    fr.update(v & 0x7FFFFF for v in (h - 1, h, h + 1, h | (1 << d), (1 << d) - 1))
  fr.update(int(v) for v in rng.integers(0, 1 << 23, 8))
  fr = np.array(sorted(fr), np.uint32)
  fields = np.arange(255, dtype=np.uint32)  # finite fields only
  return ((fields[:, None] << 23) | fr[None, :]).ravel()


MAG = _patterns()


def _reference(fmt, mag, rounding, sign, rand, rand_bits):
  e = B.floor_log2(mag)
  if fmt.subnormals:
    qe = jnp.maximum(e, fmt.emin) - fmt.man_bits
  else:
    qe = jnp.where(e < fmt.emin, fmt.emin, e - fmt.man_bits)
  return B.round_to_quantum(mag, qe, rounding, negative=sign, rand=rand, rand_bits=rand_bits)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_field_path_matches_floor_log2_path(fmt):
  mag = jnp.asarray(MAG)
  field = (mag >> 23).astype(jnp.int32)
  rng = np.random.default_rng(6)
  sign = jnp.asarray(rng.integers(0, 2, MAG.size).astype(bool))
  rand = rng.integers(0, 1 << 32, MAG.size, dtype=np.uint64).astype(np.uint32)
  rand[:64] = 0
  rand[64:128] = 0xFFFFFFFF
  rand = jnp.asarray(rand)
  cases = [(r, None) for r in B.ROUNDINGS] + [("stochastic", 1), ("stochastic", 9)]
  for rounding, rb in cases:
    got = np.asarray(fmt._round_mag(mag, field, rounding, sign, rand, rb))
    want = np.asarray(_reference(fmt, mag, rounding, sign, rand, rb))
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"{fmt!r} {rounding} rand_bits={rb}: {bad.size} mismatches, first at mag="
        f"{MAG[bad[0]]:#010x}: got {got[bad[0]]:#010x}, want {want[bad[0]]:#010x}")
