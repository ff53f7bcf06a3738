"""Every DotPolicy mode on N-D ``dot_general`` operands: the same bits as the 2-D GEMMs on
the same data (a reshape, a loop over batch indices, or an independent reference), forward
and both backward GEMMs; and the layouts of tile formats (``DotPolicy.layout``)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxlp
from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.formats._quantize import key_words
from jaxlp.formats._quantize import quantize_words as spec_words
from jaxlp.ops import _dot_general as DG
from jaxlp.ops._policy import Accum, DotPolicy, Quant

DN2 = (((1,), (0,)), ((), ()))
DENSE = (((2,), (0,)), ((), ()))  # (B, S, F) . (F, N)
KEY = jax.random.key(7)


def _bits(x):
  x = np.asarray(x, np.float32)
  return np.where(np.isnan(x), np.uint32(0x7FC00000), x.view(np.uint32))


def assert_same(got, want):
  for u, v in zip(got, want, strict=True):
    assert u.shape == v.shape, (u.shape, v.shape)
    np.testing.assert_array_equal(_bits(u), _bits(v))


def vjp_fn(policy, dn, key=None):
  """jit(x, w, dy -> (y, dx, dw)) through ``jaxlp.dot_general(policy)``."""
  dg = jaxlp.dot_general(policy, key=key)

  @jax.jit
  def run(x, w, dy):
    y, pull = jax.vjp(lambda a, b: dg(a, b, dn), x, w)
    return (y, *pull(dy))

  return run


def _data(seed, *shapes, spread=2.0):
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.normal(size=s) * np.exp2(rng.normal(size=s) * spread), jnp.float32)
          for s in shapes]


ACC = Accum(mul=F.BF16, acc=F.cpd_float(5, 6))
# One mode per N-D path. Not here, as the same path is checked elsewhere: the exact mode on
# HBFP tiles and per-sample HBFP (test_layout_and_exact_mode_share_k_blocks: the same (B, S, F)
# . (F, N) dot against block_dot_reference on the reshape, in both layouts) and on MXINT8
# blocks (test_two_contracting_dims_blocks_along_the_last_one_padded: N-D operands, MX blocks
# of 8, all three GEMMs against block_dot_reference on the canonical matrices), Kahan
# accumulation (the same accumulator route as acc_naive / acc_chunked; the algorithm is
# jaxlp.matmul's, tests/ops/test_matmul.py), the fp8 mode with per-tensor scales (the fp8
# route of fp8_mx, whose MX blocks are the ones the N-D view must keep; a per-tensor scale
# has no blocks).
MODES = {
    "fp8_mx": jaxlp.mx_policy(F.E4M3FN, 8, grad_fmt=F.E5M2, block_dot="fp8"),
    "acc_naive": DotPolicy(lhs=F.E4M3, grad=F.E5M2, fwd_acc=ACC, dlhs_acc=ACC, drhs_acc=ACC),
    "acc_chunked": DotPolicy(rhs=F.mx(F.E2M1FN, 4),
                             fwd_acc=Accum(acc=F.BF16, algorithm="chunked", chunk=4),
                             dlhs_acc=Accum(acc=F.FP16, algorithm="chunked", chunk=3)),
    "per_gemm": DotPolicy(lhs=F.mx(F.E4M3FN, 8), rhs=F.hbfp(5, 8), grad=F.E5M2,
                          dlhs_rhs=F.mx(F.E2M3FN, 4), drhs_lhs=F.BlockFormat(4, tile=(1, 8)),
                          drhs_grad=Quant(F.E4M3, "toward_zero"), layout="contraction"),
    "stochastic": DotPolicy(lhs=Quant(F.hbfp(5, 8), "stochastic"),
                            rhs=Quant(F.mx(F.E4M3FN, 8), "stochastic"),
                            grad=Quant(F.E5M2, "stochastic"), drhs_grad=Quant(F.E4M3, "up"),
                            drhs_acc=Accum(acc=F.BF16, rounding="stochastic"),
                            layout="contraction"),
}


def _vjp(policy, dn, x, w, dy, key=None):
  """(y, dx, dw) through ``jaxlp.dot_general(policy)``, traced into the caller's program."""
  dg = jaxlp.dot_general(policy, key=key)
  y, pull = jax.vjp(lambda a, b: dg(a, b, dn), x, w)
  return (y, *pull(dy))


def test_dense_nd_equals_2d_gemm_on_the_reshape():
  """(B, S, F) . (F, N), for each mode of MODES: forward, dlhs and drhs have the bits of the
  2-D GEMM on the (B * S, F) reshape (the activations' flat indices, and so the noise, are
  the same). MX blocks of the weight gradient's GEMM run along the tokens of one sequence
  (the N-D dot's innermost contracted axis); S = 8 makes them the blocks of 8 of the reshape
  too. All modes, both views and the float32 dot are one compiled program."""
  B, S, Fe, N = 2, 8, 24, 12
  x, w, dy = _data(1, (B, S, Fe), (Fe, N), (B, S, N))

  @jax.jit
  def run(x, w, dy):
    out = {}
    for mode, policy in sorted(MODES.items()):
      key = KEY if policy.stochastic else None
      out[mode] = (_vjp(policy, DENSE, x, w, dy, key),
                   _vjp(policy, DN2, x.reshape(B * S, Fe), w, dy.reshape(B * S, N), key))
    return out, _vjp(DotPolicy(), DENSE, x, w, dy)

  out, plain = run(x, w, dy)
  for mode, ((y, dx, dw), (y2, dx2, dw2)) in sorted(out.items()):
    try:
      assert_same((y, dx, dw), (y2.reshape(B, S, N), dx2.reshape(B, S, Fe), dw2))
    except AssertionError as e:
      raise AssertionError(f"mode {mode}: {e}") from None
    # the mode really acts (the test can fail): not the float32 dot of the data
    assert any(not np.array_equal(_bits(u), _bits(v)) for u, v in zip((y, dx, dw), plain)), mode


ATTN = (((3,), (3,)), ((0, 2), (0, 2)))  # 'bqhd,bkhd->bhqk'
PV = (((3,), (1,)), ((0, 1), (0, 2)))  # 'bhqk,bkhd->bhqd'
ROW8 = F.BlockFormat(7, tile=(1, 8), exponent="hbfp")
# batch dimensions are one vmap of the 2-D GEMM for every block_dot mode (_dot_general's
# _batched): the exact mode stands for fp8 too (whose 2-D GEMM is checked on N-D operands in
# test_dense_nd_equals_2d_gemm_on_the_reshape, mode fp8_mx; its batched lowering in
# tests/ops/test_block_dot.py::test_batched_dot_general_lowers_for_cuda[fp8])
BATCH_MODES = {
    "exact_rows": DotPolicy(lhs=ROW8, rhs=ROW8, grad=ROW8, block_dot="exact"),
    "acc": DotPolicy(lhs=F.E4M3, grad=F.E5M2, fwd_acc=ACC, dlhs_acc=ACC,
                     drhs_acc=Accum(acc=F.FP16, algorithm="chunked", chunk=4)),
    "per_gemm": DotPolicy(lhs=F.mx(F.E4M3FN, 8), rhs=ROW8, grad=F.E5M2,
                          dlhs_rhs=F.mx(F.E2M3FN, 4), drhs_lhs=F.BlockFormat(4, tile=(1, 4)),
                          drhs_grad=Quant(F.E4M3, "toward_zero")),
}


def _slice_loop(policy, dn2, x, w, dy, xs, ws, gs, out_shape):
  """The 2-D GEMMs per batch index: x[xs(i)] . w[ws(i)] with cotangent dy[gs(i)], in the
  contraction layout (the 2-D GEMMs' "auto" would take HBFPEmulator's view)."""
  run = vjp_fn(dataclasses.replace(policy, layout="contraction"), dn2)
  # numpy slices: an eager slice of a jax array compiles a program per index
  x, w, dy = np.asarray(x), np.asarray(w), np.asarray(dy)
  y, dx, dw = np.zeros(out_shape, np.float32), np.zeros(x.shape, np.float32), np.zeros(
      w.shape, np.float32)
  for i in np.ndindex(*out_shape[:2]):
    yi, dxi, dwi = run(x[xs(i)], w[ws(i)], dy[gs(i)])
    y[gs(i)], dx[xs(i)], dw[ws(i)] = yi, dxi, dwi
  return y, dx, dw


@pytest.mark.parametrize("mode", sorted(BATCH_MODES))
def test_batch_dims_equal_a_loop_of_2d_gemms(mode):
  """Attention's q.k (batch dims b, h in the middle of the operands) and p.v (contraction
  over the key positions, not the last axis of v): one 2-D GEMM per (b, h), the same bits."""
  policy = BATCH_MODES[mode]
  B, Q, K, H, D = 2, 3, 8, 2, 16
  q, k, g = _data(2, (B, Q, H, D), (B, K, H, D), (B, H, Q, K))
  got = vjp_fn(policy, ATTN)(q, k, g)
  sl = lambda i: (i[0], slice(None), i[1], slice(None))
  want = _slice_loop(policy, (((1,), (1,)), ((), ())), q, k, g, sl, sl, lambda i: i,
                     (B, H, Q, K))
  assert_same(got, want)
  if mode not in ("exact_rows", "acc"):  # p.v: one exact and one emulated mode suffice
    return
  p, v, g2 = _data(3, (B, H, Q, K), (B, K, H, D), (B, H, Q, D))
  got = vjp_fn(policy, PV)(p, v, g2)
  want = _slice_loop(policy, DN2, p, v, g2, lambda i: i, sl, lambda i: i, (B, H, Q, D))
  assert_same(got, want)


def test_two_contracting_dims_blocks_along_the_last_one_padded():
  """DenseGeneral's out-projection 'bshd,hdf->bsf' with MXINT8 blocks of 8 along d = 12
  (blocks [0, 8) and [8, 12) of every head): each d-run is zero-padded to 16, K-blocks of 8
  in ascending (h, d-block) order; forward, dlhs and drhs equal block_dot_reference on the
  canonical, padded matrices of the forward-quantized operands."""
  B, S, H, D, Fo = 2, 3, 2, 12, 5
  dn = (((2, 3), (0, 1)), ((), ()))
  x, w, dy = _data(4, (B, S, H, D), (H, D, Fo), (B, S, Fo))
  policy = jaxlp.mx_policy("int8", 8, block_dot="exact")
  y, dx, dw = vjp_fn(policy, dn)(x, w, dy)
  q = lambda t, axis: F.quantize(t, F.mx("int8", 8, axis))
  pad = lambda a: jnp.pad(a.reshape(a.shape[0], H, D), ((0, 0), (0, 0), (0, 4))).reshape(
      a.shape[0], H * 16)
  ref = jax.jit(BS.block_dot_reference, static_argnums=(2, 3, 4))
  a = pad(q(x, 3).reshape(B * S, H * D))
  bt = pad(q(w, 1).reshape(H * D, Fo).T)
  assert_same((y,), (ref(a, bt.T, 8, 7, 7).reshape(B, S, Fo),))
  # dlhs: K = f (5: one K-block); drhs: K = (b, s), MX blocks along s (one per sequence)
  dx_ref = ref(q(dy, 2).reshape(B * S, Fo), q(w, 2).reshape(H * D, Fo).T, 5, 7, 7)
  dw_ref = ref(q(x, 1).reshape(B * S, H * D).T, q(dy, 1).reshape(B * S, Fo), 3, 7, 7)
  assert_same((dx, dw), (dx_ref.reshape(B, S, H, D), dw_ref.reshape(H, D, Fo)))
  dims = DG.dot_dims(dn, 4, 3)
  shapes = {"lhs": x.shape, "rhs": w.shape, "out": (B, S, Fo)}
  plan = DG.block_plan(policy, dims, shapes, DG.dot_geometry(dims, "contraction"))
  assert plan == {"fwd": (12, 8), "dlhs": (5, 5), "drhs": (6, 3)}


def test_stochastic_noise_is_the_operands_own_flat_index():
  """A tile format on the contraction view of an operand whose contraction is not its last
  axis ('fb,fn->bn': lhs (F, B)) is rounded in the operand's own layout: the bits (and the
  noise) of quantizing x itself with blocks of 8 along its axis 0."""
  x, w = _data(5, (16, 6), (16, 4))
  fmt = F.BlockFormat(3, tile=(1, 8))
  policy = DotPolicy(lhs=Quant(fmt, "stochastic"), layout="contraction")
  y = jax.jit(lambda a, b, k: jaxlp.dot_general(policy, key=k)(a, b, (((0,), (0,)), ((), ()))))(
      x, w, KEY)
  xq = F.quantize(x, F.BlockFormat(3, axis=0, block_size=8), "stochastic",
                  key=jax.random.fold_in(KEY, DG.SLOTS.index("lhs")))
  np.testing.assert_array_equal(_bits(y), _bits(lax.dot_general(xq, w, (((0,), (0,)), ((), ())))))
  assert not np.array_equal(_bits(xq), _bits(F.quantize(x, F.BlockFormat(3, axis=0,
                                                                          block_size=8))))


def test_stochastic_accumulation_gets_a_key_per_gemm():
  """Stochastic accumulators (previously refused for lack of a key): GEMM i draws from
  fold_in(key, 6 + i); batched GEMMs use jaxlp.matmul's noise index of the (B, M, N) result."""
  acc = Accum(acc=F.BF16, rounding="stochastic")
  policy = DotPolicy(fwd_acc=acc, dlhs_acc=acc)
  q, k, g = _data(6, (2, 3, 2, 16), (2, 8, 2, 16), (2, 2, 3, 8))
  y, dq, dk = vjp_fn(policy, ATTN, KEY)(q, k, g)
  mm = lambda a, b, i: jaxlp.matmul(a, b, acc=F.BF16, rounding="stochastic",
                                    key=jax.random.fold_in(KEY, 6 + i))

  @jax.jit  # the reference as one program
  def want(q, k, g):
    a = q.transpose(0, 2, 1, 3).reshape(4, 3, 16)
    bt = k.transpose(0, 2, 1, 3).reshape(4, 8, 16)
    return (mm(a, bt.transpose(0, 2, 1), 0).reshape(2, 2, 3, 8),
            mm(g.reshape(4, 3, 8), bt, 1).reshape(2, 2, 3, 16).transpose(0, 2, 1, 3))

  assert_same((y, dq), want(q, k, g))
  _, _, dk2 = vjp_fn(policy, ATTN, jax.random.key(8))(q, k, g)
  assert not np.array_equal(_bits(y), _bits(vjp_fn(DotPolicy(), ATTN)(q, k, g)[0]))
  np.testing.assert_array_equal(dk, dk2)  # drhs: float32 autodiff, no noise


# ---------------------------------------------------------------------------------------
# Layouts (deliverable: blocks that mean something for sequence models)
# ---------------------------------------------------------------------------------------
def _quantized_lhs(fmt, layout, x):
  """Q(x) as the forward GEMM sees it (x . identity: every product and sum exact)."""
  return _quantized_lhs_fn(fmt, layout)(x)


@functools.cache
def _quantized_lhs_fn(fmt, layout):
  """:func:`_quantized_lhs`'s program: one per format and layout, for both arrays."""

  @jax.jit
  def run(x):
    eye = jnp.eye(x.shape[-1], dtype=jnp.float32)
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    return jaxlp.dot_general(DotPolicy(lhs=fmt, layout=layout))(x, eye, dn)

  return run


def test_exponent_sharing_per_layout():
  """(batch 2, seq 3, features 48) activations, hbfp(7, 24): one huge value in token (1, 2)
  changes, in the contraction layout, that token's 24-feature block only; in the hbfp layout
  (HBFPEmulator's (dim0, rest) view: rows = the 2 sequences, columns = (seq, feature)) the
  whole 2 x 24 tile: the same token position and features of BOTH sequences."""
  x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.0, (2, 3, 48)), jnp.float32)
  x_big = x.at[1, 2, 30].set(2.0**12)
  fmt = F.hbfp(7, 24)
  changed = {}
  for layout in ("contraction", "hbfp", "auto"):
    a, b = _quantized_lhs(fmt, layout, x), _quantized_lhs(fmt, layout, x_big)
    changed[layout] = np.argwhere(np.asarray(a != b))
  tok = {(1, 2, f) for f in range(24, 48)}
  assert {tuple(i) for i in changed["contraction"]} == tok
  assert {tuple(i) for i in changed["hbfp"]} == tok | {(0, 2, f) for f in range(24, 48)}
  np.testing.assert_array_equal(changed["auto"], changed["contraction"])  # N-D: contraction
  # per-sample HBFP: one exponent per token (contraction) or per sequence (hbfp)
  bat = F.hbfp_batched(7)
  ch = np.asarray(_quantized_lhs(bat, "contraction", x) != _quantized_lhs(bat, "contraction",
                                                                          x_big))
  assert {tuple(i) for i in np.argwhere(ch)} == {(1, 2, f) for f in range(48)}
  ch = np.asarray(_quantized_lhs(bat, "hbfp", x) != _quantized_lhs(bat, "hbfp", x_big))
  assert {tuple(i[:2]) for i in np.argwhere(ch)} == {(1, s) for s in range(3)}


def test_weights_keep_their_tiles_and_2d_gemms_keep_hbfpemulators_view():
  """A (48, 24) weight in tiles of 24: the same two 24 x 24 tiles in both layouts; a plain
  2-D GEMM under "auto" is bit-identical to the "hbfp" layout (today's CNN/MLP numbers)."""
  w = jnp.asarray(np.random.default_rng(1).uniform(0.5, 1.0, (48, 24)), jnp.float32)
  w_big = w.at[30, 5].set(2.0**12)
  x = jnp.eye(48, dtype=jnp.float32)[None]  # (1, 48, 48): an N-D GEMM
  for layout in ("contraction", "hbfp"):
    f = jax.jit(lambda b, layout=layout: jaxlp.dot_general(DotPolicy(rhs=F.hbfp(7, 24),
                                                                     layout=layout))(
        x, b, DENSE)[0])
    ch = np.argwhere(np.asarray(f(w) != f(w_big)))
    assert {tuple(i) for i in ch} == {(r, c) for r in range(24, 48) for c in range(24)}
  x2, w2, dy2 = _data(9, (30, 48), (48, 24), (30, 24))
  for pol in (jaxlp.hbfp_policy(7, 24, "tiled"), jaxlp.hbfp_policy(7, 24),
              DotPolicy(lhs=F.BlockFormat(5, tile=(4, 16)), rhs=F.BlockFormat(5, tile=(16, 4)),
                        grad=F.hbfp_batched(5))):
    hb = dataclasses.replace(pol, layout="hbfp")
    assert_same(vjp_fn(pol, DN2)(x2, w2, dy2), vjp_fn(hb, DN2)(x2, w2, dy2))
  dims = DG.dot_dims(DENSE, 3, 2)
  assert DG.resolve_layout(DotPolicy(), dims, 3, 2) == "contraction"
  assert DG.resolve_layout(DotPolicy(), DG.dot_dims(DN2, 2, 2), 2, 2) == "hbfp"


@pytest.mark.parametrize("layout", ["contraction", "hbfp"])
@pytest.mark.parametrize("activations", ["tiled", "per_sample"])
def test_layout_and_exact_mode_share_k_blocks(layout, activations):
  """hbfp_policy(7, 24, ...) on (2, 3, 48) . (48, 24) in the exact mode: the forward
  K-blocks are the 24-feature blocks of both operands, and every GEMM equals
  block_dot_reference on the canonical matrices of the quantized operands."""
  policy = jaxlp.hbfp_policy(7, 24, activations, weight_man_bits=7, block_dot="exact",
                             layout=layout)
  x, w, dy = _data(10, (2, 3, 48), (48, 24), (2, 3, 24))
  y, dx, dw = vjp_fn(policy, DENSE)(x, w, dy)
  dims = DG.dot_dims(DENSE, 3, 2)
  geo = DG.dot_geometry(dims, layout)
  shapes = {"lhs": x.shape, "rhs": w.shape, "out": (2, 3, 24)}
  plan = DG.block_plan(policy, dims, shapes, geo)
  # the weight gradient contracts over the tokens: K-blocks of one token, or of one
  # sequence where hbfp_batched in the hbfp layout shares one exponent per sequence
  want = {"fwd": 24, "dlhs": 24, "drhs": 3 if (layout, activations) == ("hbfp", "per_sample")
          else 1}
  assert {k: v[1] for k, v in plan.items()} == want
  ref = lambda a, b, g: BS.block_dot_reference(a, b, g, 7, 7)

  @jax.jit  # the reference as one program
  def reference(x, w, dy):
    qx = DG.quantize_operand(x, policy.lhs, None, "lhs", geo["lhs"])
    qw = DG.quantize_operand(w, policy.rhs, None, "rhs", geo["rhs"])
    qg = DG.quantize_operand(dy, policy.grad, None, "grad", geo["grad"])
    X, G = qx.reshape(6, 48), qg.reshape(6, 24)
    return (ref(X, qw, 24).reshape(2, 3, 24), ref(G, qw.T, 24).reshape(2, 3, 48),
            ref(X.T, G, want["drhs"]))

  assert_same((y, dx, dw), reference(x, w, dy))


def test_layout_validation_and_errors():
  with pytest.raises(ValueError, match=r"layout='rows' not in \('auto', 'hbfp', 'contraction'\)"):
    DotPolicy(layout="rows")
  with pytest.raises(ValueError, match="layout="):
    jaxlp.hbfp_policy(7, layout="tokens")
  assert jaxlp.hbfp_policy(layout="hbfp") != jaxlp.hbfp_policy()
  assert hash(jaxlp.hbfp_policy(layout="contraction"))
  # an exact K-block too long for int32 names the GEMM (per-token blocks over all of K)
  wide = DotPolicy(lhs=F.hbfp_batched(15), rhs=F.hbfp(15, 8), grad=F.hbfp_batched(15),
                   block_dot="exact")
  with pytest.raises(ValueError, match=r"dot_general \(fwd GEMM\).*K-block 4"):
    jaxlp.dot_general(wide)(jnp.ones((2, 3, 4)), jnp.ones((4, 8)), DENSE)


def test_k_changes_and_blocking():
  # (dim0, rest) tiles of 24 on a (2, 3, 48) operand, contraction over the 48 features
  assert DG.k_changes((2, 3, 48), ((0,), (1, 2), (24, 24)), (2,)) == {24}
  # rest = 3 * 40 = 120 columns in tiles of 24: boundaries at f = 24, 8, 32 (s = 0, 1, 2)
  assert DG.k_changes((2, 3, 40), ((0,), (1, 2), (24, 24)), (2,)) == {8, 16, 24, 32}
  assert DG.k_blocking({8, 16, 24, 32}, 40, 40) == (40, 8)
  # blocks of 8 along d = 12 of (h, d): changes at 8, 12, 20; segments of 12 cut in 8
  assert DG.k_changes((2, 12), ((0,), (1,), (1, 8)), (0, 1)) == {8, 12, 20}
  assert DG.k_blocking({8, 12, 20}, 24, 12) == (12, 8)
  assert DG.k_blocking(set(), 24, 12) == (24, 24)
  assert DG.k_blocking({12}, 24, 12) == (24, 12)  # a tie: no padding
  # per-row blocks over rows the GEMM contracts: every step changes
  assert DG.k_changes((6, 4), ((0,), (1,), (1, None)), (0,)) == {1, 2, 3, 4, 5}
  assert DG.pad_segments(jnp.arange(6.0).reshape(1, 6), 3, 2).tolist() == [
      [0, 1, 2, 0, 3, 4, 5, 0]]
  assert DG.pad_segments(jnp.arange(6.0).reshape(1, 6), 6, 4).shape == (1, 6)  # one segment


def test_tiles_on_a_transposed_view_round_in_the_operands_own_layout():
  """A weight (F, H, D) contracted over H: its (rows (F, D), columns H) view is no reshape
  of the array, so the block maxima are taken on the transposed view and the rounding (and
  its noise) stays in the weight's own layout: with nearest rounding the bits of quantizing
  the transposed view; with tiles (1, 4) those of blocks of 4 along H, noise included."""
  w = _data(11, (6, 8, 5))[0]
  dn = (((1,), (1,)), ((), ()))  # x (B, H) . w (F, H, D)
  geo = DG.dot_geometry(DG.dot_dims(dn, 2, 3), "contraction")["rhs"]
  assert geo.view == ((0, 2), (1,)) and geo.weight
  fmt = F.BlockFormat(4, tile=(3, 4))
  got = jax.jit(lambda t: DG.quantize_operand(t, Quant(fmt), None, "rhs", geo))(w)
  view = jnp.transpose(w, (0, 2, 1)).reshape(30, 8)
  want = F.quantize(view, fmt).reshape(6, 5, 8).transpose(0, 2, 1)
  np.testing.assert_array_equal(_bits(got), _bits(want))
  k = jax.random.key(3)
  rows = F.BlockFormat(4, tile=(1, 4))
  viewed = DG._Viewed(rows, (0, 2, 1), 2)
  sr = jax.jit(lambda t: spec_words(t, jnp.stack(key_words(k)), viewed, "stochastic"))(w)
  ref = F.quantize(w, F.BlockFormat(4, axis=1, block_size=4), "stochastic", key=k)
  np.testing.assert_array_equal(_bits(sr), _bits(ref))
