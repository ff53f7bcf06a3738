"""The exact block dot (``DotPolicy(block_dot="exact")``; definition in
``jaxlp/formats/_block_dot.py``, dispatch in ``jaxlp/ops/_block_dot.py``): its definition
checked with rational arithmetic, the exact scaling, the XLA int8 formulation, and the policy
wiring through ``custom_vjp`` (forward, dlhs and drhs GEMMs)."""

import dataclasses
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD

# compiled as one program each (eagerly, every operation would compile on its own)
_ref = jax.jit(BS.block_dot_reference, static_argnums=(2, 3, 4))
_xla_int8 = jax.jit(BD.block_dot_xla_int8, static_argnums=(2, 3, 4))

DN = (((1,), (0,)), ((), ()))


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  both_nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(both_nan, 0, _bits(x)), np.where(both_nan, 0, _bits(y)))


def _definition(a, b, g):
  """The bits by definition: per K-block the exact rational dot rounded once to float32
  (numpy's correctly rounded float64 -> float32 of an exact float64), flushed below
  2**-126; blocks summed in float32 in ascending order from the first partial (flushed);
  NaN blocks give NaN."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  M, K = a.shape
  N = b.shape[1]
  out = np.zeros((M, N), np.float32)

  def flush(v):
    return np.copysign(np.float32(0), v) if abs(v) < 2.0**-126 else v

  for m in range(M):
    for n in range(N):
      s = None
      for b0 in range(0, K, g):
        ks = range(b0, min(b0 + g, K))
        if not all(np.isfinite(a[m, k]) and np.isfinite(b[k, n]) for k in ks):
          p = np.float32(np.nan)
        else:
          exact = sum(Fraction(a[m, k]) * Fraction(b[k, n]) for k in ks)
          with np.errstate(over="ignore"):
            p = np.float32(float(exact)) if abs(exact) < 2**1000 else np.float32(
                np.sign(exact) * np.inf)
          p = flush(p)
        with np.errstate(invalid="ignore", over="ignore"):
          s = p if s is None else flush(np.float32(s + p))
      out[m, n] = s
  return out


def _wide(rng, shape, spread=6.0):
  return jnp.asarray(rng.normal(size=shape) * np.exp2(rng.normal(size=shape) * spread),
                     jnp.float32)


def test_scale_exact_is_correctly_rounded_and_flushed():
  rng = np.random.default_rng(0)
  n = np.concatenate([rng.integers(-2**31 + 1, 2**31 - 1, 4000), rng.integers(-5000, 5000, 4000),
                      [0, 1, -1, 2**31 - 1, -(2**31 - 1), 2**24 + 1, 2**25 - 1, 3 << 24, 5, -3]])
  q = rng.integers(-330, 260, n.size)
  # hand-picked: a subnormal tie region, exactly 2**-126, just below it, overflow
  q[-10:] = [-149, -149, -150, -180, 120, -170, 0, -174, -128, 260]
  n, q = n.astype(np.int32), q.astype(np.int32)
  got = np.asarray(jax.jit(BS.scale_exact)(jnp.asarray(n), jnp.asarray(q)))
  with np.errstate(over="ignore"):
    ref = (n.astype(np.float64) * np.ldexp(1.0, q.astype(np.int64))).astype(np.float32)
  ref = np.where(np.abs(ref) < np.float32(2**-126), np.copysign(np.float32(0), ref), ref)
  assert np.array_equal(_bits(got), _bits(ref))
  assert np.isnan(BS.scale_exact(jnp.int32(3), jnp.int32(BS.NAN_Q)))
  assert _bits(BS.scale_exact(jnp.int32(-1), jnp.int32(-140))) == 0x80000000  # -0.0


@pytest.mark.parametrize("fmt,fb,bits,g", [
    (F.hbfp(7, 24), F.hbfp(7, 24), 7, 24),
    (F.BlockFormat(7, tile=(4, 8)), F.BlockFormat(7, tile=(8, 4)), 7, 8),
    (F.BlockFormat(5, axis=1, block_size=16), F.BlockFormat(5, axis=0, block_size=16), 5, 16),
    (F.hbfp(11, 8), F.hbfp(11, 8), 11, 8)], ids=["hbfp8", "tiles", "axis", "hbfp12"])
def test_reference_is_the_definition(fmt, fb, bits, g):
  rng = np.random.default_rng(1)
  a = F.quantize(_wide(rng, (5, 50)), fmt)
  b = F.quantize(_wide(rng, (50, 4)), fb)
  ref = _ref(a, b, g, bits, bits)
  assert _same(ref, _definition(a, b, g))
  if bits <= 7:
    assert _same(_xla_int8(a, b, g, bits, bits), ref)


def test_mxint8_significands_and_definition():
  rng = np.random.default_rng(2)
  x = _wide(rng, (6, 64), 3.0)
  x = x.at[0, :32].set(jnp.linspace(-63.97, 30.0, 32))  # -63.97 / 2**-1 -> -128
  a = F.quantize(x, F.mx("int8", 32, axis=1))
  b = F.quantize(_wide(rng, (64, 3), 3.0), F.mx("int8", 32, axis=0))
  k, q = jax.jit(BS.split_significands, static_argnums=(1, 2))(a, 32, 7)  # (eagerly: per op)
  assert int(k.min()) >= -128 and int(k.max()) <= 127 and int(k.min()) == -128
  back = np.asarray(k, np.float64) * np.exp2(np.asarray(q, np.float64))[..., None]
  assert np.array_equal(back.reshape(6, 64), np.asarray(a, np.float64))
  ref = _ref(a, b, 32, 7, 7)
  assert _same(ref, _definition(a, b, 32))
  assert _same(_xla_int8(a, b, 32, 7, 7), ref)


def test_range_overflow_flush_and_nan():
  """Rows x columns of one GEMM with K-blocks of 4 (the second block is zero except in
  row 2): overflow, a partial flushed to -0.0 (then -0 + +0 = +0), a NaN block, and a
  tiny but normal partial."""
  a = np.zeros((4, 8), np.float32)
  b = np.zeros((8, 4), np.float32)
  a[0, :4], b[:4, 0] = 2.0**100, 2.0**100  # 4 * 2**200 -> inf
  a[1, :4], b[:4, 1] = -(2.0**-70), 2.0**-60  # -2**-128 -> -0.0
  a[2, :], a[2, 5] = 1.0, np.inf  # the format turns block 1 of row 2 into NaN
  a[3, :4], b[:4, 3] = 2.0**-60, 2.0**-60  # 2**-118: kept
  a = F.quantize(jnp.asarray(a), F.BlockFormat(7, axis=1, block_size=4))
  b = F.quantize(jnp.asarray(b), F.BlockFormat(7, axis=0, block_size=4))
  out = np.asarray(_ref(a, b, 4, 7, 7))
  assert _same(out, _definition(a, b, 4))
  assert out[0, 0] == np.inf and _bits(out[1, 1]) == 0 and np.isnan(out[2]).all()
  assert out[3, 3] == np.float32(2.0**-118)
  assert _bits(BS.scale_exact(jnp.int32(-4), jnp.int32(-130))) == 0x80000000  # -0.0


def test_blocks_and_bounds():
  assert BS.contraction_blocks(24, 24, 100) == 24
  assert BS.contraction_blocks(100, 24, 100) == 24  # whole axis imposes nothing
  assert BS.contraction_blocks(24, 16, 100) == 8
  assert BS.contraction_blocks(1, 24, 100) == 1
  assert BS.contraction_blocks(300, 500, 100) == 100
  BS.check_exact(2**17 - 1, 7, 7)
  with pytest.raises(ValueError, match="K-block 131072 with 7- and 7-bit"):
    BS.check_exact(2**17, 7, 7)
  with pytest.raises(ValueError, match="impl='nope'"):
    BD.block_dot(jnp.ones((2, 2)), jnp.ones((2, 2)), 2, 7, 7, impl="nope")


def test_policy_validation():
  with pytest.raises(ValueError, match="block_dot='fast' not in"):
    jaxlp.DotPolicy(lhs=F.hbfp(7, 24), rhs=F.hbfp(7, 24), block_dot="fast")
  with pytest.raises(ValueError, match="exclusive"):
    jaxlp.DotPolicy(lhs=F.hbfp(7), rhs=F.hbfp(7), grad=F.hbfp(7), block_dot="exact",
                    fwd_acc=jaxlp.Accum(acc=F.BF16))
  with pytest.raises(ValueError, match="the fwd GEMM's slot 'rhs' is None"):
    jaxlp.hbfp_policy(7, 24, block_dot="exact")  # per-sample: fp32 weights
  with pytest.raises(ValueError, match="the dlhs GEMM's slot 'grad' is None"):
    jaxlp.DotPolicy(lhs=F.hbfp(7), rhs=F.hbfp(7), block_dot="exact")
  with pytest.raises(ValueError, match="fp8 twin.*slot 'lhs' is BlockFormat"):
    jaxlp.hbfp_policy(7, 24, "tiled", block_dot="fp8")
  with pytest.raises(ValueError, match="integer significands"):
    jaxlp.float_policy(F.E4M3, F.E5M2, block_dot="exact")
  p = jaxlp.mx_policy("int8", block_dot="exact")
  assert p.block_dot == "exact" and hash(p)
  # the GPU implementation is a field of the policy (no module state): checked, hashed
  assert (p.gpu_impl, p.gpu_route, p.fp8_gpu_impl) == ("auto", "auto", "pallas")
  for field, ok, bad in (("gpu_impl", "xla_int8", "cublas"), ("gpu_route", "int8", "bf16"),
                         ("fp8_gpu_impl", "xla", "auto")):
    q = dataclasses.replace(p, **{field: ok})
    assert q != p and hash(q) != hash(p)
    with pytest.raises(ValueError, match=f"DotPolicy: {field}={bad!r} not in"):
      dataclasses.replace(p, **{field: bad})
  with pytest.raises(ValueError, match="block_dot: gpu_impl='nope'"):
    BD.block_dot(jnp.ones((2, 2)), jnp.ones((2, 2)), 2, 7, 7, gpu_impl="nope")
  with pytest.raises(ValueError, match="fp8_dot: gpu_impl='int8'"):
    BD.fp8_dot(jnp.ones((2, 32)), jnp.ones((32, 2)), F.mx(F.E4M3FN), F.mx(F.E4M3FN), 32,
               gpu_impl="int8")


def _grads(policy, x, w, dn=DN):
  f = jaxlp.dot_general(policy)
  return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(f(x, w, dn))),
                                    argnums=(0, 1)))(x, w)


def _vjp(policy, x, w, dy, dn=DN):
  """The forward GEMM and both backward GEMMs of a given cotangent, as one program."""
  f = jaxlp.dot_general(policy)

  @jax.jit
  def run(x, w, dy):
    y, pull = jax.vjp(lambda a, b: f(a, b, dn), x, w)
    return (y, *pull(dy))

  return run(x, w, dy)


# The policy GEMMs below are compared with _definition (exact rationals, in numpy) on the
# quantized operands -- the definition that block_dot_reference equals in the tests above --
# with the quantized operands computed by one program per test.
@pytest.mark.parametrize("transpose", [False, True], ids=["xw", "xTwT"])
def test_dot_general_exact_gemms(transpose):
  """fwd, dlhs and drhs go through the block dot with the forward-quantized operands and
  the quantized gradient (hbfp tiles: K-blocks of 24 in all three GEMMs)."""
  rng = np.random.default_rng(3)
  x, w, dy = _wide(rng, (30, 50), 2.0), _wide(rng, (50, 20), 2.0), _wide(rng, (30, 20), 2.0)
  fmt = F.hbfp(7, 24)
  policy = jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact")
  dn = DN
  xa, wa, dya = x, w, dy
  if transpose:  # (the same GEMMs on the transposed operands, the output transposed too)
    xa, wa, dn, dya = x.T, w.T, (((0,), (1,)), ((), ())), dy

  @jax.jit  # the quantized operands as one program
  def parts(x, w, dy):
    if transpose:
      return F.quantize(x.T, fmt).T, F.quantize(w.T, fmt).T, F.quantize(dy, fmt)
    return F.quantize(x, fmt), F.quantize(w, fmt), F.quantize(dy, fmt)

  out, gx, gw = _vjp(policy, xa, wa, dya, dn)
  xq, wq, gq = (np.asarray(v) for v in parts(x, w, dy))
  assert _same(out, _definition(xq, wq, 24)), "fwd"
  dx, dw = _definition(gq, wq.T, 24), _definition(xq.T, gq, 24)
  assert _same(gx, dx.T if transpose else dx), "dlhs"
  assert _same(gw, dw.T if transpose else dw), "drhs"


def test_dot_general_mxint8_requantizes_along_each_contraction():
  rng = np.random.default_rng(4)
  x, w, dy = _wide(rng, (16, 64), 2.0), _wide(rng, (64, 40), 2.0), _wide(rng, (16, 40), 1.0)
  policy = jaxlp.mx_policy("int8", 32, block_dot="exact")
  y, gx, gw = _vjp(policy, x, w, dy)

  @jax.jit  # the quantized operands as one program
  def parts(x, w, g):
    return (F.quantize(x, F.mx("int8", 32, 1)), F.quantize(w, F.mx("int8", 32, 0)),
            F.quantize(g, F.mx("int8", 32, 1)), F.quantize(w, F.mx("int8", 32, 1)),
            F.quantize(x, F.mx("int8", 32, 0)), F.quantize(g, F.mx("int8", 32, 0)))

  xa, wb, ga, wa, xb, gb = (np.asarray(v) for v in parts(x, w, dy))
  assert _same(y, _definition(xa, wb, 32)), "fwd"
  assert _same(gx, _definition(ga, wa.T, 32)), "dlhs"
  assert _same(gw, _definition(xb.T, gb, 16)), "drhs"  # M=16: one block


def test_exact_differs_from_emulation_only_in_rounding():
  """K-blocks scaled by 2**U{-12..12}: sums crossing blocks round, so exact and emulation
  differ (in the last bits) -- and exact is the definition computed in float64."""
  rng = np.random.default_rng(5)
  scale = np.repeat(np.exp2(rng.integers(-12, 13, size=20)), 24)
  x = jnp.asarray(rng.normal(size=(64, 480)) * scale, jnp.float32)
  w = jnp.asarray(rng.normal(size=(480, 32)), jnp.float32)
  exact, emu = (jax.jit(jaxlp.dot_general(jaxlp.hbfp_policy(7, 24, "tiled", block_dot=m)),
                        static_argnums=2)(x, w, DN) for m in ("exact", None))
  exact, emu = np.asarray(exact), np.asarray(emu)
  assert 0 < np.mean(exact != emu) and np.abs(exact - emu).max() < 1e-5 * np.abs(emu).max()
  fmt = F.hbfp(7, 24)
  a, b = np.asarray(F.quantize(x, fmt), np.float64), np.asarray(F.quantize(w, fmt), np.float64)
  blocks = [a[:, i:i + 24] @ b[i:i + 24] for i in range(0, 480, 24)]  # exact: <= 2**24 terms
  s = blocks[0].astype(np.float32)
  for p in blocks[1:]:
    s = (s + p.astype(np.float32)).astype(np.float32)
  assert np.array_equal(s, exact)


def test_unsupported_ops_refuse():
  policy = jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact")
  conv = jaxlp.conv_general_dilated(policy)
  with pytest.raises(NotImplementedError, match="feature_group_count=1"):
    conv(jnp.ones((1, 4, 5, 5)), jnp.ones((3, 2, 3, 3)), (1, 1), "VALID", feature_group_count=2)
  wide = jaxlp.hbfp_policy(15, 0, "tiled", block_dot="exact")
  with pytest.raises(ValueError, match="fwd GEMM"):
    jaxlp.dot_general(wide)(jnp.ones((2, 8)), jnp.ones((8, 2)), DN)


@pytest.mark.usefixtures("fast_compile")  # close to the emulation, finite: any level
def test_fp8_mode_is_close_and_differentiable():
  rng = np.random.default_rng(6)
  x, w = _wide(rng, (16, 64), 1.0), _wide(rng, (64, 8), 1.0)
  policy = jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2, block_dot="fp8")
  (v8, (gx8, gw8)) = _grads(policy, x, w)
  (v, (gx, gw)) = _grads(jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2), x, w)
  for a, b in ((v8, v), (gx8, gx), (gw8, gw)):
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
  # float policy: per-tensor scales (forward only)
  y8, y = (jax.jit(jaxlp.dot_general(jaxlp.float_policy(F.E4M3, F.E5M2, block_dot=m)),
                   static_argnums=2)(x, w, DN) for m in ("fp8", None))
  np.testing.assert_allclose(y8, y, rtol=1e-5, atol=1e-5 * float(jnp.abs(y).max()))


def test_xla_int8_unrolled_accumulation_keeps_the_bits():
  """``_scan_blocks`` steps :data:`SCAN_UNROLL` K-blocks at a time: the same declared
  accumulation for a block count that leaves a remainder (20: 1 + 16 + 3) and for 2 and 1."""
  rng = np.random.default_rng(9)
  assert BD.SCAN_UNROLL == 16
  for nb in (20, 2, 1):  # (against the definition: block_dot_reference's, checked above)
    a = F.quantize(_wide(rng, (6, 8 * nb)), F.BlockFormat(7, axis=1, block_size=8))
    b = F.quantize(_wide(rng, (8 * nb, 5)), F.BlockFormat(7, axis=0, block_size=8))
    assert _same(_xla_int8(a, b, 8, 7, 7), _definition(a, b, 8)), nb


@pytest.mark.parametrize("M,K,N,g,split", [
    (576, 131072, 64, 1024, True),  # ResNet-18 weight gradients (batch 128): 5 tiles
    (27, 131072, 64, 1024, True),
    (1152, 32768, 128, 256, True),
    (131072, 1296, 64, 24, False),  # forward / input gradients: 1024 tiles
    (4608, 2048, 512, 16, False),
    (2304, 8192, 256, 64, False),  # 36 tiles
    (128, 10, 512, 10, False),  # one K-block: nothing to split
])
def test_gpu_auto_splits_the_few_tile_gemms(M, K, N, g, split):
  """``gpu_impl="auto"`` (the default): the rule, and what the CUDA lowering then holds (one
  batched int8 dot and no Pallas kernel, or the kernel); the CPU lowering is the reference
  either way."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pallas"))
  import cuda_lowering as CL  # noqa: PLC0415

  assert BD.splits_k_blocks(M, N, K, g) == split
  if M * K > 2**24:  # the lowering of the largest shapes: the rule alone
    return
  a, b = jax.ShapeDtypeStruct((M, K), jnp.float32), jax.ShapeDtypeStruct((K, N), jnp.float32)
  text, triton = CL.lower_for_cuda(lambda a, b: BD.block_dot_gpu_auto(a, b, g, 7, 7), a, b)
  int8_dot = "xi8>" in text and "stablehlo.dot_general" in text
  assert (int8_dot, bool(triton)) == ((True, False) if split else (False, True))


@pytest.mark.parametrize("policy", [
    dataclasses.replace(jaxlp.mx_policy("int8", 32, block_dot="exact"), gpu_impl="pallas"),
    jaxlp.mx_policy("int8", 32, block_dot="exact"),
    jaxlp.mx_policy(F.E4M3FN, 32, block_dot="fp8"),
], ids=["exact_pallas", "exact_auto", "fp8"])
def test_batched_dot_general_lowers_for_cuda(policy):
  """An attention-shaped dot ('bqhd,bkhd->bhqk': batch dims in the middle) runs one 2-D GEMM
  per batch index (``jax.vmap``): under value_and_grad it lowers for CUDA with the policy's
  GPU implementation -- the block GEMM kernels batched by Pallas, or batched int8 dots --
  and no op Triton cannot compile (checked on the CPU; not run on a GPU here)."""
  import os  # noqa: PLC0415
  import sys  # noqa: PLC0415

  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pallas"))
  import cuda_lowering as CL  # noqa: PLC0415

  dot = jaxlp.dot_general(policy)
  attn = (((3,), (3,)), ((0, 2), (0, 2)))
  q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.float32)
  loss = lambda q, k: jnp.sum(dot(q, k, attn))
  text, mods = CL.lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1)), q, q)
  assert all(not CL.illegal_ops(m) for m in mods)
  names = CL.kernel_names(mods)
  if policy.block_dot == "fp8":
    assert "jaxlp_fp8_block_gemm" in names
  elif policy.gpu_impl == "pallas":
    assert "jaxlp_block_gemm" in names
  else:  # few tiles, 2 K-blocks: batched XLA int8 dots
    assert not mods and "xi8>" in text
