"""`jaxlp.ops.matmul` (the reference) against independent numpy loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _bits as B
from jaxlp.formats._quantize import key_words, quantize_f32
from jaxlp.ops._matmul import matmul


def _rand(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _q(v, fmt, rounding="nearest", rand=None):
  return quantize_f32(v, fmt, rounding, rand, None)


def _np_loop(a, b, *, mul=None, acc=None, kahan=False, rounding="nearest", noise=None,
             bias=None):
  """Independent per-MAC loop: numpy float32 products/sums (never fused), Q via the spec."""
  M, K = a.shape
  N = b.shape[1]
  R = 5 if kahan else 2

  def Q(v, fmt, t, r):
    if fmt is None:
      return v.astype(np.float32)
    rnd = None if noise is None else noise(t, r)
    return np.asarray(_q(jnp.asarray(v, jnp.float32), fmt, rounding, rnd))

  s = np.zeros((M, N), np.float32) if bias is None else \
      np.broadcast_to(np.asarray(bias, np.float32), (M, N)).copy()
  c = np.zeros((M, N), np.float32)
  for t in range(K):
    p = Q(np.multiply(a[:, t:t + 1], b[t:t + 1, :], dtype=np.float32), mul, t, 0)
    if kahan:
      y = Q(p - c, acc, t, 1)
      tt = Q(s + y, acc, t, 2)
      c = Q(Q(tt - s, acc, t, 3) - y, acc, t, 4)
      s = tt
    else:
      s = Q(s + p, acc, t, 1)
  del R
  return s


def test_no_fma_contraction_explicit():
  # fma(1+2^-12, 1+2^-12, -1) = 2^-11 + 2^-24, but fl(fl(a*b) - 1) = 2^-11.
  e = np.float32(1 + 2**-12)
  a = np.array([[-1.0, e]], np.float32)
  b = np.array([[1.0], [e]], np.float32)
  for alg in ("naive", "kahan"):
    out = matmul(a, b, algorithm=alg)
    assert float(out[0, 0]) == 2.0**-11, alg
    out = jax.jit(functools.partial(matmul, algorithm=alg))(a, b)
    assert float(out[0, 0]) == 2.0**-11, alg


@pytest.mark.parametrize("alg", ["naive", "kahan"])
def test_fp32_equals_unfused_numpy_loop(alg):
  a, b = _rand((13, 37), 0), _rand((37, 11), 1)
  want = _np_loop(a, b, kahan=alg == "kahan")
  np.testing.assert_array_equal(_bits(jax.jit(lambda a, b: matmul(a, b, algorithm=alg))(a, b)),
                                _bits(want))


@pytest.mark.parametrize("e,m", [(5, 2), (4, 3), (8, 7)])
def test_cpd_kahan_reproduces_quant_gemm(e, m):
  a, b = _rand((6, 29), 2, 3.0), _rand((29, 5), 3, 3.0)
  fmt = F.cpd_float(e, m)
  want = _np_loop(a, b, mul=fmt, acc=fmt, kahan=True)
  got = matmul(a, b, mul=fmt, acc=fmt, algorithm="kahan")
  np.testing.assert_array_equal(_bits(got), _bits(want))
  # The compensation matters (else this test could pass with a plain sum).
  plain = matmul(a, b, mul=fmt, acc=fmt)
  assert not np.array_equal(_bits(plain), _bits(got))


@pytest.mark.parametrize("mul,acc", [(F.BF16, F.FP16), (None, F.E5M2), (F.E4M3, None),
                                     (F.FixedPoint(12, 6), F.qpytorch_float(5, 6))], ids=repr)
def test_naive_formats(mul, acc):
  a, b = _rand((5, 23), 4), _rand((23, 7), 5)
  want = _np_loop(a, b, mul=mul, acc=acc)
  np.testing.assert_array_equal(_bits(matmul(a, b, mul=mul, acc=acc)), _bits(want))


def test_stochastic_noise_index_scheme():
  a, b = _rand((4, 9), 6), _rand((9, 3), 7)
  key = jax.random.key(11)
  k0, k1 = key_words(key)
  M, N = 4, 3
  o = (np.arange(M)[:, None] * N + np.arange(N)[None, :]).astype(np.uint32)

  def noise(t, r):
    return B.hash_bits(k0, k1, jnp.asarray((t * 2 + r) * (M * N) + o, jnp.uint32))

  want = _np_loop(a, b, mul=F.BF16, acc=F.E5M2, rounding="stochastic", noise=noise)
  got = matmul(a, b, mul=F.BF16, acc=F.E5M2, rounding="stochastic", key=key)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  other = matmul(a, b, mul=F.BF16, acc=F.E5M2, rounding="stochastic", key=jax.random.key(12))
  assert not np.array_equal(_bits(got), _bits(other))


def test_chunked_properties():
  a, b = _rand((6, 40), 8), _rand((40, 5), 9)
  # chunk=1: one exact product per chunk == naive with fp32 products.
  np.testing.assert_array_equal(_bits(matmul(a, b, algorithm="chunked", chunk=1)),
                                _bits(matmul(a, b)))
  # One chunk covering K: the plain fp32 dot.
  full = jnp.matmul(a, b, precision="highest", preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(_bits(matmul(a, b, algorithm="chunked", chunk=64)), _bits(full))
  # Rounded accumulator: Q(Q(Q(0 + d0) + d1) + d2) over chunk dots d_i.
  d = [jnp.matmul(a[:, i:i + 16], b[i:i + 16], precision="highest",
                  preferred_element_type=jnp.float32) for i in (0, 16)]
  d.append(jnp.matmul(np.pad(a[:, 32:], ((0, 0), (0, 8))), np.pad(b[32:], ((0, 8), (0, 0))),
                      precision="highest", preferred_element_type=jnp.float32))
  s = jnp.zeros((6, 5))
  for di in d:
    s = _q(s + di, F.BF16)
  np.testing.assert_array_equal(_bits(matmul(a, b, algorithm="chunked", chunk=16, acc=F.BF16)),
                                _bits(s))


def test_batched_and_dimension_numbers():
  a, b = _rand((2, 3, 4, 9), 10), _rand((9, 5), 11)
  out = matmul(a, b, acc=F.BF16)
  assert out.shape == (2, 3, 4, 5)
  one = jax.jit(lambda x: matmul(x, b, acc=F.BF16))
  for i, j in ((0, 0), (1, 2)):
    np.testing.assert_array_equal(_bits(out[i, j]), _bits(one(a[i, j])))
  # a^T @ b^T via dot_general dimension numbers.
  a2, b2 = _rand((9, 4), 12), _rand((5, 9), 13)
  got = matmul(a2, b2, acc=F.BF16, dimension_numbers=(((0,), (1,)), ((), ())))
  np.testing.assert_array_equal(_bits(got), _bits(matmul(a2.T, b2.T, acc=F.BF16)))
  # Batch dims in the middle, as lax.dot_general lays them out (batch, lhs free, rhs free).
  a3, b3 = _rand((4, 2, 9), 14), _rand((9, 2, 3), 15)
  dn = (((2,), (0,)), ((1,), (1,)))
  got = matmul(a3, b3, dimension_numbers=dn, algorithm="kahan")
  assert got.shape == jax.lax.dot_general(a3, b3, dn).shape == (2, 4, 3)
  one = jax.jit(functools.partial(matmul, algorithm="kahan"))
  for i in range(2):
    np.testing.assert_array_equal(_bits(got[i]), _bits(one(a3[:, i], b3[:, i])))


def test_empty_and_dtypes():
  assert matmul(np.zeros((0, 3), np.float32), np.zeros((3, 4), np.float32)).shape == (0, 4)
  z = matmul(np.zeros((2, 0), np.float32), np.zeros((0, 4), np.float32), acc=F.BF16)
  np.testing.assert_array_equal(np.asarray(z), np.zeros((2, 4), np.float32))
  a, b = jnp.asarray(_rand((3, 5), 16), jnp.bfloat16), jnp.asarray(_rand((5, 2), 17), jnp.bfloat16)
  out = matmul(a, b, acc=F.BF16)
  assert out.dtype == jnp.bfloat16
  ref = matmul(a.astype(jnp.float32), b.astype(jnp.float32), acc=F.BF16)
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(ref))
  assert matmul(a, b, preferred_element_type=jnp.float32).dtype == jnp.float32


def test_errors():
  a, b = np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)
  with pytest.raises(ValueError, match="algorithm"):
    matmul(a, b, algorithm="pairwise")
  with pytest.raises(ValueError, match="chunk"):
    matmul(a, b, algorithm="chunked")
  with pytest.raises(ValueError, match="mul must be None"):
    matmul(a, b, algorithm="chunked", chunk=2, mul=F.BF16)
  with pytest.raises(ValueError, match="elementwise"):
    matmul(a, b, acc=F.mx(F.E4M3FN))
  with pytest.raises(ValueError, match="PRNG key"):
    matmul(a, b, acc=F.BF16, rounding="stochastic")
  with pytest.raises(ValueError, match="supports rounding"):
    matmul(a, b, acc=F.cpd_float(5, 2), rounding="stochastic", key=jax.random.key(0))
  with pytest.raises(TypeError, match="dtype"):
    matmul(a.astype(np.int32), b)
  with pytest.raises(ValueError, match="mismatch"):
    matmul(a, np.ones((4, 2), np.float32))


@pytest.mark.parametrize("kahan", [False, True])
@pytest.mark.parametrize("bias_shape", [(7,), (5, 1), (5, 7)])
def test_bias_is_the_initial_accumulator(kahan, bias_shape):
  """``bias`` starts the running sum (D = A B + C), unrounded; every addition then rounds."""
  a, b = _rand((5, 9), 21), _rand((9, 7), 22)
  bias = _rand(bias_shape, 23, 4.0)
  fmt = F.cpd_float(4, 3)
  got = matmul(a, b, mul=fmt, acc=fmt, algorithm="kahan" if kahan else "naive", bias=bias)
  want = _np_loop(a, b, mul=fmt, acc=fmt, kahan=kahan, bias=bias)
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_bias_edge_cases_and_errors():
  bias = _rand((3, 4), 24)
  out = matmul(np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32), bias=bias)
  np.testing.assert_array_equal(_bits(out), _bits(bias))  # K = 0: the bias itself
  chunked = matmul(_rand((3, 40), 25), _rand((40, 4), 26), acc=F.BF16, algorithm="chunked",
                   chunk=16, bias=bias)
  zero = matmul(_rand((3, 40), 25), _rand((40, 4), 26), acc=F.BF16, algorithm="chunked",
                chunk=16, bias=np.zeros((3, 4), np.float32))
  assert not np.array_equal(_bits(chunked), _bits(zero))
  with pytest.raises(ValueError, match="bias.shape"):
    matmul(_rand((3, 5), 1), _rand((5, 4), 2), bias=np.zeros((2,), np.float32))
  with pytest.raises(TypeError, match="bias"):
    matmul(_rand((3, 5), 1), _rand((5, 4), 2), bias=np.zeros((4,), np.int32))
