"""The suite compiles with XLA:CPU's elemental fusion emitters (tests/conftest.py,
``--xla_cpu_use_fusion_emitters=false``: the suite in 21% less CPU time); users' programs compile
with XLA's default MLIR fusion emitters. The library's exactly specified operations must give
the same bits under both: here one program of each kind -- every quantizer family (nearest and
stochastic, special values, subnormals, ±0), the exact block GEMMs (int8, limbs, two-level
NVFP4), the accumulator emulation (naive and Kahan, float32 products), a low-precision psum
and two compressors under a named vmap -- runs in this process and in a subprocess with XLA's
default flags, and the bits are compared (NaN payloads included)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROGRAMS = r'''
import hashlib, json
import jax, jax.numpy as jnp, numpy as np
import jaxlp
from jaxlp import formats as F
from jaxlp import parallel as P

def inputs(shape, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
  x = x.astype(np.float32).reshape(-1)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e-39, 2.0**-126,
                      3.4e38, -65504.0, 448.0, 0.5], np.float32)
  x[:special.size] = special
  return jnp.asarray(x.reshape(shape))

def finite(shape, seed):
  rng = np.random.default_rng(seed)
  return jnp.asarray((rng.standard_normal(shape) * np.exp2(rng.integers(-4, 4, shape)))
                     .astype(np.float32))

def programs():
  key = jax.random.key(7)
  x = inputs((16, 64), 1)
  out = {}
  quant = {"e4m3fn": F.E4M3FN, "bf16": F.BF16, "e5m2": F.E5M2, "fixed8_4": F.FixedPoint(8, 4),
           "qpytorch_e5m2": F.qpytorch_float(5, 2), "hbfp7_16": F.hbfp(7, 16),
           "qpytorch_block8": F.qpytorch_block(8), "mxfp8": F.mx(F.E4M3FN),
           "mxfp4": F.mx(F.E2M1FN), "mxint8": F.mx("int8"), "nvfp4": F.nvfp4()}
  # specials in x make whole blocks NaN (and NVFP4's tensor scale, so all of it): the same
  # programs also run on x with its infinities and NaN replaced by 1
  xf = jnp.where(jnp.isfinite(x), x, 1.0)
  for name, fmt in quant.items():
    q = jax.jit(lambda x, k, fmt=fmt: (jaxlp.quantize(x, fmt),
                                       jaxlp.quantize(x, fmt, "stochastic", key=k)))
    out[f"quantize/{name}"] = (q(x, key), q(xf, key))
  cpd = jax.jit(lambda x: jaxlp.quantize(x, F.cpd_float(5, 2)))
  out["quantize/cpd_e5m2"] = (cpd(x), cpd(xf))
  a, b = finite((8, 64), 2), finite((64, 12), 3)
  dn = (((1,), (0,)), ((), ()))
  pols = {"exact_mxint8": jaxlp.mx_policy("int8", 32, block_dot="exact"),
          "exact_mxfp8": jaxlp.mx_policy(F.E4M3FN, 32, block_dot="exact"),
          "exact_nvfp4": jaxlp.DotPolicy(lhs=F.nvfp4(), rhs=F.nvfp4(axis=0),
                                         grad=F.nvfp4(), block_dot="exact"),
          "acc_fp16": jaxlp.DotPolicy(fwd_acc=jaxlp.Accum(acc=F.FP16)),
          "acc_bf16_kahan": jaxlp.DotPolicy(fwd_acc=jaxlp.Accum(acc=F.BF16, algorithm="kahan")),
          "acc_e4m3_mul": jaxlp.DotPolicy(fwd_acc=jaxlp.Accum(mul=F.E4M3FN, acc=F.BF16))}
  for name, pol in pols.items():
    out[f"gemm/{name}"] = jax.jit(lambda a, b, pol=pol: jaxlp.dot_general(pol)(a, b, dn))(a, b)
  g = finite((4, 2048), 4)
  out["psum/bf16_ring"] = jax.jit(jax.vmap(lambda t: P.psum(t, "w", fmt=F.BF16), axis_name="w"))(g)
  for name, comp in {"cgx4": P.compressors.cgx(bits=4), "topk": P.compressors.topk(0.01)}.items():
    st = P.init_compression_state(comp, g[0])
    st = jax.tree_util.tree_map(lambda s: jnp.broadcast_to(s, (4,) + jnp.shape(s)), st)
    run = jax.vmap(lambda t, s, comp=comp: P.compressed_allreduce(t, s, "w", comp),
                   axis_name="w")
    out[f"compress/{name}"] = jax.jit(run)(g, st)
  return out

def digests():
  """{program: [sha256 of its outputs' bytes, whether one of its float outputs has a finite
  non-zero value]}."""
  res = {}
  for name, tree in programs().items():
    h, informative = hashlib.sha256(), False
    for leaf in jax.tree_util.tree_leaves(tree):
      if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
      a = np.ascontiguousarray(np.asarray(leaf))
      if np.issubdtype(a.dtype, np.floating) and a.ndim:
        informative |= bool((np.isfinite(a) & (a != 0)).any())
      h.update(a.tobytes())
    res[name] = [h.hexdigest(), informative]
  return res
'''


def _digests_here():
  ns = {}
  exec(compile(_PROGRAMS, "<test_xla_emitters programs>", "exec"), ns)  # noqa: S102
  return ns["digests"]()


def test_exact_operations_have_the_same_bits_under_xlas_default_emitters():
  flags = os.environ.get("JAXLP_TEST_XLA_CPU_FLAGS", "")
  if "xla_cpu_use_fusion_emitters" not in flags:
    pytest.skip("the suite runs with XLA's default emitters (JAXLP_TEST_XLA_CPU_FLAGS): "
                "nothing to compare")
  here = _digests_here()
  env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
  script = _PROGRAMS + "\nprint(json.dumps(digests()))\n"
  r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                     timeout=900, check=False)
  assert r.returncode == 0, r.stderr[-4000:]
  default = json.loads(r.stdout.strip().splitlines()[-1])
  assert sorted(default) == sorted(here)
  empty = [k for k, (_, informative) in here.items() if not informative]
  assert not empty, f"outputs without a finite non-zero value (nothing compared): {empty}"
  differ = [k for k in here if here[k] != default[k]]
  assert not differ, f"different bits under XLA:CPU's default fusion emitters: {differ}"
