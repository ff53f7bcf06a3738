"""The C accelerator of the CPU path's noise words (``jaxlp.torch._cnoise``, built by setup.py):
the same words as the NumPy functions of ``jaxlp/torch/_cpu.py`` and as JAX, and the same
stochastic results with and without it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxlp.torch as jt
from jaxlp import formats as F
from jaxlp.torch import _cpu as C
from jaxlp.torch._formats import QPyTorchFixedPoint

CN = C._cnoise

# A source tree on sys.path without the built extension (pip install -e . builds it in place)
needs_c = pytest.mark.skipif(CN is None, reason="jaxlp.torch._cnoise is not built")


def test_the_extension_is_built_where_a_compiler_was_found():
  """CI installs with ``pip install -e .`` on a machine with a C compiler: the accelerator must
  be there (an optional extension whose build failed would otherwise pass silently)."""
  import shutil
  import sysconfig

  cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
  if shutil.which(cc) is None:
    pytest.skip(f"no C compiler ({cc}) on this machine")
  assert CN is not None, ("jaxlp.torch._cnoise is not built: run `pip install -e .` (or "
                          "`python setup.py build_ext --inplace`) in the checkout")


@needs_c
def test_words_are_jax_random_bits_and_the_python_threefry():
  rng = np.random.default_rng(0)
  pairs = [(0, 0), (0, 1), (1, 0), (2**32 - 1, 2**32 - 1), (0x1BD11BDA, 0), (2**31, 2**31 - 1)]
  pairs += [tuple(int(v) for v in rng.integers(0, 2**32, 2)) for _ in range(2000)]
  for w0, w1 in pairs:
    assert CN.words(w0, w1) == C._threefry_words(w0, w1), (w0, w1)
  data = jnp.asarray(np.array(pairs[:64], np.uint32))
  want = np.asarray(jax.vmap(lambda d: jax.random.bits(
      jax.random.wrap_key_data(d, impl="threefry2x32"), (2,), jnp.uint32))(data))
  assert [CN.words(*p) for p in pairs[:64]] == [tuple(int(v) for v in w) for w in want]


@needs_c
@pytest.mark.parametrize("n", [1, 2, 3, 100, 4097, 65536, 65537, 300_001])
def test_fill_equals_the_numpy_noise(n):
  rng = np.random.default_rng(n)
  for k0, k1 in [(0, 0), (2**32 - 1, 2**32 - 1)] + [
      tuple(int(v) for v in rng.integers(0, 2**32, 2)) for _ in range(3)]:
    out = np.empty(n, np.uint32)
    CN.fill(out, k0, k1)
    np.testing.assert_array_equal(out, C.noise(n, k0, k1), err_msg=f"{n} {k0} {k1}")
    CN.fill_drawn(out, k0, k1)
    np.testing.assert_array_equal(out, C.noise(n, *C._threefry_words(k0, k1)))


@needs_c
def test_fill_equals_the_spec_hash():
  out = np.empty(1000, np.uint32)
  CN.fill(out, 7, 9)
  np.testing.assert_array_equal(out, np.asarray(jax.jit(
      lambda: F._quantize.B.hash_bits(jnp.uint32(7), jnp.uint32(9),
                                      jnp.arange(1000, dtype=jnp.uint32)))()))


@needs_c
def test_bad_arguments_are_refused():
  out = np.empty(4, np.uint32)
  with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
    CN.fill(out, -1, 0)
  with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
    CN.words(0, 2**32)
  with pytest.raises(TypeError, match="int"):
    CN.fill_drawn(out, 1.0, 0)
  with pytest.raises(TypeError, match="takes"):
    CN.words(1)
  ro = np.empty(4, np.uint32)
  ro.setflags(write=False)
  with pytest.raises((BufferError, ValueError, TypeError)):
    CN.fill(ro, 1, 2)
  with pytest.raises(ValueError, match="uint32 elements"):
    CN.fill(bytearray(6), 1, 2)
  with pytest.raises((BufferError, ValueError, TypeError)):
    CN.fill(np.empty(8, np.uint32)[::2], 1, 2)  # not contiguous
  CN.fill(np.empty(0, np.uint32), 1, 2)  # nothing to fill


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stochastic_calls_are_the_same_with_and_without_it(monkeypatch, dtype):
  """Every stochastic kind of the CPU path (elementwise, fixed point with its mask, block),
  from a seed and from a generator: the same bits through C and through NumPy."""
  x = torch.from_numpy(np.random.default_rng(1).standard_normal((3, 37)).astype(np.float32))
  x = x.to(dtype)
  calls = [
      lambda **k: jt.quantize(x, F.qpytorch_float(5, 2), "stochastic", **k),
      lambda **k: jt.quantize(x, F.E4M3, "stochastic", **k),
      lambda **k: jt.float_quantize(x, 4, 3, rounding="stochastic", **k),
      lambda **k: jt.fixed_point_quantize(x, 8, 4, rounding="stochastic", **k),
      lambda **k: jt.block_quantize(x, 6, dim=0, rounding="stochastic", **k),
      lambda **k: jt.quantize(x, QPyTorchFixedPoint(6, 3, True, False), "stochastic", **k)]
  got = {}
  for accel in (CN, None):
    monkeypatch.setattr(C, "_cnoise", accel)
    res = []
    for call in calls:
      res.append(call(seed=12345))
      res.append(call(generator=torch.Generator().manual_seed(3)))
    got[accel is None] = res
  for i, (a, b) in enumerate(zip(got[False], got[True])):
    assert torch.equal(a.view(torch.int16 if dtype is torch.bfloat16 else torch.int32),
                       b.view(torch.int16 if dtype is torch.bfloat16 else torch.int32)), i


@needs_c
@pytest.mark.parametrize("fl", [-126, -20, -1, 0, 4, 23, 100, 126])
def test_scaled_stochastic_equals_the_numpy_core(monkeypatch, fl):
  """Fixed point's stochastic core in C against NumPy's on the fast path's whole domain
  (every |x| * 2**fl finite): random patterns of every exponent, subnormals, +-0, the largest
  magnitude allowed, and noise words at, just below and just above each element's threshold."""
  rng = np.random.default_rng(fl + 200)
  top = min(254, 254 - fl) << 23 | 0x7FFFFF  # _scaled_fast's bound for |x|
  mags = rng.integers(0, top + 1, 200_000, dtype=np.uint64).astype(np.uint32)
  mags[:8] = [0, 1, 2, 0x7FFFFF, 0x800000, top, top - 1, 0x3F800000 if top >= 0x3F800000 else 3]
  bits = mags | (rng.integers(0, 2, mags.size, dtype=np.uint32) << np.uint32(31))
  x = bits.view(np.float32)
  y = np.abs(x) * np.float32(2.0**fl)
  thr = ((y - np.floor(y)) * np.float32(2**32)).astype(np.uint32)
  k = mags.size // 4
  rand = rng.integers(0, 2**32, mags.size, dtype=np.uint64).astype(np.uint32)
  rand[:k] = thr[:k]
  rand[k:2 * k] = thr[k:2 * k] - np.uint32(1)  # (wraps to 2**32 - 1 at a zero threshold)
  rand[2 * k:2 * k + 8] = [0, 1, 2**32 - 1, 2**31, 0, 0, 2**32 - 1, 7]
  core = C._scaled(fl, "stochastic", qpytorch=True)
  got = core(bits, rand, bits & np.uint32(0x7FFFFFFF))
  monkeypatch.setattr(C, "_cnoise", None)
  with np.errstate(over="ignore"):  # fl = -126: the largest |x| can round up to 2**128 (inf)
    want = core(bits, rand, bits & np.uint32(0x7FFFFFFF))
  # (the fast path calls the core only below that, _scaled_fast's bound; the formats allow
  # fl >= -100 only, where FLT_MAX is on the grid)
  bad = np.flatnonzero(got != want)
  assert bad.size == 0, (fl, bad[:5], bits[bad[:5]], rand[bad[:5]], got[bad[:5]], want[bad[:5]])
  assert (got != bits).any()  # something was rounded
