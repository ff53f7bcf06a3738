"""``BlockFormat.quantize`` on the CPU (block max and elements in conditionals) gives the bits
of the plain composition: the block maxima (``block_max_bits``) then the element rounding
(``_round_with_block_max``, the Pallas kernels' path), bit for bit (NaN payloads included).

Arrays hold ties at several dropped-bit counts, float32 subnormals, values that saturate,
+-0, inf, NaN and all-zero blocks, with blocks along the last, a middle and the first axis
(partial last blocks) and tiles (HBFP's 24 x 24 with partial tiles, one per row, one per
tensor), both exponent rules, nearest and stochastic rounding, under jit and vmap (where a
conditional runs both branches and selects).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _bits as B
from jaxlp.formats._block import block_max_bits

RNG = np.random.default_rng(4546)


def _array(shape):
  """float32 values over many binades, with crafted specials at fixed places."""
  n = int(np.prod(shape))
  x = (RNG.standard_normal(n) * np.exp2(RNG.integers(-30, 30, n))).astype(np.float32)
  # ties of an 8-bit grid on [-8, 8): k * 2**-4 + 2**-5 (the block max 7.97 sets e = 3)
  k = RNG.integers(-127, 127, n // 4)
  x[: n // 4] = (k * 2.0**-4 + 2.0**-5).astype(np.float32)
  x[n // 4] = 7.97
  specials = np.array([0.0, -0.0, 1e-40, -3e-39, 1.4e-45, 3.4e38, -3.4e38, np.inf, -np.inf,
                       np.nan, 2.0**-126, 1.0 - 2.0**-24], np.float32)
  at = RNG.choice(np.arange(n // 4 + 1, n), len(specials), replace=False)
  x[at] = specials
  x = x.reshape(shape)
  x[..., :3] = 0.0  # zero blocks along the first axis / in the first tiles
  return jnp.asarray(x)


def _want(x, fmt, rounding):
  bits = B.to_bits(x)
  mx = block_max_bits(bits & B.u32(B.ABS_MASK), tile=fmt.tile, axis=fmt.axis,
                      block_size=fmt.block_size)
  return np.asarray(fmt._round_with_block_max(bits, mx, rounding, None, None))


FORMATS = [
    F.BlockFormat(7, axis=-1, block_size=24, exponent="hbfp"),
    F.BlockFormat(7, axis=1, block_size=24, exponent="hbfp"),
    F.BlockFormat(4, axis=0, block_size=5),
    F.hbfp(7, 24),
    F.hbfp(3, 4),
    F.hbfp_batched(7),
    F.BlockFormat(23),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_quantize_matches_the_composition_under_jit_and_vmap(fmt):
  x = _array((4, 30, 50))
  got = jax.jit(lambda v: F.quantize(v, fmt))(x)
  np.testing.assert_array_equal(np.asarray(B.to_bits(got)), np.asarray(_want(x, fmt, "nearest")))
  # under vmap each (30, 50) slice is quantized on its own: axis blocks one axis lower
  inner = fmt if fmt.axis is None else F.BlockFormat(
      fmt.man_bits, axis=fmt.axis if fmt.axis < 0 else max(fmt.axis - 1, 0),
      block_size=fmt.block_size, exponent=fmt.exponent)
  got = jax.jit(jax.vmap(lambda v: F.quantize(v, inner)))(x)
  want = np.stack([_want(x[i], inner, "nearest") for i in range(x.shape[0])])
  np.testing.assert_array_equal(np.asarray(B.to_bits(got)), want)


def test_the_cpu_path_is_the_conditional_one():
  """The jaxpr holds the platform choice and the conditionals (so the tests above check
  them on this CPU)."""
  jaxpr = str(jax.make_jaxpr(lambda v: F.quantize(v, FORMATS[0]))(jnp.ones((4, 30))))
  assert "platform_index" in jaxpr and jaxpr.count("cond[") >= 3, jaxpr[:2000]


@pytest.mark.parametrize("fmt", [FORMATS[0], FORMATS[3]], ids=repr)
def test_stochastic_matches_the_composition(fmt):
  x = _array((4, 30, 50))
  key = jax.random.key(7)
  got = jax.jit(lambda v, k: F.quantize(v, fmt, "stochastic", key=k))(x, key)
  # quantize's noise: element i draws word i of random_bits(key, shape)
  bits = B.to_bits(x)
  mx = block_max_bits(bits & B.u32(B.ABS_MASK), tile=fmt.tile, axis=fmt.axis,
                      block_size=fmt.block_size)
  rand = F.random_bits(key, x.shape)
  want = fmt._round_with_block_max(bits, mx, "stochastic", rand, None)
  np.testing.assert_array_equal(np.asarray(B.to_bits(got)), np.asarray(want))
