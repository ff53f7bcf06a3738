"""``block_dot="exact"`` / ``"fp8"`` for convolutions (``jaxlp/ops/_conv.py``): the three GEMMs
on im2col matrices, checked bit for bit against an independent numpy im2col fed to the jnp
reference, the K-blocks checked to be the quantization blocks, the int8 routes reused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD
from jaxlp.ops import _conv as CC
from jaxlp.ops._dot_general import quantize_operand


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, x.view(np.uint32)), np.where(nan, 0, y.view(np.uint32)))


def _vjp(policy, x, w, g, **kw):
  conv = jaxlp.conv_general_dilated(policy)

  @jax.jit
  def run(x, w, g):
    y, pull = jax.vjp(lambda a, b: conv(a, b, **kw), x, w)
    return (y, *pull(g))

  return run(x, w, g)


POLICIES = {
    "hbfp_tiled": lambda: jaxlp.hbfp_policy(7, 4, "tiled", block_dot="exact"),
    "hbfp_per_sample": lambda: jaxlp.hbfp_policy(7, 4, "per_sample", weight_man_bits=7,
                                                 block_dot="exact"),
    "mxint8": lambda: jaxlp.mx_policy("int8", 2, block_dot="exact"),
}


# -- an independent numpy im2col (NCHW / OIHW, 2-D), in the declared K orders -------------
def _np_im2col(x, R, st, pads, ld, rd):
  N, C, H, W = x.shape
  Hp = [(s - 1) * d + 1 + lo + hi for s, d, (lo, hi) in zip((H, W), ld, pads)]
  xp = np.zeros((N, C, *Hp), np.float32)
  for h in range(H):
    for w in range(W):
      p = (h * ld[0] + pads[0][0], w * ld[1] + pads[1][0])
      if 0 <= p[0] < Hp[0] and 0 <= p[1] < Hp[1]:
        xp[:, :, p[0], p[1]] = x[:, :, h, w]
  So = [(hp - (r - 1) * d - 1) // s + 1 for hp, r, d, s in zip(Hp, R, rd, st)]
  out = np.zeros((N, C, R[0] * R[1], *So), np.float32)
  for t, (i, j) in enumerate(np.ndindex(*R)):
    for a in range(So[0]):
      for b in range(So[1]):
        out[:, :, t, a, b] = xp[:, :, a * st[0] + i * rd[0], b * st[1] + j * rd[1]]
  return out


def _np_grad_cols(g, S, R, st, pads, ld, rd):
  N, O, *So = g.shape
  out = np.zeros((N, O, R[0] * R[1], *S), np.float32)
  for t, r in enumerate(np.ndindex(*R)):
    for s in np.ndindex(*S):
      q = [s[d] * ld[d] + pads[d][0] - r[d] * rd[d] for d in range(2)]
      if all(q[d] % st[d] == 0 and 0 <= q[d] // st[d] < So[d] for d in range(2)):
        out[:, :, t, s[0], s[1]] = g[:, :, q[0] // st[0], q[1] // st[1]]
  return out


def _np_blocks(x, L, g):
  """(R, K) -> (R, nblocks, g): segments of L zero-padded to a multiple of g, cut in g."""
  R, K = x.shape
  Lp = -(-L // g) * g
  return np.pad(x.reshape(R, K // L, L), ((0, 0), (0, 0), (0, Lp - L))).reshape(R, -1, g)


def _on_block_grid(blocks, bits):
  """Every (row, K-block) holds ``k * 2**Q`` with one Q and ``|k| <= 2**bits`` (``-2**t``
  counts one binade lower: MXINT8's -128): the K-blocks are blocks of the quantization (an
  integer dot per K-block is exact)."""
  m, e = np.frexp(blocks.astype(np.float64))
  fl = np.where(blocks == 0, -1000, e - 1 - ((m == -0.5) & (blocks != 0)))
  q = np.max(fl, axis=-1, keepdims=True) - (bits - 1)
  k = np.ldexp(blocks.astype(np.float64), -q)
  return np.array_equal(k, np.round(k)) and np.all(np.abs(k) <= 2.0**bits)


def _np_definition(a, bt, L, g):
  """The exact block bits (``jaxlp/formats/_block_dot.py``) in numpy: per K-block the exact dot
  (float64 holds it: one shared grid, < 2**53) rounded once to float32, flushed below
  2**-126; blocks summed in float32, ascending."""
  pa, pb = _np_blocks(a, L, g), _np_blocks(bt, L, g)
  assert _on_block_grid(pa, 7) and _on_block_grid(pb, 7)
  part = np.einsum("mbk,nbk->bmn", pa.astype(np.float64), pb.astype(np.float64))
  part = part.astype(np.float32)

  def flush(v):
    return np.where(np.abs(v) < 2.0**-126, np.copysign(np.float32(0), v), v)

  s = flush(part[0])
  for p in part[1:]:
    s = flush((s + flush(p)).astype(np.float32))
  return s


def _gemm_matrices(policy, x, w, gy, kw, plan):
  """The three GEMMs' (A, B^T) per the definition in ``jaxlp/ops/_conv.py``, from the
  quantized operands of each GEMM (NCHW / OIHW)."""
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NCHW", "OIHW", "NCHW"))
  geo = CC._conv_geometry(dn)
  vals = {"lhs": x, "rhs": w, "grad": gy, "dlhs_rhs": w, "drhs_lhs": x, "drhs_grad": gy}
  ops = policy.gemm_operands()
  slots = {s: qq for pair in ops.values() for s, qq in pair}
  q = jax.jit(lambda v: {s: quantize_operand(v[s], qq, None, s, geo[s])
                         for s, qq in slots.items()})({s: vals[s] for s in slots})
  q = {s: np.asarray(v) for s, v in q.items()}
  st, ld, rd, pads = kw["window_strides"], kw["lhs_dilation"], kw["rhs_dilation"], kw["padding"]
  R, S = w.shape[2:], x.shape[2:]
  (sl, sr), (sg, sw), (sx, sg2) = ((a for a, _ in ops[k]) for k in ("fwd", "dlhs", "drhs"))
  C, O, T = x.shape[1], w.shape[0], R[0] * R[1]
  cols = _np_im2col(q[sl], R, st, pads, ld, rd)  # (N, C, T, *So)
  if plan["fwd"][0] == "cr":
    a = cols.transpose(0, 3, 4, 1, 2).reshape(-1, C * T)
    bt = q[sr].reshape(O, C * T)
  else:
    a = cols.transpose(0, 3, 4, 2, 1).reshape(-1, T * C)
    bt = q[sr].reshape(O, C, T).transpose(0, 2, 1).reshape(O, -1)
  out = {"fwd": (a, bt)}
  gc = _np_grad_cols(q[sg], S, R, st, pads, ld, rd)  # (N, O, T, *S)
  out["dlhs"] = (gc.transpose(0, 3, 4, 2, 1).reshape(-1, T * O),
                 q[sw].reshape(O, C, T).transpose(1, 2, 0).reshape(C, -1))
  cols = _np_im2col(q[sx], R, st, pads, ld, rd)
  if plan["drhs"][0] == "sn":
    out["drhs"] = (cols.transpose(1, 2, 3, 4, 0).reshape(C * T, -1),
                   q[sg2].transpose(1, 2, 3, 0).reshape(O, -1))
  else:
    out["drhs"] = (cols.transpose(1, 2, 0, 3, 4).reshape(C * T, -1),
                   q[sg2].transpose(1, 0, 2, 3).reshape(O, -1))
  return out


KW = dict(window_strides=(2, 1), padding=((1, 1), (2, -1)), lhs_dilation=(1, 2),
          rhs_dilation=(1, 2))
CASES = {  # name: (policy, x NCHW, w OIHW, conv kwargs, layout, declared orders and K-blocks)
    "tiled_pads_dilations": ("hbfp_tiled", (4, 6, 5, 5), (8, 6, 3, 3), KW, "NCHW",
                             {"fwd": ("cr", 54, 1), "dlhs": ("to", 72, 1),
                              "drhs": ("sn", 4, 4)}),
    "mxint8_nhwc_same": (
        "mxint8", (3, 5, 6, 5), (4, 5, 3, 2),
        dict(window_strides=(1, 2), padding="SAME", lhs_dilation=(1, 1),
             rhs_dilation=(2, 1)), "NHWC",
        {"fwd": ("rc", 5, 2), "dlhs": ("to", 4, 2), "drhs": ("sn", 3, 2)}),
    "per_sample_1d_valid": ("hbfp_per_sample", (3, 4, 1, 9), (6, 4, 1, 3),
                            dict(window_strides=(1, 3), padding=((0, 0), (-1, 1)),
                                 lhs_dilation=(1, 1), rhs_dilation=(1, 1)), "1D",
                            {"fwd": ("cr", 12, 4), "dlhs": ("to", 6, 4),
                             "drhs": ("ns", 3, 3)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bits_are_the_definition_on_the_declared_blocks(case):
  """Wide-range data (block exponents differ): forward, dlhs and drhs are the definition
  (numpy) on an independent im2col in the declared K order, every K-block is a block of
  the quantization (one exponent per row and K-block), on NCHW, NHWC and 1-D layouts."""
  name, xs, ws, kw, layout, expected = CASES[case]
  policy = POLICIES[name]()
  rng = np.random.default_rng(1)
  x = np.float32(rng.normal(size=xs) * np.exp2(rng.integers(-6, 7, xs[:2] + (1, 1))))
  w = np.float32(rng.normal(size=ws) * np.exp2(rng.integers(-6, 7, ws[:1] + (1, 1, 1))))
  y = jax.eval_shape(lambda a, b: lax.conv_general_dilated(a, b, **kw), x, w)
  gy = np.float32(rng.normal(size=y.shape) * np.exp2(rng.integers(-6, 7, y.shape[:2] + (1, 1))))
  # the layer's own layout: NCHW, NHWC/HWIO, or 1-D (NCW/OIW: the H = 1 axis dropped)
  to = {"NCHW": (lambda a: a, lambda a: a, lambda a: a),
        "NHWC": (lambda a: a.transpose(0, 2, 3, 1), lambda a: a.transpose(2, 3, 1, 0),
                 lambda a: a.transpose(0, 2, 3, 1)),
        "1D": (lambda a: a[:, :, 0], lambda a: a[:, :, 0], lambda a: a[:, :, 0])}[layout]
  lkw = dict(kw)
  if layout == "NHWC":
    lkw["dimension_numbers"] = ("NHWC", "HWIO", "NHWC")
  if layout == "1D":
    lkw = {k: v[1:] if isinstance(v, tuple) else v for k, v in kw.items()}
  got = _vjp(policy, to[0](x), to[1](w), to[2](gy), **lkw)
  dn = lax.conv_dimension_numbers(xs, ws, None)
  cv = CC._conv_shape(dn, xs, ws, kw["window_strides"], kw["padding"], kw["lhs_dilation"],
                      kw["rhs_dilation"])
  plan = CC._conv_plan(policy, cv)
  assert plan == expected
  if isinstance(kw["padding"], str):
    kw = dict(kw, padding=lax.padtype_to_pads(
        xs[2:], [(r - 1) * d + 1 for r, d in zip(ws[2:], kw["rhs_dilation"])],
        kw["window_strides"], kw["padding"]))
  mats = _gemm_matrices(policy, x, w, gy, kw, plan)
  want = {k: _np_definition(a, bt, *plan[k][1:]) for k, (a, bt) in mats.items()}
  N, O, Ho, Wo = y.shape
  want = (want["fwd"].reshape(N, Ho, Wo, O).transpose(0, 3, 1, 2),
          want["dlhs"].reshape(N, *xs[2:], xs[1]).transpose(0, 3, 1, 2),
          want["drhs"].reshape(xs[1], *ws[2:], O).transpose(3, 0, 1, 2))
  for gemm, u, v, f in zip(("fwd", "dlhs", "drhs"), got, want, (to[2], to[0], to[1]),
                           strict=True):
    assert _same(u, f(v)), (case, gemm)
  if name == "mxint8":  # the XLA int8 route gives the same bits on the conv's GEMM
    a, bt = mats["fwd"]
    _, L, g = plan["fwd"]
    pa, pb = (_np_blocks(m, L, g).reshape(m.shape[0], -1) for m in (a, bt))
    assert _same(BD.block_dot_xla_int8(pa, pb.T, g, 7, 7),
                 BS.block_dot_reference(pa, pb.T, g, 7, 7))


@pytest.mark.usefixtures("fast_compile")  # within bounds of each other, finite: any level
def test_exact_and_fp8_vs_emulation_on_a_layer():
  """A 3x3 conv layer (16 -> 16 channels, 8x8, NHWC) with un-normalised channels, HBFP8
  tiled (K-blocks of 1 in the forward GEMM): exact and today's emulation differ only in the
  order of the float32 sums (a few ulps of the largest output); the fp8
  mode (MXFP8) is close to its emulation and differentiable."""
  rng = np.random.default_rng(2)
  x = rng.normal(size=(4, 8, 8, 16)) * np.exp2(rng.integers(-8, 9, 16))[None, None, None, :]
  x = jnp.asarray(x, jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 3, 16, 16)) * 0.1, jnp.float32)
  kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=lax.Precision.HIGHEST)

  def fwd(policy):
    return jax.jit(lambda x, w: jaxlp.conv_general_dilated(policy)(x, w, **kw))(x, w)

  ex = fwd(jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact"))
  emu = fwd(jaxlp.hbfp_policy(7, 24, "tiled"))
  assert 0 < float(jnp.max(jnp.abs(ex - emu)) / jnp.max(jnp.abs(emu))) < 1e-6
  mx8 = jaxlp.mx_policy(F.E4M3FN, 32, grad_fmt=F.E5M2)
  conv8 = jaxlp.conv_general_dilated(dataclasses.replace(mx8, block_dot="fp8"))

  def loss8(w):
    y = conv8(x, w, **kw)
    return jnp.sum(y**2), y

  # the fp8 forward and its weight gradient: one program
  (_, f8), dw = jax.jit(jax.value_and_grad(loss8, has_aux=True))(w)
  fe = fwd(mx8)
  assert float(jnp.max(jnp.abs(f8 - fe)) / jnp.max(jnp.abs(fe))) < 1e-5
  assert dw.shape == w.shape and bool(jnp.all(jnp.isfinite(dw)))


def test_unsupported_configurations_refuse():
  policy = jaxlp.hbfp_policy(7, 24, "tiled", block_dot="exact")
  conv = jaxlp.conv_general_dilated(policy)
  with pytest.raises(NotImplementedError, match="feature_group_count=1 .* got feature_group"):
    conv(jnp.ones((1, 4, 5, 5)), jnp.ones((4, 2, 3, 3)), (1, 1), "VALID", feature_group_count=2)
  with pytest.raises(NotImplementedError, match="batch_group_count=2"):
    conv(jnp.ones((2, 2, 5, 5)), jnp.ones((4, 2, 3, 3)), (1, 1), "VALID", batch_group_count=2)
  wide = jaxlp.hbfp_policy(15, 0, "tiled", block_dot="exact")
  with pytest.raises(ValueError, match=r"conv_general_dilated \(fwd GEMM\).* K-block 18"):
    jaxlp.conv_general_dilated(wide)(jnp.ones((2, 2, 4, 4)), jnp.ones((2, 2, 3, 3)), (1, 1),
                                     "SAME")
