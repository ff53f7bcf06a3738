"""NVFP4 and MX scale rules wherever a format is accepted: jaxlp.quantize, DotPolicy and the
layers (emulation: quantize, then the float32 GEMM), optax transforms, compressor wire formats
(cast), the torch bridge; and clear refusals where a block format cannot go (2-D tiles on the
wire, psum's partial sums, exact GEMMs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import formats as F

from . import _ref

RNG = np.random.default_rng(31)
A = jnp.asarray(RNG.standard_normal((8, 48)).astype(np.float32))
B = jnp.asarray(RNG.standard_normal((48, 16)).astype(np.float32))


def test_public_quantize_dispatch_equals_the_spec():
  for fmt in (F.nvfp4(), F.nvfp4(tile=16), F.mx(F.E4M3FN, scale_rule="rceil")):
    _ref.assert_same_bits(jaxlp.quantize(A, fmt), F.quantize(A, fmt), A, repr(fmt))


@pytest.mark.parametrize("fmt", [F.nvfp4(), F.mx(F.E2M1FN, 16, scale_rule="rceil")], ids=repr)
def test_dot_policy_blocks_along_the_contraction_axis(fmt):
  """Emulation (block_dot=None): every operand quantized with its blocks along its
  contraction axis (the format's own axis replaced), then the float32 GEMM; gradients too."""
  import dataclasses

  pol = jaxlp.DotPolicy(lhs=fmt, rhs=fmt, grad=fmt)
  dg = jaxlp.dot_general(pol)
  dims = (((1,), (0,)), ((), ()))
  out = dg(A, B, dims)
  ql = F.quantize(A, dataclasses.replace(fmt, axis=1))
  qr = F.quantize(B, dataclasses.replace(fmt, axis=0))
  want = jax.lax.dot_general(ql, qr, dims)
  _ref.assert_same_bits(out, want, msg="forward")
  # blocks along K differ from blocks along the format's default axis for B
  assert not np.array_equal(np.asarray(qr), np.asarray(F.quantize(B, fmt)))
  g = jax.grad(lambda l, r: dg(l, r, dims).sum(), argnums=(0, 1))(A, B)
  assert all(np.isfinite(np.asarray(v)).all() for v in g)


def test_two_d_tiles_quantize_w_and_its_transpose_alike():
  """16x16 tiles of a weight: the forward GEMM and the dlhs GEMM (which contracts the other
  axis of W) see the same quantized values."""
  w = jnp.asarray(RNG.standard_normal((48, 32)).astype(np.float32))
  fmt = F.nvfp4(tile=16)
  np.testing.assert_array_equal(np.asarray(F.quantize(w, fmt)).T,
                                np.asarray(F.quantize(w.T, fmt)))
  pol = jaxlp.DotPolicy(rhs=fmt, dlhs_rhs="fwd")
  dg = jaxlp.dot_general(pol)
  dims = (((1,), (0,)), ((), ()))
  g = jax.grad(lambda l: dg(l, w, dims).sum())(A)
  want = jnp.ones((8, 32)) @ F.quantize(w, fmt).T
  np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5)  # summation order


def test_exact_and_fp8_gemms_refuse_nvfp4_clearly():
  for mode in ("exact", "fp8"):
    with pytest.raises(ValueError, match="block_dot"):
      jaxlp.DotPolicy(lhs=F.nvfp4(), rhs=F.nvfp4(), grad=F.nvfp4(), dlhs_rhs=F.nvfp4(),
                      drhs_lhs=F.nvfp4(), drhs_grad=F.nvfp4(), block_dot=mode)


def test_flax_dense_layer_with_an_nvfp4_policy():
  nn = pytest.importorskip("flax.linen", reason="the layer test needs flax")
  pol = jaxlp.DotPolicy(lhs=F.nvfp4(), rhs=F.nvfp4(tile=16), grad=F.nvfp4())
  layer = nn.Dense(16, dot_general=jaxlp.dot_general(pol))
  params = layer.init(jax.random.key(0), A)
  out = layer.apply(params, A)
  k = params["params"]["kernel"]
  want = F.quantize(A, F.nvfp4()) @ F.quantize(k, F.nvfp4(tile=16)) + params["params"]["bias"][None]
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_optax_transforms_take_nvfp4():
  optax = pytest.importorskip("optax", reason="the optax test needs optax")
  params = {"w": B}
  tx = jaxlp.optim.quantize_updates(F.nvfp4())
  state = tx.init(params)
  upd, _ = tx.update({"w": B * 0.1}, state, params)
  _ref.assert_same_bits(upd["w"], F.quantize(B * 0.1, F.nvfp4()), msg="quantize_updates")
  tx = jaxlp.optim.trace(0.9, fmt=F.nvfp4(), rounding="stochastic", key=jax.random.key(1))
  state = tx.init(params)
  upd, state = tx.update({"w": B}, state, params)
  assert np.isfinite(np.asarray(upd["w"])).all()
  assert isinstance(tx, optax.GradientTransformation)


def _wire_cases():
  x = RNG.standard_normal(1001).astype(np.float32)
  x[::97] *= 1e4  # outlier blocks
  x[32:48] = 0.0
  x[50] = -0.0
  x[60:64] *= np.float32(1e-39)  # subnormals
  return x


@pytest.mark.parametrize("fmt", [
    F.nvfp4(), F.nvfp4(tensor_scale=False),
    F.ScaledBlockFormat(F.E2M1FN, block_size=32, scale_fmt="e8m0", tensor_scale=False),
    F.ScaledBlockFormat(F.E4M3FN, block_size=8, scale_fmt="fp32", tensor_scale=False),
    F.ScaledBlockFormat(F.E2M3FN, block_size=16, tensor_scale=True),
], ids=repr)
def test_block_scaled_formats_are_compressor_wire_formats(fmt):
  """cast(nvfp4()): element codes + block-scale codes + the tensor scale on the wire;
  decode(encode(x)) == quantize(x, fmt) bit for bit, wire_bytes == the payload's bytes."""
  from jaxlp.parallel import compressors

  c = compressors.cast(fmt)
  x = _wire_cases()
  def run(v):
    p = c.encode(v, ())[0]
    return p, c.decode(p, (1001,)), F.quantize(v, fmt)

  p, out, want_q = jax.jit(run)(x)
  _ref.assert_same_bits(out, want_q, x, repr(fmt))
  n, nb = 1001, -(-1001 // fmt.block_size)
  elem = n * (fmt.elem.bits // 8) + -(-n * (fmt.elem.bits % 8) // 8)
  want = elem + nb * (4 if fmt.scale_fmt == "fp32" else 1) + 4 * fmt.tensor_scale
  assert compressors.payload_nbytes(p) == c.wire_bytes((n,)) == want
  if fmt == F.nvfp4():
    assert want == 501 + 63 + 4  # 4 bits per element, 1 byte per 16, 4 per tensor
    assert p["scales"].dtype == np.uint8 and p["elements"]["rest"].dtype == np.uint8


def test_nonfinite_gradients_on_the_nvfp4_wire():
  """inf in one block: the UE4M3 (0x7F) and E8M0 (0xFF) NaN scale codes make that block NaN
  (one-level); a two-level tensor's NaN tensor scale makes it all NaN. One program."""
  from jaxlp.parallel import compressors

  x = np.ones(64, np.float32)
  x[20] = np.inf
  fmts = (F.nvfp4(), F.nvfp4(tensor_scale=False),
          F.ScaledBlockFormat(F.E2M1FN, 16, scale_fmt="e8m0", tensor_scale=False))
  cs = [compressors.cast(f) for f in fmts]
  outs = jax.jit(lambda v: [(c.decode(c.encode(v, ())[0], (64,)), F.quantize(v, c.fmt))
                            for c in cs])(x)
  for fmt, (got, want) in zip(fmts, outs, strict=True):
    _ref.assert_same_bits(got, want, x, repr(fmt))
    got = np.asarray(got)
    assert np.isnan(got[16:32]).all() and np.isnan(got).all() == fmt.tensor_scale


def test_nvfp4_cast_reduction_is_the_decoded_sum_over_w():
  """compressed_allreduce / reduce_gradients with cast(nvfp4()): per worker, the gradient
  leaf quantized as a flat vector; the decoded values summed in rank order, divided by W."""
  from jaxlp.parallel import compressors
  from jaxlp.parallel._compressed import compressed_allreduce, init_compression_state

  c = compressors.cast(F.nvfp4())
  w = 2
  g = jnp.asarray(RNG.standard_normal((w, 12, 30)).astype(np.float32))
  st = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (w,) + a.shape),
                              init_compression_state(c, jnp.zeros((12, 30))))
  def step(g, s):  # the reduction and, as the reference, this worker's flat quantization
    out, _ = compressed_allreduce(g, s, "i", c, min_size=0)
    return out, F.quantize(g.reshape(-1), F.nvfp4()).reshape(g.shape)

  out, q = jax.jit(jax.vmap(step, axis_name="i"))(g, st)
  q = np.asarray(q)
  acc = q[0]
  for r in range(1, w):
    acc = acc + q[r]
  want = acc / np.float32(w)
  for r in range(w):
    _ref.assert_same_bits(out[r], want, msg=f"worker {r}")


def test_nvfp4_wire_format_in_the_torch_ddp_hook_codec():
  """The DDP hook's codec (payload -> one byte string per rank, gathered, decoded, summed in
  rank order) carries cast(nvfp4()): the sum of the ranks' quantized gradients."""
  pytest.importorskip("torch", reason="the DDP hook needs torch")
  from jaxlp.parallel import compressors
  from jaxlp.torch import ddp

  c = compressors.cast(F.nvfp4())
  n = 200
  encode, decode_sum, st = ddp._codec(c, n)
  xs = [jnp.asarray(RNG.standard_normal(n).astype(np.float32) * s) for s in (1.0, 1e3)]
  wires = [encode(x, st, None)[0] for x in xs]
  assert wires[0].dtype == jnp.uint8 and wires[0].shape == (c.wire_bytes((n,)),)
  got = decode_sum(jnp.stack(wires))
  want = F.quantize(xs[0], F.nvfp4()) + F.quantize(xs[1], F.nvfp4())
  _ref.assert_same_bits(got, want, msg="hook codec")


def test_compressor_refusals_and_psum_refuses_block_formats():
  """2-D tiles cannot be a wire format (a compressor sees the flat gradient); MX is not a
  cast wire format (yet); a block format cannot round a psum's partial sums."""
  from jaxlp.parallel import compressors

  with pytest.raises(ValueError, match="2-D tiles"):
    compressors.cast(F.nvfp4(tile=16))
  with pytest.raises(ValueError, match="not a FloatFormat"):
    compressors.cast(F.mx(F.E2M1FN))
  for fmt in (F.nvfp4(), F.mx(F.E2M1FN)):
    with pytest.raises(TypeError, match="elementwise format"):
      jaxlp.parallel.psum(A, "i", fmt=fmt)


def test_torch_bridge_quantizes_through_jax():
  torch = pytest.importorskip("torch", reason="the torch bridge test needs torch")
  import jaxlp.torch as jt

  t = torch.from_numpy(np.array(A))
  for fmt in (F.nvfp4(), F.mx(F.E4M3FN, scale_rule="even")):
    got = jt.quantize(t, fmt)
    assert isinstance(got, torch.Tensor)
    _ref.assert_same_bits(got.numpy(), F.quantize(A, fmt), A, repr(fmt))
  got = jt.quantize(t, F.nvfp4(), "stochastic", seed=3)
  want = F.quantize(A, F.nvfp4(), "stochastic", key=jax.random.key(3))
  _ref.assert_same_bits(got.numpy(), want, A, "stochastic")
