"""The exact block dot for MX float formats (MXFP4, MXFP6, MXFP8) and two-level formats
(``nvfp4()``): the reference against exact rational arithmetic, its parts (limbs, digits
rounded once with a sticky bit, tensor scales), and ``DotPolicy(block_dot="exact")`` through
``dot_general`` (N-D operands, the backward GEMMs, 2-D weight tiles, stochastic rounding).
The Pallas kernel: ``tests/pallas/test_block_gemm_limbs.py``."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD

_ref = jax.jit(BS.block_dot_reference, static_argnums=(2, 3, 4))
DN = (((1,), (0,)), ((), ()))


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, _bits(x)), np.where(nan, 0, _bits(y)))


def _f32(x: Fraction) -> np.float32:
  """The float32 nearest (ties to even) to an exact rational, with gradual underflow and
  overflow to inf: integer arithmetic only (``float(Fraction)`` would round twice)."""
  if x == 0:
    return np.float32(0.0)
  a = abs(x)
  e = a.numerator.bit_length() - a.denominator.bit_length()
  if Fraction(2) ** e > a:
    e -= 1
  qe = max(e - 23, -149)  # the quantum of a's binade (or of the subnormals)
  scaled = a / Fraction(2) ** qe
  n, rem = divmod(scaled.numerator, scaled.denominator)
  if 2 * rem > scaled.denominator or (2 * rem == scaled.denominator and n % 2):
    n += 1
  v = Fraction(n) * Fraction(2) ** qe
  s = -1.0 if x < 0 else 1.0
  return np.float32(s * np.inf) if v >= 2**128 else np.float32(s * float(v))


def _flush(v):
  return np.copysign(np.float32(0), v) if abs(v) < 2.0**-126 else v


def _definition(a, b, g, scale=Fraction(1)):
  """The exact block dot by definition: per K-block the rational dot times ``scale`` rounded
  once to float32, flushed below 2**-126; blocks summed in float32, ascending; NaN blocks
  give NaN."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  (M, K), N = a.shape, b.shape[1]
  out = np.zeros((M, N), np.float32)
  for m in range(M):
    for n in range(N):
      s = None
      for b0 in range(0, K, g):
        ks = range(b0, min(b0 + g, K))
        if not all(np.isfinite(a[m, k]) and np.isfinite(b[k, n]) for k in ks):
          p = np.float32(np.nan)
        else:
          p = _flush(_f32(sum((Fraction(a[m, k]) * Fraction(b[k, n]) for k in ks),
                              Fraction(0)) * scale))
        with np.errstate(invalid="ignore", over="ignore"):
          s = p if s is None else _flush(np.float32(s + p))
      out[m, n] = s
  return out


def _wide(rng, shape, spread=6.0):
  return jnp.asarray(rng.normal(size=shape) * np.exp2(rng.normal(size=shape) * spread),
                     jnp.float32)


def _parts(x, fmt, rounding="nearest", key=None):
  """(values, tensor scale) of a two-level format: what dot_general's exact GEMMs see."""
  return (F.quantize(x, BS.two_level_values(fmt), rounding, key=key), BS.tensor_scale(x, fmt))


# one compiled program per format and shape (eagerly, every operation compiles on its own)
_parts_jit = jax.jit(_parts, static_argnums=(1, 2))


def test_significand_specs():
  """bits = emax - emin + man + 1 (+4 for UE4M3 block scales); prec = man + 1 (+4)."""
  specs = {F.mx(F.E2M1FN): (4, 2), F.mx(F.E2M3FN): (6, 4), F.mx(F.E3M2FN): (9, 3),
           F.mx(F.E4M3FN): (18, 4), F.mx(F.E5M2): (32, 3), F.mx("int8"): (7, 7),
           F.nvfp4(): (8, 6), F.nvfp4(tensor_scale=False): (8, 6), F.hbfp(7, 24): (7, 7),
           F.ScaledBlockFormat(F.E2M1FN, scale_fmt="e8m0", tensor_scale=False): (4, 2)}
  for fmt, (bits, prec) in specs.items():
    spec = BS.significand_spec(fmt)
    assert (spec.bits, spec.prec) == (bits, prec), fmt
    assert spec.tensor_scale == (fmt == F.nvfp4())
  assert BS.significand_spec(F.ScaledBlockFormat(scale_fmt="fp32", tensor_scale=False)) is None
  assert BS.significand_spec(F.E4M3) is None
  # every MXFP8 value of a block is its significand times the block's power of two
  x = F.quantize(_wide(np.random.default_rng(0), (8, 64), 8.0), F.mx(F.E5M2, 32, 1))
  split = jax.jit(BS.split_limbs, static_argnums=(1, 2, 3))  # (eagerly: a program per op)
  for W, nl in ((9, 4), (8, 4), (10, 4)):
    limbs, q, _ = split(x.reshape(8, 2, 32), 32, W, nl)
    k = sum(np.asarray(lb, np.float64) * 2.0 ** (W * i) for i, lb in enumerate(limbs))
    assert all(int(np.abs(lb).max()) <= 2**W for lb in limbs)
    back = k * np.exp2(np.asarray(q, np.float64))[..., None]
    assert np.array_equal(back.reshape(8, 64), np.asarray(x, np.float64))


def test_digits_round_once_with_a_sticky_bit():
  """``exact_partial`` = the correctly rounded float32 of ``n * ma * mb * 2**q`` (an int32
  dot times two 24-bit tensor-scale significands: up to 79 bits): random values, exact ties
  (to even), ties with bits below them (up), overflow, subnormal results (flushed, signed)."""
  rng = np.random.default_rng(1)
  n = list(rng.integers(-(2**31) + 1, 2**31, 300)) + list(rng.integers(-2000, 2000, 300))
  ma = list(rng.integers(2**23, 2**24, 600))
  mb = list(rng.integers(2**23, 2**24, 600))
  q = list(rng.integers(-260, 80, 600))
  # crafted: 3 * 2**22 * (2**23 + 1): a tie whose kept LSB is odd (up); (2**23 + 1) *
  # (2**23 - 1) = 2**46 - 1: below a tie by one unit far down (up); n * 2**46 exact
  crafted = [(1, 3 * 2**22, 2**23 + 1, 0), (1, 3 * 2**22, 2**23 + 2**0, -40),
             (2, 2**23 + 2**22 + 1, 2**23, 0), (-1, 2**23 + 1, 2**23 - 1, 5),
             (5, 2**23, 2**23, -200), (-7, 2**23, 2**23 + 3, -215), (1, 2**23, 2**23, 82),
             (3, 2**24 - 1, 2**24 - 1, 33), (1, 2**23, 2**23, -172), (-1, 2**23, 2**23, -173)]
  for c in crafted:
    for v, lst in zip(c, (n, ma, mb, q), strict=True):
      lst.append(v)
  n, ma, mb, q = (np.asarray(v, np.int64) for v in (n, ma, mb, q))
  plan = BS.LimbPlan(10, 1, 1, 4)

  @jax.jit
  def partial(n, ma, mb, q):
    return BS.exact_partial([n], q, plan, BS.tensor_digits(ma, mb, 10))

  got = np.asarray(partial(*(jnp.asarray(v, jnp.int32) for v in (n, ma, mb, q))))
  want = np.array([_flush(_f32(Fraction(int(a)) * int(b) * int(c) * Fraction(2) ** int(e)))
                   for a, b, c, e in zip(n, ma, mb, q, strict=True)], np.float32)
  assert _same(got, want)
  assert np.isinf(got).any() and (_bits(got) == 0x80000000).any() and (got == 0).sum() > 2


@pytest.mark.parametrize("ea,eb", [(F.E2M1FN, F.E2M1FN), (F.E2M3FN, F.E3M2FN),
                                   (F.E4M3FN, F.E4M3FN), (F.E5M2, F.E5M2),
                                   (F.E4M3FN, F.E5M2), (F.E4M3FN, F.E2M1FN)],
                         ids=["mxfp4", "mxfp6", "e4m3", "e5m2", "e4m3xe5m2", "e4m3xe2m1"])
def test_mx_float_reference_is_the_definition(ea, eb):
  """MX blocks of 32 along K (one ragged), values over 2**+-20 within rows: partials exact
  from E2M1's 8-bit products to E5M2's 69-bit sums (limbs), overflow (scales 2**127),
  flushed partials, a NaN block."""
  rng = np.random.default_rng(2)
  x = np.array(_wide(rng, (5, 70)))
  x[0, :32] = rng.normal(size=32) * 2.0**100  # overflowing partials against column 0 of y
  x[1, :32] *= 2.0**-120  # flushed partials
  x[2, 40] = np.inf  # a NaN block
  x[3, :32] = 0.0
  x[3, 5], x[3, 6] = 6.0 * 2.0**10, -(2.0**-20)  # one block: max and a tiny element
  y = np.array(_wide(rng, (70, 3)))
  y[:32, 0] = np.abs(rng.normal(size=32)) * np.sign(x[0, :32]) * 2.0**100
  y[:32, 1] *= 2.0**-20
  fa, fb = F.mx(ea, 32, 1), F.mx(eb, 32, 0)
  a, b = F.quantize(jnp.asarray(x), fa), F.quantize(jnp.asarray(y), fb)
  out = np.asarray(_ref(a, b, 32, BS.significand_bits(fa), BS.significand_bits(fb)))
  assert _same(out, _definition(a, b, 32))
  assert np.isinf(out[0, 0]) and np.isnan(out[2]).all()


def test_nvfp4_reference_is_the_definition():
  """Two-level blocks of 16: per K-block ``fl32(ga * gb * sum qa sb_a qb sb_b)``, rounded
  once (the tensor scales' 48-bit product inside the rounding), and without tensor scales;
  E8M0 block scales; extremes of the tensor scale (2**-121 floor, near FLT_MAX)."""
  rng = np.random.default_rng(3)
  x, w = np.array(_wide(rng, (6, 40), 3.0)), np.array(_wide(rng, (40, 4), 3.0))
  x[1] *= 1e-37  # block scales clamped at UE4M3's 2**-6: zero elements, +0.0 partials
  fa, fb = F.nvfp4(axis=1), F.nvfp4(axis=0)
  for xs, ws in ((x, w), (x * 1e-30, w * 1e-8), (x * 1e30, w * 1e9)):
    (a, ga), (b, gb) = (_parts_jit(jnp.asarray(xs, jnp.float32), fa),
                        _parts_jit(jnp.asarray(ws), fb))
    out = _ref(a, b, 16, 8, 8, (ga, gb))
    assert _same(out, _definition(a, b, 16, Fraction(float(ga)) * Fraction(float(gb))))
  # (jitted: eagerly, each operation of tensor_scale would compile on its own)
  tiny = jax.jit(BS.tensor_scale, static_argnums=1)(jnp.full(4, 1e-38, jnp.float32), fa)
  assert float(tiny) == 2.0**-121
  b = jax.jit(F.quantize, static_argnums=1)(jnp.asarray(w), F.nvfp4(axis=0, tensor_scale=False))
  for fmt in (F.nvfp4(axis=1, tensor_scale=False),
              F.ScaledBlockFormat(F.E2M1FN, axis=1, scale_fmt="e8m0", tensor_scale=False)):
    a = jax.jit(F.quantize, static_argnums=1)(jnp.asarray(x), fmt)
    assert _same(_ref(a, b, 16, BS.significand_bits(fmt), 8), _definition(a, b, 16))

  # the values of the two-level parts are the format's elements times its block scales
  @jax.jit
  def parts_and_encode(x):
    q, s, g = fa.encode(x)
    return _parts(x, fa), q * jnp.repeat(s, 16, axis=1)[:, :40], g

  (a, ga), want_a, g = parts_and_encode(jnp.asarray(x))
  assert _same(a, want_a) and _same(ga, g)


def test_two_level_parts_keep_the_noise_and_nan():
  """Stochastic elements of the parts are encode's with the same key; a tensor holding inf
  has a NaN scale and NaN partials."""
  x = _wide(np.random.default_rng(4), (4, 32), 2.0)
  key = jax.random.key(7)

  @jax.jit  # one program (eagerly, every operation would compile on its own)
  def run(x, key):
    q, s, g = F.nvfp4().encode(x, "stochastic", key=key)
    a, ga = _parts(x, F.nvfp4(), "stochastic", key)
    bad, gbad = _parts(x.at[0, 0].set(jnp.inf), F.nvfp4())
    return (a, ga), (q * jnp.repeat(s, 16, axis=1), g), (bad, gbad), _ref(bad, a.T, 16, 8, 8,
                                                                          (gbad, ga))

  (a, ga), (want_a, g), (bad, gbad), out = run(x, key)
  assert _same(a, want_a) and _same(ga, g)
  assert np.isnan(gbad) and np.isnan(np.asarray(bad)).all()
  assert np.isnan(np.asarray(out)).all()


def test_policy_and_dispatch_validation():
  for fmt in (F.mx(F.E4M3FN), F.mx(F.E5M2), F.nvfp4(), F.nvfp4(tile=16)):
    assert jaxlp.DotPolicy(lhs=fmt, rhs=fmt, grad=fmt, block_dot="exact")
  with pytest.raises(ValueError, match="slot 'lhs' is ScaledBlockFormat.*scale_fmt='fp32'"):
    f = F.ScaledBlockFormat(scale_fmt="fp32", tensor_scale=False)
    jaxlp.DotPolicy(lhs=f, rhs=f, grad=f, block_dot="exact")
  BS.check_exact(2**22, 40, 40, limbs=True)
  with pytest.raises(ValueError, match="at most 40 bits, got K-block 32 with 41-"):
    BS.check_exact(32, 41, 4, limbs=True)
  with pytest.raises(ValueError, match="impl='xla_int8' needs <= 7-bit"):
    BD.block_dot(jnp.ones((2, 32)), jnp.ones((32, 2)), 32, 18, 18, impl="xla_int8")
  policy = jaxlp.DotPolicy(lhs=F.nvfp4(), rhs=F.nvfp4(), grad=F.nvfp4(), block_dot="exact")
  with pytest.raises(NotImplementedError, match="in jaxlp.dot_general only"):
    jaxlp.conv_general_dilated(policy)(jnp.ones((1, 16, 4, 4)), jnp.ones((16, 16, 1, 1)),
                                       (1, 1), "VALID")


def _vjp(policy, x, w, dy, key=None, wrt_w=True):
  """jit(x, w, dy -> (y, dx[, dw])) through ``jaxlp.dot_general(policy)``: the forward GEMM
  and the backward GEMMs of a given cotangent (with ``wrt_w=False`` the lhs's only)."""
  f = jaxlp.dot_general(policy, key=key)

  @jax.jit
  def run(x, w, dy):
    if not wrt_w:
      y, pull = jax.vjp(lambda a: f(a, w, DN), x)
      return (y, *pull(dy))
    y, pull = jax.vjp(lambda a, b: f(a, b, DN), x, w)
    return (y, *pull(dy))

  return run(x, w, dy)


def _scale(*gs):
  """The product of tensor scales (float32 scalars) as an exact rational."""
  out = Fraction(1)
  for g in gs:
    out *= Fraction(float(g))
  return out


# The policy GEMMs below are compared with :func:`_definition` (exact rationals, in numpy) on
# the quantized operands: the definition that block_dot_reference (the jnp reference the
# Pallas kernels are checked against) equals in the tests above. One compiled program of
# quantized parts per test instead of a compiled reference of the three GEMMs.
def test_nvfp4_policy_gemms():
  """fwd, dlhs and drhs of an NVFP4 policy in the recipe's shape -- stochastic gradients,
  weights and activations re-quantized along each backward GEMM's contraction -- are the
  definition on the operands' parts (the same keys); the drhs GEMM reuses the gradient
  blocked along N, so it contracts the tokens in K-blocks of 1."""
  rng = np.random.default_rng(5)
  x, w, dy = _wide(rng, (8, 48), 2.0), _wide(rng, (48, 20), 2.0), _wide(rng, (8, 20), 2.0)
  f = F.nvfp4()
  policy = jaxlp.DotPolicy(lhs=f, rhs=f, grad=jaxlp.Quant(f, "stochastic"), dlhs_rhs=f,
                           drhs_lhs=f, block_dot="exact")
  key = jax.random.key(3)
  y, gx, gw = _vjp(policy, x, w, dy, key=key)

  @jax.jit  # the parts as one program
  def parts(x, w, dy, key):
    slot_key = jax.random.fold_in(key, 2)  # the "grad" slot
    return (_parts(x, F.nvfp4(axis=1)), _parts(w, F.nvfp4(axis=0)),
            _parts(dy, F.nvfp4(axis=1), "stochastic", slot_key), _parts(w, F.nvfp4(axis=1)),
            _parts(x, F.nvfp4(axis=0)))

  (a, ga), (b, gb), (gq, gg), (wq, gw_), (xq, gx_) = parts(x, w, dy, key)
  assert _same(y, _definition(a, b, 16, _scale(ga, gb))), "fwd"
  assert _same(gx, _definition(gq, np.asarray(wq).T, 16, _scale(gg, gw_))), "dlhs"
  assert _same(gw, _definition(np.asarray(xq).T, gq, 1, _scale(gx_, gg))), "drhs"


def test_nvfp4_weight_tiles_and_nd_operands():
  """2-D 16 x 16 weight tiles: K-blocks of 16 in the forward GEMM (tile rows) and of 16 and
  4 in the dlhs GEMM (tile columns of a 20-wide weight, reused from the forward pass); batch
  dimensions of a (2, 4, 48) activation are one GEMM per batch index with the tensors' own
  scales. (An N-D operand without batch dimensions is its 2-D reshape for every block_dot
  mode: tests/ops/test_dot_general_nd.py.)"""
  rng = np.random.default_rng(6)
  x, w, dy = _wide(rng, (8, 48), 2.0), _wide(rng, (48, 20), 2.0), _wide(rng, (8, 20), 2.0)
  f, ft = F.nvfp4(), F.nvfp4(tile=16)
  policy = jaxlp.DotPolicy(lhs=f, rhs=ft, grad=f, block_dot="exact")
  # the weight tiles are operands of fwd and dlhs only: no weight gradient (the drhs GEMM of
  # NVFP4 operands: test_nvfp4_policy_gemms)
  y, gx = _vjp(policy, x, w, dy, wrt_w=False)
  # batch dimensions ('bik,bkn->bin'): one GEMM per batch index, with the tensors' own scales
  x3, wb = x.reshape(2, 4, 48), _wide(rng, (2, 48, 20), 2.0)
  dot = jaxlp.dot_general(policy)

  @jax.jit  # the batched GEMM and the parts as one program
  def run(x, w, dy, x3, wb):
    yb = dot(x3, wb, (((2,), (1,)), ((0,), (0,))))
    return (yb, _parts(x, F.nvfp4(axis=1)), _parts(w, ft), _parts(dy, F.nvfp4(axis=1)),
            _parts(x3, F.nvfp4(axis=2)), _parts(wb, ft))

  yb, (a, ga), (b, gb), (gq, gg), (a3, ga3), (b3, gb3) = run(x, w, dy, x3, wb)
  assert _same(y, _definition(a, b, 16, _scale(ga, gb))), "fwd"
  assert _same(gx, _definition(gq, np.asarray(b).T, 16, _scale(gg, gb))), "dlhs"
  for i in range(2):
    assert _same(yb[i], _definition(a3[i], b3[i], 16, _scale(ga3, gb3))), f"batch index {i}"


def test_mxfp8_policy_gemms():
  """MXFP8 (E4M3FN forward, E5M2 gradients): all three GEMMs are the definition (limbs)."""
  rng = np.random.default_rng(7)
  x, w, dy = _wide(rng, (6, 64), 3.0), _wide(rng, (64, 40), 3.0), _wide(rng, (6, 40), 1.0)
  policy = jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2, block_dot="exact")
  y, gx, gw = _vjp(policy, x, w, dy)

  @jax.jit  # the quantized operands as one program
  def parts(x, w, g):
    return (F.quantize(x, F.mx(F.E4M3FN, 32, 1)), F.quantize(w, F.mx(F.E4M3FN, 32, 0)),
            F.quantize(g, F.mx(F.E5M2, 32, 1)), F.quantize(w, F.mx(F.E4M3FN, 32, 1)),
            F.quantize(x, F.mx(F.E4M3FN, 32, 0)), F.quantize(g, F.mx(F.E5M2, 32, 0)))

  xa, wb, ga, wa, xb, gb = (np.asarray(v) for v in parts(x, w, dy))
  assert _same(y, _definition(xa, wb, 32)), "fwd"
  assert _same(gx, _definition(ga, wa.T, 32)), "dlhs"
  assert _same(gw, _definition(xb.T, gb, 6)), "drhs"  # M = 6: one block
