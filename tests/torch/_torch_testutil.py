"""Shared helpers for the torch bridge tests."""

import numpy as np


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


def assert_same_bits(a, b, what=""):
  """Bit equality, NaN-aware (any NaN equals any NaN)."""
  a = np.ascontiguousarray(np.asarray(a, np.float32))
  b = np.ascontiguousarray(np.asarray(b, np.float32))
  assert a.shape == b.shape, (a.shape, b.shape)
  same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
  if not same.all():
    i = np.flatnonzero(~same.ravel())[:5]
    raise AssertionError(f"{what}: {(~same).sum()} of {a.size} differ, e.g. "
                         f"{[(a.ravel()[k], b.ravel()[k]) for k in i]}")
