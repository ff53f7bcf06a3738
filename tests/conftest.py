"""Test configuration: 8 forced CPU devices (set before jax is imported).

On a GPU machine (``JAX_PLATFORMS=cuda,cpu``) the default backend is the GPU and
``jax.devices()`` lists only it; the 8 forced CPU devices are still there as
``jax.devices("cpu")``. Tests that need several devices take them from there (see the
``cpu_devices`` fixture) instead of from ``jax.devices()``.
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, shared by the pytest-xdist workers and
# the subprocesses the tests start (jaxlp train, examples, benchmarks, multi-process jobs): a
# program that several processes compile is compiled once. Created by the first process that
# loads this file (the xdist controller, before it starts the workers) and removed when that
# process exits; a cache directory given in the environment is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="jaxlp-tests-jit-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

N_CPU_DEVICES = 8


@pytest.fixture
def cpu_devices():
  """The forced CPU devices, with JAX's default device pinned to the first of them.

  For tests that compare a multi-device run (a mesh or pmap over these CPU devices) with a
  single-device run bit for bit: with the default device pinned, the single-device parts
  (vmap references, ``jnp`` inputs, eager ops) run on XLA:CPU as well, so one backend is
  compared with itself whatever the default backend is. On a CPU-only run this changes
  nothing (CPU device 0 already is the default device).
  """
  devs = jax.devices("cpu")
  if len(devs) < N_CPU_DEVICES:
    pytest.fail(f"tests/conftest.py forces {N_CPU_DEVICES} CPU devices but jax.devices('cpu') "
                f"has {len(devs)} (was jax initialised before XLA_FLAGS was set?)")
  with jax.default_device(devs[0]):
    yield devs
