"""The Pallas block GEMM (``jaxlp/pallas/_block_gemm.py``) in interpret mode gives the bits of
the reference ``block_dot_reference`` (``jaxlp/formats/_block_dot.py``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD
from jaxlp.pallas import _block_gemm as PB
from jaxlp.pallas._block_gemm import block_gemm

# the reference and the route map compiled as one program each (eagerly, every operation
# would compile on its own)
_ref = jax.jit(BS.block_dot_reference, static_argnums=(2, 3, 4))
_routes = jax.jit(PB.tile_routes, static_argnums=(2, 3, 4), static_argnames=("block_m", "block_n"))
_quantize = jax.jit(F.quantize, static_argnums=1)


def _wide(rng, shape, spread=4.0):
  return jnp.asarray(rng.normal(size=shape) * np.exp2(rng.normal(size=shape) * spread),
                     jnp.float32)


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, x.view(np.uint32)), np.where(nan, 0, y.view(np.uint32)))


@pytest.mark.parametrize("fa,fb,g,shape", [
    (F.hbfp(7, 24), F.hbfp(7, 24), 24, (20, 70, 12)),  # partial tiles and K-block
    (F.mx("int8", 32, 1), F.mx("int8", 32, 0), 32, (17, 64, 33)),
    (F.hbfp_batched(7), F.hbfp_batched(7), 1, (9, 5, 18)),  # K-blocks of 1 (per sample)
    (F.BlockFormat(6, axis=1), F.BlockFormat(7, axis=0), 40, (8, 40, 8)),  # one block
], ids=["hbfp8", "mxint8", "g1", "whole"])
@pytest.mark.parametrize("route", PB.ROUTES)
def test_interpret_matches_reference(fa, fb, g, shape, route):
  M, K, N = shape
  rng = np.random.default_rng(0)
  x = _wide(rng, (M, K))
  tiled = fa.tile is not None if isinstance(fa, F.BlockFormat) else False
  if g > 1:
    x = x.at[2, :].set(2.0**90)  # an overflowing row
    if not tiled:  # (in a tile, a NaN would spread to every row of the tile)
      x = x.at[1, 3].set(jnp.inf)  # a NaN block
  a = _quantize(x, fa)
  b = _quantize(_wide(rng, (K, N)) * (2.0**60 if g > 1 else 1.0), fb)
  ba, bb = BS.significand_bits(fa), BS.significand_bits(fb)
  ref = _ref(a, b, g, ba, bb)
  out = block_gemm(a, b, g, ba, bb, interpret=True, route=route)
  assert _same(out, ref)
  if g > 1:
    assert np.isinf(np.asarray(out)[2]).any()
    assert tiled or np.isnan(np.asarray(out)[1]).all()


# (K-blocks of 32, as MXINT8's, fill their window as those of 64 and 1024 do)
@pytest.mark.parametrize("R,K,g", [(37, 50, 24), (33, 256, 64), (40, 100, 8), (17, 2048, 1024)],
                         ids=["hbfp8-ragged", "g64", "g8", "g1024"])
def test_pallas_operand_preparation_has_the_jnp_bits(R, K, g):
  """prep_bf16_rows (one Pallas kernel, interpreted) writes the bf16 values and block exponents
  that _prepare and _bf16_values compute in jnp: ragged rows and K-blocks, inf, NaN, all-zero
  and -0.0 blocks, subnormals, exponents from 2**-150 to 2**120."""
  rng = np.random.default_rng(R)
  x = rng.normal(size=(R, K)) * np.exp2(rng.integers(-150, 120, size=(R, 1)))
  x[0, :3] = [np.inf, np.nan, 1.0]
  x[1, :] = 0.0
  x[2, :g] = -0.0
  x[3, :5] = 2.0**-149
  a = _quantize(jnp.asarray(x, jnp.float32), F.BlockFormat(7, axis=1, block_size=g))
  rows = -(-R // 16) * 16

  @jax.jit  # the jnp side and the kernel, one program each
  def want(a):
    k, q = PB._prepare_one(a, g, 7, rows)
    return PB._bf16_values(k, q, -(-g // 16) * 16, 1), q

  want_v, q = want(a)
  v, got_q = jax.jit(lambda a: PB.prep_bf16_rows(a, g, 7, 1, rows, interpret=True))(a)
  assert np.array_equal(np.asarray(got_q), np.asarray(q))
  assert np.array_equal(np.asarray(v).view(np.uint16), np.asarray(want_v).view(np.uint16))


@pytest.mark.parametrize("M,K,N,g", [(40, 96, 24, 24), (20, 64, 33, 32)])
def test_pallas_preparation_and_gpu_auto_keep_the_gemm_bits(M, K, N, g):
  """block_gemm(prep="pallas") and gpu_impl="auto"'s implementation give the reference's
  bits (a NaN block, an all-zero row, exponents 2**-60 to 2**60); a bad prep is refused."""
  rng = np.random.default_rng(M)
  x = rng.normal(size=(M, K)) * np.exp2(rng.integers(-60, 60, size=(M, 1)))
  x[0, 1], x[2, :] = np.nan, 0.0
  a = _quantize(jnp.asarray(x, jnp.float32), F.BlockFormat(7, axis=1, block_size=g))
  b = _quantize(_wide(rng, (K, N)), F.BlockFormat(7, axis=0, block_size=g))
  ref = _ref(a, b, g, 7, 7)
  assert _same(block_gemm(a, b, g, 7, 7, interpret=True, prep="pallas"), ref)
  assert _same(BD.block_dot_gpu_auto(a, b, g, 7, 7, interpret=True), ref)
  with pytest.raises(ValueError, match="prep='xla' not in"):
    block_gemm(a, b, g, 7, 7, interpret=True, prep="xla")


def test_rejects_wide_significands():
  with pytest.raises(ValueError, match="<= 7 bits"):
    block_gemm(jnp.ones((4, 8)), jnp.ones((8, 4)), 8, 11, 7, interpret=True)


def test_fast_scaling_equals_scale_exact_on_its_range():
  """The kernel's fast scaling, ``fl32(n) * 2**q`` for FAST_Q_MIN <= q <= FAST_Q_MAX, has
  ``scale_exact``'s bits (ties of the int -> float conversion, the extremes of n and q)."""
  from jaxlp.formats import _bits as B
  from jaxlp.pallas import _block_gemm as PB

  rng = np.random.default_rng(1)
  special = [0, 1, -1, 2**24 + 1, 2**24 + 3, -(2**24 + 1), 2**25 + 2, 2**31 - 1, -(2**31 - 1),
             2**30 + 64, 123456789]
  n = np.concatenate([special, rng.integers(-(2**31 - 1), 2**31, 4000)]).astype(np.int32)
  q = np.concatenate([[PB.FAST_Q_MIN, PB.FAST_Q_MAX, 0, -1, 1],
                      rng.integers(PB.FAST_Q_MIN, PB.FAST_Q_MAX + 1, 200)]).astype(np.int32)
  nn, qq = (jnp.asarray(v) for v in np.meshgrid(n, q))

  @jax.jit  # one program (eagerly, every operation would compile on its own)
  def run(nn, qq):
    fast = nn.astype(jnp.float32) * B.from_bits(B.pow2_bits(qq))
    return fast, BS.scale_exact(nn, qq), BS.flush(fast)

  fast, exact, flushed = run(nn, qq)
  assert _same(fast, exact)
  assert _same(flushed, fast)  # normal or +0.0: accumulate's flush is the identity


def test_interpret_mixes_fast_and_exact_tiles():
  """N(0, 1) blocks (bf16 route / fast scaling), all-zero blocks, blocks scaled to 2**-130
  (their partials leave the normal range: int8 route, exact scaling) and blocks scaled to
  2**110, in one GEMM."""
  rng = np.random.default_rng(2)
  M, K, N, g = 40, 96, 36, 24
  x = rng.normal(size=(M, K))
  x[:16, :24] = 0.0  # all-zero blocks
  x[24:40, 24:48] *= 2.0**-130  # tiny blocks (a whole 24 x 24 tile of hbfp)
  x[30, 72:] *= 2.0**110  # partials beyond FAST_Q_MAX
  w = rng.normal(size=(K, N))
  w[48:72, :4] *= 2.0**-20
  a = _quantize(jnp.asarray(x, jnp.float32), F.hbfp(7, 24))
  b = _quantize(jnp.asarray(w, jnp.float32), F.hbfp(7, 24))
  ref = _ref(a, b, g, 7, 7)
  # the int8 route alone once: its bits do not depend on the route tiles
  for bm, route in ((16, "auto"), (16, "int8"), (32, "auto")):
    routes = np.asarray(_routes(a, b, g, 7, 7, block_m=bm, block_n=16))
    assert routes.min() == 0 and routes.max() == 1  # both routes in one GEMM
    out = block_gemm(a, b, g, 7, 7, interpret=True, block_m=bm, block_n=16, route=route)
    assert _same(out, ref)


def test_bf16_route_is_taken_on_ordinary_data():
  """N(0, 1) HBFP8 / MXINT8 operands: every tile takes the bf16 route. (Its bits: on HBFP8's
  N(0, 1) tiles in test_interpret_mixes_fast_and_exact_tiles, on MXINT8 tiles in
  test_bf16_route_exponent_boundary and test_bf16_route_gives_positive_zero_...)"""
  rng = np.random.default_rng(3)
  for fa, fb, g in ((F.hbfp(7, 24), F.hbfp(7, 24), 24),
                    (F.mx("int8", 32, 1), F.mx("int8", 32, 0), 32)):
    a = _quantize(jnp.asarray(rng.normal(size=(40, 96)), jnp.float32), fa)
    b = _quantize(jnp.asarray(rng.normal(size=(96, 48)), jnp.float32), fb)
    assert np.asarray(_routes(a, b, g, 7, 7, block_m=16, block_n=16)).all()


@pytest.mark.parametrize("qa_min", [PB.BF16_Q_MIN, PB.BF16_Q_MIN - 1])
def test_bf16_route_exponent_boundary(qa_min):
  """A block of ``a`` with exponent qa at the bf16 route's lower limit (taken) and one below
  it (int8 route), with ``b``'s exponent 0 so that qa + qb is at the limit too."""
  rng = np.random.default_rng(4)
  x = rng.uniform(-1, 1, size=(16, 32)) * 2.0**(qa_min + 6)
  x[:, 0] = 2.0**(qa_min + 6)  # the block max fixes qa = qa_min (7 bits: q = floor(log2) - 6)
  w = rng.uniform(-1, 1, size=(32, 16)) * 2.0**6
  w[0, :] = 2.0**6
  a = _quantize(jnp.asarray(x, jnp.float32), F.mx("int8", 32, 1))
  b = _quantize(jnp.asarray(w, jnp.float32), F.mx("int8", 32, 0))
  _, qa, _, qb = jax.jit(lambda a, b: PB._prepare(a, b, 32, 7, 7, 16, 16))(a, b)
  assert int(qa.min()) == qa_min and int(qb.max()) == 0
  taken = bool(_routes(a, b, 32, 7, 7)[0, 0])
  assert taken == (qa_min >= PB.BF16_Q_MIN)
  ref = _ref(a, b, 32, 7, 7)
  assert _same(block_gemm(a, b, 32, 7, 7, interpret=True), ref)


def test_bf16_route_gives_positive_zero_for_negative_zero_products():
  """A K-block whose products are all -0.0 (0 x negative; no zero padding at g = 32): the
  reference's partial is +0.0 (scale_exact of 0), and so is the bf16 route's (its sum starts
  at +0.0), also as the only K-block."""
  a = jnp.zeros((16, 32), jnp.float32).at[1:].set(1.0)
  b = -jnp.ones((32, 16), jnp.float32)
  for route in PB.ROUTES:
    out = block_gemm(a, b, 32, 7, 7, interpret=True, route=route)
    assert np.asarray(out)[0].view(np.uint32).max() == 0  # +0.0, not -0.0
    assert _same(out, _ref(a, b, 32, 7, 7))


def test_bf16_route_needs_exact_float32_block_sums():
  """The bf16 route needs g * 2**(bits_a + bits_b) <= 2**24; longer K-blocks run int8 only."""
  assert PB.bf16_route_ok(1024, 7, 7) and not PB.bf16_route_ok(1025, 7, 7)
  assert PB.bf16_route_ok(2**18, 3, 3) and not PB.bf16_route_ok(24, 8, 7)
  rng = np.random.default_rng(5)
  a = _quantize(jnp.asarray(rng.normal(size=(16, 1100)), jnp.float32), F.BlockFormat(7, axis=1))
  b = _quantize(jnp.asarray(rng.normal(size=(1100, 16)), jnp.float32), F.BlockFormat(7, axis=0))
  assert not np.asarray(_routes(a, b, 1100, 7, 7)).any()
  ref = _ref(a, b, 1100, 7, 7)
  assert _same(block_gemm(a, b, 1100, 7, 7, interpret=True), ref)


@pytest.mark.parametrize("g", [1, 5, 24])
def test_nonzero_blocks_is_any_nonzero_significand(g):
  """The kernels' block-exponent mask tests the input's magnitudes; it must agree with the
  significands (the reference's view) on zeros, -0.0, subnormals, inf, NaN and a ragged
  last block."""
  vals = np.array([0.0, -0.0, 1e-45, -1e-42, 1.5, -3.0, np.inf, -np.inf, np.nan, 2.0**-126,
                   3e38], np.float32)
  rng = np.random.default_rng(g)
  x = rng.choice(vals, size=(40, 53))
  x[::3] = 0.0  # all-zero rows and blocks
  x[1::3, : 53 // 2] = -0.0


  @jax.jit  # one program (eagerly, every operation would compile on its own)
  def run(x):
    return PB._nonzero_blocks(x, g), [jnp.any(BS.split_significands(x, g, bits)[0] != 0,
                                              axis=-1) for bits in (3, 7)]

  mask, want = run(jnp.asarray(x))
  for w in want:
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(w))


def test_rejects_bad_route_and_tiles():
  with pytest.raises(ValueError, match="route='fp8' not in"):
    block_gemm(jnp.ones((4, 8)), jnp.ones((8, 4)), 8, 7, 7, interpret=True, route="fp8")
  with pytest.raises(ValueError, match="block_m must be a power of two >= 16, got 24"):
    block_gemm(jnp.ones((4, 8)), jnp.ones((8, 4)), 8, 7, 7, interpret=True, block_m=24)


@pytest.mark.parametrize("elem,kind,g,shape", [
    (F.E4M3FN, "e4m3fn", 32, (40, 96, 36)),
    (F.E5M2, "e5m2", 16, (20, 40, 24)),  # K-blocks padded to the fp8 MMA depth, ragged K
], ids=["e4m3fn", "e5m2-g16"])
def test_fp8_block_gemm_matches_the_xla_fp8_mode(elem, kind, g, shape):
  """The fp8 fast mode's kernel (interpret mode) against the XLA route of ``fp8_dot`` and a
  float64 product of the same operands: not bit-exact by design, but within float32
  rounding of the largest output (the interpreter's fp8 dots are exact)."""
  M, K, N = shape
  rng = np.random.default_rng(6)
  fa, fb = F.mx(elem, g, 1), F.mx(elem, g, 0)
  x = rng.normal(size=(M, K)) * np.exp2(rng.integers(-8, 9, size=(1, K)))  # blocks differ
  a = _quantize(jnp.asarray(x, jnp.float32), fa)
  b = _quantize(jnp.asarray(rng.normal(size=(K, N)), jnp.float32), fb)


  @jax.jit  # the kernel and the XLA route as one program
  def run(a, b):
    a8, sa = BD._fp8_scaled(a, kind, g, True)
    b8, sb = BD._fp8_scaled(b.T, kind, g, True)
    return (PB.fp8_block_gemm(a8, sa, b8, sb, interpret=True, block_m=16, block_n=16),
            BD.fp8_dot(a, b, fa, fb, g))

  out, xla = (np.asarray(v) for v in run(a, b))
  exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  scale = np.abs(exact).max()
  assert np.abs(out - exact).max() / scale < 4e-7
  assert np.abs(out - xla).max() / scale < 4e-7


def test_fp8_block_gemm_rejects_mismatched_operands():
  a8 = jnp.zeros((4, 2, 32), jnp.float8_e4m3fn)
  s = jnp.zeros((4, 2), jnp.int32)
  with pytest.raises(ValueError, match="do not match"):
    PB.fp8_block_gemm(a8, s, jnp.zeros((4, 3, 32), jnp.float8_e4m3fn),
                      jnp.zeros((4, 3), jnp.int32), interpret=True)
