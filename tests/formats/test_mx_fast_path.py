"""MX's round-to-nearest paths give the bits of the scaled element rounding.

``MXFormat`` rounds ``rounding="nearest"`` with ``_round_nearest`` (integer, no
``floor_log2``) and, on the CPU, with ``_round_nearest_float`` (add and subtract a power of
two) where every block of the array allows it (``_fast_params``), chosen by a conditional on
the whole array. Each is checked bit for bit (NaN payloads included) against
``elem._round_bits(x, scale_exp=s, saturate=True)`` with the block's scale exponent ``s`` (NaN
for a block holding inf or NaN): the element paths on every block scale and every element
exponent around it, with ties at every dropped-bit count; ``quantize`` on crafted arrays that
take each branch, under jit and vmap, along both axes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _bits as B
from jaxlp.formats._block import OCP_ELEMENTS, block_max_bits

RNG = np.random.default_rng(4545)


def _fractions():
  """Fraction fields at every tie and half-ulp boundary of every dropped-bit count."""
  fr = {0, 1, 2, 3, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x400001}
  for d in range(1, 24):
    h = 1 << (d - 1)
    fr.update(v & 0x7FFFFF for v in (h - 1, h, h + 1, h | (1 << d)))
  return np.array(sorted(fr), np.uint32)


def _grid():
  """(mag, mx): element magnitude bits against block-maximum bits, one row per block max.

  Block maxima: every normal exponent field (fraction 0, and all ones for 3 in 4), float32
  subnormal
  maxima, 0, inf and NaN. Elements: every exponent field from 34 below the block max's to
  one above it (the element grids reach 32 binades below the block max), each with every
  fraction of :func:`_fractions`, plus 0, the smallest subnormal and the largest finite."""
  fr = _fractions()
  maxima = [(f << 23) | m for f in range(1, 255) for m in ((0, 0x7FFFFF) if f % 4 else (0,))]
  maxima += [1, 0x400, 0x400000, 0x7FFFFF, 0, 0x7F800000, 0x7FC00000]
  rows = []
  for mx in maxima:
    f = min(mx >> 23, 254)
    fields = np.arange(max(f - 34, 0), min(f + 2, 255), dtype=np.uint32)
    mag = ((fields[:, None] << 23) | fr[None, :]).ravel()
    rows.append(np.concatenate([mag, np.array([0, 1, 0x7F7FFFFF], np.uint32)]))
  width = max(len(r) for r in rows)
  mag = np.stack([np.pad(r, (0, width - len(r))) for r in rows])
  return mag, np.broadcast_to(np.array(maxima, np.uint32)[:, None], mag.shape)


MAG, MX = _grid()
SIGN = RNG.integers(0, 2, MAG.shape).astype(np.uint32) << np.uint32(31)


@functools.partial(jax.jit, static_argnums=0)  # one program (op by op took longer)
def _want_jit(fmt, bits, mx):
  s = jnp.clip(fmt.scale_exponent(jnp.minimum(mx, B.u32(0x7F7FFFFF))), -127, 127)
  r = fmt.elem._round_bits(bits, "nearest", None, None, scale_exp=s, saturate=True)
  return jnp.where(B.is_finite_mag(mx), r, B.u32(B.QNAN_BITS))


def _want(fmt, bits, mx):
  """The scaled element rounding with the blocks' scale exponents, NaN for non-finite
  blocks (uint32 bits)."""
  return np.asarray(_want_jit(fmt, bits, mx))


def _assert_bits(got, want, where, msg):
  got, want = np.asarray(got), np.asarray(want)
  bad = (got != want) & where
  if bad.any():
    i = np.flatnonzero(bad)[:8]
    raise AssertionError(f"{msg}: {bad.sum()} of {where.sum()} differ; " + ", ".join(
        f"x={B.from_bits(jnp.uint32(b)).item()!r} got {g:#010x} want {w:#010x}"
        for b, g, w in zip(np.asarray(BITS).ravel()[i], got.ravel()[i], want.ravel()[i],
                           strict=True)))


BITS = jnp.asarray(MAG | SIGN)


@pytest.mark.parametrize("elem", OCP_ELEMENTS, ids=repr)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_element_paths_match_the_scaled_rounding(elem, rule):
  """``_round_nearest`` on every block; ``_round_nearest_float`` on every block that
  ``_fast_params`` accepts (most of them: all but the extreme scales)."""
  fmt = F.mx(elem, 32, scale_rule=rule)
  mx = jnp.asarray(MX)

  @jax.jit
  def paths(bits, mx):
    params = fmt._block_params(mx, "nearest")
    lob, cb, vmax, ok, regular = fmt._fast_params(mx, params)
    return (fmt._round_nearest(bits, params),
            fmt._round_nearest_float(bits, lob, cb, vmax, ok), regular)

  exact, fast, regular = paths(BITS, mx)
  want = _want(fmt, BITS, mx)
  everywhere = np.ones(MAG.shape, bool)
  _assert_bits(exact, want, everywhere, f"{elem!r} {rule} integer path")
  regular = np.asarray(regular)
  # an all-zero block is accepted for its zeros (no other element can be in it)
  _assert_bits(fast, want, regular & ((MX != 0) | (MAG == 0)), f"{elem!r} {rule} float path")
  rows = regular.all(axis=1)
  assert rows.sum() > 300 and not rows.all(), rows.sum()  # the extremes are refused
  assert rows[-7:].tolist() == [False] * 4 + [True] * 3  # tiny maxima; zero, inf, NaN blocks


def _blocks(elem, extreme: bool):
  """(48, 32) float32, one block of 32 per row at scales 2**-90 .. 2**90, with ±0, ties of
  the element grid at the block's scale, values that saturate, subnormal results, a zero
  block, a block holding inf, one holding NaN; ``extreme`` adds a block whose maximum is a
  float32 subnormal (which the float path refuses)."""
  x = RNG.standard_normal((48, 32)).astype(np.float32)
  scale = 2.0 ** np.linspace(-90, 90, 48).round()
  x *= scale[:, None].astype(np.float32)
  x[:, 0] = 0.0
  x[:, 1] = -0.0
  # ties: (k + 1/2) quanta of the element grid at the block's scale, below and above 2**lo
  m, emax = elem.man_bits, elem.emax
  for i in range(48):
    amax = np.float32(np.abs(x[i]).max())
    e = int(np.floor(np.log2(amax)))
    s = e - emax
    q_hi = 2.0 ** (e - m)  # quantum of the top binade
    q_lo = 2.0 ** (s + elem.emin - m)  # quantum of the scaled subnormals
    x[i, 2:6] = np.array([1.5 * q_lo, 2.5 * q_lo, 0.5 * q_lo, -3.5 * q_lo], np.float32)
    x[i, 6] = np.float32(2.0**e + 0.5 * q_hi)  # tie in the top binade
    x[i, 7] = np.float32(-(2.0 ** (e + 1) - 0.25 * q_hi))  # saturates (floor rule)
  x[40] = 0.0
  x[41, 9] = np.inf
  x[42, 3] = np.nan
  if extreme:
    x[43] = (RNG.standard_normal(32) * 2.0**-140).astype(np.float32)
  return jnp.asarray(x)


@functools.partial(jax.jit, static_argnums=1)
def _want_quantize_jit(x, fmt):
  bits = B.to_bits(x)
  mx = block_max_bits(bits & B.u32(B.ABS_MASK), axis=fmt.axis, block_size=fmt.block_size)
  return _want_jit(fmt, bits, mx)


def _want_quantize(x, fmt):
  return np.asarray(_want_quantize_jit(x, fmt))


@pytest.mark.parametrize("elem", OCP_ELEMENTS, ids=repr)
@pytest.mark.parametrize("extreme", [False, True], ids=["float-path", "integer-path"])
def test_quantize_takes_either_branch_with_the_same_bits(elem, extreme):
  """``quantize`` under jit (blocks along the rows and, transposed, along the columns) and
  under vmap (where the conditional runs both branches and selects) gives the reference
  bits; without the extreme block every block is one the float path accepts."""
  x = _blocks(elem, extreme)
  for fmt, xa in ((F.mx(elem, 32), x), (F.mx(elem, 32, axis=0), x.T)):
    bits = B.to_bits(xa)
    mx = block_max_bits(bits & B.u32(B.ABS_MASK), axis=fmt.axis, block_size=32)
    regular = fmt._fast_params(mx, fmt._block_params(mx, "nearest"))[-1]
    assert bool(jnp.all(regular)) == (not extreme)
    got = jax.jit(lambda v, fmt=fmt: F.quantize(v, fmt))(xa)
    np.testing.assert_array_equal(np.asarray(B.to_bits(got)), _want_quantize(xa, fmt),
                                  err_msg=f"{elem!r} axis {fmt.axis}")
  fmt = F.mx(elem, 32)
  got = jax.jit(jax.vmap(lambda v: F.quantize(v, fmt)))(x.reshape(6, 8, 32))
  np.testing.assert_array_equal(np.asarray(B.to_bits(got)).reshape(48, 32),
                                _want_quantize(x, fmt), err_msg=f"{elem!r} vmap")


def test_partial_blocks_and_middle_axes():
  """Blocks cut without padding (a partial last block reduced on its own) along a middle
  axis and the last, with the maxima of the last-axis blocks taken in two stages."""
  x = jnp.asarray((RNG.standard_normal((3, 63, 40)) * 0.05).astype(np.float32))
  for axis, bs in ((1, 32), (2, 32), (0, 2)):
    fmt = F.mx(F.E4M3FN, bs, axis=axis)
    got = jax.jit(lambda v, fmt=fmt: F.quantize(v, fmt))(x)
    np.testing.assert_array_equal(np.asarray(B.to_bits(got)), _want_quantize(x, fmt),
                                  err_msg=f"axis {axis} block {bs}")
