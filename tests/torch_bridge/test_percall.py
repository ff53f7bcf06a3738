"""The per-call fast path of jaxlp.torch: cached compiled executables keep the JAX spec's bits,
bad input is still refused on a cached key, and a repeated call does not trace again."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _torch_testutil import assert_same_bits, special_data

import jaxlp.torch as jt
from jaxlp import formats as F
from jaxlp.torch import _quantize as Q

_ref = jax.jit(lambda x, k, fmt, r: F.quantize(x, fmt, r, key=k), static_argnums=(2, 3))
_JDT = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


def _expect(t, fmt, rounding, seed):
  x = jnp.asarray(t.float().numpy()).astype(_JDT[t.dtype])
  return _ref(x, jax.random.key(seed), fmt, rounding).astype(jnp.float32)


def test_cached_path_same_bits_as_spec_while_the_key_changes():
  base = special_data(96, seed=21)[::2].copy()  # specials and subnormals included
  base[~np.isfinite(base)] = 0.0  # block formats: finite inputs
  cases = [  # (format, rounding, shape, dtype): each call below switches the cache key
      (F.E4M3, "nearest", (48,), torch.float32),
      (F.E4M3, "stochastic", (48,), torch.float32),
      (F.E4M3, "nearest", (6, 8), torch.float32),
      (F.E4M3, "nearest", (48,), torch.bfloat16),
      (F.qpytorch_float(5, 2), "stochastic", (6, 8), torch.float32),
      (F.qpytorch_block(6, 0), "nearest", (6, 8), torch.float32),
      (F.FixedPoint(8, 4), "stochastic", (48,), torch.float16),
  ]
  for rep in range(2):
    for i, (fmt, rounding, shape, dtype) in enumerate(cases):
      t = torch.from_numpy(base.reshape(shape)).to(dtype)
      seed = 100 * rep + i
      out = jt.quantize(t, fmt, rounding, seed=seed)
      assert out.dtype == dtype and out.shape == shape
      assert_same_bits(out.float(), _expect(t, fmt, rounding, seed), f"{fmt!r} {rounding} {rep}")
  # a non-contiguous view and a tensor that requires grad take the same executable
  t = torch.from_numpy(base.reshape(8, 6)).t()
  assert_same_bits(jt.quantize(t, F.E4M3), _expect(t.contiguous(), F.E4M3, "nearest", 0), "view")
  g = torch.from_numpy(base.reshape(6, 8)).requires_grad_()
  assert_same_bits(jt.quantize(g, F.E4M3).detach(), _expect(g.detach(), F.E4M3, "nearest", 0),
                   "requires_grad")


def test_bad_input_is_refused_on_a_cached_key():
  t = torch.ones(8)
  jt.quantize(t, F.E4M3)
  jt.quantize(t, F.E4M3, "stochastic", seed=1)
  jt.quantize(t, F.cpd_float(4, 3))
  jt.float_quantize(t, 5, 2, "nearest")
  jt.fixed_point_quantize(t, 8, 4, rounding="nearest")
  jt.block_quantize(t, 8, 0, "nearest")
  with pytest.raises(ValueError, match="rounding"):
    jt.quantize(t, F.E4M3, "bogus")
  with pytest.raises(ValueError, match="rounding"):
    jt.quantize(t, F.cpd_float(4, 3), "stochastic")  # a rounding the format lacks
  with pytest.raises(TypeError, match="dtype"):
    jt.quantize(t.double(), F.E4M3)
  with pytest.raises(TypeError, match="dtype"):
    jt.float_quantize(t.double(), 5, 2, "nearest")
  with pytest.raises(TypeError, match="torch.Tensor"):
    jt.quantize(t.numpy(), F.E4M3)
  with pytest.raises(ValueError, match="seed"):
    jt.quantize(t, F.E4M3, "stochastic", seed=2**64)
  with pytest.raises(TypeError, match="seed"):
    jt.quantize(t, F.E4M3, "stochastic", seed=1.0)
  with pytest.raises(ValueError, match="not both"):
    jt.quantize(t, F.E4M3, "stochastic", seed=1, generator=torch.Generator())
  with pytest.raises(ValueError, match="exp"):
    jt.float_quantize(t, 5.0, 2, "nearest")  # 5 is cached: 5.0 is still refused
  with pytest.raises(ValueError, match="exp"):
    jt.float_quantize(t, [5], 2, "nearest")  # unhashable: the constructor's own error
  with pytest.raises(TypeError, match="clamp"):
    jt.fixed_point_quantize(t, 8, 4, clamp=1, rounding="nearest")
  with pytest.raises(ValueError, match="dim|axis"):
    jt.block_quantize(t, 8, 1, "nearest")  # dim 1 of a 1-d tensor
  with pytest.raises(ValueError, match="device"):
    jt.quantize(torch.ones(8, device="meta"), F.E4M3)
  with pytest.raises(TypeError, match="dtype"):
    Q.quantize_raw(t.double(), F.E4M3, "nearest", None)


def test_a_repeated_call_does_not_trace_again(monkeypatch):
  traces = []
  kernel = Q._kernel

  def counting_kernel(*args):
    traces.append(args[:3])
    return kernel(*args)

  monkeypatch.setattr(Q, "_kernel", counting_kernel)
  # a format the CPU tensors' NumPy path does not take (jaxlp/torch/_cpu.py): the JAX route
  fmt = F.mx(F.E4M3FN, 5)
  t = torch.linspace(-3.0, 3.0, 15).reshape(3, 5)  # a shape no other test uses
  first = jt.quantize(t, fmt, "stochastic", seed=0)
  for seed in (0, 1, 2):
    jt.quantize(t, fmt, "stochastic", seed=seed)
    jt.quantize(t + 1, fmt, "stochastic", seed=seed)  # new values, same key
  assert len(traces) == 1, traces
  torch.testing.assert_close(jt.quantize(t, fmt, "stochastic", seed=0), first, rtol=0, atol=0)
  jt.quantize(t.reshape(15), fmt, "stochastic", seed=0)  # a new shape is a new key
  assert len(traces) == 2
  # the formats of the NumPy path compile nothing, whatever the shape
  for shape in ((15,), (3, 5), (5, 3), (1, 15, 1)):
    jt.quantize(t.reshape(shape), F.qpytorch_float(4, 3), "stochastic", seed=0)
    jt.float_quantize(t.reshape(shape), 4, 3, "nearest")
  assert len(traces) == 2


def test_threads_share_the_cache():
  x = torch.from_numpy(special_data(128, seed=5))
  want = jt.quantize(x, F.E5M2, "stochastic", seed=9)
  got, errors = [], []

  def work():
    try:
      for _ in range(20):
        got.append(jt.quantize(x, F.E5M2, "stochastic", seed=9))
    except Exception as e:  # noqa: BLE001 -- reported below
      errors.append(e)

  threads = [threading.Thread(target=work) for _ in range(3)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  assert not errors, errors
  assert len(got) == 60
  for g in got:
    assert_same_bits(g, want, "thread")


def test_dlpack_fast_paths_share_memory():
  x = torch.arange(8, dtype=torch.float32)
  a = jt.to_jax(x)
  y = jt.to_torch(a)
  assert y.data_ptr() == x.data_ptr()
  w = torch.ones(4, requires_grad=True)
  assert jt.to_torch(jt.to_jax(w)).requires_grad is False
  assert jt.to_torch(jt.to_jax(torch.arange(6.0).reshape(2, 3).t())).tolist() == \
      [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
