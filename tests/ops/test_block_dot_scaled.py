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
  for W, nl in ((9, 4), (8, 4), (10, 4)):
    limbs, q, _ = BS.split_limbs(x.reshape(8, 2, 32), 32, W, nl)
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
  assert float(BS.tensor_scale(jnp.float32(1e-38) * jnp.ones(4), fa)) == 2.0**-121
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


def _vg(policy, x, w, dn=DN, key=None, argnums=(0, 1)):
  """The forward output and the gradients of sum(sin(y)). The output is returned itself
  (not only the loss) so the forward check compares bits, not a sum whose reduction order
  XLA may choose differently in two programs."""
  f = jaxlp.dot_general(policy, key=key)

  def loss(x, w):
    y = f(x, w, dn)
    return jnp.sum(jnp.sin(y)), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(x, w)
  return y, grads


def test_nvfp4_policy_gemms():
  """fwd, dlhs and drhs of an NVFP4 policy in the recipe's shape -- stochastic gradients,
  weights and activations re-quantized along each backward GEMM's contraction -- are the
  reference on the operands' parts (the same keys); the drhs GEMM reuses the gradient
  blocked along N, so it contracts the tokens in K-blocks of 1."""
  rng = np.random.default_rng(5)
  x, w = _wide(rng, (8, 48), 2.0), _wide(rng, (48, 20), 2.0)
  f = F.nvfp4()
  policy = jaxlp.DotPolicy(lhs=f, rhs=f, grad=jaxlp.Quant(f, "stochastic"), dlhs_rhs=f,
                           drhs_lhs=f, block_dot="exact")
  key = jax.random.key(3)
  y_out, (gx, gw) = _vg(policy, x, w, key=key)

  @jax.jit  # the reference as one program
  def want(x, w, key):
    (a, ga), (b, gb) = _parts(x, F.nvfp4(axis=1)), _parts(w, F.nvfp4(axis=0))
    y = _ref(a, b, 16, 8, 8, (ga, gb))
    slot_key = jax.random.fold_in(key, 2)  # the "grad" slot
    gq, gg = _parts(jnp.cos(y), F.nvfp4(axis=1), "stochastic", slot_key)
    (wq, gw_) = _parts(w, F.nvfp4(axis=1))
    (xq, gx_) = _parts(x, F.nvfp4(axis=0))
    return y, _ref(gq, wq.T, 16, 8, 8, (gg, gw_)), _ref(xq.T, gq, 1, 8, 8, (gx_, gg))

  y, want_gx, want_gw = want(x, w, key)
  assert _same(y_out, y)
  assert _same(gx, want_gx)
  assert _same(gw, want_gw)


def test_nvfp4_weight_tiles_and_nd_operands():
  """2-D 16 x 16 weight tiles: K-blocks of 16 in the forward GEMM (tile rows) and of 16 and
  4 in the dlhs GEMM (tile columns of a 20-wide weight, reused from the forward pass); batch
  dimensions of a (2, 4, 48) activation are one GEMM per batch index with the tensors' own
  scales. (An N-D operand without batch dimensions is its 2-D reshape for every block_dot
  mode: tests/ops/test_dot_general_nd.py.)"""
  rng = np.random.default_rng(6)
  x, w = _wide(rng, (8, 48), 2.0), _wide(rng, (48, 20), 2.0)
  f, ft = F.nvfp4(), F.nvfp4(tile=16)
  policy = jaxlp.DotPolicy(lhs=f, rhs=ft, grad=f, block_dot="exact")
  # the weight tiles are operands of fwd and dlhs only: no weight gradient (the drhs GEMM of
  # NVFP4 operands: test_nvfp4_policy_gemms)
  y_out, (gx,) = _vg(policy, x, w, argnums=(0,))
  # batch dimensions ('bik,bkn->bin'): one GEMM per batch index, with the tensors' own scales
  x3, wb = x.reshape(2, 4, 48), _wide(rng, (2, 48, 20), 2.0)
  dot = jaxlp.dot_general(policy)

  @jax.jit  # the N-D GEMMs and the reference as one program
  def run(x, w, x3, wb):
    (a, ga), (b, gb) = _parts(x, F.nvfp4(axis=1)), _parts(w, ft)
    y = _ref(a, b, 16, 8, 8, (ga, gb))
    gq, gg = _parts(jnp.cos(y), F.nvfp4(axis=1))
    yb = dot(x3, wb, (((2,), (1,)), ((0,), (0,))))
    (a3, ga3), (b3, gb3) = _parts(x3, F.nvfp4(axis=2)), _parts(wb, ft)
    # one compiled copy of the reference, run per batch index
    want_yb = jax.lax.map(lambda ab: _ref(*ab, 16, 8, 8, (ga3, gb3)), (a3, b3))
    return y, _ref(gq, b.T, 16, 8, 8, (gg, gb)), yb, want_yb

  y, want_gx, yb, want_yb = run(x, w, x3, wb)
  assert _same(y_out, y)
  assert _same(gx, want_gx)
  for i in range(2):
    assert _same(yb[i], want_yb[i])


def test_mxfp8_policy_gemms():
  """MXFP8 (E4M3FN forward, E5M2 gradients): all three GEMMs are the reference (limbs)."""
  rng = np.random.default_rng(7)
  x, w = _wide(rng, (6, 64), 3.0), _wide(rng, (64, 40), 3.0)
  policy = jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2, block_dot="exact")
  y_out, (gx, gw) = _vg(policy, x, w)

  @jax.jit  # the reference as one program
  def want(x, w):
    y = _ref(F.quantize(x, F.mx(F.E4M3FN, 32, 1)), F.quantize(w, F.mx(F.E4M3FN, 32, 0)), 32,
             18, 18)
    g = jnp.cos(y)
    dx = _ref(F.quantize(g, F.mx(F.E5M2, 32, 1)), F.quantize(w, F.mx(F.E4M3FN, 32, 1)).T, 32,
              32, 18)
    dw = _ref(F.quantize(x, F.mx(F.E4M3FN, 32, 0)).T, F.quantize(g, F.mx(F.E5M2, 32, 0)), 6,
              18, 32)  # M = 6: one block
    return y, dx, dw

  y, dx, dw = want(x, w)
  assert _same(y_out, y)
  assert _same(gx, dx) and _same(gw, dw)
