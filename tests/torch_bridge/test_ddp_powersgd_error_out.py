"""A float32 PowerSGD bucket's new error written into the state's own tensor
(``_powersgd_bucket(..., error_out=...)``, what the hooks and CommState pass) has the bits of
a new tensor, step after step; a tensor that does not fit (another dtype, length or a
non-contiguous view) is left alone and a new one returned."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxlp.torch import ddp  # noqa: E402

W = 2


def _sum(t):
  """A stand-in for the all-reduce over two ranks: the other rank sends 0.75 t."""
  return t + t * 0.75


def _bits(t):
  return t.detach().contiguous().view(torch.int32).numpy()


def _steps(plan, flat0, error_out_of, steps=2):
  """``steps`` PowerSGD steps; ``error_out_of(error)`` picks ``error_out``."""
  comp = ddp._hook_comp(2, 1.0, 0.0, False)
  n_err = plan.square ** 2 if plan.square else plan.numel
  error = torch.zeros(n_err)
  q = ddp._draw_q(plan, 7, torch.float32, False)
  res = []
  for k in range(steps):
    bucket = flat0 * (k + 1)
    target = error_out_of(error)
    out, err, p, q = ddp._powersgd_bucket(bucket, plan, comp=comp, w=W, error=error, q=q,
                                          sum_fn=_sum, error_feedback=True, out=bucket,
                                          error_out=target)
    res.append((out.clone(), err.clone(), p.clone(), q.clone(), err, target))
    error = err
  return res


def test_error_written_into_the_given_tensor_has_the_same_bits():
  shapes = [(7,), (12, 10), (0,), (5, 2, 3), (9,)]
  n = sum(int(np.prod(s)) for s in shapes)
  plan = ddp._layerwise_plan(shapes, 2, 1.0)[0]
  flat0 = torch.randn(n, generator=torch.Generator().manual_seed(1))
  flat0[2] = -0.0
  want = _steps(plan, flat0, lambda e: None)
  got = _steps(plan, flat0, lambda e: e)  # the state's own tensor, as the hooks pass it
  for g, w in zip(got, want, strict=True):
    assert g[4].data_ptr() == g[5].data_ptr()  # written in place
    for a, b in zip(g[:4], w[:4], strict=True):
      np.testing.assert_array_equal(_bits(a), _bits(b))
  # tensors that do not fit are not written
  n_other = torch.zeros(n + 1)
  halves = torch.zeros(n, dtype=torch.float16)
  strided = torch.zeros(2 * n)[::2]
  for bad in (n_other, halves, strided):
    before = bad.clone()
    res = _steps(plan, flat0, lambda e, bad=bad: bad, steps=1)
    assert res[0][4].data_ptr() != bad.data_ptr() and torch.equal(bad, before)
    np.testing.assert_array_equal(_bits(res[0][1]), _bits(want[0][1]))


def test_batched_error_is_the_finish_output():
  """The batched hook's error (``s * s`` long) is the last stage's own output: ``error_out``
  is not used, and the bits are those of a run without it."""
  n = 30
  plan = ddp._square_plan(n, 2)
  flat0 = torch.randn(n, generator=torch.Generator().manual_seed(2))
  want = _steps(plan, flat0, lambda e: None)
  got = _steps(plan, flat0, lambda e: e)
  for g, w in zip(got, want, strict=True):
    assert g[4].data_ptr() != g[5].data_ptr() and g[4].numel() == plan.square ** 2
    for a, b in zip(g[:4], w[:4], strict=True):
      np.testing.assert_array_equal(_bits(a), _bits(b))
