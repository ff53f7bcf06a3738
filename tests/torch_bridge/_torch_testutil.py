"""Shared helpers for the torch bridge tests."""

import jax
import numpy as np
import torch

import jaxlp.torch as jt


def special_data(n, seed=0, max_exp=30):
  """float32 values: random magnitudes over a wide range plus ±0, ±inf, NaN, subnormals."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal(n) * np.exp2(rng.integers(-max_exp, max_exp, n))).astype(np.float32)
  specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-42, 1.5, -1.5,
                       2.0**-126, -(2.0**-149)], np.float32)
  x[:len(specials)] = specials
  sub = rng.integers(1, 2**23, 64).astype(np.uint32).view(np.float32)
  x[len(specials):len(specials) + 64] = sub * np.where(rng.random(64) < 0.5, -1, 1)
  return x


def to_numpy(a):
  """``a`` as a numpy array; torch tensors (CUDA ones included) are detached and copied to
  the host first (``Tensor.numpy()`` refuses CUDA tensors)."""
  if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch.Tensor
    return a.detach().cpu().numpy()
  return np.asarray(a)


def jax_device_of(t):
  """The JAX device where ``jaxlp.torch`` runs its jitted JAX for torch tensor ``t`` (the
  device of ``jaxlp.torch.to_jax(t)``: JAX's CPU device for a CPU tensor, the matching GPU
  for a CUDA tensor).

  A JAX reference computed for a bit-for-bit comparison with a ``jaxlp.torch`` result must
  run there too: left on JAX's default device it runs on the GPU under
  ``JAX_PLATFORMS=cuda,cpu`` while the layer (CPU tensors) runs on XLA:CPU, and the two
  backends' GEMMs/convolutions sum in different orders (last-bit differences).
  """
  (dev,) = jt.to_jax(t).devices()
  return dev


def assert_same_bits(a, b, what=""):
  """Bit equality, NaN-aware (any NaN equals any NaN). Accepts numpy/JAX arrays and torch
  tensors on any device."""
  a = np.ascontiguousarray(np.asarray(to_numpy(a), np.float32))
  b = np.ascontiguousarray(np.asarray(to_numpy(b), np.float32))
  assert a.shape == b.shape, (a.shape, b.shape)
  same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
  if not same.all():
    i = np.flatnonzero(~same.ravel())[:5]
    raise AssertionError(f"{what}: {(~same).sum()} of {a.size} differ, e.g. "
                         f"{[(a.ravel()[k], b.ravel()[k]) for k in i]}")


def gpu_host() -> bool:
  """Whether torch sees a CUDA device and JAX has a GPU backend (``JAX_PLATFORMS=cuda,cpu``):
  what the CUDA paths of the torch bridge need."""
  if not torch.cuda.is_available():
    return False
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def full_batch_train(worker, world: int):
  """``worker.model_fn()``'s model trained in this process, without DDP or a hook, on the
  batches of all ``world`` ranks of a DDP worker script (``_ddp_worker.py``,
  ``_ddp_hooks_worker.py``: step ``s`` of rank ``r`` draws its batch of 32 x 16 inputs and 4
  classes from ``torch.Generator().manual_seed(1000 * s + r)``): the uncompressed mean
  gradient of every step, SGD with lr 0.1 for ``worker.STEPS`` steps."""
  model = worker.model_fn()
  opt = torch.optim.SGD(model.parameters(), lr=0.1)
  for step in range(worker.STEPS):
    xs, ys = [], []
    for rank in range(world):
      g = torch.Generator().manual_seed(1000 * step + rank)
      xs.append(torch.randn(32, 16, generator=g))
      ys.append(torch.randint(0, 4, (32,), generator=g))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    opt.step()
  return model
