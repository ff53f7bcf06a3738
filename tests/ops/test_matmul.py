"""`jaxlp.ops.matmul` (the reference) against independent numpy loops."""

import functools
import importlib

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


# ---------------------------------------------------------------------------------------
# The derivative (grad="fp32" | "emulate"): never a silent zero
# ---------------------------------------------------------------------------------------
HI = jax.lax.Precision.HIGHEST
KEY = jax.random.key(7)

#: Settings for the derivative tests: every algorithm, with and without mul/acc, stochastic.
GRAD_CASES = [
    dict(),
    dict(acc=F.BF16),
    dict(mul=F.BF16, acc=F.E5M2),
    dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2), algorithm="kahan"),
    dict(acc=F.FP16, algorithm="chunked", chunk=4),
    dict(mul=F.BF16, acc=F.FP16, rounding="stochastic", key=KEY),
    dict(acc=F.E5M2, algorithm="kahan", rounding="stochastic", key=KEY),
]
_IDS = [",".join(f"{k}={v!r}" for k, v in kw.items() if k != "key") or "fp32"
        for kw in GRAD_CASES]


def _dot32(x, y):
  return np.asarray(jnp.matmul(x, y, precision=HI, preferred_element_type=jnp.float32))


def _ints(shape, seed):
  """Small integers: every float32 sum of their products is exact, in any order."""
  return np.random.default_rng(seed).integers(-4, 5, shape).astype(np.float32)


@pytest.mark.usefixtures("fast_compile")  # tolerances: any optimization level
def test_issue_probe_gradient_is_not_zero():
  """Issue 49: ``jax.grad`` of ``sum(matmul(a, b, acc=BF16))`` was all zeros (also with
  ``acc=None``, w.r.t. ``b`` and through ``jax.jvp``)."""
  a, b = _rand((3, 8), 40), _rand((8, 4), 41)
  want_a = np.broadcast_to(b.sum(1, dtype=np.float32), (3, 8))
  want_b = np.broadcast_to(a.sum(0)[:, None], (8, 4))

  @jax.jit
  def grads(a, b):
    return [jax.grad(lambda a, b, acc=acc, grad=grad: matmul(a, b, acc=acc, grad=grad).sum(),
                     (0, 1))(a, b)
            for grad in ("fp32", "emulate") for acc in (F.BF16, None)]

  for ga, gb in grads(a, b):
    np.testing.assert_allclose(np.asarray(ga), want_a, rtol=1e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(gb), want_b, rtol=1e-2, atol=2e-2)
  t = jax.jvp(lambda a: matmul(a, b, acc=F.BF16), (a,), (np.ones_like(a),))[1]
  np.testing.assert_allclose(np.asarray(t), _dot32(np.ones_like(a), b), rtol=1e-6)


@pytest.mark.parametrize("kw", [GRAD_CASES[i] for i in (0, 3, 4, 6)],
                         ids=[_IDS[i] for i in (0, 3, 4, 6)])
def test_grad_fp32_is_the_float32_gemms(kw):
  """grad="fp32" (default): dA = g B^T, dB = A^T g (float32 GEMMs), d bias = g; jvp is
  dA B + A dB + d bias; under jit, vmap and eagerly. Integer data: the float32 GEMMs are exact
  whatever their summation order, so the bits are compared exactly."""
  a, b, bias, g = _ints((4, 9), 42), _ints((9, 3), 43), _ints((3,), 44), _ints((4, 3), 45)
  da, db, dbias = _ints((4, 9), 46), _ints((9, 3), 47), _ints((3,), 48)

  def f(a, b, bias):
    return matmul(a, b, bias=bias, **kw)

  @jax.jit
  def run(a, b, bias, g, da, db, dbias):
    _, vjp = jax.vjp(f, a, b, bias)
    _, tan = jax.jvp(f, (a, b, bias), (da, db, dbias))
    batched = jax.vmap(lambda a, g: jax.vjp(lambda a: f(a, b, bias), a)[1](g)[0])(
        a[:, None], g[:, None])
    return vjp(g), tan, batched

  (ga, gb, gbias), tan, batched = run(a, b, bias, g, da, db, dbias)
  np.testing.assert_array_equal(_bits(ga), _bits(g @ b.T))
  np.testing.assert_array_equal(_bits(gb), _bits(a.T @ g))
  np.testing.assert_array_equal(_bits(gbias), _bits(g.sum(0)))
  np.testing.assert_array_equal(_bits(tan), _bits(da @ b + a @ db + dbias))
  np.testing.assert_array_equal(_bits(batched[:, 0]), _bits(g @ b.T))
  # random data: the float32 GEMMs up to their (backend's) summation order
  a, b, g = _rand((4, 9), 49), _rand((9, 3), 50), _rand((4, 3), 51)
  ga, gb, _ = jax.vjp(f, a, b, None)[1](g)
  np.testing.assert_allclose(np.asarray(ga), _dot32(g, b.T), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(gb), _dot32(a.T, g), rtol=1e-5, atol=1e-6)


# all but the CPDFloat Kahan case (3), whose pieces the others hold: Kahan (6, stochastic), mul
# and acc formats (2, 5); grad="emulate" calls matmul with the same settings whatever they are
@pytest.mark.parametrize("kw", [c for i, c in enumerate(GRAD_CASES) if i != 3],
                         ids=[c for i, c in enumerate(_IDS) if i != 3])
def test_grad_emulate_is_the_emulated_backward_gemms(kw):
  """grad="emulate": dA = matmul(g, B^T) and dB = matmul(A^T, g) with the same settings (keys
  fold_in(key, 1) and fold_in(key, 2)), d bias = g; the same bits under jit and vmap."""
  a, b, bias, g = _rand((4, 9), 52), _rand((9, 3), 53), _rand((4, 1), 54), _rand((4, 3), 55)
  kw = dict(kw, grad="emulate")
  bw = {k: v for k, v in kw.items() if k not in ("key", "grad")}
  k1 = k2 = None
  if "key" in kw:
    k1, k2 = jax.random.fold_in(KEY, 1), jax.random.fold_in(KEY, 2)

  def f(a, b, bias):
    return matmul(a, b, bias=bias, **kw)

  @jax.jit
  def run(a, b, bias, g):
    _, vjp = jax.vjp(f, a, b, bias)
    batched = jax.vmap(lambda g: vjp(g)[:2])(jnp.stack([g, 2 * g]))
    want = (matmul(g, b.T, key=k1, **bw), matmul(a.T, g, key=k2, **bw),
            matmul(a.T, 2 * g, key=k2, **bw))
    return vjp(g), batched, want

  (ga, gb, gbias), batched, (want_a, want_b, want_b2) = run(a, b, bias, g)
  np.testing.assert_array_equal(_bits(ga), _bits(want_a))
  np.testing.assert_array_equal(_bits(gb), _bits(want_b))
  np.testing.assert_array_equal(_bits(gbias), _bits(g.sum(1, keepdims=True)))
  np.testing.assert_array_equal(_bits(batched[0][0]), _bits(ga))
  np.testing.assert_array_equal(_bits(batched[1][1]), _bits(want_b2))
  if "mul" in kw or "acc" in kw:
    assert not np.array_equal(_bits(ga), _bits(_dot32(g, b.T)))  # the emulation shows


def test_grad_eager_equals_jit():
  a, b, g = _rand((4, 9), 56), _rand((9, 3), 57), _rand((4, 3), 58)
  for grad in ("fp32", "emulate"):
    f = functools.partial(matmul, acc=F.E5M2, algorithm="kahan", grad=grad)
    eager = jax.vjp(f, a, b)[1](g)
    jitted = jax.jit(lambda a, b, g, f=f: jax.vjp(f, a, b)[1](g))(a, b, g)
    for x, y in zip(eager, jitted):
      np.testing.assert_array_equal(_bits(x), _bits(y))


def test_grad_emulate_forward_mode_is_a_documented_type_error():
  a, b = _rand((2, 3), 54), _rand((3, 2), 55)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda a: matmul(a, b, acc=F.BF16, grad="emulate"), (a,), (a,))


def test_second_derivatives():
  """Reverse over reverse: the backward GEMMs are differentiable too (no silent zero). With
  small integers every BF16 sum is exact, so both modes give the exact second derivative of
  sum(c * (a @ b)) w.r.t. (a, b): d/db sum(h * (c @ b^T)) = c^T h summed, etc."""
  rng = np.random.default_rng(56)
  a, b, c, h = (rng.integers(-3, 4, s).astype(np.float32)
                for s in ((3, 5), (5, 2), (3, 2), (3, 5)))
  assert np.abs(h.T @ c).sum() > 0
  for grad in ("fp32", "emulate"):
    def ga(a, b, grad=grad):
      return jax.grad(lambda a: (matmul(a, b, acc=F.BF16, grad=grad) * c).sum())(a)

    got = jax.jit(jax.grad(lambda b: (ga(a, b) * h).sum()))(b)  # d/db sum(h * (c b^T)) = h^T c
    np.testing.assert_array_equal(np.asarray(got), h.T @ c)


def test_grad_batch_broadcast_dimension_numbers_and_half_dtypes():
  a, b, g = _rand((2, 1, 4, 6), 59), _rand((3, 6, 5), 60), _rand((2, 3, 4, 5), 61)
  a2, b2, g2 = _rand((9, 4), 62), _rand((5, 9), 63), _rand((4, 5), 64)
  a3 = jnp.asarray(_rand((3, 5), 65), jnp.bfloat16)
  b3 = jnp.asarray(_rand((5, 2), 66), jnp.bfloat16)
  g3 = _rand((3, 2), 67)
  dn = (((0,), (1,)), ((), ()))

  @functools.partial(jax.jit, static_argnums=0)
  def run(grad):
    f = functools.partial(matmul, acc=F.BF16, grad=grad)
    # broadcast batch dims: the cotangent of a broadcast operand is summed (float32)
    bcast = jax.vjp(f, a, b)[1](g)
    full = jax.vjp(f, jnp.broadcast_to(a, (2, 3, 4, 6)), jnp.broadcast_to(b, (2, 3, 6, 5)))[1](g)
    one = jax.vjp(lambda a: f(a, b[2]), a[1, 0])[1](g[1, 2])[0]
    # dimension_numbers: a^T b^T gives the transposes of the plain product's gradients
    dims = jax.vjp(lambda a, b: f(a, b, dimension_numbers=dn), a2, b2)[1](g2)
    plain = jax.vjp(f, a2.T, b2.T)[1](g2)
    # bfloat16 operands: the float32 cotangent rounded to bfloat16
    half = jax.vjp(lambda a, b: f(a, b, preferred_element_type=jnp.float32), a3, b3)[1](g3)
    wide = jax.vjp(f, a3.astype(jnp.float32), b3.astype(jnp.float32))[1](g3)
    return bcast, full, one, dims, plain, half, wide

  for grad in ("fp32", "emulate"):
    (ga, gb), (ga_full, gb_full), one, dims, plain, half, wide = run(grad)
    np.testing.assert_array_equal(_bits(ga), _bits(jnp.sum(ga_full, 1, keepdims=True)))
    np.testing.assert_array_equal(_bits(gb), _bits(jnp.sum(gb_full, 0)))
    if grad == "emulate":  # one batch element alone: its own (order-defined) GEMM
      np.testing.assert_array_equal(_bits(ga_full[1, 2]), _bits(one))
    np.testing.assert_array_equal(_bits(dims[0]), _bits(plain[0].T))
    np.testing.assert_array_equal(_bits(dims[1]), _bits(plain[1].T))
    assert half[0].dtype == half[1].dtype == jnp.bfloat16
    for x, y in zip(half, wide):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y.astype(jnp.bfloat16)))


def test_grad_through_the_kernel_dispatch(monkeypatch):
  """The GPU route of ``jaxlp.matmul`` (kernel branch of ``lax.platform_dependent``, here
  re-pointed to the CPU and interpreted) has the reference's gradients, bit for bit."""
  OM = importlib.import_module("jaxlp.ops._matmul")
  PM = importlib.import_module("jaxlp.pallas._matmul")
  monkeypatch.setattr(PM, "KERNEL_IS_FASTER", dict.fromkeys(PM.KERNEL_IS_FASTER, True))
  monkeypatch.setattr(PM, "MIN_PALLAS_MACS", 1)
  monkeypatch.setattr(OM, "_KERNEL_PLATFORMS", ("cpu",))
  calls = []

  def interpreted(*args, **kw):
    calls.append(kw["grad"])
    return PM.matmul(*args, interpret=True, **kw)

  monkeypatch.setattr(OM, "_kernel_matmul", interpreted)
  OM._dispatch.clear_cache()
  try:
    a, b = _rand((5, 6), 66), _rand((6, 3), 67)

    @jax.jit
    def run(a, b):
      out = []
      for grad in ("fp32", "emulate"):
        kw = dict(acc=F.BF16, rounding="stochastic", key=KEY, grad=grad)
        for f in (matmul, OM.matmul_reference):
          out.append(jax.grad(lambda a, b, f=f, kw=kw: (f(a, b, **kw) ** 2).sum(), (0, 1))(a, b))
      return out

    got32, want32, got, want = run(a, b)
    assert calls == ["fp32", "emulate"]  # the kernel branch was traced
    for x, y in zip(got32 + got, want32 + want):
      np.testing.assert_array_equal(_bits(x), _bits(y))
  finally:
    OM._dispatch.clear_cache()


def test_shape_errors_name_both_shapes():
  """Issue 49: batch dims that do not broadcast gave a bare jnp broadcasting error."""
  with pytest.raises(ValueError, match=r"batch dimensions of a.shape=\(2, 8, 48\) and "
                                       r"b.shape=\(3, 48, 4\).*do not broadcast"):
    matmul(np.ones((2, 8, 48), np.float32), np.ones((3, 48, 4), np.float32))
  with pytest.raises(ValueError, match=r"a.shape\[-1\]=48 but b.shape\[-2\]=47.*"
                                       r"a.shape=\(8, 48\), b.shape=\(47, 4\)"):
    matmul(np.ones((8, 48), np.float32), np.ones((47, 4), np.float32))
  with pytest.raises(ValueError, match=r"ndim >= 2.*a.shape=\(48,\), b.shape=\(48, 4\)"):
    matmul(np.ones((48,), np.float32), np.ones((48, 4), np.float32))
  with pytest.raises(ValueError, match=r"batch dimension mismatch.*a.shape\[0\]=2 but "
                                       r"b.shape\[0\]=3"):
    matmul(np.ones((2, 3, 4), np.float32), np.ones((3, 4, 5), np.float32),
           dimension_numbers=(((2,), (1,)), ((0,), (0,))))
  with pytest.raises(ValueError, match="pairs 1 lhs contracting dimension"):
    matmul(np.ones((2, 3), np.float32), np.ones((3, 2), np.float32),
           dimension_numbers=(((1,), (0, 1)), ((), ())))


@pytest.mark.parametrize("bad,match", [
    (dict(a=np.ones((2, 2), np.int32)), "a must be float32"),
    (dict(b=np.ones((2, 2), bool)), "b must be float32"),
    (dict(a=np.ones((2, 2), np.complex64)), "a must be float32"),
    (dict(a=np.ones((2, 2))), "float64"),
    (dict(a="ab"), "a must be a float32.*array, got str"),
    (dict(b=None), "b must be a float32.*array, got NoneType"),
    (dict(grad="exact"), "grad must be one of"),
    (dict(grad=None), "grad must be one of"),
    (dict(rounding="nearest_even"), "unknown rounding"),
], ids=repr)
def test_argument_errors(bad, match):
  args = dict(a=np.ones((2, 2), np.float32), b=np.ones((2, 2), np.float32))
  args.update(bad)
  a, b = args.pop("a"), args.pop("b")
  with pytest.raises((TypeError, ValueError), match=match):
    matmul(a, b, **args)
