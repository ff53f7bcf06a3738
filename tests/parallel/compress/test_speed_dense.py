"""The fast dense-quantizer paths (issue 14 item 5) keep the bits of the plain definitions.

CGX splits full buckets from the partial last one (no pad-copy), redoes near-tie buckets in
rounds, and guards its decode against FMA with one XOR; QSGD decodes level/levels with a
two-term reciprocal instead of a table gather; TernGrad takes max|x| as max(max, -min).
The oracles are numpy (IEEE float32 division, no FMA).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp.parallel.compressors as C
from jaxlp.parallel.compressors._base import no_fma, uniform01
from jaxlp.parallel.compressors._quantizers import _recip_split


def _bytes(a):
  a = np.asarray(a)
  return a.dtype, a.shape, a.tobytes()


# the library's entry points under jit: one compile per shape, not one per op and shape
_pack = jax.jit(C.pack_bits, static_argnums=(1, 2))
_unpack = jax.jit(C.unpack_bits, static_argnums=(1, 2))
_uniform01 = jax.jit(uniform01, static_argnums=1)


def _decode(comp, payload, shape):
  return jax.jit(comp.decode, static_argnums=1)(payload, shape)


def np_pack(codes, bits):
  stream = np.array([(int(c) >> k) & 1 for c in codes for k in range(bits)] + [0] * 7, np.uint32)
  nbytes = (len(codes) * bits + 7) // 8
  return (stream[:8 * nbytes].reshape(nbytes, 8) << np.arange(8, dtype=np.uint32)).sum(
    1).astype(np.uint8)


def np_cgx(x, bits, bucket, r=None, nq=None):
  """CGX levels and decode, one IEEE division per element (numpy float32)."""
  x = np.asarray(x, np.float32).ravel()
  nq = x.size if nq is None else nq
  out = np.empty(nq, np.float32)
  levels, meta = [], []
  top = np.float32(2 ** bits - 1)
  for s in range(0, nq, bucket):
    b = x[s:min(s + bucket, nq)]
    mx, mn = b.max(), b.min()
    unit = np.float32((mx - mn) / top)
    if unit < 1e-10:
      lev = np.zeros(b.size, np.float32)
    else:
      rr = np.float32(0.5) if r is None else r[s:s + b.size]
      lev = np.minimum(np.maximum(np.floor(np.float32((b - mn) / unit) + rr), 0), top)
    levels.append(lev)
    meta += [unit, mn]
    out[s:s + b.size] = mn + np.float32(unit * lev)
  lev = np.concatenate(levels).astype(np.uint32) if levels else np.zeros(0, np.uint32)
  return out, np_pack(lev, bits), np.array(meta, np.float32)


def _crafted(rng, bucket):
  """The input families: random values (ending in a partial bucket), values on the level grid
  (near ties), zeros, tiny values (1e-9), each family in whole buckets of one leaf ("mixed":
  no bucket holds two families; one leaf instead of one per family, each leaf shape is
  traced and compiled on its own), a single element and a leaf of 45."""
  def whole(x):  # rounded up to whole buckets
    return np.resize(x, -(-x.size // bucket) * bucket)
  yield "mixed", np.concatenate([
    whole((rng.standard_normal(300) * 1e-9).astype(np.float32)),
    whole(np.zeros(77, np.float32)),
    whole((rng.integers(0, 16, 1031) * 0.5).astype(np.float32)),
    rng.standard_normal(1000).astype(np.float32)])
  yield "single", np.array([-2.5], np.float32)
  yield "n < bucket", rng.standard_normal(45).astype(np.float32)


def test_cgx_equals_numpy_division():
  """4 bits in buckets of 64, compiled as in production."""
  _cgx_equals_numpy_division(4, 64)


# The same claim at other widths and bucket sizes (a bucket of 7 or 9: partial buckets, odd
# sizes), the same code with other constants: XLA's optimizations off. Widths 1, 3 and 8 are
# also compared with numpy compiled normally (test_compress_compressors.py's
# test_cgx_deterministic_exact).
@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("bits,bucket", [(8, 32), (3, 7), (5, 24), (1, 9)])
def test_cgx_other_widths_equal_numpy_division(bits, bucket):
  _cgx_equals_numpy_division(bits, bucket)


def _cgx_equals_numpy_division(bits, bucket):
  rng = np.random.default_rng(bits)
  comps = [C.cgx(bits, bucket, skip_incomplete=skip) for skip in (False, True)]
  named = list(_crafted(rng, bucket))

  @jax.jit  # every input and both settings in one program (one compile); encode and decode
  def run(xs):  # together, as the engine runs them
    out = []
    for c in comps:
      for x in xs:
        p = c.encode(x, ())[0]
        out.append((p, c.decode(p, x.shape)))
    return out

  got = iter(run([jnp.asarray(x) for _, x in named]))
  for skip in (False, True):
    for name, x in named:
      p, dec = next(got)
      nq = (x.size // bucket) * bucket if skip else x.size
      out, packed, meta = np_cgx(x, bits, bucket, nq=nq)
      assert _bytes(p["levels"]) == _bytes(packed), (name, skip)
      assert _bytes(p["meta"]) == _bytes(meta), (name, skip)
      want = np.concatenate([out, x[nq:]])
      assert _bytes(dec) == _bytes(want), (name, skip)


def test_cgx_stochastic_noise_is_uniform01_over_the_quantized_elements():
  x = np.random.default_rng(3).standard_normal(333).astype(np.float32)
  key = jax.random.key(4)
  c = C.cgx(3, 50, stochastic=True)
  p = jax.jit(lambda x: c.encode(x, (), key)[0])(jnp.asarray(x))
  out, packed, _ = np_cgx(x, 3, 50, r=np.asarray(_uniform01(key, (333,))))
  assert _bytes(p["levels"]) == _bytes(packed)
  assert _bytes(_decode(c, p, (333,))) == _bytes(out)


def _tie_leaf(rng, ties):
  """64 buckets of 16, the first ``ties`` on the level grid (every element a near tie)."""
  x = rng.standard_normal((64, 16)).astype(np.float32)
  x[:ties] = rng.integers(0, 16, (ties, 16)) * np.float32(0.5)
  x[:ties, 0], x[:ties, 1] = 0.0, 7.5
  return x.ravel()


def test_cgx_near_tie_buckets_are_redone_in_rounds():
  """64 buckets of 16; near-tie buckets are redone nb // 16 + 16 = 20 at a time: 0, 1, 2 and 4
  rounds (every bucket a tie), alone and as a vmapped batch whose members need different
  numbers of rounds (SRA encodes its W chunks that way)."""
  rng = np.random.default_rng(5)
  c = C.cgx(4, 16)
  leaves = [_tie_leaf(rng, ties) for ties in (0, 19, 25, 40, 64)]
  enc = jax.jit(lambda x: c.encode(x, ())[0])
  batched = jax.jit(jax.vmap(lambda x: c.encode(x, ())[0]))(jnp.asarray(np.stack(leaves)))
  for i, x in enumerate(leaves):
    out, packed, _ = np_cgx(x, 4, 16)
    p = enc(jnp.asarray(x))
    assert _bytes(p["levels"]) == _bytes(packed), i
    assert _bytes(c.decode(p, x.shape)) == _bytes(out), i
    assert _bytes(batched["levels"][i]) == _bytes(packed), i


def test_recip_split_gives_ieee_quotients_with_and_without_fma():
  for levels in range(1, 128):
    bits = 1 + max(1, int(np.ceil(np.log2(levels + 1))))
    lev = np.arange(2 ** (bits - 1), dtype=np.float32)
    want = lev / np.float32(levels)
    hi, lo = _recip_split(levels)
    assert (lev.astype(np.float64) * float(hi) == (lev * hi).astype(np.float64)).all()
    assert _bytes(lev * hi + lev * lo) == _bytes(want), levels
    fused = (lev.astype(np.float64) * float(lo) + (lev * hi).astype(np.float64))
    assert _bytes(fused.astype(np.float32)) == _bytes(want), levels


@pytest.mark.parametrize("levels", [1, 7, 15, 127])
def test_qsgd_decode_every_code_equals_division(levels):
  c = C.qsgd(levels, 8)
  n = 2 ** c.bits * 3
  codes = np.arange(n, dtype=np.uint32) % (2 ** c.bits)
  norm = np.array([1.5, 3e-3, 7.0] * (n // 24 + 1), np.float32)[:-(-n // 8)]
  payload = {"norm": jnp.asarray(norm), "codes": _pack(jnp.asarray(codes), c.bits)}
  mag = (codes >> 1).astype(np.float32) / np.float32(levels)
  want = np.repeat(norm, 8)[:n] * np.where(codes & 1, -mag, mag)
  assert _bytes(_decode(c, payload, (n,))) == _bytes(want)


def np_qsgd_levels(x, norm, u, levels, bucket):
  """QSGD codes from the payload's norms: level = floor((|x| * f32(1/norm)) * levels + u),
  every operation rounded to float32 (numpy: no FMA)."""
  x = np.asarray(x, np.float32).ravel()
  nrm = np.repeat(np.asarray(norm, np.float32), bucket)[:x.size]
  with np.errstate(divide="ignore"):
    inv = np.where(nrm > 0, np.float32(1.0) / nrm, np.float32(0.0)).astype(np.float32)
  lev = np.floor((np.abs(x) * inv).astype(np.float32) * np.float32(levels) + u)
  lev = np.where(inv > 0, np.clip(lev, 0, levels), 0).astype(np.uint32)
  return (lev << 1) | (x < 0).astype(np.uint32)


@pytest.mark.parametrize("levels,bucket", [(15, 64), (7, 10), (127, 512), (1, 3)])
def test_qsgd_encode_equals_the_numpy_definition(levels, bucket):
  rng = np.random.default_rng(levels)
  key = jax.random.key(levels)
  c = C.qsgd(levels, bucket)
  named = list(_crafted(rng, bucket))
  # every input, with its noise, in one program (one compile)
  got = jax.jit(lambda xs: [(c.encode(x, (), key)[0], uniform01(key, x.shape)) for x in xs])(
    [jnp.asarray(x) for _, x in named])
  for (name, x), (p, u) in zip(named, got, strict=True):
    norm = np.asarray(p["norm"])
    xb = np.pad(x, (0, norm.size * bucket - x.size)).reshape(norm.size, bucket)
    np.testing.assert_allclose(norm, np.sqrt((xb.astype(np.float64) ** 2).sum(1)), rtol=1e-6)
    want = np_qsgd_levels(x, norm, np.asarray(u), levels, bucket)
    assert _bytes(p["codes"]) == _bytes(np_pack(want, c.bits)), name


@pytest.mark.parametrize("comp", [C.cgx(4, 64), C.cgx(3, 100, stochastic=True), C.qsgd(15, 64)],
                         ids=repr)
def test_conv_shaped_leaf_equals_its_flat_vector(comp):
  """The elementwise passes run on the flat vector (per_element): a 4-D leaf encodes and
  decodes to the bits of the same values given flat."""
  x = np.random.default_rng(0).standard_normal((16, 8, 3, 3)).astype(np.float32)
  key = jax.random.key(2)

  @jax.jit  # both shapes, encode and decode, in one program (one compile)
  def run(x4, x1):
    p4, p1 = comp.encode(x4, (), key)[0], comp.encode(x1, (), key)[0]
    return p4, p1, comp.decode(p4, x4.shape), comp.decode(p1, x1.shape)

  p4, p1, d4, d1 = run(jnp.asarray(x), jnp.asarray(x.ravel()))
  assert jax.tree_util.tree_map(_bytes, p4) == jax.tree_util.tree_map(_bytes, p1)
  assert _bytes(d4) == _bytes(np.asarray(d1).reshape(x.shape))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_bits_vectorized_gives_the_pack_bits_stream(bits):
  from jaxlp.parallel.compressors._base import pack_bits_vectorized
  rng = np.random.default_rng(bits)
  codes = [rng.integers(0, 2 ** bits, n).astype(np.uint32)
           for n in (0, 1, 5, 31, 32, 33, 1000, 4099)]
  pads = (0, 2 ** bits - 1) if 8 % bits == 0 else (0,)

  @jax.jit  # every length and pad in one program (one compile)
  def run(codes):
    out = []
    for c in codes:
      for pad in pads:
        got = pack_bits_vectorized(c, bits, pad)
        out.append((got, C.pack_bits(c, bits, pad) if pad else None,
                    C.unpack_bits(got, bits, c.shape[0])))
    return out

  res = iter(run([jnp.asarray(c) for c in codes]))
  for c in codes:
    for pad in pads:
      got, stream, unpacked = next(res)
      want = np_pack(c, bits) if pad == 0 else stream
      assert _bytes(got) == _bytes(want), (c.size, pad)
      assert _bytes(unpacked) == _bytes(c), (c.size, pad)
  # under vmap (the engine's emulated workers): per worker the same bytes
  codes = rng.integers(0, 2 ** bits, (3, 77)).astype(np.uint32)
  got = jax.jit(jax.vmap(lambda c: pack_bits_vectorized(c, bits)))(jnp.asarray(codes))
  for i in range(3):
    assert _bytes(got[i]) == _bytes(np_pack(codes[i], bits))


def test_materialize_and_per_element_keep_the_bits():
  from jaxlp.parallel.compressors._base import materialize, per_element
  bits = np.array([0, 1, 0x80000000, 0x7F800000, 0xFFC00001, 0x00000001, 0x3F800000],
                  np.uint32)
  for dt in (np.float32, np.int32, np.uint32):
    v = jnp.asarray(bits.view(dt))
    assert _bytes(jax.jit(materialize)(v)) == _bytes(v)
    assert _bytes(jax.vmap(materialize)(v[None])[0]) == _bytes(v)
  assert _bytes(per_element(jnp.arange(3.0), 4, 10)) == _bytes(
    np.repeat(np.arange(3.0, dtype=np.float32), 4)[:10])


def test_terngrad_scale_is_max_abs_on_signed_zeros_and_nan():
  key = jax.random.key(0)
  for x in ([-0.0, -0.0], [0.0, -0.0, -3.0], [np.nan, 1.0], [-np.inf, 2.0], [1.0, -1.0]):
    x = np.array(x, np.float32)
    s = jax.jit(lambda x: C.terngrad().encode(x, (), key)[0]["scale"])(jnp.asarray(x))
    assert _bytes(s) == _bytes(np.max(np.abs(x)).reshape(1)), x


def test_no_fma_anchor_keeps_the_rounded_product():
  rng = np.random.default_rng(0)
  a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
  want = a + b * c  # numpy: the product rounded, then the add
  got = jax.jit(lambda a, b, c: a + no_fma(b * c, anchor=a))(a, b, c)
  assert _bytes(got) == _bytes(want)
  got = jax.jit(jax.vmap(lambda a, b, c: a + no_fma(b * c, anchor=a)))(
    a.reshape(4, -1), b.reshape(4, -1), c.reshape(4, -1))
  assert _bytes(got) == _bytes(want.reshape(4, -1))


def _no_apart(fn, *args, **_):
  return fn(*args)


def test_apart_keeps_the_bits_and_is_a_conditional_only_on_cpu():
  """``apart`` returns ``fn(*args)`` bit for bit (NaN payloads, -0, subnormals, a pytree of
  several dtypes), also under vmap; on CPU the compiled program holds the conditional that
  keeps the loop apart, and the CUDA lowering has none (no device-to-host sync there)."""
  from jaxlp.parallel.compressors._base import apart
  bits = np.array([0, 0x80000000, 1, 0x7FC00001, 0xFFBFFFFF, 0x7F800000, 0x3F800000], np.uint32)
  x = np.resize(bits, 5000).view(np.float32)

  def fn(v, k):
    return v * 2.0, (lax_bits(v) >> 3) ^ k, (v > 0)

  def lax_bits(v):
    return jax.lax.bitcast_convert_type(v, jnp.uint32)

  k = jnp.uint32(0x5A5A)
  want = jax.jit(fn)(jnp.asarray(x), k)
  got = jax.jit(lambda v, k: apart(fn, v, k))(jnp.asarray(x), k)
  assert jax.tree_util.tree_map(_bytes, got) == jax.tree_util.tree_map(_bytes, want)
  xs = np.stack([x, x[::-1]])
  gv = jax.jit(jax.vmap(lambda v: apart(fn, v, k)))(jnp.asarray(xs))
  wv = jax.vmap(lambda v: fn(v, k))(jnp.asarray(xs))
  assert jax.tree_util.tree_map(_bytes, gv) == jax.tree_util.tree_map(_bytes, wv)
  kv = jnp.arange(2, dtype=jnp.uint32)
  gv = jax.jit(jax.vmap(lambda v, k: apart(fn, v, k)))(jnp.asarray(xs), kv)
  wv = jax.vmap(fn)(jnp.asarray(xs), kv)
  assert jax.tree_util.tree_map(_bytes, gv) == jax.tree_util.tree_map(_bytes, wv)
  f = jax.jit(lambda v: apart(fn, v, k))
  with jax.default_device(jax.devices("cpu")[0]):  # compiled for CPU, also under cuda,cpu
    cpu = f.lower(jax.ShapeDtypeStruct(x.shape, jnp.float32)).compile().as_text()
    # under vmap one conditional for the whole batch (custom_vmap), not a select of both
    # branches
    batched = jax.jit(jax.vmap(lambda v: apart(fn, v, k))).lower(
      jax.ShapeDtypeStruct(xs.shape, jnp.float32)).compile().as_text()
  assert " conditional(" in cpu and " conditional(" in batched
  # the opaque predicate hashes with fmix32 (multiplier 0x85EBCA6B = 2246822507): the CPU
  # lowering computes it, the CUDA lowering (platform_dependent's default) does not
  lower = {p: f.trace(jax.ShapeDtypeStruct(x.shape, jnp.float32)).lower(
    lowering_platforms=(p,)).as_text() for p in ("cpu", "cuda")}
  assert "2246822507" in lower["cpu"] and "2246822507" not in lower["cuda"]
  assert lower["cuda"].count("stablehlo.case") < lower["cpu"].count("stablehlo.case")
  # below min_size it is fn itself: no conditional at all
  small = jax.jit(lambda v: apart(fn, v, k, min_size=10 ** 6)).trace(
    jax.ShapeDtypeStruct(x.shape, jnp.float32)).lower(lowering_platforms=("cpu",)).as_text()
  assert "stablehlo.case" not in small


def test_qsgd_large_conv_leaf_keeps_the_bits_of_the_fused_program(monkeypatch):
  """A leaf above every barrier threshold (QSGD's encoder: 2**19 elements; a 4-D leaf is
  copied flat first) gives the payload and decode bits of the same program without the
  barriers, which the numpy tests above check on smaller leaves; decode equals numpy."""
  from jaxlp.parallel.compressors import _base, _quantizers
  c = C.qsgd(15, 512)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((256, 256, 3, 3)), jnp.float32)
  key = jax.random.key(9)

  def run():
    p = jax.jit(lambda x: c.encode(x, (), key)[0])(x)
    return p, jax.jit(lambda p: c.decode(p, x.shape))(p), jax.jit(
      lambda x: c.decode(c.encode(x, (), key)[0], x.shape))(x)

  p, d, rt = run()
  monkeypatch.setattr(_quantizers, "apart", _no_apart)
  monkeypatch.setattr(_base, "apart", _no_apart)
  p0, d0, rt0 = run()
  assert jax.tree_util.tree_map(_bytes, p) == jax.tree_util.tree_map(_bytes, p0)
  assert _bytes(d) == _bytes(d0) == _bytes(rt) == _bytes(rt0)
  codes = np.asarray(_unpack(p["codes"], c.bits, x.size))
  mag = (codes >> 1).astype(np.float32) / np.float32(15)
  want = np.repeat(np.asarray(p["norm"]), 512)[:x.size] * np.where(codes & 1, -mag, mag)
  assert _bytes(d) == _bytes(want.reshape(x.shape))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_unpack_bits_reads_every_position_of_every_width(bits):
  """The word-based unpacking (two uint32 words per group of 8 codes, shifts by >= 32 giving
  0) against the numpy stream, for lengths that end mid-group and mid-byte."""
  rng = np.random.default_rng(bits)
  codes = [rng.integers(0, 2 ** bits, n).astype(np.uint32)
           for n in (1, 7, 8, 9, 15, 16, 17, 1001, 5000)]
  packed = [jnp.asarray(np_pack(c, bits)) for c in codes]
  # every length in one program (one compile)
  got = jax.jit(lambda ps: [C.unpack_bits(p, bits, c.size) for p, c in zip(ps, codes)])(packed)
  for g, c in zip(got, codes, strict=True):
    assert _bytes(g) == _bytes(c), c.size


def test_qsgd_partial_last_bucket_on_a_large_leaf_equals_numpy():
  """QSGD runs its elementwise passes over whole buckets (zeros after the leaf's end, the
  packed stream cut back to the leaf's codes): a leaf above the encoder's barrier threshold
  (2**19) that ends mid-bucket and mid-group has the numpy definition's codes, and decodes
  to the numpy values, with the bits of the same leaf encoded as a multi-worker chunk would
  be (under vmap)."""
  c = C.qsgd(15, 512)
  n = 2 ** 19 + 3
  x = np.random.default_rng(6).standard_normal(n).astype(np.float32)
  key = jax.random.key(4)
  p = jax.jit(lambda x: c.encode(x, (), key)[0])(jnp.asarray(x))
  assert p["codes"].shape == (c.wire_bytes((n,)) - 4 * p["norm"].size,)
  want = np_qsgd_levels(x, p["norm"], np.asarray(_uniform01(key, (n,))), 15, 512)
  assert _bytes(p["codes"]) == _bytes(np_pack(want, c.bits))
  d = np.asarray(jax.jit(lambda p: c.decode(p, (n,)))(p))
  mag = (want >> 1).astype(np.float32) / np.float32(15)
  nrm = np.repeat(np.asarray(p["norm"]), 512)[:n]
  assert _bytes(d) == _bytes(nrm * np.where(want & 1, -mag, mag))
  pv = jax.jit(jax.vmap(lambda x: c.encode(x, (), key)[0]))(jnp.asarray(x[None]))
  assert jax.tree_util.tree_map(lambda a: _bytes(a[0]), pv) == jax.tree_util.tree_map(_bytes, p)


def np_det_sum(x):
  """``det_sum``'s pairwise order in numpy float32: pad to even with a zero, add the pairs."""
  x = np.asarray(x, np.float32)
  if x.size == 0:
    return np.float32(0)
  while x.size > 1:
    if x.size % 2:
      x = np.append(x, np.float32(0))
    x = x[0::2] + x[1::2]
  return x[0]


@pytest.mark.parametrize("n", [1, 1000, 4097])
def test_terngrad_clip_equals_the_numpy_definition(n):
  """terngrad(clip=c): x clipped to +-c*std first, std = sqrt(sum((x - mu)^2) / n) with
  mu = sum(x) / n, each sum in det_sum's pairwise order, each division and the square root
  correctly rounded (numpy float32); then s = max|x|, kept where u*s < |x|."""
  rng = np.random.default_rng(n)
  x = (rng.standard_normal(n) * np.where(rng.random(n) < 0.02, 40.0, 1.0)).astype(np.float32)
  key = jax.random.key(n)
  c = C.terngrad(clip=2.5)
  p, d = jax.jit(lambda x: (lambda p: (p, c.decode(p, x.shape)))(c.encode(x, (), key)[0]))(
    jnp.asarray(x))
  mu = np.float32(np_det_sum(x) / np.float32(n))
  std = np.sqrt(np.float32(np_det_sum(np.square(x - mu)) / np.float32(n)))
  lim = np.float32(2.5) * std
  xc = np.clip(x, -lim, lim)
  s = np.max(np.abs(xc))
  u = np.asarray(_uniform01(key, (n,)))
  code = np.where(u * s < np.abs(xc), np.where(xc < 0, 0, 2), 1).astype(np.uint32)
  assert _bytes(p["scale"]) == _bytes(np.array([s], np.float32))
  assert _bytes(_unpack(p["codes"], 2, n)) == _bytes(code)
  assert _bytes(d) == _bytes((code.astype(np.int32) - 1).astype(np.float32) * s)
  if n > 1:
    assert (np.abs(x) > lim).any() and np.abs(np.asarray(d)).max() <= lim  # the clip acted
