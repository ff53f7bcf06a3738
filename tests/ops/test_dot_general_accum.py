"""DotPolicy accumulator emulation routes the GEMMs through jaxlp.matmul (bit-exact)."""

import jax
import numpy as np
import pytest
from jax import lax

import jaxlp
from jaxlp import formats as F
from jaxlp.ops._policy import Accum, DotPolicy

DN = (((1,), (0,)), ((), ()))


def _bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("algorithm", ["naive", "kahan"])
def test_accumulator_policy_equals_matmul(algorithm):
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (5, 37))
  w = jax.random.normal(k2, (37, 6))
  dy = jax.random.normal(k3, (5, 6))
  acc = Accum(mul=F.BF16, acc=F.cpd_float(5, 4), algorithm=algorithm)
  pol = DotPolicy(fwd_acc=acc, dlhs_acc=acc, drhs_acc=acc)
  dg = jaxlp.dot_general(pol)

  @jax.jit  # one program (eagerly every operation of the emulation compiles on its own)
  def fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(lambda a, b: dg(a, b, DN), x, w)
    return (y, *vjp(dy))

  y, dx, dw = fwd_bwd(x, w, dy)
  mm = jax.jit(lambda a, b: jaxlp.matmul(a, b, mul=F.BF16, acc=F.cpd_float(5, 4),
                                         algorithm=algorithm))
  np.testing.assert_array_equal(_bits(y), _bits(mm(x, w)))
  np.testing.assert_array_equal(_bits(dx), _bits(mm(dy, w.T)))
  np.testing.assert_array_equal(_bits(dw), _bits(mm(x.T, dy)))
  # The emulation really changes the result (so the test can fail).
  assert np.any(_bits(y) != _bits(lax.dot_general(x, w, DN)))


def test_accumulator_policy_transposed_rhs():
  x = jax.random.normal(jax.random.key(1), (4, 9))
  wt = jax.random.normal(jax.random.key(2), (3, 9))  # (N, K)
  acc = Accum(mul=None, acc=F.E5M2)
  y = jaxlp.dot_general(DotPolicy(fwd_acc=acc))(x, wt, (((1,), (1,)), ((), ())))
  ref = jaxlp.matmul(x, wt.T, acc=F.E5M2)
  np.testing.assert_array_equal(_bits(y), _bits(ref))
