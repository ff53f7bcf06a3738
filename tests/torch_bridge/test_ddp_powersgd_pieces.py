"""The PowerSGD hooks write the bits of the stages' ``finish``.

``jaxlp.torch.ddp``'s hooks run ``finish_pieces`` + ``errors`` and write the pieces into the
bucket with torch (``_powersgd_bucket``); ``_powersgd_stages``' ``finish`` assembles the
same pieces in JAX, and before rounded 16-bit values with the spec then converted them
(``_narrow`` converts with XLA, NaNs fixed). The hook is compared bit for bit here with that
``finish`` (output, error, P and Q), for the layer-wise plan (compressed matrices, vectors and
an empty tensor) and the batched square one, float32, float16 and bfloat16 buckets, with and
without error feedback, writing into a new tensor and into the bucket itself; and
``_narrow`` with the spec at every rounding boundary.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxlp.formats import BF16, FP16  # noqa: E402
from jaxlp.formats import quantize as spec_quantize  # noqa: E402
from jaxlp.torch import ddp  # noqa: E402
from jaxlp.torch._dlpack import to_jax, to_torch  # noqa: E402

W = 2


def _bits(t):
  t = t.detach()
  return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy()


def _reference(flat, plan, comp, error, q, error_feedback, monkeypatch):
  """The stages' ``finish`` with the sums of ``_sum`` (the hooks' order), 16-bit values
  rounded by the spec before the conversion (as the stages did before ``_narrow``)."""
  half = {torch.float16: FP16, torch.bfloat16: BF16}.get(flat.dtype)
  with monkeypatch.context() as m:
    m.setattr(ddp, "_narrow", lambda v, dt: spec_quantize(v, half).astype(dt))
    fns = ddp._define_stages(plan, comp, W, half, error_feedback)
    start, middle, finish = (jax.jit(fns[k]) for k in ("start", "middle", "finish"))
    e = to_jax(error) if error_feedback else to_jax(torch.zeros(0))
    xe, unc, p = start(to_jax(flat), e, to_jax(q))
    unc_sum = _sum(to_torch(unc).clone())
    p, q_loc = middle(xe, to_jax(_sum(to_torch(p).clone())))
    out, err, q_new = finish(xe, p, to_jax(_sum(to_torch(q_loc).clone())), to_jax(unc_sum))
  return (to_torch(out), None if err is None else to_torch(err),
          to_torch(p.astype(q_new.dtype)), to_torch(q_new))


def _sum(t):
  """A stand-in for the all-reduce over two ranks: the other rank sends 0.75 t."""
  return t + t * 0.75


@pytest.mark.parametrize("square,dtype,error_feedback", [
    (False, torch.float32, True), (False, torch.float32, False), (True, torch.float16, True),
    (False, torch.bfloat16, True)])
def test_hook_pieces_are_finish(square, dtype, error_feedback, monkeypatch):
  shapes = [(7,), (12, 10), (0,), (5, 2, 3), (9,)]
  n = sum(int(np.prod(s)) for s in shapes)
  rank = 2
  plan = ddp._square_plan(n, rank) if square else ddp._layerwise_plan(shapes, rank, 1.0)[0]
  assert square or (len(plan.mats), len(plan.unc)) == (2, 3)
  comp = ddp._hook_comp(rank, 1.0, 0.0, dtype != torch.float32)
  gen = torch.Generator().manual_seed(3)
  flat = torch.randn(n, generator=gen).to(dtype)
  flat[3] = 0.0
  n_err = plan.square ** 2 if square else n
  error = (torch.randn(n_err, generator=gen) * 0.1).to(dtype)
  q = ddp._draw_q(plan, 5, dtype, False)
  want = _reference(flat, plan, comp, error, q, error_feedback, monkeypatch)
  for in_place in (False, True):
    bucket = flat.clone()
    got = ddp._powersgd_bucket(bucket, plan, comp=comp, w=W, error=error, q=q, sum_fn=_sum,
                               error_feedback=error_feedback,
                               out=bucket if in_place else None)
    assert (got[0] is bucket) == in_place
    assert got[0].dtype == dtype and got[0].shape == (n,)
    for g, w in zip(got, want, strict=True):
      if w is None:
        assert g is None
      else:
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("fmt,dtype", [(FP16, jnp.float16), (BF16, jnp.bfloat16)])
def test_narrow_is_the_spec_then_a_cast(fmt, dtype):
  """``_narrow`` (XLA's float32 -> 16-bit conversion, NaNs made the spec's) gives the bits of
  the spec's rounding followed by the (then exact) conversion: every 16-bit value, the
  midpoints between neighbours and their float32 neighbours, float32 subnormals, overflow,
  infinities and NaNs of either sign and any payload."""
  vals = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16).view(
      np.float16 if dtype == jnp.float16 else jnp.bfloat16).astype(np.float32)
  v = np.unique(vals[np.isfinite(vals)])
  mid = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
  nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFBFFFFF, 0x7FA00000],
                  np.uint32).view(np.float32)
  x = np.concatenate([vals, mid, np.nextafter(mid, np.float32(np.inf)),
                      np.nextafter(mid, np.float32(-np.inf)), nans,
                      np.array([2.0 ** -149, -2.0 ** -140, 1e-40, 3.4e38, -3.4028235e38,
                                65520.0, -65519.99], np.float32)])
  x = jnp.asarray(x)
  got = jax.jit(lambda a: ddp._narrow(a, dtype))(x)
  want = jax.jit(lambda a: spec_quantize(a, fmt).astype(dtype))(x)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
