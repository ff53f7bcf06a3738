"""The fast block-wire codec of the sharded collectives gives the bits of the full emulation:
integer BlockFormat codes (``bfp_codes``) and values (``bfp_values``) against exact numpy
oracles; ``encode_nearest`` (codes straight from the values) and the new encode / decode
against the ``scale_pow2`` formulas they replace; ``rank_sum``'s hardware-add path against
``add_f32``; and compressed_reduce_scatter / all_gather on crafted leaves (subnormal scales,
zero blocks, NaN / inf blocks, +-3e38, ties, -0) against the numpy oracles, under jit, vmap,
shard_map and shard_map x vmap (the Trainer's program)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp import parallel as jp
from jaxlp.formats import _bits as B
from jaxlp.parallel._arith import add_f32, scale_pow2
from jaxlp.parallel._codec import bfp_codes, bfp_values, max_last
from jaxlp.parallel._sharded import _wire, rank_sum

sys.path.insert(0, str(Path(__file__).parent))
import oracle  # noqa: E402
from test_sharded import assert_same_bits, run_shard_map, run_two_level, run_vmap  # noqa: E402

W = 4


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def _f32(bits):
  return np.asarray(bits, np.uint32).view(np.float32)


def _crafted_magnitudes(rng):
  """uint32 magnitude bits: zeros, every subnormal scale, powers of two, ties, the top binade,
  random finite patterns."""
  special = [0, 1, 2, 3, 4, 5, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FFFFF, 0x7F000000,
             0x3F800000, 0x3FC00000, 0x3F400000, 0x40100000, 0x0D800000, 0x0D7FFFFF]
  pow2 = [e << 23 for e in range(1, 255)] + [1 << b for b in range(23)]
  ties = [((2 * k + 1) << 22) | (e << 23) for k in range(2) for e in range(1, 255, 7)]
  rand = rng.integers(0, 0x7F800000, size=4000, dtype=np.uint32)
  return np.unique(np.array(special + pow2 + ties, np.uint32).tolist() + rand.tolist()).astype(
      np.uint32)


@pytest.mark.parametrize("man_bits", [3, 7, 23])
def test_bfp_codes_are_nearest_even_integers(man_bits):
  rng = np.random.default_rng(0)
  mag = _crafted_magnitudes(rng)
  qes = np.array([-180, -160, -152, -151, -150, -149, -148, -130, -127, -126, -125, -100, -24,
                  -3, 0, 1, 20, 100, 120, 124, 125, 126, 127, 128, 140], np.int32)
  m, q = np.meshgrid(mag, qes, indexing="ij")
  got = np.asarray(jax.jit(bfp_codes, static_argnums=2)(jnp.asarray(m), jnp.asarray(q),
                                                        man_bits))
  v = _f32(m).astype(np.float64)
  want = np.minimum(np.rint(np.ldexp(v, -q)), 2.0**man_bits - 1).astype(np.uint32)
  np.testing.assert_array_equal(got, want)
  # exact ties of the quantum: k + 1/2 goes to the even neighbour
  k = np.arange(0, 2**min(man_bits, 10), dtype=np.float64)
  x = ((k + 0.5) * 2.0**-20).astype(np.float32)
  got = np.asarray(bfp_codes(jnp.asarray(_bits(x)), jnp.int32(-20), man_bits))
  want = np.minimum(np.rint(k + 0.5), 2**man_bits - 1).astype(np.uint32)
  np.testing.assert_array_equal(got, want)


def test_bfp_values_are_scale_pow2_of_the_integers():
  rng = np.random.default_rng(1)
  k = np.unique(np.concatenate([np.arange(300), rng.integers(0, 2**24, size=300),
                                [2**24 - 1, 2**23, 2**23 - 1]])).astype(np.uint32)
  qes = np.arange(-185, 131, 3, dtype=np.int32)
  kk, q = np.meshgrid(k, qes, indexing="ij")
  got = np.asarray(jax.jit(bfp_values)(jnp.asarray(kk), jnp.asarray(q)))
  with np.errstate(over="ignore"):
    want = _bits(np.ldexp(kk.astype(np.float64), q).astype(np.float32))  # IEEE, nearest even
  np.testing.assert_array_equal(got, want)
  emul = _bits(jax.jit(scale_pow2)(jnp.asarray(kk, jnp.float32), jnp.asarray(q)))
  np.testing.assert_array_equal(got, emul)


def test_max_last_is_the_max():
  rng = np.random.default_rng(2)
  xs = [rng.integers(0, 2**32, size=(3, 7, n), dtype=np.uint32) for n in (1, 2, 3, 5, 13, 64)]
  for x, got in zip(xs, jax.jit(lambda a: [max_last(v) for v in a])(xs), strict=True):
    np.testing.assert_array_equal(np.asarray(got), x.max(-1))
  assert max_last(jnp.zeros((4, 0), jnp.uint32)).shape == (4,)


# ---------------------------------------------------------------------------------------------
# the wire: encode_nearest / encode / decode against the scale_pow2 formulas they replace

def _old_encode(wire, q, v):
  """The BlockFormat encode before the integer codes (scale_pow2 of the rounded values)."""
  m = q.shape[0]
  vb, nb, bs = wire._blocks(v, m)
  qb, _, _ = wire._blocks(q, m)
  mx = jnp.max(B.to_bits(vb) & B.u32(B.ABS_MASK), axis=1)
  finite = B.is_finite_mag(mx)
  mxc = jnp.minimum(mx, B.u32(0x7F7FFFFF))
  m_bits = wire.fmt.man_bits
  e = wire.fmt.shared_exponent(mxc)
  bits = B.to_bits(qb)
  mag = B.from_bits(bits & B.u32(B.ABS_MASK))
  k = scale_pow2(mag, -(e - m_bits)[:, None])
  k = jnp.where(finite[:, None], k, 0.0).astype(jnp.uint32)
  codes = ((bits >> 31) << m_bits) | k
  scales = jnp.where(finite, e, -32768).astype(jnp.int16)
  return {"codes": wire._pack(codes.reshape(-1)[:m]), "scales": scales}


def _old_decode(wire, payload, m):
  from jaxlp.parallel.compressors._base import unpack_bits
  bits = wire.bits
  codes = payload["codes"]
  codes = unpack_bits(codes, bits, m) if bits <= 8 else codes.astype(jnp.uint32)
  cb, nb, bs = wire._blocks(codes, m)
  sc = payload["scales"].astype(jnp.int32)
  m_bits = wire.fmt.man_bits
  k = (cb & B.u32((1 << m_bits) - 1)).astype(jnp.float32)
  out = scale_pow2(k, (sc - m_bits)[:, None])
  out = B.from_bits(B.to_bits(out) | ((cb >> m_bits) << 31))
  out = jnp.where((sc == -32768)[:, None], jnp.float32(jnp.nan), out)
  return out.reshape(-1)[:m]


def crafted_blocks(bs, nblocks, seed):
  """float32 (nblocks * bs,) values, one kind of block after another: normal, zero (+-0),
  subnormal, tiny normal (scale below 2**-100), a NaN / inf block, +-3e38, exact ties of the
  block quantum, one nonzero among zeros, a wide range."""
  rng = np.random.default_rng(seed)
  kinds = []
  for i in range(nblocks):
    c = i % 10
    if c == 0:
      b = rng.normal(size=bs)
    elif c == 1:
      b = np.where(rng.random(bs) < 0.5, -0.0, 0.0)
    elif c == 2:
      b = rng.normal(size=bs) * 1e-40
    elif c == 3:
      b = rng.normal(size=bs) * 1e-33
    elif c == 4:
      b = rng.normal(size=bs)
      b[rng.integers(bs)] = [np.nan, np.inf, -np.inf][i % 3]
    elif c == 5:
      b = rng.choice([3e38, -3e38, 3.4e38, -1.0, 0.0], size=bs)
    elif c == 6:  # block max 7.5 (e = 3): quantum 2**(3 - m) for m = 3; ties k + 1/2
      b = (rng.integers(-7, 8, size=bs) + 0.5) * rng.choice([1.0, 0.0625], size=bs)
      b[0] = 7.5
    elif c == 7:
      b = np.zeros(bs)
      b[rng.integers(bs)] = -rng.random() * 1e-3
    elif c == 8:
      b = rng.normal(size=bs) * 10.0 ** rng.integers(-45, 38, size=bs)
    else:
      b = -np.abs(rng.normal(size=bs)) * 1e-30  # negatives rounding to -0
      b[0] = 1.0
    kinds.append(b)
  return np.concatenate(kinds).astype(np.float32)


WIRE_FMTS = [F.BlockFormat(3, axis=-1, block_size=8), F.BlockFormat(3, axis=-1, block_size=5),
             F.BlockFormat(24, axis=-1, block_size=4),
             F.BlockFormat(7, axis=-1, block_size=8, exponent="hbfp"),
             F.BlockFormat(3, axis=-1, block_size=None)]
# more code widths and exponent options on the same paths (packed codes of <= 8 bits, 16-bit
# codes, the exact and hbfp exponents: WIRE_FMTS), with XLA's optimizations off
# (tests/conftest.py, fast_compile)
MORE_WIRE_FMTS = [F.BlockFormat(7, axis=-1, block_size=8),
                  F.BlockFormat(15, axis=-1, block_size=8),
                  F.BlockFormat(3, axis=-1, block_size=8, exponent="hbfp", eps=0.0)]


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("fmt", MORE_WIRE_FMTS, ids=str)
def test_more_wire_formats_encode_and_decode_with_the_bits_of_the_scale_pow2_codec(fmt):
  test_encode_nearest_and_decode_give_the_bits_of_the_scale_pow2_codec(fmt)


@pytest.mark.parametrize("fmt", WIRE_FMTS, ids=str)
def test_encode_nearest_and_decode_give_the_bits_of_the_scale_pow2_codec(fmt):
  wire = _wire(fmt, True)
  bs = fmt.block_size or 8
  v = jnp.asarray(crafted_blocks(bs, 40, 3)[:40 * bs - (bs > 4)])  # a partial last block
  m = v.shape[0]
  q = F.quantize(v, fmt)

  @jax.jit
  def run(v, q):
    return (wire.encode_nearest(v), wire.encode(q, v), _old_encode(wire, q, v))

  fast, new, old = run(v, q)
  for a, b, c in zip(jax.tree_util.tree_leaves(fast), jax.tree_util.tree_leaves(new),
                     jax.tree_util.tree_leaves(old), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
  dec = jax.jit(lambda p: (wire.decode(p, m), _old_decode(wire, p, m)))
  got, want = dec(fast)
  assert_same_bits(got, want, str(fmt))
  assert_same_bits(got, np.asarray(q), str(fmt))  # the wire carries Q(v) exactly
  # every code with every scale, NaN marker included: the same bits as the old decode
  scales = np.array([-32768, -160, -152, -149, -148, -140, -126, -120, -100, 0, 5, 120, 128],
                    np.int16)
  per = min(2 ** min(wire.bits, 8), 64)
  bs2 = fmt.block_size or 8
  codes = np.arange(len(scales) * per, dtype=np.uint32) % (2 ** wire.bits)
  rows = np.resize(codes, (len(scales) * per // bs2 + 1) * bs2).reshape(-1, bs2)
  sc = np.resize(scales, rows.shape[0])[:, None]
  pay = jax.vmap(lambda c, s: {"codes": wire._pack(c), "scales": s})(jnp.asarray(rows),
                                                                      jnp.asarray(sc))
  got, want = jax.jit(jax.vmap(lambda p: (wire.decode(p, bs2), _old_decode(wire, p, bs2))))(pay)
  assert_same_bits(got, want, "every code")


@pytest.mark.parametrize("fmt", [F.BlockFormat(3, axis=-1, block_size=8), F.mx(F.E2M1FN, 8)],
                         ids=str)
def test_encode_nearest_under_vmap_equals_encode_of_the_quantized_rows(fmt):
  wire = _wire(fmt, True)
  rows = jnp.asarray(crafted_blocks(8, 24, 4).reshape(3, 64))
  q = jax.vmap(lambda r: F.quantize(r, _row(fmt)))(rows)
  a = jax.jit(jax.vmap(wire.encode_nearest))(rows)
  b = jax.jit(jax.vmap(wire.encode))(q, rows)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _row(fmt):
  import dataclasses
  return dataclasses.replace(fmt, axis=-1)


# ---------------------------------------------------------------------------------------------
# rank_sum: the hardware adds where no value is below 2**-100, add_f32 elsewhere

def _np_chain(rows):
  rows = np.asarray(rows, np.float32)
  acc = rows[0].copy()
  with np.errstate(over="ignore", invalid="ignore"):
    for r in range(1, rows.shape[0]):
      acc = (acc + rows[r]).astype(np.float32)
  return acc


def _sum_rows(seed):
  rng = np.random.default_rng(seed)
  big = rng.normal(size=(W, 64)) * 10.0 ** rng.integers(-30, 38, size=(W, 64))
  big[:, 0] = [3e38, 3e38, -3e38, 1.0]  # overflow to inf, then back: inf stays
  big[:, 1] = [3.4e38, -3.4e38, 1.0, -1.0]
  big[:, 2] = [1.0, 2.0**-24, 2.0**-24, 0.0]  # ties of the add
  big[:, 3] = [-0.0, -0.0, -0.0, -0.0]
  big[:, 4] = [-0.0, 0.0, -0.0, -0.0]
  big[:, 5] = [np.nan, 1.0, np.inf, -np.inf]
  big[:, 6] = [np.inf, -np.inf, 1.0, 1.0]
  big[:, 7] = [2.0**-100, -2.0**-100 * (1 + 2.0**-23), 0.0, 2.0**-99]  # cancellation to 2**-123
  big[:, 8] = [0.0, 0.0, 0.0, 0.0]
  return big.astype(np.float32)


def test_rank_sum_hardware_path_is_the_ieee_chain():
  rows = _sum_rows(5)
  tiny = rows.copy()
  tiny[:, 9] = [1e-40, 2e-40, -5e-41, 1e-45]  # subnormals: add_f32's lifted path
  tiny[:, 10] = [2.0**-101, 2.0**-101, 2.0**-126 * 0.5, 0.0]
  for data in (rows, tiny):
    want = _np_chain(data)
    emul = jax.jit(lambda r: add_f32(add_f32(add_f32(r[0], r[1]), r[2]), r[3]))(data)
    assert_same_bits(emul, want, "add_f32 chain")
    assert_same_bits(jax.jit(rank_sum)(data), want, "rank_sum under jit (lax.cond)")
    got = jax.jit(jax.vmap(rank_sum, in_axes=1, out_axes=1))(np.stack([data, data], 1))
    assert_same_bits(got[:, 0], want, "rank_sum under vmap (batched predicate)")
  # the hardware chain alone would flush the subnormal sums: the test can fail
  plain = np.asarray(jax.jit(lambda r: ((r[0] + r[1]) + r[2]) + r[3])(tiny))
  assert not np.array_equal(_bits(plain[9:11]), _bits(_np_chain(tiny)[9:11])), \
      "XLA:CPU kept subnormals here: the flush this path avoids did not happen"


# ---------------------------------------------------------------------------------------------
# the collectives on crafted leaves, against the numpy oracles

LEAVES = {  # name: rows of crafted blocks per worker -> leaf (2W, 16), scatter dimension 0
    "mixed": lambda r: crafted_blocks(8, 2 * W * 2, 10 + r)[[i for i in range(4 * W * 8)
                                                            if (i // 8) % 10 not in (4, 5)]],
    "big": lambda r: np.resize(np.array([3e38, -3e38, 2.9e38, -2.9e38, 1.0, -1.0, 0.5, 0.0],
                                        np.float32) * (1 if r % 2 else -1), 2 * W * 16),
    "overflow": lambda r: np.resize(np.array([3e38, 1.0], np.float32), 2 * W * 16),
    "nan": lambda r: crafted_blocks(8, 2 * W * 2, 20 + r),
}


def _leaf_data():
  out = {}
  for k, f in LEAVES.items():
    rows = []
    for r in range(W):
      v = np.asarray(f(r), np.float32)
      rows.append(np.resize(v, 2 * W * 16).reshape(2 * W, 16))
    out[k] = np.stack(rows)
  return out


def _rs_oracle(data, fmt):
  q = oracle.Q(_row(fmt))
  out = {}
  for k, x in data.items():
    shape = x.shape[1:]
    gs = x.reshape(W, -1)
    want = oracle.all_to_all_sum(gs, shape, 0, q)
    if not (np.all(np.isfinite(gs)) and np.all(np.isfinite(want))):
      want = np.full_like(want, np.nan)  # the leaf policy: NaN everywhere
    out[k] = want
  return out


@pytest.mark.parametrize("fmt", [F.BlockFormat(3, axis=-1, block_size=8),
                                 F.BlockFormat(7, axis=-1, block_size=8)], ids=str)
def test_compressed_reduce_scatter_fast_path_matches_the_oracle(fmt, cpu_devices):
  data = _leaf_data()
  want = _rs_oracle(data, fmt)
  assert np.all(np.isnan(want["overflow"])) and np.all(np.isnan(want["nan"]))
  assert np.all(np.isfinite(want["mixed"])) and np.all(np.isfinite(want["big"]))
  shapes = {k: jax.ShapeDtypeStruct(v.shape[1:], jnp.float32) for k, v in data.items()}
  st = jp.init_sharded_state(fmt, shapes)

  def fn(t):
    return jp.compressed_reduce_scatter(t, st, "i", fmt)[0]

  def fn2(t):
    return jp.compressed_reduce_scatter(t, st, ("dev", "emu"), fmt)[0]

  for name, got in (("vmap", run_vmap(fn, data)), ("shard_map", run_shard_map(fn, data, W)),
                    ("shard_map x vmap", run_two_level(fn2, data, W, 1))):
    for k in data:
      assert_same_bits(np.asarray(got[k]).reshape(W, -1), want[k], f"{name} {k}")


def test_all_gather_fast_encode_matches_the_oracle(cpu_devices):
  fmt = F.BlockFormat(7, axis=-1, block_size=8)
  shards = np.stack([crafted_blocks(8, 6, 30 + r).reshape(3, 16) for r in range(W)])
  want = oracle.all_gather(shards, fmt, axis=0)

  def fn(s):
    return jp.all_gather(s, "i", fmt=fmt)

  for name, got in (("vmap", run_vmap(fn, shards)), ("shard_map", run_shard_map(fn, shards, W))):
    for r in range(W):
      assert_same_bits(got[r], want, f"{name} worker {r}")
