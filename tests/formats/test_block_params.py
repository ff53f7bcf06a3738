"""The block formats' per-block split (block parameters computed once per block, then the
elements) gives the bits of the per-element formulas it replaced, and ``fence`` is the
identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _bits as B
from jaxlp.formats._block import OCP_ELEMENTS, _bfp_round, block_max_bits

from . import _ref

RNG = np.random.default_rng(45)


def _blocks_input():
  """(64, 32) float32: one block of 32 per row, each row at its own scale (2**-149 ..
  2**127, float32 subnormal maxima included), with zeros, -0, ties on the E2M1 .. E4M3
  grids, values just below powers of two, a row holding inf and one holding NaN."""
  x = RNG.standard_normal((64, 32)).astype(np.float32)
  x[:, :8] = np.array([0.0, -0.0, 1.5, 2.5, 1.0625, 1.1875, 0.75, -3.0], np.float32)
  x[:, 8] = np.nextafter(np.float32(1.0), np.float32(0.0))
  scale = 2.0 ** np.linspace(-149, 127, 62).round()
  with np.errstate(over="ignore", under="ignore"):
    x[:62] = (x[:62] * scale[:, None]).astype(np.float32)
  x[62, 5] = np.inf
  x[63, 7] = np.nan
  return jnp.asarray(x)


@pytest.mark.parametrize("elem", OCP_ELEMENTS, ids=repr)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mx_elements_match_the_scaled_element_rounding(elem, rule):
  """``mx(...)`` = ``elem._round_bits(x, scale_exp=s, saturate=True)`` with the block's scale
  exponent ``s``, NaN for non-finite blocks: every rounding mode."""
  fmt = F.mx(elem, 32, scale_rule=rule)
  roundings = ("nearest", "toward_zero", "up", "down", "nearest_away", "stochastic")

  @jax.jit  # one program for the case (op-by-op dispatch took 2-3x longer)
  def run(x):
    bits = B.to_bits(x)
    mx = block_max_bits(bits & B.u32(B.ABS_MASK), axis=-1, block_size=32)
    s = jnp.clip(fmt.scale_exponent(jnp.minimum(mx, B.u32(0x7F7FFFFF))), -127, 127)
    out = []
    for rounding in roundings:
      key = jax.random.key(1) if rounding == "stochastic" else None
      rand = F.random_bits(key, x.shape) if key is not None else None
      want = elem._round_bits(bits, rounding, rand, None, scale_exp=s, saturate=True)
      want = B.from_bits(jnp.where(B.is_finite_mag(mx), want, B.u32(B.QNAN_BITS)))
      out.append((F.quantize(x, fmt, rounding, key=key), want))
    return out

  for rounding, (got, want) in zip(roundings, run(_blocks_input()), strict=True):
    _ref.assert_same_bits(got, want, msg=f"{elem!r} {rule} {rounding}")


@pytest.mark.parametrize("man_bits", [1, 3, 8, 24])
@pytest.mark.parametrize("exponent", ["exact", "hbfp"])
def test_bfp_elements_match_the_shared_exponent_rounding(man_bits, exponent):
  """``BlockFormat`` (tiles and axis blocks) = ``_bfp_round`` with the block's shared
  exponent, NaN for non-finite blocks."""
  fmts = (F.BlockFormat(man_bits, tile=(5, 7), exponent=exponent),
          F.BlockFormat(man_bits, axis=0, block_size=3, exponent=exponent))
  cases = [(fmt, rounding) for fmt in fmts for rounding in ("nearest", "up", "stochastic")]

  @jax.jit  # one program for the case (op-by-op dispatch took longer)
  def run(x):
    bits = B.to_bits(x)
    out = []
    for fmt, rounding in cases:
      mx = fmt._block_max(bits & B.u32(B.ABS_MASK))
      e = fmt.shared_exponent(jnp.minimum(mx, B.u32(0x7F7FFFFF)))
      key = jax.random.key(2) if rounding == "stochastic" else None
      rand = F.random_bits(key, x.shape) if key is not None else None
      want = _bfp_round(bits, e, man_bits, rounding, rand, None)
      want = B.from_bits(jnp.where(B.is_finite_mag(mx), want, B.u32(B.QNAN_BITS)))
      out.append((F.quantize(x, fmt, rounding, key=key), want))
    return out

  for (fmt, rounding), (got, want) in zip(cases, run(_blocks_input()), strict=True):
    _ref.assert_same_bits(got, want, msg=f"{fmt!r} {rounding}")


def test_fence_is_the_identity():
  """``fence`` returns its integer and bool arrays unchanged (extremes, negatives), under jit
  and vmap."""
  u = jnp.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF], jnp.uint32)
  i = jnp.array([-(2**31), -1, 0, 1, 2**31 - 1], jnp.int32)
  b = jnp.array([True, False, True, True, False])
  for word in (jnp.uint32(0), jnp.uint32(0xFFFFFFFF), u[3]):
    out = jax.jit(B.fence)((u, i, b), word)
    for got, want in zip(out, (u, i, b), strict=True):
      assert got.dtype == want.dtype
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  out = jax.vmap(lambda a, w: B.fence(a, w))(jnp.stack([u, u]), u[:2])
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.stack([u, u])))
