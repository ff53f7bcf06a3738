"""The exact block GEMM's GPU implementations, compiled and run on a GPU, give the bits of the
reference run on the CPU (skipped where JAX sees no GPU: ``JAX_PLATFORMS=cuda,cpu``).

Shapes: a weight gradient's (few output tiles, many long K-blocks: "auto" splits it into one
batched XLA int8 dot), the forward GEMMs of HBFP8 tiles and MXINT8 blocks (the Pallas kernel,
with the jnp or the Pallas operand preparation), a ragged one, and NaN, inf, zero blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlp import formats as F
from jaxlp.formats import _block_dot as BS
from jaxlp.ops import _block_dot as BD

GPUS = [d for d in jax.devices() if d.platform == "gpu"] if jax.default_backend() == "gpu" else []
pytestmark = pytest.mark.skipif(not GPUS, reason="needs a JAX GPU backend "
                                "(JAX_PLATFORMS=cuda,cpu); this machine has none")

CASES = [  # (M, K, N, g, a's format, b's format)
    (64, 16384, 64, 256, F.BlockFormat(7, axis=1, block_size=256),
     F.BlockFormat(7, axis=0, block_size=256)),
    (96, 2040, 130, 24, F.hbfp(7, 24), F.hbfp(7, 24)),
    (2000, 96, 272, 24, F.hbfp(7, 24), F.hbfp(7, 24)),  # 48 tiles: not split
    (4096, 64, 128, 32, F.mx("int8", 32, 1), F.mx("int8", 32, 0)),  # 32 tiles: not split
]


def _operands(M, K, N, fa, fb, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(M, K)) * np.exp2(rng.integers(-60, 60, size=(M, 1)))
  x[0, 5], x[1, 7], x[2, :] = np.nan, np.inf, 0.0
  y = rng.normal(size=(K, N)) * np.exp2(rng.integers(-30, 30, size=(1, N)))
  cpu = jax.devices("cpu")[0]
  a = F.quantize(jax.device_put(jnp.asarray(x, jnp.float32), cpu), fa)
  b = F.quantize(jax.device_put(jnp.asarray(y, jnp.float32), cpu), fb)
  return a, b


def _same(x, y):
  x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
  nan = np.isnan(x) & np.isnan(y)
  return np.array_equal(np.where(nan, 0, x.view(np.uint32)), np.where(nan, 0, y.view(np.uint32)))


@pytest.mark.parametrize("impl", ["pallas", "auto", "xla_int8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-g{c[3]}")
def test_gpu_implementation_gives_the_reference_bits(case, impl):
  M, K, N, g, fa, fb = case
  assert BD.splits_k_blocks(M, N, K, g) == (M * N < 2**18)  # both kinds of shape covered
  a, b = _operands(M, K, N, fa, fb, M + K)
  ref = BS.block_dot_reference(a, b, g, 7, 7)  # on the CPU (its operands live there)
  fn = jax.jit(lambda a, b: BD._IMPL_FNS[impl](a, b, g, 7, 7))
  out = fn(jax.device_put(a, GPUS[0]), jax.device_put(b, GPUS[0]))
  assert _same(out, ref), (impl, BD.splits_k_blocks(M, N, K, g))
