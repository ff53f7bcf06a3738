"""The fp16/bf16 hooks' torch arithmetic is the JAX engine's, bit for bit.

``jaxlp.torch.ddp`` computes PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook`` with
torch ops (``to(dtype)``, division and adds in the 16-bit dtype) where they give the bits of
the engine's definition (``jaxlp.parallel._aggregate.cast_share`` and ``cast_gathered_sum``):
checked here over every 16-bit value, the rounding boundaries of float32 inputs, subnormals,
overflow, ties, signed zeros, infinities and NaN, for 2 to 5 ranks (and 8 and 16 for the
division); and the hook's own entry (``_cast_mean``) against the engine's jitted path, with
torch's subnormals on and flushed (the jitted path then runs).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxlp.parallel import _aggregate as A  # noqa: E402
from jaxlp.parallel import compressors as C  # noqa: E402
from jaxlp.torch import ddp  # noqa: E402

DTYPES = {"fp16": (torch.float16, np.float16), "bf16": (torch.bfloat16, None)}


def _bits(t):
  """float32 bit patterns of a torch tensor or array (16-bit values widened exactly)."""
  if isinstance(t, torch.Tensor):
    t = t.float().numpy()
  return np.asarray(t, np.float32).view(np.uint32)


def _same(got, want, nan_payload=True):
  g, w = _bits(got), _bits(want)
  if not nan_payload:  # NaN anywhere in one iff in the other; other bits equal
    gn, wn = np.isnan(g.view(np.float32)), np.isnan(w.view(np.float32))
    np.testing.assert_array_equal(gn, wn)
    g, w = g[~gn], w[~wn]
  np.testing.assert_array_equal(g, w)


def _all_values(dtype):
  """Every 16-bit pattern of ``dtype`` as float32 (exact)."""
  return torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype).float()


def _boundaries(values):
  """float32 inputs around every rounding boundary of the 16-bit grid: each midpoint between
  neighbours and its float32 neighbours, plus float32 subnormals and huge values."""
  v = np.unique(values[np.isfinite(values)])
  mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
  near = [mid, np.nextafter(mid, np.float32(np.inf)), np.nextafter(mid, np.float32(-np.inf))]
  extra = np.array([2.0 ** -149, -2.0 ** -149, 2.0 ** -127, 1e-40, -1e-45, 65519.996, 65520.0,
                    -65520.0, 3.4e38, -3.4e38, np.finfo(np.float32).max, np.inf, -np.inf,
                    np.nan, 0.0, -0.0], np.float32)
  return torch.from_numpy(np.concatenate(near + [extra]))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_share_is_cast_share(name):
  """``to(dtype) / w`` = ``cast_share``: every 16-bit value divided by 2..16, and the float32
  rounding boundaries (w = 2, 3)."""
  comp = C.cast(name)
  tdt, _ = DTYPES[name]
  vals = _all_values(tdt)
  inputs = {w: vals for w in (2, 3, 4, 5, 7, 8, 16)}
  bounds = _boundaries(vals.numpy())
  for w in (2, 3):
    inputs[w] = torch.cat([inputs[w], bounds])
  for w, x in inputs.items():
    got = ddp._cast_share_torch(x, tdt, w)
    want = jax.jit(lambda v, w=w: A.cast_share(comp, v, w))(jnp.asarray(x.numpy()))
    assert got.dtype == tdt
    _same(got, want, nan_payload=False)  # torch's NaN payloads: _cast_mean fixes them


def _special(dtype):
  """16-bit values where sums round, tie, vanish, overflow or are NaN."""
  f = torch.finfo(dtype)
  v = [0.0, -0.0, f.tiny, -f.tiny, f.smallest_normal * 2 ** -3, f.eps, 1.0, -1.0, 1.0 + f.eps,
       1.5, 3.0, f.max, -f.max, f.max / 2, float("inf"), float("-inf"), float("nan"), 1e-3,
       -7e-4, 2.0 ** -24, 2.0 ** -133, -2.0 ** -130]
  return torch.tensor(v, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_sum_is_cast_gathered_sum(name):
  """The torch sums in psum's ring order = ``cast_gathered_sum`` (NaN where it has NaN; the
  payload is fixed by ``_cast_mean``): two ranks, every 16-bit value plus each special value;
  3 to 5 ranks, random values of every magnitude with the specials mixed in."""
  comp = C.cast(name)
  tdt, _ = DTYPES[name]
  gathered = jax.jit(lambda s: A.cast_gathered_sum(comp, s))
  vals, sp = _all_values(tdt).to(tdt), _special(tdt)
  a = vals.repeat(len(sp))
  b = sp.repeat_interleave(len(vals))
  for stack in (torch.stack([a, b]),):
    _same(ddp._cast_gathered_sum_torch(stack), gathered(jnp.asarray(stack.float().numpy())),
          nan_payload=False)
  rng = np.random.default_rng(0)
  for w in (3, 4, 5):
    x = rng.standard_normal((w, 4099)) * 10.0 ** rng.integers(-30, 30, (w, 4099))
    stack = torch.from_numpy(x.astype(np.float32)).to(tdt)
    stack[:, :len(sp)] = sp.roll(w)
    stack[w - 1, len(sp):2 * len(sp)] = sp
    _same(ddp._cast_gathered_sum_torch(stack), gathered(jnp.asarray(stack.float().numpy())),
          nan_payload=False)
  assert ddp._cast_gathered_sum_torch(torch.ones(1, 3, dtype=tdt)).tolist() == [1.0] * 3


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_hook_mean_is_the_engines(name, monkeypatch):
  """``_cast_mean`` (what fp16_compress_hook / bf16_compress_hook run) writes the bits the
  engine's jitted path wrote before (its float32 result copied into the bucket), NaNs
  included, into a float32 bucket and a 16-bit one (inside the compress wrappers), for 3
  ranks: the torch path, and with torch flushing subnormals (``torch.set_flush_denormal``)
  the jitted path it then takes."""
  comp = C.cast(name)
  tdt, _ = DTYPES[name]
  w = 3
  rng = np.random.default_rng(1)
  x = torch.from_numpy((rng.standard_normal((w, 777)) *
                        10.0 ** rng.integers(-44, 5, (w, 777))).astype(np.float32))
  x[:, :6] = torch.tensor([0.0, -0.0, 3e38, float("nan"), 1e-39, -65504.0])
  x[1, 6], x[2, 6] = float("inf"), float("-inf")  # inf - inf: NaN
  share, total = ddp._cast_fns(comp, w)
  shares = torch.stack([ddp.to_torch(share(jnp.asarray(x[r].numpy()))) for r in range(w)])
  want = ddp.to_torch(total(ddp.to_jax(shares)))
  assert torch.isnan(want[:8]).sum() == 2

  def fake_gather(t, group):  # rank 0's own addend, then the other ranks'
    assert group == "g"
    _same(t, shares[0], nan_payload=False)
    return shares.to(t.dtype)

  monkeypatch.setattr(ddp, "_gather_bits", fake_gather)

  def check():
    for dt in (torch.float32, tdt):
      buf = x[0].clone().to(dt)
      got = ddp._cast_mean(comp, buf, "g", w, out=buf)
      assert got is buf
      np.testing.assert_array_equal(buf.view(torch.int16 if dt == tdt else torch.int32).numpy(),
                                    torch.empty_like(buf).copy_(want).view(buf.dtype).view(
                                        torch.int16 if dt == tdt else torch.int32).numpy())
    _same(ddp._cast_mean(comp, x[0], "g", w), want)

  assert ddp._torch_keeps_subnormals()
  check()
  if not torch.set_flush_denormal(True):
    pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")
  try:
    assert not ddp._torch_keeps_subnormals()
    check()
  finally:
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_wrapper_rounding_is_the_specs(name, monkeypatch):
  """``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` round the bucket with torch's
  ``to(dtype)`` (finite buckets) or the jitted spec (a bucket with inf or NaN): the spec's
  bits either way, at every rounding boundary of the 16-bit grid (the largest values one at
  a time, so that the finiteness check's sum does not overflow)."""
  from jaxlp.formats import BF16, FP16  # noqa: PLC0415
  fmt, jdt = {"fp16": (FP16, jnp.float16), "bf16": (BF16, jnp.bfloat16)}[name]
  tdt, _ = DTYPES[name]
  x = _boundaries(_all_values(tdt).numpy())
  spec = ddp._round_fn(fmt, jdt)

  def want(flat):
    return ddp.to_torch(spec(ddp.to_jax(flat))).view(torch.int16).numpy()

  got = ddp._round_to_half(x, fmt, jdt)  # inf and NaN inside: the spec
  assert got.dtype == tdt
  np.testing.assert_array_equal(got.view(torch.int16).numpy(), want(x))
  small = x[torch.isfinite(x) & (x.abs() < 1e30)]
  huge = x[torch.isfinite(x) & (x.abs() >= 1e30)]
  assert len(huge) >= 3
  want_small, want_huge = want(small), want(huge)
  monkeypatch.setattr(ddp, "_round_fn", None)  # torch's path only from here on
  got = ddp._round_to_half(small, fmt, jdt)
  np.testing.assert_array_equal(got.view(torch.int16).numpy(), want_small)
  got = torch.cat([ddp._round_to_half(v, fmt, jdt) for v in huge.reshape(-1, 1)])
  np.testing.assert_array_equal(got.view(torch.int16).numpy(), want_huge)
