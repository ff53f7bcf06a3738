"""NVFP4 and MX scale rules wherever a format is accepted: jaxlp.quantize, DotPolicy and the
layers (emulation: quantize, then the float32 GEMM), optax transforms, the torch bridge; and
clear refusals where a block format cannot go (compressor wire formats, psum, exact GEMMs)."""

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


def test_compressor_cast_and_psum_refuse_block_formats():
  """A block format has no per-element storage code: it cannot be a cast compressor's wire
  format, nor the rounding of a psum's partial sums; both say so."""
  from jaxlp.parallel import compressors

  for fmt in (F.nvfp4(), F.mx(F.E2M1FN)):
    with pytest.raises(ValueError, match="not a FloatFormat"):
      compressors.cast(fmt)
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
