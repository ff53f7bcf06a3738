"""The NumPy path of CPU tensors (``jaxlp/torch/_cpu.py``) against the JAX spec, bit for bit.

Both the fast path (what a call runs) and the full, line-by-line port are compared with
``jaxlp.formats.quantize`` (exact bits, NaN payloads included), for every rounding of each
format, stochastic rounding with the same seed: on crafted patterns (every exponent field with
ties, half-ulps and extremes; the low bits of every drop count; both signs), on 2**16 random
float32 bit patterns, on tensors built to take each branch of the fast paths (zeros, values
below the normal range, overflows, NaN, inf), on every float16 and bfloat16 pattern, and with
float32 subnormals flushed (``torch.set_flush_denormal``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxlp.torch as jt
from jaxlp import formats as F
from jaxlp.torch import _cpu as C
from jaxlp.torch import _quantize as Q
from jaxlp.torch._formats import QPyTorchFixedPoint

SEED = 1234
WORDS = np.array([SEED >> 32, SEED & 0xFFFFFFFF], np.uint32)

FAMILIES = {
    "qpytorch_float": [F.qpytorch_float(5, 2), F.qpytorch_float(4, 3), F.qpytorch_float(8, 7),
                       F.qpytorch_float(8, 0), F.qpytorch_float(1, 0), F.qpytorch_float(5, 23),
                       F.qpytorch_float(8, 23), F.qpytorch_float(3, 22)],
    "float_format": [F.E4M3, F.E5M2, F.E4M3FNUZ, F.BF16, F.FloatFormat(3, 0),
                     F.FloatFormat(4, 3, subnormals=False),
                     F.FloatFormat(2, 1, specials="finite"), F.FloatFormat(5, 23)],
    "cpd_float": [F.cpd_float(4, 3), F.cpd_float(8, 7), F.cpd_float(3, 0), F.cpd_float(5, 10),
                  F.cpd_float(8, 23)],
    "fixed_point": [F.FixedPoint(8, 4), F.FixedPoint(16, 10, symmetric=True),
                    F.FixedPoint(4, -2, clamp=False), F.FixedPoint(1, 3, symmetric=True),
                    F.FixedPoint(32, 140), F.FixedPoint(8, 126)],
    "qpytorch_fixed": [QPyTorchFixedPoint(8, 4), QPyTorchFixedPoint(30, 3),
                       QPyTorchFixedPoint(8, 4, symmetric=True),
                       QPyTorchFixedPoint(8, 149, clamp=False), QPyTorchFixedPoint(1, 2),
                       QPyTorchFixedPoint(64, 10), QPyTorchFixedPoint(2, -99, clamp=False)],
}
CASES = [(f, r) for fam in FAMILIES.values() for f in fam for r in f.supported_roundings]
_FRACS = np.array([0, 1, 2, 3, 0x400000, 0x3FFFFF, 0x7FFFFF, 0x200000, 0x100000, 0x080000,
                   0x7FFFFE, 0x600000, 0x500000, 0x180000, 0x0C0000, 0x300001, 0x400001,
                   0x1FFFFF, 0x7FFF, 0x8000, 0xFFFF], np.uint32)


def _crafted():
  """Every exponent field x 21 fractions, and for every drop count d the low-bit patterns
  half, half - 1, half + 1 and all ones, at every third exponent field; both signs."""
  c = (np.repeat(np.arange(256, dtype=np.uint32), _FRACS.size) << 23) | np.tile(_FRACS, 256)
  lows = np.array([v & 0x7FFFFF for d in range(24)
                   for v in ((1 << d) >> 1, ((1 << d) >> 1) - 1, ((1 << d) >> 1) + 1,
                             (1 << d) - 1)], np.uint32)
  fields = np.arange(0, 256, 3, dtype=np.uint32)
  c2 = (np.repeat(fields, lows.size) << 23) | np.tile(lows, fields.size)
  both = np.concatenate([c, c2])
  return np.concatenate([both, both | np.uint32(0x80000000)])


def _random(n, seed=0):
  return np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


def _segments(n=4096, seed=0):
  """Tensors that take each branch of the fast paths (all of size n)."""
  rng = np.random.default_rng(seed)
  r = rng.standard_normal(n).astype(np.float32)
  segs = {"randn": r}
  z = r.copy()
  z[::7] = 0.0
  z[3::11] = -0.0
  segs["zeros"] = z
  t = r.copy()
  t[::13] *= np.float32(2.0**-40)
  t[5::17] = np.float32(1e-41)
  t[6::17] = np.float32(-3e-39)
  segs["tiny"] = t
  h = r.copy()
  h[::9] *= np.float32(2.0**100)
  segs["huge"] = h
  w = r.astype(np.float64) * np.exp2(rng.integers(-140, 128, n))
  segs["wide"] = np.clip(w, -3e38, 3e38).astype(np.float32)
  a = r.copy()
  a[::5] = np.nan
  a[1::50] = np.uint32(0x7F800001).view(np.float32)  # a signalling NaN
  segs["nan"] = a
  b = r.copy()
  b[::5] = -np.inf
  b[2::5] = np.inf
  segs["inf"] = b
  segs["all zeros"] = np.zeros(n, np.float32)
  segs["all -0.0"] = np.full(n, -0.0, np.float32)
  segs["scaled"] = (r * np.float32(2.0**-12)).astype(np.float32)
  return segs


#: On the crafted and random patterns, the formats of a family with six roundings: these (the
#: others of the family are checked on every branch of the fast paths below).
HEAVY = {"float_format": 3, "fixed_point": 3}


@functools.cache
def _spec_fn(family, heavy=False):
  """One jitted program: every (format, rounding) of the family on one input."""
  fmts = FAMILIES[family][:HEAVY.get(family)] if heavy else FAMILIES[family]
  cases = [(f, r) for f in fmts for r in f.supported_roundings]

  def spec(x, f, r, key):
    if isinstance(f, QPyTorchFixedPoint):  # a torch-side format: its own jnp definition
      rand = F.random_bits(key, x.shape) if r == "stochastic" else jnp.zeros((), jnp.uint32)
      return f.quantize_with_mask(x, r, rand)[0]
    return F.quantize(x, f, r, key=key if r == "stochastic" else None)

  def fn(x):
    key = jax.random.key(SEED)
    return [spec(x, f, r, key) for f, r in cases]
  return cases, jax.jit(fn)


def _port(fmt, rounding, x):
  """(fast, full, API) results of the NumPy path for float32 array x."""
  kind, fast, full = C.plan(fmt, rounding)
  bits = x.view(np.uint32).copy()
  rand = C.noise(x.size, *C.key_words(int(WORDS[0]), int(WORDS[1]))) \
      if rounding == "stochastic" else None
  out = {}
  for name, f in (("fast", fast), ("full", full)):
    o = f(bits, rand)
    out[name] = (o[0] if kind == "mask" else o).view(np.float32)
  assert (bits == x.view(np.uint32)).all(), "the input was modified"
  t = torch.from_numpy(x.copy())
  api = Q.quantize_raw(t, fmt, rounding, WORDS if rounding == "stochastic" else None)
  out["API"] = api.numpy()
  return out


def _assert_bits(got, want, x, what):
  g, w = got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32)
  bad = np.flatnonzero(g != w)
  if bad.size:
    i = bad[:5]
    raise AssertionError(
        f"{what}: {bad.size} of {g.size} differ, e.g. x={[hex(v) for v in x.view(np.uint32)[i]]}"
        f" got={[hex(v) for v in g[i]]} want={[hex(v) for v in w[i]]}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_crafted_and_random_patterns(family):
  """The crafted patterns (every exponent field, every drop count's low bits) and 2**16 random
  bit patterns."""
  x = np.concatenate([_crafted(), _random(2**16, seed=len(family))]).view(np.float32)
  cases, fn = _spec_fn(family, heavy=True)
  wants = fn(jnp.asarray(x))
  for (fmt, rounding), want in zip(cases, wants, strict=True):
    for name, got in _port(fmt, rounding, x).items():
      _assert_bits(got, np.asarray(want), x, f"{fmt!r} {rounding} {name}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_branch_of_the_fast_paths(family):
  cases, fn = _spec_fn(family)
  for seg, x in _segments().items():
    wants = fn(jnp.asarray(x))
    for (fmt, rounding), want in zip(cases, wants, strict=True):
      for name, got in _port(fmt, rounding, x).items():
        _assert_bits(got, np.asarray(want), x, f"{fmt!r} {rounding} {name} on {seg}")


BLOCKS = [F.qpytorch_block(wl, dim) for wl in (2, 4, 8, 16, 23) for dim in (-1, 0, 1)]


def _block_inputs(seed=0):
  """2-D inputs for block formats: rows at exponents from float32's bottom to its top (a
  block maximum >= 2**126 included), a zero row, a row whose maximum is a subnormal, ties; a
  copy holding a NaN and an inf; random finite patterns (32 tensors of 64 x 64 as one
  (32, 64, 64) array: the shape of the others, so that one compiled spec program takes
  every input)."""
  rng = np.random.default_rng(seed)
  n = 64
  x = rng.standard_normal((n, n)) * np.exp2(rng.integers(-12, 0, (n, n)))
  x *= np.exp2(np.linspace(-150, 127, n).astype(int))[:, None]
  x = np.clip(x, -3.4e38, 3.4e38).astype(np.float32)
  x[3] = 0.0
  x[5] = np.float32(1e-40) * rng.integers(-3, 4, n)
  x[7, :4] = [1.0, 2.0**-7, -3 * 2.0**-7, 0.5 + 2.0**-9]
  y = x.copy()
  y[9, 9] = np.nan
  y[11, 2] = -np.inf
  r = _random(256 * 512, seed).reshape(256, 512)
  r[(r & 0x7F800000) == 0x7F800000] &= np.uint32(0xBFFFFFFF)  # finite: clear an exponent bit
  # inputs for the fast paths (every block maximum's exponent in [-100, 124]): ties, zeros,
  # subnormals next to normal values, and maxima at both ends of that range
  g = rng.standard_normal((n, n)).astype(np.float32)
  g[::5, ::3] = 0.0
  g[1::7, ::4] = np.float32(-1e-40)
  g[2, :6] = [1.0, 2.0**-7, -3 * 2.0**-7, 0.5 + 2.0**-9, -(0.5 + 2.0**-9), 1.9999999]
  top = (g.astype(np.float64) * 2.0**123).astype(np.float32)
  top[0, 0] = np.float32(2.0**125 * 0.9999999)  # the largest magnitude still below 2**125
  bottom = (g.astype(np.float64) * 2.0**-99).astype(np.float32)
  bottom[0, 0] = np.float32(2.0**-100)
  return {"scales": x, "specials": y, "random": r.view(np.float32).reshape(-1, n, n),
          "randn": g, "top": top, "bottom": bottom}


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_block_formats(rounding):
  key = jax.random.key(SEED)
  fn = jax.jit(lambda v: [F.quantize(v, f, rounding, key=key if rounding == "stochastic"
                                     else None) for f in BLOCKS])
  inputs = [(f"{name}[{i}]" if xs.ndim == 3 else name, x)
            for name, xs in _block_inputs().items() for i, x in enumerate(xs.reshape(-1, 64, 64))]
  rand = C.noise(64 * 64, *C.key_words(int(WORDS[0]), int(WORDS[1])))
  for name, x in inputs:
    wants = fn(jnp.asarray(x))
    t = torch.from_numpy(x.copy())
    for fmt, want in zip(BLOCKS, wants, strict=True):
      w = WORDS if rounding == "stochastic" else None
      got = Q.quantize_raw(t, fmt, rounding, w).numpy()
      _assert_bits(got, np.asarray(want), x, f"{fmt!r} {rounding} on {name}")
      full = C.plan(fmt, rounding)[2](x.view(np.uint32).reshape(-1), rand, x.shape)
      _assert_bits(full.view(np.float32).reshape(x.shape), np.asarray(want), x,
                   f"{fmt!r} {rounding} full port on {name}")


_HALF = [F.qpytorch_float(5, 2), F.E4M3, F.E5M2, F.FixedPoint(8, 4), QPyTorchFixedPoint(8, 4),
         F.cpd_float(4, 3), F.qpytorch_float(8, 7)]


def _same_half(got, want):
  """Bit equality of half-precision tensors, every NaN equal to every NaN (XLA's fused
  program does not keep NaN payloads consistently: see ``jaxlp.torch._cpu._tensor_of``)."""
  same = got.view(torch.int16) == want.view(torch.int16)
  return bool((same | (torch.isnan(got) & torch.isnan(want))).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_half_precision_pattern(dtype):
  """Every float16 / bfloat16 bit pattern: widened, rounded and narrowed as the JAX route
  does (XLA's ``astype``), bit for bit (NaN payloads aside)."""
  t = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.int16).copy()).view(dtype)
  cases = [(f, r) for f in _HALF for r in ("nearest", "stochastic") if r in f.supported_roundings]
  # the JAX route's computation (Q._kernel, what jax_route compiles for one case), compiled
  # normally, every case in one program
  wants = jax.jit(lambda x, key: [Q._kernel(f, r, False, x, key) for f, r in cases])(
      jt.to_jax(t), WORDS)
  for (fmt, rounding), want in zip(cases, wants, strict=True):
    w = WORDS if rounding == "stochastic" else None
    got = Q.quantize_raw(t, fmt, rounding, w)
    assert got.dtype == dtype
    assert _same_half(got, jt.to_torch(want)), (fmt, rounding)
  # and a block format on a 2-D half tensor
  x = torch.from_numpy(_block_inputs()["scales"]).clamp(-6e4, 6e4).to(dtype)
  for rounding in ("nearest", "stochastic"):
    w = WORDS if rounding == "stochastic" else None
    got = Q.quantize_raw(x, F.qpytorch_block(8, 0), rounding, w)
    want = Q.jax_route(x, F.qpytorch_block(8, 0), rounding, w)
    assert _same_half(got, want), rounding


def test_flushed_subnormals_change_nothing():
  """With ``torch.set_flush_denormal(True)`` (flush-to-zero in this thread) the results keep
  their bits: the fast paths use float arithmetic only where no subnormal can matter, and
  the fixed-point ones step aside when subnormals are flushed."""
  if not torch.set_flush_denormal(True):
    pytest.skip("this CPU cannot flush denormals (no SSE3 / FTZ)")
  try:
    assert not C._ieee_subnormals()
    fams = ("qpytorch_float", "fixed_point", "qpytorch_fixed")
    # the segments' size of test_every_branch_of_the_fast_paths: its compiled spec programs
    segs = _segments()
    for family in fams:
      cases, fn = _spec_fn(family)
      for seg in ("tiny", "wide", "zeros"):
        x = segs[seg]
        wants = fn(jnp.asarray(x))
        for (fmt, rounding), want in zip(cases, wants, strict=True):
          got = Q.quantize_raw(torch.from_numpy(x.copy()), fmt, rounding,
                               WORDS if rounding == "stochastic" else None).numpy()
          _assert_bits(got, np.asarray(want), x, f"{fmt!r} {rounding} flushed, {seg}")
    x = _block_inputs()["scales"]
    for fmt in (F.qpytorch_block(8, 0), F.qpytorch_block(8, -1)):
      got = Q.quantize_raw(torch.from_numpy(x.copy()), fmt, "nearest", None).numpy()
      _assert_bits(got, np.asarray(F.quantize(jnp.asarray(x), fmt)), x, f"{fmt!r} flushed")
  finally:
    torch.set_flush_denormal(False)
  assert C._ieee_subnormals()


def test_key_words_are_jax_random_bits():
  for w0, w1 in ((0, 0), (0, 42), (123456789, 987654321), (2**32 - 1, 2**32 - 1), (1, 2**31)):
    key = jax.random.wrap_key_data(jnp.array([w0, w1], jnp.uint32), impl="threefry2x32")
    want = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    assert C.key_words(w0, w1) == tuple(int(v) for v in want), (w0, w1)
  np.testing.assert_array_equal(C.noise(1000, 7, 9), np.asarray(jax.jit(
      lambda: F._quantize.B.hash_bits(jnp.uint32(7), jnp.uint32(9),
                                      jnp.arange(1000, dtype=jnp.uint32)))()))


def test_shapes_views_and_outputs():
  """Any shape (0-d, empty, N-d), a non-contiguous view, a tensor that requires grad: the
  spec's bits, a fresh output of the input's shape and dtype, the input untouched."""
  rng = np.random.default_rng(5)
  fmt = F.qpytorch_float(4, 3)
  for shape in ((), (0,), (3, 0, 2), (7,), (2, 3, 4), (1, 1, 1, 5)):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    keep = x.clone()
    for rounding in ("nearest", "stochastic"):
      got = jt.quantize(x, fmt, rounding, seed=SEED)
      want = Q.jax_route(x, fmt, rounding, WORDS if rounding == "stochastic" else None)
      assert got.shape == x.shape and got.dtype == x.dtype
      assert torch.equal(got.view(torch.int32), want.view(torch.int32)), shape
      assert torch.equal(x, keep)
      if x.numel():
        assert got.data_ptr() != x.data_ptr()
  base = torch.from_numpy(rng.standard_normal((6, 8)).astype(np.float32))
  for view in (base.t(), base[:, ::2], base[1:4]):
    assert torch.equal(jt.quantize(view, fmt), jt.quantize(view.contiguous(), fmt))
  g = base.clone().requires_grad_()
  assert torch.equal(jt.quantize(g, fmt).detach(), jt.quantize(base, fmt))


def test_native_path_is_taken_and_the_rest_takes_jax(monkeypatch):
  """The formats documented for the NumPy path never reach JAX on CPU tensors; the others
  (and float64, which JAX refuses) do."""
  routed = []
  real = Q.jax_route

  def spy(*args, **kwargs):
    routed.append(args[1])
    return real(*args, **kwargs)

  monkeypatch.setattr(Q, "jax_route", spy)
  t = torch.randn(32)
  for fmt, rounding in CASES:
    Q.quantize_raw(t, fmt, rounding, WORDS if rounding == "stochastic" else None)
  for fmt in BLOCKS[:3]:
    Q.quantize_raw(t.reshape(4, 8), fmt, "stochastic", WORDS)
  Q.quantize_raw_mask(t, QPyTorchFixedPoint(8, 4), "nearest", None)
  assert routed == []
  jt.quantize(t, F.mx(F.E4M3FN, 8))
  jt.quantize(t.reshape(4, 8), F.BlockFormat(4, axis=-1, block_size=4))
  assert len(routed) == 2


def test_large_tensors_take_the_bucketed_jax_route(monkeypatch):
  """Above NATIVE_MAX elements the NumPy path's formats take the compiled spec on the flat
  tensor padded to a size class: the spec's bits (same as the exact shape), and one compile
  per size class, not per shape."""
  traces = []
  kernel = Q._kernel

  def counting_kernel(*args):
    traces.append(args[:3])
    return kernel(*args)

  monkeypatch.setattr(Q, "_kernel", counting_kernel)
  rng = np.random.default_rng(8)
  fmt = F.qpytorch_float(4, 3)
  shapes = [(70001,), (7, 10001), (100, 701), (2, 3, 11667)]  # 65537 < n <= 81920: one class
  assert len({Q.bucket(int(np.prod(s))) for s in shapes}) == 1
  for shape in shapes:
    x = torch.from_numpy((rng.standard_normal(shape) * 100).astype(np.float32))
    for rounding in ("nearest", "stochastic"):
      w = WORDS if rounding == "stochastic" else None
      got = Q.quantize_raw(x, fmt, rounding, w)
      assert got.shape == x.shape and got.is_contiguous()
      want = F.quantize(jnp.asarray(x.numpy()), fmt, rounding,
                        key=jax.random.key(SEED) if w is not None else None)
      _assert_bits(got.numpy(), np.asarray(want), x.numpy(), f"{shape} {rounding}")
  assert len(traces) == 2, traces  # nearest and stochastic, once each
  # the mask of QPyTorch's fixed point, a one-block qpytorch_block and half inputs too
  x = torch.from_numpy((rng.standard_normal(70000) * 10).astype(np.float32))
  q, m = Q.quantize_raw_mask(x, QPyTorchFixedPoint(8, 4), "stochastic", WORDS)
  rq, rm = Q.jax_route(x, QPyTorchFixedPoint(8, 4), "stochastic", WORDS, True)
  assert torch.equal(q, rq) and torch.equal(m, rm) and m.any()
  for fmt, t in ((F.qpytorch_block(6), x), (F.E4M3, x.to(torch.bfloat16)),
                 (F.qpytorch_block(6, 0), x.reshape(700, 100))):
    iv = torch.int16 if t.dtype == torch.bfloat16 else torch.int32
    for rounding in ("nearest", "stochastic"):
      w = WORDS if rounding == "stochastic" else None
      got = Q.quantize_raw(t, fmt, rounding, w)
      assert torch.equal(got.view(iv), Q.jax_route(t, fmt, rounding, w).view(iv)), fmt
