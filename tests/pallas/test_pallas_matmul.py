"""Pallas GEMM kernel (interpret mode on CPU) == the jnp reference `jaxlp.ops.matmul`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_lowering import illegal_ops, kernel_names, lower_for_cuda

from jaxlp import formats as F
from jaxlp.ops._matmul import matmul as ref
from jaxlp.pallas._matmul import can_use_pallas_matmul
from jaxlp.pallas._matmul import matmul as ker

KEY = jax.random.key(99)


def _rand(shape, seed, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _check(a, b, bm=8, bn=8, **kw):
  @jax.jit
  def both(a, b):
    return ref(a, b, **kw), ker(a, b, interpret=True, block_m=bm, block_n=bn, **kw)

  r, k = both(a, b)
  assert r.shape == k.shape and r.dtype == k.dtype
  np.testing.assert_array_equal(_bits(k), _bits(r))
  return r


CASES = [
    dict(),
    dict(algorithm="kahan"),
    dict(mul=F.BF16, acc=F.E5M2),
    dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2), algorithm="kahan"),
    dict(mul=F.qpytorch_float(5, 4), acc=F.FixedPoint(16, 8)),
    dict(acc=F.E4M3FN, rounding="toward_zero"),
    dict(algorithm="chunked", chunk=16),
    dict(algorithm="chunked", chunk=5, acc=F.FP16, rounding="up"),
    dict(mul=F.BF16, acc=F.FP16, rounding="stochastic", key=KEY),
    dict(acc=F.E5M2, algorithm="kahan", rounding="stochastic", key=KEY),
    dict(algorithm="chunked", chunk=4, acc=F.BF16, rounding="stochastic", key=KEY),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(
    f"{k}={v!r}" for k, v in kw.items() if k != "key"))
def test_kernel_equals_reference(kw):
  # Non-multiples of the 8x8 tiles and of the chunks.
  _check(_rand((13, 21), 0, 2.0), _rand((21, 11), 1, 2.0), **kw)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 7, 1), (9, 1, 3), (17, 3, 8)])
def test_awkward_shapes(m, k, n):
  _check(_rand((m, k), 2), _rand((k, n), 3), acc=F.BF16, algorithm="kahan")


def test_empty():
  for ash, bsh in (((0, 4), (4, 3)), ((2, 0), (0, 3)), ((2, 4), (4, 0))):
    out = ker(np.ones(ash, np.float32), np.ones(bsh, np.float32), interpret=True)
    assert out.shape == (ash[0], bsh[1])
    np.testing.assert_array_equal(np.asarray(out), np.zeros(out.shape, np.float32))


def test_batched_and_dimension_numbers():
  a, b = _rand((2, 5, 9), 4), _rand((2, 9, 6), 5)
  _check(a, b, acc=F.BF16, rounding="stochastic", key=KEY)
  # Transposed lhs, batch dim last on the rhs.
  a2, b2 = _rand((9, 2, 5), 6), _rand((9, 6, 2), 7)
  dn = (((0,), (0,)), ((1,), (2,)))
  r = _check(a2, b2, bm=4, bn=2, acc=F.FP16, algorithm="kahan", dimension_numbers=dn)
  assert r.shape == (2, 5, 6)


def test_fma_not_contracted_in_kernel():
  e = np.float32(1 + 2**-12)
  a = np.array([[-1.0, e]], np.float32)
  b = np.array([[1.0], [e]], np.float32)
  for alg in ("naive", "kahan"):
    out = jax.jit(functools.partial(ker, algorithm=alg, interpret=True))(a, b)
    assert float(out[0, 0]) == 2.0**-11, alg


def test_half_inputs_and_output_dtype():
  a = jnp.asarray(_rand((5, 6), 8), jnp.bfloat16)
  b = jnp.asarray(_rand((6, 3), 9), jnp.float16)
  r = _check(a, b, acc=F.BF16)
  assert r.dtype == jnp.float32  # result_type(bf16, f16)
  r = _check(a, b, acc=F.BF16, preferred_element_type=jnp.bfloat16)
  assert r.dtype == jnp.bfloat16


def test_can_use_is_false_for_cpu_arrays():
  cpu = jax.devices("cpu")[0]
  a = jax.device_put(jnp.zeros((512, 512)), cpu)
  assert not can_use_pallas_matmul(a, a)


@pytest.mark.parametrize("alg", ["naive", "kahan", "chunked"])
def test_bias_kernel_equals_reference(alg):
  kw = dict(acc=F.E5M2, algorithm=alg)
  if alg == "chunked":
    kw["chunk"] = 4
  else:
    kw["mul"] = F.BF16
  a, b = _rand((2, 9, 11), 31), _rand((2, 11, 13), 32)
  for bias in (_rand((13,), 33), _rand((2, 9, 1), 34)):
    _check(a, b, bias=bias, **kw)


@pytest.mark.parametrize("grad", ["fp32", "emulate"])
@pytest.mark.parametrize("kw", [dict(acc=F.BF16, bias=True),
                                dict(mul=F.cpd_float(5, 2), acc=F.cpd_float(5, 2),
                                     algorithm="kahan"),
                                dict(algorithm="chunked", chunk=4, acc=F.FP16,
                                     rounding="stochastic", key=KEY)],
                         ids=["naive", "kahan", "chunked-stochastic"])
def test_kernel_gradients_equal_reference(kw, grad):
  """Issue 49: ``grad`` of the kernel failed ("Linearization failed"). Now it has
  :func:`jaxlp.matmul`'s derivative, bit for bit (``grad="emulate"``: the backward GEMMs run
  through the kernel), under jit and vmap; with batch dims."""
  kw = dict(kw, grad=grad)
  a, b, g = _rand((2, 5, 9), 40), _rand((2, 9, 6), 41), _rand((2, 5, 6), 42)
  bias = _rand((6,), 43) if kw.pop("bias", False) else None

  def loss(f):
    return lambda a, b, bias, g: (f(a, b, bias=bias, **kw) * g).sum()

  @jax.jit
  def both(a, b, bias, g):
    k = functools.partial(ker, interpret=True, block_m=4, block_n=4)
    out = [jax.grad(loss(f), (0, 1, 2) if bias is not None else (0, 1))(a, b, bias, g)
           for f in (ref, k)]
    # per-example gradients (vmap over the batch)
    out += [jax.vmap(jax.grad(loss(f)), (0, 0, None, 0))(a[:, None], b[:, None], None,
                                                         g[:, None]) for f in (ref, k)]
    return out

  r, k, rv, kv = both(a, b, bias, g)
  for x, y in zip(r + (rv,), k + (kv,)):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_array_equal(_bits(y), _bits(x))
  assert all(np.abs(np.asarray(x)).sum() > 0 for x in r)


@pytest.mark.parametrize("alg", ["naive", "chunked"])
def test_emulated_gradients_lower_for_cuda(alg):
  """With ``grad="emulate"`` the two backward GEMMs are kernels too: three Triton kernels,
  with only ops the Triton NVIDIA backend compiles (lowered on the CPU, see
  cuda_lowering.py)."""
  kw = dict(acc=F.BF16, algorithm=alg, chunk=32 if alg == "chunked" else None,
            rounding="stochastic", key=KEY, grad="emulate")
  a = jax.ShapeDtypeStruct((64, 48), jnp.float32)
  b = jax.ShapeDtypeStruct((48, 32), jnp.float32)
  f = jax.grad(lambda a, b: ker(a, b, **kw).sum(), (0, 1))
  _, mods = lower_for_cuda(f, a, b)
  assert kernel_names(mods) == [f"jaxlp_matmul_{alg}"] * 3
  assert not any(illegal_ops(m) for m in mods)
