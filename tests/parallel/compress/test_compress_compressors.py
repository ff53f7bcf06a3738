"""Each compressor vs an independent numpy reference of its published algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.formats import FloatFormat, quantize
from jaxlp.parallel.compressors import pack_bits, payload_nbytes, unpack_bits
from jaxlp.parallel.compressors._base import uniform01

KEY = jax.random.key(7)


_uniform01 = jax.jit(uniform01, static_argnums=1)


def _jit_encode(c):
  """``c.encode`` compiled as one program (op by op, each operation compiles on its own)."""
  return jax.jit(c.encode)


def _jit_decode(c):
  return jax.jit(c.decode, static_argnums=1)


def _g(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---- numpy references ------------------------------------------------------------------------

def np_pack(codes, bits):
  """LSB-first stream: code j at stream bits [j*bits, (j+1)*bits)."""
  stream = [(int(c) >> k) & 1 for c in codes for k in range(bits)]
  stream += [0] * (-len(stream) % 8)
  return np.array([sum(stream[8 * i + k] << k for k in range(8)) for i in range(len(stream) // 8)],
                  np.uint8)


def np_cgx(x, bits, bucket, r=None):
  x = np.asarray(x, np.float32).ravel()
  out = np.empty_like(x)
  levels = []
  top = np.float32(2 ** bits - 1)
  for s in range(0, x.size, bucket):
    b = x[s:s + bucket]
    mx, mn = b.max(), b.min()
    unit = np.float32((mx - mn) / top)
    if unit < 1e-10:
      lev = np.zeros(b.size, np.float32)
    else:
      rr = np.float32(0.5) if r is None else r[s:s + bucket]
      lev = np.minimum(np.floor(np.float32((b - mn) / unit) + rr), top)
    levels.append(lev)
    out[s:s + bucket] = mn + np.float32(unit * lev)
  return out, np.concatenate(levels).astype(np.uint32)


def np_tbq(g, r, tau):
  r = r + g
  code = np.where(r >= tau, 2, np.where(r <= -tau, 0, 1))
  r = np.where(code == 2, r - tau, np.where(code == 0, r + tau, r)).astype(np.float32)
  return code, r


# ---- packing -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8])
def test_pack_matches_reference_and_round_trips(bits):
  codes = np.random.default_rng(bits).integers(0, 2 ** bits, 37).astype(np.uint32)
  # pack and unpack in one program, as the engine runs them (op by op, each operation
  # compiles on its own)
  packed, unpacked = jax.jit(lambda c: (lambda p: (p, unpack_bits(p, bits, 37)))(
      pack_bits(c, bits)))(jnp.asarray(codes))
  np.testing.assert_array_equal(np.asarray(packed), np_pack(codes, bits))
  np.testing.assert_array_equal(np.asarray(unpacked), codes)


# ---- CGX ---------------------------------------------------------------------------------------

def test_cgx_published_goldens():
  c = C.cgx(bits=2, bucket_size=4)
  for x, want in [([0, 1, 0.5, 0.25], [0, 1, 0.6666667, 0.33333334]),
                  ([-1, -0.2, 0.3, 1], [-1, -0.3333333, 0.33333337, 1])]:
    p, _ = _jit_encode(c)(jnp.array(x, jnp.float32), (), None)
    np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (4,))), np.float32(want))
  c4 = C.cgx(bits=4)
  p, _ = _jit_encode(c4)(jnp.full((3,), 3.0), (), None)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c4)(p, (3,))), [3.0, 3.0, 3.0])


@pytest.mark.parametrize("bits,bucket,n", [(4, 512, 1500), (3, 64, 1025), (1, 16, 100),
                                           (8, 128, 300)])
def test_cgx_deterministic_exact(bits, bucket, n):
  x = _g((n,), bits)
  c = C.cgx(bits, bucket)
  p, _ = jax.jit(c.encode)(jnp.asarray(x), (), None)
  want, lev = np_cgx(x, bits, bucket)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (n,))), want)
  np.testing.assert_array_equal(np.asarray(p["levels"]), np_pack(lev, bits))


def test_cgx_stochastic_with_fixed_noise_and_unbiased():
  n = 1000
  x = _g((n,), 3)
  c = C.cgx(2, 100, stochastic=True)
  p, _ = _jit_encode(c)(jnp.asarray(x), (), KEY)
  r = np.asarray(_uniform01(KEY, (n // 100, 100))).ravel()
  want, _ = np_cgx(x, 2, 100, r=r)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (n,))), want)
  keys = jax.random.split(KEY, 400)
  avg = jax.jit(jax.vmap(lambda k: c.decode(c.encode(jnp.asarray(x), (), k)[0], (n,))))(
      keys).mean(0)
  assert np.abs(np.asarray(avg) - x).max() < 0.25  # per-element SE ~ unit/2/sqrt(400)


def test_cgx_skip_incomplete_sends_tail_raw():
  x = _g((70,), 4)
  c = C.cgx(4, 32, skip_incomplete=True)
  p, _ = _jit_encode(c)(jnp.asarray(x), (), None)
  out = np.asarray(_jit_decode(c)(p, (70,)))
  np.testing.assert_array_equal(out[64:], x[64:])
  np.testing.assert_array_equal(out[:64], np_cgx(x[:64], 4, 32)[0])


# ---- TBQ ---------------------------------------------------------------------------------------

def test_tbq_codes_residual_and_packing_exact():
  c = C.tbq(0.7)
  r = np.zeros(31, np.float32)
  st = c.init((31,))
  for t in range(4):
    g = _g((31,), t)
    p, st = _jit_encode(c)(jnp.asarray(g), st, None)
    code, r = np_tbq(g, r, np.float32(0.7))
    np.testing.assert_array_equal(np.asarray(st["residual"]), r)
    padded = np.concatenate([code, np.ones(1)])  # partial last byte padded with code 1
    np.testing.assert_array_equal(np.asarray(p["codes"]), np_pack(padded, 2))
    np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (31,))),
                                  ((code - 1) * np.float32(0.7)).astype(np.float32))


# ---- TernGrad ------------------------------------------------------------------------------------

def test_terngrad_paper_fixed_noise_exact_and_unbiased():
  x = _g((257,), 5)
  c = C.terngrad()
  p, _ = _jit_encode(c)(jnp.asarray(x), (), KEY)
  u = np.asarray(_uniform01(KEY, (257,)))
  s = np.abs(x).max()
  want = np.where(u * s < np.abs(x), s * np.sign(x), 0).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (257,))), want)
  keys = jax.random.split(KEY, 2000)
  avg = jax.jit(jax.vmap(lambda k: c.decode(c.encode(jnp.asarray(x), (), k)[0], (257,))))(
      keys).mean(0)
  assert np.abs(np.asarray(avg) - x).max() < 5 * s / np.sqrt(2000)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_terngrad_hipress_deterministic_exact(bits):
  n = 45
  x = _g((n,), bits)
  c = C.terngrad("hipress", bits)
  p, _ = _jit_encode(c)(jnp.asarray(x), (), None)
  mn, mx = x.min(), x.max()
  gap = np.float32((mx - mn) / np.float32(2 ** bits - 1))
  gap_inv = np.float32(1) / np.float32(gap + np.float32(1e-8))
  lev = np.clip(np.rint(np.float32(x - mn) * gap_inv), 0, 2 ** bits - 1).astype(np.uint32)
  hdr = np.concatenate([[bits, (-n) % (8 // bits)], np.frombuffer(mn.tobytes(), np.uint8),
                        np.frombuffer(mx.tobytes(), np.uint8)]).astype(np.uint8)
  np.testing.assert_array_equal(np.asarray(p["header"]), hdr)
  np.testing.assert_array_equal(np.asarray(p["codes"]), np_pack(lev, bits))
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (n,))),
                                (np.float32(lev * gap) + mn).astype(np.float32))


def test_terngrad_constant_tensor_exact():
  c = C.terngrad("hipress", 2)
  p, _ = _jit_encode(c)(jnp.full((9,), -2.5), (), None)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (9,))), np.full(9, -2.5, np.float32))


# ---- onebit, QSGD ------------------------------------------------------------------------------

@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("scaling", ["mean", "pos_neg_means"])
def test_onebit_reference_and_residual(scaling):
  c = C.onebit(scaling)
  st = c.init((50,))
  r = np.zeros(50, np.float32)
  for t in range(3):
    g = _g((50,), t)
    p, st = _jit_encode(c)(jnp.asarray(g), st, None)
    x = g + r
    neg = x < 0
    if scaling == "mean":
      s = np.abs(x).mean(dtype=np.float32)
      want = np.where(neg, -s, s)
    else:
      want = np.where(neg, x[neg].mean(), x[~neg].mean())
    out = np.asarray(_jit_decode(c)(p, (50,)))
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_array_equal(np.sign(out), np.where(neg, -1, 1))
    r = x - out
    np.testing.assert_allclose(np.asarray(st["residual"]), r, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("fast_compile")
def test_qsgd_fixed_noise_and_unbiased():
  x = _g((300,), 9)
  c = C.qsgd(7, 100)
  p, _ = _jit_encode(c)(jnp.asarray(x), (), KEY)
  u = np.asarray(_uniform01(KEY, (3, 100)))
  xb = x.reshape(3, 100)
  norm = np.sqrt((xb * xb).sum(1, keepdims=True))
  lev = np.floor(np.abs(xb) / norm * np.float32(7) + u)
  want = (norm * np.sign(xb) * (lev / np.float32(7))).ravel()
  np.testing.assert_allclose(np.asarray(_jit_decode(c)(p, (300,))), want, rtol=1e-6)
  keys = jax.random.split(KEY, 1000)
  avg = jax.jit(jax.vmap(lambda k: c.decode(c.encode(jnp.asarray(x), (), k)[0], (300,))))(
      keys).mean(0)
  assert np.abs(np.asarray(avg) - x).max() < 0.15


# ---- sparsifiers -------------------------------------------------------------------------------

def test_topk_exact_with_residual():
  c = C.topk(0.1)
  x = _g((100,), 2)
  p, st = _jit_encode(c)(jnp.asarray(x), c.init((100,)), None)
  idx = np.argsort(-np.abs(x))[:10]
  want = np.zeros(100, np.float32)
  want[idx] = x[idx]
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (100,))), want)
  np.testing.assert_array_equal(np.asarray(st["residual"]), x - want)
  assert int(p["count"][0]) == 10


def test_dgc_momentum_correction_and_masking_exact_topk():
  c = C.dgc(0.1, momentum=0.9, sample_rate=None)
  st = c.init((60,))
  u = np.zeros(60, np.float32)
  v = np.zeros(60, np.float32)
  for t in range(3):
    g = _g((60,), t)
    p, st = _jit_encode(c)(jnp.asarray(g), st, None)
    u = np.float32(0.9) * u + g
    v = v + u
    idx = np.argsort(-np.abs(v))[:6]
    want = np.zeros(60, np.float32)
    want[idx] = v[idx]
    np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (60,))), want)
    u[idx] = 0
    v[idx] = 0
    np.testing.assert_array_equal(np.asarray(st["u"]), u)
    np.testing.assert_array_equal(np.asarray(st["v"]), v)


@pytest.mark.usefixtures("fast_compile")
def test_dgc_warmup_schedule_and_sampled_threshold():
  n = 4000
  c = C.dgc(0.01, sample_rate=0.05, warmup=2)
  st = c.init((n,))
  counts = []
  for t in range(8):
    p, st = _jit_encode(c)(jnp.asarray(_g((n,), t)), st, jax.random.fold_in(KEY, t))
    counts.append(int(p["count"][0]))
  caps = [max(0.01, 0.25 ** (1 + t // 2)) * n for t in range(8)]
  for cnt, cap in zip(counts, caps, strict=True):
    assert cnt <= np.ceil(cap)
    assert cnt >= 0.5 * cap  # the sampled threshold keeps about the target fraction


def test_graddrop_residual_exact_topk_mode():
  c = C.graddrop(0.9, sample_rate=None)
  st = c.init((50,))
  r = np.zeros(50, np.float32)
  for t in range(3):
    g = _g((50,), t)
    p, st = _jit_encode(c)(jnp.asarray(g), st, None)
    r = r + g
    idx = np.argsort(-np.abs(r))[:5]
    sent = np.zeros(50, np.float32)
    sent[idx] = r[idx]
    np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (50,))), sent)
    r[idx] = 0
    np.testing.assert_array_equal(np.asarray(st["residual"]), r)


def test_randomk_indices_from_seed():
  c = C.randomk(0.2)
  x = _g((40,), 1)
  p, st = _jit_encode(c)(jnp.asarray(x), c.init((40,)), KEY)
  out = np.asarray(_jit_decode(c)(p, (40,)))
  assert (out != 0).sum() == 8
  np.testing.assert_array_equal(out[out != 0], x[out != 0])
  np.testing.assert_array_equal(np.asarray(st["residual"]) + out, x)


# ---- cast, PowerSGD ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,np_dt", [("bf16", "bfloat16"), ("fp16", "float16"),
                                       ("E4M3FN", "float8_e4m3fn"), ("E2M1FN", "float4_e2m1fn")])
def test_cast_round_trip_is_rne_cast(fmt, np_dt):
  import ml_dtypes
  x = _g((33,), 0) * 3
  c = C.cast(fmt)
  p, _ = jax.jit(c.encode)(jnp.asarray(x), (), None)
  dt = getattr(ml_dtypes, np_dt, None) or np.dtype(np_dt)
  np.testing.assert_array_equal(np.asarray(_jit_decode(c)(p, (33,))),
                                x.astype(dt).astype(np.float32))


CUSTOM_CASTS = [FloatFormat(3, 3), FloatFormat(5, 5), FloatFormat(8, 10),
                FloatFormat(4, 3, specials="finite"), FloatFormat(2, 1, specials="fn"), "E2M1FN",
                "E3M2FN"]


@pytest.mark.parametrize("fmt", CUSTOM_CASTS, ids=repr)
def test_cast_any_format_round_trip_and_wire_bytes(fmt):
  """Formats without a native dtype travel as packed storage codes: decode(encode(x)) is
  exactly quantize(x, fmt) (RNE), and the payload is bits/8 bytes per element (+ <1 byte)."""
  c = C.cast(fmt)
  x = _g((1001,), 3) * 4.0
  x[:6] = [0.0, -0.0, np.inf, -np.inf, 1e30, -3e-30]
  p, _ = jax.jit(c.encode)(jnp.asarray(x), (), None)
  out = np.asarray(jax.jit(lambda p: c.decode(p, (1001,)))(p))
  want = np.asarray(quantize(jnp.asarray(x), c.format))
  np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
  n, b = 1001, c.bits
  assert payload_nbytes(p) == c.wire_bytes((n,)) == n * (b // 8) + -(-n * (b % 8) // 8)
  assert c.wire_bytes((n,)) <= -(-n * b // 8) + 1  # within one byte of n*bits/8
  assert c.native_dtype is None


def test_cast_reduce_custom_format_is_decoded_sum_over_w():
  from jaxlp.parallel._compressed import compressed_allreduce, init_compression_state
  c = C.cast(FloatFormat(4, 4))
  w = 4
  g = jnp.asarray(np.stack([_g((40, 30), s) for s in range(w)]))
  st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                              init_compression_state(c, jnp.zeros((40, 30))))
  out, _ = jax.jit(jax.vmap(lambda g, s: compressed_allreduce(g, s, "i", c, min_size=0),
                            axis_name="i"))(g, st)
  q = np.asarray(quantize(g, c.format))
  acc = q[0]
  for r in range(1, w):
    acc = acc + q[r]
  want = acc / np.float32(w)
  for r in range(w):
    np.testing.assert_array_equal(np.asarray(out[r]), want)


def test_cast_bad_format_is_a_clear_error():
  with pytest.raises(ValueError, match="fmt"):
    C.cast("float7")
  with pytest.raises(ValueError, match="fmt"):
    C.cast(3.5)


@pytest.mark.usefixtures("fast_compile")
def test_powersgd_recovers_exact_low_rank():
  rng = np.random.default_rng(0)
  m = (rng.standard_normal((40, 2)) @ rng.standard_normal((2, 30))).astype(np.float32)
  c = C.powersgd(rank=2)
  st = c.init(m.shape, key=KEY)
  p, st = _jit_encode(c)(jnp.asarray(m), st, None)
  out = np.asarray(_jit_decode(c)(p, m.shape))
  np.testing.assert_allclose(out, m, atol=1e-4 * np.abs(m).max())
  np.testing.assert_allclose(np.asarray(st["error"]).reshape(m.shape), 0, atol=1e-4)


def test_powersgd_compress_rule_and_batched_shape():
  c = C.powersgd(rank=4)
  assert c.matrix_shape((10,)) is None  # vectors never with rate 2
  assert c.matrix_shape((8, 8)) is None  # (8+8)*4*2 = 128 >= 64
  assert c.matrix_shape((64, 64)) == (64, 64, 4)
  assert C.powersgd(rank=2, batched=True).matrix_shape((10, 10)) == (10, 10, 2)
  assert C.powersgd(rank=2, batched=True).matrix_shape((101,)) == (11, 11, 2)


# ---- every compressor: payload dtypes, wire bytes, error feedback ------------------------------

ALL = [C.cgx(), C.cgx(3, 100, True, True), C.qsgd(15, 64), C.onebit(), C.onebit("pos_neg_means"),
       C.tbq(0.5), C.terngrad(), C.terngrad("hipress", 4), C.dgc(0.05), C.dgc(0.05, warmup=2),
       C.graddrop(0.9), C.topk(0.05), C.randomk(0.05), C.powersgd(2), C.powersgd(2, batched=True),
       C.cast("bf16"), C.cast("E5M2"), C.cast("E3M2FN")]


@pytest.mark.usefixtures("fast_compile")
def test_wire_bytes_exact_and_packed_dtypes():
  shape = (67, 31)
  sts = [comp.init(shape, key=KEY) for comp in ALL]
  # every compressor's encode in one program (one compile instead of one per compressor)
  ps = jax.jit(lambda g, sts, key: [comp.encode(g, st, key)[0]
                                    for comp, st in zip(ALL, sts, strict=True)])(
      jnp.asarray(_g(shape)), sts, KEY)
  for comp, p in zip(ALL, ps, strict=True):
    assert payload_nbytes(p) == comp.wire_bytes(shape), comp
    assert payload_nbytes(p) < 4 * 67 * 31, comp
    for a in jax.tree_util.tree_leaves(p):
      assert a.dtype in (jnp.uint8, jnp.uint32, jnp.int32, jnp.float32, jnp.bfloat16,
                         jnp.float8_e5m2), (comp, a.dtype)


EF = [C.onebit(), C.onebit("pos_neg_means"), C.tbq(3.0), C.topk(0.1), C.randomk(0.25),
      C.graddrop(0.9), C.powersgd(1)]


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("comp", EF, ids=lambda c: type(c).__name__)
def test_error_feedback_time_average_converges(comp):
  # constant mean gradient + noise: sum(decoded) = sum(g) - residual, so the time average of
  # the compressed updates converges to the mean (without EF the biased ones would not)
  shape = (16, 12)
  mean = _g(shape, 100)
  st = comp.init(shape, key=KEY)
  enc = jax.jit(comp.encode)
  dec = jax.jit(lambda p: comp.decode(p, shape))
  total = np.zeros(shape, np.float64)
  gsum = np.zeros(shape, np.float64)
  errs = {}
  for t in range(400):
    g = mean + 0.1 * _g(shape, t)
    p, st = enc(jnp.asarray(g), st, jax.random.fold_in(KEY, t))
    total += np.asarray(dec(p))
    gsum += g
    if t + 1 in (50, 400):
      errs[t + 1] = np.abs(total / (t + 1) - mean).max() / np.abs(mean).max()
  resid = st["error"] if "error" in st else st["residual"]
  np.testing.assert_allclose(total + np.asarray(resid).reshape(shape), gsum, atol=2e-3)
  assert errs[400] < 0.15 and errs[400] < 0.6 * errs[50] + 1e-3, errs
