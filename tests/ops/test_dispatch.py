"""`jaxlp.quantize` / `jaxlp.matmul` dispatch: by the platform compiled for, and by the
measured-faster tables (`KERNEL_IS_FASTER`); the kernel and the spec give the same bits.

The kernel branch is staged with ``lax.platform_dependent``: lowering for CPU keeps only the
spec, lowering for CUDA (done here on the CPU, see tests/pallas/cuda_lowering.py) keeps the
kernel where the table says it is faster. To run the kernel branch on a CPU, the tests
re-point the kernel platform to "cpu" and run the kernel in interpret mode.
"""

import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlp
from jaxlp import formats as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pallas"))
import cuda_lowering as CL  # noqa: E402

OQ = importlib.import_module("jaxlp.ops._quantize")
OM = importlib.import_module("jaxlp.ops._matmul")
PQ = importlib.import_module("jaxlp.pallas._quantize")
PM = importlib.import_module("jaxlp.pallas._matmul")
KEY = jax.random.key(5)

#: One format of every kernel family (jaxlp.pallas._quantize.family).
FAMILY_FORMATS = {
    "elementwise": F.E4M3,
    "axis_blocks": F.BlockFormat(7, axis=-1, block_size=16),
    "tiles": F.hbfp(8, 24),
    "mx": F.mx(F.E2M1FN, 32),
    "scaled_blocks": F.nvfp4(),
}


def test_every_family_has_an_example():
  assert set(FAMILY_FORMATS) == set(PQ.KERNEL_IS_FASTER)
  for fam, fmt in FAMILY_FORMATS.items():
    assert PQ.family(fmt, (256, 256)) == fam


def _x(shape=(256, 256), seed=0):
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 30
  return jnp.asarray(x)


def _on_cpu(x):
  return jax.device_put(x, jax.devices("cpu")[0])


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.fixture
def fresh_dispatch():
  """Dispatch caches are cleared before and after (tests change what gets staged)."""
  for f in (OQ._dispatch, OM._dispatch):
    f.clear_cache()
  yield
  for f in (OQ._dispatch, OM._dispatch):
    f.clear_cache()


def _kernel_everywhere(monkeypatch):
  """Every family's kernel counts as faster, and small arrays qualify."""
  monkeypatch.setattr(PQ, "KERNEL_IS_FASTER", dict.fromkeys(PQ.KERNEL_IS_FASTER, True))
  monkeypatch.setattr(PQ, "MIN_PALLAS_SIZE", 64)


# ---------------------------------------------------------------------------------------
# quantize
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", sorted(FAMILY_FORMATS))
def test_cuda_lowering_runs_the_kernel_exactly_where_measured_faster(fam, fresh_dispatch):
  fmt = FAMILY_FORMATS[fam]
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  _, mods = CL.lower_for_cuda(lambda x: jaxlp.quantize(x, fmt, "stochastic", key=KEY), x)
  assert bool(mods) == PQ.KERNEL_IS_FASTER[fam], (fam, CL.kernel_names(mods))
  small = jax.ShapeDtypeStruct((8, 64), jnp.float32)  # below MIN_PALLAS_SIZE: the spec
  _, mods = CL.lower_for_cuda(lambda x: jaxlp.quantize(x, fmt), small)
  assert not mods


def test_cpu_lowering_runs_the_spec(monkeypatch, fresh_dispatch):
  """Even where every kernel is preferred, a computation compiled for the CPU (here: the
  array committed to a CPU device, as on a GPU host) contains no Pallas kernel."""
  _kernel_everywhere(monkeypatch)
  x = jax.device_put(_x(), jax.devices("cpu")[0])
  # one program per family, lowered once and run: the dispatched quantize and the spec
  for fam, fmt in FAMILY_FORMATS.items():
    f = functools.partial(jaxlp.quantize, fmt=fmt, rounding="stochastic", key=KEY)
    lowered = jax.jit(lambda x, f=f, fmt=fmt: (
        f(x), F.quantize(x, fmt, "stochastic", key=KEY))).lower(x)
    text = lowered.as_text()
    assert "triton" not in text and "pallas" not in text, fam
    got, want = lowered.compile()(x)
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=fam)


#: The rounding of each family (sorted) in test_kernel_branch_same_bits_gradient_and_vmap.
ROTATION = ("stochastic", "nearest", "down", "stochastic", "up")


def test_kernel_branch_same_bits_gradient_and_vmap(monkeypatch, fresh_dispatch):
  calls = []

  def interpreted(*args, **kw):
    calls.append(args[2])
    return PQ.quantize_words(*args, interpret=True, **kw)

  _kernel_everywhere(monkeypatch)
  monkeypatch.setattr(OQ, "_KERNEL_PLATFORMS", ("cpu",))
  monkeypatch.setattr(OQ, "_kernel_words", interpreted)
  x = _on_cpu(_x((16, 64)))  # compiled for the CPU on any host (the re-pointed platform)
  # Each rounding through the dispatch on a rotation of the families (stochastic, with its
  # key, twice), all in one program; every family's kernel with every rounding against the
  # spec: tests/pallas/test_pallas_quantize.py.
  cases = [(fam, r) for fam, r in zip(sorted(FAMILY_FORMATS), ROTATION, strict=True)]

  @jax.jit
  def both(x):
    return [(jaxlp.quantize(x, FAMILY_FORMATS[fam], r, key=KEY),
             F.quantize(x, FAMILY_FORMATS[fam], r, key=KEY)) for fam, r in cases]

  for (fam, r), (got, want) in zip(cases, both(x), strict=True):
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"{fam} {r}")
  assert calls == [FAMILY_FORMATS[fam] for fam, _ in cases]
  fmt = FAMILY_FORMATS["axis_blocks"]
  xs = _on_cpu(jnp.stack([x, -x]))

  @jax.jit  # the gradient, vmap and their specs as one program
  def grad_and_vmap(x, xs):
    v, g = jax.value_and_grad(lambda x: jnp.sum(jaxlp.quantize(x, fmt) * 2.0))(x)
    return (v, g, jnp.sum(F.quantize(x, fmt) * 2.0), jax.vmap(lambda x: jaxlp.quantize(x, fmt))(xs),
            F.quantize(xs, fmt))

  v, g, want_v, got, want = grad_and_vmap(x, xs)
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 2.0, np.float32))
  assert v == want_v
  np.testing.assert_array_equal(_bits(got), _bits(want))


def test_can_use_pallas_quantize_reads_the_device_not_the_default_backend(monkeypatch):
  _kernel_everywhere(monkeypatch)
  fmt = FAMILY_FORMATS["axis_blocks"]
  x = jax.device_put(_x(), jax.devices("cpu")[0])
  assert PQ.kernel_applies(fmt, x.shape, x.dtype)
  assert not PQ.can_use_pallas_quantize(x, fmt)  # a CPU array: never the kernel
  jax.jit(lambda x: (assert_false(PQ.can_use_pallas_quantize(x, fmt)), x)[1])(x)


def assert_false(v):
  assert v is False


# ---------------------------------------------------------------------------------------
# matmul
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("alg", sorted(PM.KERNEL_IS_FASTER))
def test_matmul_cuda_lowering_follows_the_table(alg, monkeypatch, fresh_dispatch):
  kw = dict(acc=F.BF16, algorithm=alg, chunk=32 if alg == "chunked" else None)
  a = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  _, mods = CL.lower_for_cuda(lambda a, b: jaxlp.matmul(a, b, **kw), a, a)
  assert bool(mods) == PM.KERNEL_IS_FASTER[alg]
  monkeypatch.setattr(PM, "KERNEL_IS_FASTER", {**PM.KERNEL_IS_FASTER, alg: True})
  OM._dispatch.clear_cache()
  _, mods = CL.lower_for_cuda(lambda a, b: jaxlp.matmul(a, b, **kw), a, a)
  assert CL.kernel_names(mods) == [f"jaxlp_matmul_{alg}"]
  assert not any(CL.illegal_ops(m) for m in mods)


def test_matmul_kernel_branch_same_bits(monkeypatch, fresh_dispatch):
  calls = []

  def interpreted(*args, **kw):
    calls.append(kw["algorithm"])
    return PM.matmul(*args, interpret=True, **kw)

  monkeypatch.setattr(PM, "KERNEL_IS_FASTER", dict.fromkeys(PM.KERNEL_IS_FASTER, True))
  monkeypatch.setattr(PM, "MIN_PALLAS_MACS", 1)
  monkeypatch.setattr(OM, "_KERNEL_PLATFORMS", ("cpu",))
  monkeypatch.setattr(OM, "_kernel_matmul", interpreted)
  a, b, bias = (_on_cpu(_x(s, i)) for i, s in enumerate(((6, 10), (10, 5), (5,))))

  @jax.jit  # the three dispatched GEMMs and their references as one program
  def both(a, b, bias):
    out = []
    for kw in (dict(acc=F.E4M3, algorithm="kahan", bias=bias),
               dict(mul=F.BF16, acc=F.FP16, rounding="stochastic", key=KEY),
               dict(acc=F.E5M2, algorithm="naive",
                    dimension_numbers=[[[0], [0]], [[], []]])):
      lhs = a if "dimension_numbers" not in kw else a.T
      out.append((jaxlp.matmul(lhs, b, **kw), OM.matmul_reference(lhs, b, **kw)))
    return out

  for i, (got, want) in enumerate(both(a, b, bias)):
    np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=f"GEMM {i}")
  assert calls == ["kahan", "naive", "naive"]


def test_cuda_lowering_under_grad_and_vmap(fresh_dispatch):
  """The kernel branch lowers for CUDA inside value_and_grad and vmap as well."""
  fmt = FAMILY_FORMATS["axis_blocks"]
  assert PQ.KERNEL_IS_FASTER["axis_blocks"]
  f = jax.value_and_grad(lambda x: jnp.sum(jaxlp.quantize(x, fmt, "stochastic", key=KEY) ** 2))
  _, mods = CL.lower_for_cuda(f, jax.ShapeDtypeStruct((512, 256), jnp.float32))
  assert CL.kernel_names(mods) == ["jaxlp_quantize_block"]
  g = jax.vmap(lambda x: jaxlp.quantize(x, fmt))
  _, mods = CL.lower_for_cuda(g, jax.ShapeDtypeStruct((4, 512, 256), jnp.float32))
  assert CL.kernel_names(mods) == ["jaxlp_quantize_block"]
