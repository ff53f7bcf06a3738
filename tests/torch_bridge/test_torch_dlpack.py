"""DLPack exchange: zero-copy, dtypes, devices, non-contiguous inputs, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxlp.torch as jt
from jaxlp import formats as F


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32,
                                   torch.int8, torch.uint8, torch.bool])
def test_round_trip_dtypes_zero_copy(dtype):
  t = (torch.arange(64) % 7 - 3).to(dtype).reshape(8, 8)
  a = jt.to_jax(t)
  assert a.shape == (8, 8)
  assert a.dtype == jnp.dtype(str(t.dtype).removeprefix("torch."))
  assert a.unsafe_buffer_pointer() == t.data_ptr()  # zero-copy torch -> jax
  back = jt.to_torch(a)
  assert back.dtype == dtype and back.device == t.device
  assert back.data_ptr() == t.data_ptr()  # zero-copy jax -> torch
  assert torch.equal(back, t)


def test_jax_result_to_torch_is_zero_copy():
  # on JAX's default device: a CUDA tensor where that is a GPU (JAX_PLATFORMS=cuda,cpu)
  a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 2
  t = jt.to_torch(a)
  (dev,) = a.devices()
  assert t.device.type == ("cpu" if dev.platform == "cpu" else "cuda")
  assert t.data_ptr() == a.unsafe_buffer_pointer()
  np.testing.assert_array_equal(t.cpu().numpy(), np.asarray(a))


def test_non_contiguous_made_contiguous():
  base = torch.randn(6, 10)
  for t in (base.t(), base[:, ::2], base[1:5, 3:7], base.t()[::3]):
    assert not t.is_contiguous()
    a = jt.to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    q = jt.quantize(t, F.E4M3)
    assert q.is_contiguous() and q.shape == t.shape
    np.testing.assert_array_equal(q.numpy(), np.asarray(F.quantize(jnp.asarray(t.numpy()),
                                                                   F.E4M3)))


def test_requires_grad_and_negated_views():
  t = torch.randn(5, requires_grad=True)
  np.testing.assert_array_equal(np.asarray(jt.to_jax(t)), t.detach().numpy())
  c = torch.randn(4, dtype=torch.complex64).conj()
  np.testing.assert_array_equal(np.asarray(jt.to_jax(c)), c.resolve_conj().numpy())


def test_errors():
  with pytest.raises(TypeError, match="torch.Tensor"):
    jt.to_jax(np.ones(3))
  with pytest.raises(TypeError, match="jax.Array"):
    jt.to_torch(torch.ones(3))
  with pytest.raises(ValueError, match="device"):
    jt.to_jax(torch.ones(3, device="meta"))
  with pytest.raises(TypeError, match="dtype"):
    jt.to_jax(torch.ones(3, dtype=torch.float8_e4m3fn))
  with pytest.raises(TypeError, match="jax_enable_x64"):
    jt.to_jax(torch.ones(3, dtype=torch.float64))
  for dt in (torch.float64, torch.int32):
    with pytest.raises(TypeError, match="float32, torch.float16 or torch.bfloat16"):
      jt.quantize(torch.ones(3, dtype=dt), F.E4M3)
    with pytest.raises(TypeError, match="dtype"):
      jt.float_quantize(torch.ones(3, dtype=dt), 5, 2)


def test_sharded_array_rejected():
  # the forced CPU devices (tests/conftest.py: 8); jax.devices() may be a single GPU
  devs = jax.devices("cpu")
  assert len(devs) >= 2, "tests/conftest.py forces 8 CPU devices"
  mesh = jax.make_mesh((2,), ("x",), devices=devs[:2])
  a = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(mesh,
                                                                 jax.sharding.PartitionSpec("x")))
  with pytest.raises(ValueError, match="sharded"):
    jt.to_torch(a)


def test_unaligned_view_still_correct():
  base = torch.arange(17, dtype=torch.float32)
  t = base[1:]  # starts 4 bytes into the storage: JAX may copy, values must be right
  np.testing.assert_array_equal(np.asarray(jt.to_jax(t)), t.numpy())
  np.testing.assert_array_equal(jt.quantize(t, F.E5M2).numpy(),
                                np.asarray(F.quantize(jnp.asarray(t.numpy()), F.E5M2)))


@pytest.mark.parametrize("fast", [True, False], ids=["direct-import", "public-from_dlpack"])
def test_to_jax_direct_import_and_its_fallback_agree(fast, monkeypatch):
  """to_jax calls jaxlib's DLPack import directly where the private entry point has the
  expected signature (checked once), else jax.dlpack.from_dlpack: same array, zero-copy."""
  from jaxlp.torch import _dlpack

  if fast and _dlpack._buffer_from_capsule() is None:
    pytest.skip("this jaxlib has no compatible dlpack_managed_tensor_to_buffer")
  if not fast:
    monkeypatch.setattr(_dlpack, "_buffer_from_capsule", lambda: None)
  for t in (torch.randn(5, 7), torch.arange(10, dtype=torch.int32), torch.ones(0),
            torch.randn(3, 4).t()):
    a = jt.to_jax(t)
    assert a.shape == tuple(t.shape) and a.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    if t.is_contiguous() and t.numel():
      assert a.unsafe_buffer_pointer() == t.data_ptr()
