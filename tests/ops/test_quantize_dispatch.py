"""`jaxlp.ops.quantize` dispatch: spec on CPU, Pallas kernel where the predicate allows."""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp import formats as F
from jaxlp.ops.quantize import quantize
from jaxlp.pallas.quantize import quantize as pallas_quantize

dispatch_mod = sys.modules["jaxlp.ops.quantize"]
KEY = jax.random.key(5)


def _x(n=300):
  return jnp.asarray(np.random.default_rng(0).standard_normal(n).astype(np.float32) * 30)


def test_cpu_uses_spec(monkeypatch):
  calls = []
  monkeypatch.setattr(dispatch_mod, "_pallas_quantize", lambda *a, **k: calls.append(1))
  x = _x()
  out = quantize(x, F.E4M3, "stochastic", key=KEY)
  assert not calls
  np.testing.assert_array_equal(np.asarray(out), np.asarray(F.quantize(x, F.E4M3, "stochastic",
                                                                       key=KEY)))


def test_kernel_path_same_bits_and_gradient(monkeypatch):
  calls = []

  def fake_kernel(*a, **k):
    calls.append(1)
    return pallas_quantize(*a, interpret=True, **k)

  monkeypatch.setattr(dispatch_mod, "can_use_pallas_quantize", lambda x, f, r: True)
  monkeypatch.setattr(dispatch_mod, "_pallas_quantize", fake_kernel)
  x = _x()
  for fmt, r in ((F.E4M3, "stochastic"), (F.mx(F.E2M1FN, 32), "nearest")):
    out = jax.jit(functools.partial(quantize, fmt=fmt, rounding=r, key=KEY))(x)
    want = F.quantize(x, fmt, r, key=KEY)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32),
                                  np.asarray(want).view(np.uint32))
  assert len(calls) == 2
  g = jax.grad(lambda x: jnp.sum(quantize(x, F.BF16) * 2.0))(x)
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 2.0, np.float32))
