"""Parity of the QPyTorch drop-ins with live QPyTorch (qtorch 0.3.0, CPU build)."""

import numpy as np
import pytest
import torch
from _torch_testutil import assert_same_bits, special_data

import jaxlp.torch as jt
from jaxlp import formats as F

# one xdist worker for every module that imports qtorch (tests/formats/test_qtorch_parity.py)
pytestmark = pytest.mark.xdist_group("qtorch")

N = 4096
FAST_MANS = (1, 2, 3, 4, 7, 10, 13, 22)


def _float_case(qq, exp, mans):
  x = torch.from_numpy(special_data(N, seed=exp))
  for man in mans:
    ref = qq.float_quantize(x.clone(), exp, man, "nearest")
    assert_same_bits(jt.float_quantize(x, exp, man, "nearest").numpy(), ref.numpy(),
                     f"float_quantize exp={exp} man={man}")


@pytest.mark.parametrize("exp", range(2, 9))
def test_float_quantize_nearest(qtorch_quant, exp):
  _float_case(qtorch_quant, exp, FAST_MANS)


@pytest.mark.slow
@pytest.mark.parametrize("exp", range(2, 9))
def test_float_quantize_nearest_all_man(qtorch_quant, exp):
  _float_case(qtorch_quant, exp, [m for m in range(1, 23) if m not in FAST_MANS])


def _block_data(shape, seed):
  rng = np.random.default_rng(seed)
  x = special_data(int(np.prod(shape)), seed=seed, max_exp=20).reshape(shape)
  x[np.isinf(x) | np.isnan(x)] = 1.0
  # per-row scales so blocks have different exponents; one all-zero row, one tiny row
  x = x * np.exp2(rng.integers(-8, 8, (shape[0],) + (1,) * (len(shape) - 1))).astype(np.float32)
  x[1] = 0
  x[2] = np.float32(1e-40)  # a block whose max is a float32 subnormal (degenerate base 0)
  return x


@pytest.mark.parametrize("wl", [2, 3, 4, 5, 6, 8, 11, 16])
def test_block_quantize_nearest(qtorch_quant, wl):
  for dim, shape in ((-1, (64, 64)), (0, (64, 64)), (1, (64, 64)), (1, (8, 16, 32))):
    x = _block_data(shape, seed=wl)
    ref = qtorch_quant.block_quantize(torch.from_numpy(x.copy()), wl, dim, "nearest")
    out = jt.block_quantize(torch.from_numpy(x), wl, dim, "nearest")
    assert_same_bits(out.numpy(), ref.numpy(), f"block_quantize wl={wl} dim={dim} {shape}")


def test_block_quantize_specials(qtorch_quant):
  # inf/NaN in a block: QPyTorch's arithmetic makes the whole block NaN; jaxlp too.
  x = special_data(N, seed=7).reshape(64, 64)
  x[x > 1e30] = 1e30  # block max >= 2**127 overflows QPyTorch's 6*2**E (x86 default NaN)
  for wl in (4, 8):
    for dim in (-1, 0, 1):
      ref = qtorch_quant.block_quantize(torch.from_numpy(x.copy()), wl, dim, "nearest")
      assert_same_bits(jt.block_quantize(torch.from_numpy(x), wl, dim, "nearest").numpy(),
                       ref.numpy(), f"block specials wl={wl} dim={dim}")


FIXED = [(8, 4), (8, 2), (4, 1), (16, 8), (12, 10), (24, 6), (26, 4), (30, 20), (32, 2),
         (2, 1), (9, 23), (8, 130)]


def _fixed_data(fl, seed):
  rng = np.random.default_rng(seed)
  parts = [
      (rng.standard_normal(1024) * 8).astype(np.float32),
      (rng.integers(-2**10, 2**10, 512) * 0.5 * 2.0**-fl).astype(np.float32),  # ties
      special_data(1024, seed=seed),
      (rng.integers(2**23, 2**24, 256) * 2.0**-fl * np.where(rng.random(256) < .5, -1, 1)),
      ((0.5 + rng.integers(-8, 8, 64) * 2.0**-25) * 2.0**-fl),  # y just above/below 0.5
      (rng.standard_normal(512) * 2.0**-fl),
  ]
  return np.concatenate([np.asarray(p, np.float32) for p in parts])


@pytest.mark.parametrize("wl,fl", FIXED)
def test_fixed_point_quantize_nearest(qtorch_quant, wl, fl):
  x = _fixed_data(fl, seed=wl * 100 + fl)
  for clamp in (True, False):
    for sym in (True, False):
      ref = qtorch_quant.fixed_point_quantize(torch.from_numpy(x.copy()), wl, fl, clamp, sym,
                                              "nearest")
      out = jt.fixed_point_quantize(torch.from_numpy(x), wl, fl, clamp, sym, "nearest")
      assert_same_bits(out.numpy(), ref.numpy(), f"fixed wl={wl} fl={fl} {clamp=} {sym=}")


def test_jaxlp_fixed_point_rne_is_not_qpytorch_cpu(qtorch_quant):
  """Documents why the drop-in uses QPyTorchFixedPoint: plain RNE differs from QPyTorch CPU."""
  x = torch.tensor([-0.0, 0.25 + 2.0**-25, 2.0**22 + 0.5, -1e-42], dtype=torch.float32)
  ref = qtorch_quant.fixed_point_quantize(x.clone(), 32, 1, False, False, "nearest")
  rne = jt.quantize(x, F.FixedPoint(32, 1, clamp=False))
  exact = jt.fixed_point_quantize(x, 32, 1, False, False, "nearest")
  assert_same_bits(exact.numpy(), ref.numpy(), "QPyTorchFixedPoint")
  assert (rne.numpy().view(np.uint32) != ref.numpy().view(np.uint32)).sum() >= 2


def _sr_mean_check(out_fn, ref_fn, x, reps, tol):
  ours = torch.stack([out_fn(x) for _ in range(reps)]).double().mean(0)
  theirs = torch.stack([ref_fn(x) for _ in range(reps)]).double().mean(0)
  err = (ours - theirs).abs().max().item()
  assert err < tol, err
  # and both are unbiased estimates of x
  assert (ours - x.double()).abs().max().item() < tol


def test_stochastic_means_match(qtorch_quant):
  torch.manual_seed(0)
  x = (torch.rand(256) * 3.8 - 1.9).float()  # inside every clip range
  reps = 400
  # grid step of E5M2 near |x|<=2 is <= 0.25: std of a mean of 400 SR draws <= 0.25/2/20
  _sr_mean_check(lambda t: jt.float_quantize(t, 5, 2),
                 lambda t: qtorch_quant.float_quantize(t, 5, 2), x, reps, 0.06)
  _sr_mean_check(lambda t: jt.fixed_point_quantize(t, 8, 3),
                 lambda t: qtorch_quant.fixed_point_quantize(t, 8, 3), x, reps, 0.04)
  _sr_mean_check(lambda t: jt.block_quantize(t, 6),
                 lambda t: qtorch_quant.block_quantize(t, 6), x, reps, 0.05)


def test_stochastic_is_not_nearest_and_reproducible():
  x = torch.rand(1024) * 3
  torch.manual_seed(1)
  a = jt.float_quantize(x, 5, 2)
  torch.manual_seed(1)
  b = jt.float_quantize(x, 5, 2)
  c = jt.float_quantize(x, 5, 2)
  assert torch.equal(a, b) and not torch.equal(b, c)
  assert not torch.equal(a, jt.float_quantize(x, 5, 2, "nearest"))
