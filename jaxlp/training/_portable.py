"""Training-step arithmetic with the same float32 bits on every XLA backend.

``jaxlp train --exact-blocks`` promises one result on a GPU and on the CPU. Its GEMMs are exact
by construction (``DotPolicy(block_dot="exact")``), but on one H200 against the CPU (jax 0.11.2,
2026-11-26, each stage compared on the two backends) the rest of an MLP step still differed:

* parameter init (the truncated normal's ``erf_inv``): up to thousands of ulps;
* ``exp``, ``log`` and ``log1p``: 1-2 ulps on a third of the inputs (each backend has its own
  approximations);
* sums over an axis: each backend reduces in its own order (up to 2048 ulps after
  cancellation);
* the optimizer update ``p - lr * m``: a backend may fuse a multiply and the add that uses it
  into one FMA (one rounding instead of two); which pairs it fuses depends on its fusion
  decisions, and ``lax.optimization_barrier`` does not stop it (XLA removes barriers before
  code generation: measured on this CPU, where a barrier-separated polynomial still differed
  from numpy's twice-rounded one in 10% of the elements);
* float32 subnormals: XLA's CPU flushes them, a GPU keeps them.

This module defines the arithmetic of the step instead (the "portable" float32):

* :func:`mul` is a software IEEE multiply on the bit patterns (integer operations only: there
  is no float multiply for a compiler to fuse with an add), rounded to nearest-even;
* :func:`add` is the hardware float32 add (correctly rounded everywhere) of two such values;
* both flush subnormal inputs and results to a signed zero, and return the canonical quiet NaN
  ``0x7FC00000`` for any NaN, so that neither the flush mode nor the NaN payload rules of a
  backend show;
* sums run as a fixed pairwise tree (:func:`tree_sum`); ``exp`` and ``log`` are fixed
  polynomials in these operations (accurate to about 1 and 2 ulps; not correctly rounded,
  but the same everywhere);
* parameters are initialised on the CPU (:func:`init_device`);
* values that several reductions read (the log-sum-exp, the logits' gradient, the tree sums)
  are computed once (:func:`materialize`): XLA would fuse their whole expressions into each
  reader, which jax 0.11's CPU backend compiles very slowly.

Outside the normal range this differs from IEEE float32 only by the flush to zero. The cost is
a few dozen integer operations per product: fine for the MLP's and the CNN's 26-28K
parameters, their bias gradients and their (batch, classes) loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlp.formats import _bits as B
from jaxlp.parallel import _axes

_f32 = np.float32
_NAN = np.uint32(B.QNAN_BITS)  # numpy: no device array (backend start-up) at import
_SIGN = np.uint32(B.SIGN_MASK)


def _bits(x):
  return B.to_bits(jnp.asarray(x, jnp.float32))


_float = B.from_bits


def _clean(u):
  """Bit patterns ``u`` with subnormals flushed to a signed zero and NaNs made canonical."""
  exp = u & B.EXP_MASK
  u = jnp.where(exp == 0, u & _SIGN, u)
  return jnp.where((exp == B.EXP_MASK) & ((u & B.FRAC_MASK) != 0), _NAN, u)


def flush(x):
  """``x`` with subnormals flushed to a signed zero and any NaN made ``0x7FC00000``."""
  return _float(_clean(_bits(x)))


def add(a, b):
  """``a + b`` rounded to nearest-even (the hardware add), with subnormal inputs and result
  flushed to a signed zero and a canonical NaN."""
  return flush(flush(a) + flush(b))


def mul(a, b):
  """``a * b`` rounded to nearest-even, computed from the bit patterns with integer operations
  (module docstring); subnormal inputs and results are flushed to a signed zero, overflow
  gives a signed inf, NaN (also inf * 0) gives ``0x7FC00000``."""
  ua, ub = _clean(_bits(a)), _clean(_bits(b))
  ua, ub = jnp.broadcast_arrays(ua, ub)
  sign = (ua ^ ub) & _SIGN
  ea, eb = (ua >> 23) & 0xFF, (ub >> 23) & 0xFF
  ma, mb = (ua & 0x7FFFFF) | 0x800000, (ub & 0x7FFFFF) | 0x800000
  # 24 x 24 -> 48-bit product in base 2**24 from 12-bit limbs (every partial < 2**26)
  ah, al, bh, bl = ma >> 12, ma & 0xFFF, mb >> 12, mb & 0xFFF
  mid = ah * bl + al * bh
  lo = al * bl + ((mid & 0xFFF) << 12)
  hi = ah * bh + (mid >> 12) + (lo >> 24)
  lo = lo & 0xFFFFFF
  top = hi >= 0x800000  # product in [2**47, 2**48): hi holds the 24 leading bits
  mant = jnp.where(top, hi, (hi << 1) | (lo >> 23))
  rest = jnp.where(top, lo, (lo << 1) & 0xFFFFFF)  # the 24 bits after the leading 24
  half = rest >> 23
  sticky = (rest & 0x7FFFFF) != 0
  mant = mant + (half & (sticky | ((mant & 1) == 1)).astype(jnp.uint32))
  e = ea.astype(jnp.int32) + eb.astype(jnp.int32) - 127 + top.astype(jnp.int32)
  carry = mant >> 24
  mant = jnp.where(carry == 1, mant >> 1, mant)
  e = e + carry.astype(jnp.int32)
  out = sign | (jnp.clip(e, 0, 255).astype(jnp.uint32) << 23) | (mant & 0x7FFFFF)
  out = jnp.where(e >= 255, sign | 0x7F800000, out)
  out = jnp.where(e <= 0, sign, out)
  # zeros, infs and NaNs
  za, zb = ea == 0, eb == 0
  ia, ib = ea == 255, eb == 255
  na, nb = ia & ((ua & 0x7FFFFF) != 0), ib & ((ub & 0x7FFFFF) != 0)
  out = jnp.where(za | zb, sign, out)
  out = jnp.where((ia | ib) & ~(za | zb), sign | 0x7F800000, out)
  out = jnp.where(na | nb | ((ia | ib) & (za | zb)), _NAN, out)
  return _float(out)


def materialize(x):
  """``x`` (float32), bit for bit, computed once as an array of its own.

  XLA fuses cheap elementwise producers into every consumer, so without this a portable
  expression (a few thousand integer operations for a cross-entropy gradient) is recomputed
  inside each reduction that reads it. jax 0.11's CPU backend compiles such reduction fusions
  very slowly: the MLP's ``--exact-blocks`` training step did not finish compiling in 10
  minutes (jax 0.10: 11 s). Here ``x``'s bit patterns are summed with zeros over a new
  leading axis of two, a reduction XLA keeps (algebraically an identity on the integers) and
  whose fusion holds the expression once; its readers read the result.
  ``tests/cli/test_portable.py`` checks the compiled step's fusions."""
  u = _bits(x)
  return _float(jnp.sum(jnp.stack([u, jnp.zeros_like(u)]), axis=0, dtype=jnp.uint32))


def tree_sum(x, axis=0):
  """The sum of ``x`` over ``axis`` as a fixed pairwise tree: element ``i`` of the first half
  plus element ``i`` of the second, repeated (an odd last element is carried to the next
  level). The same bits on every backend."""
  x = jnp.moveaxis(jnp.asarray(x), axis, 0)
  if x.shape[0] == 0:
    return jnp.zeros(x.shape[1:], x.dtype)
  while x.shape[0] > 1:
    n, h = x.shape[0], x.shape[0] // 2
    s = add(x[:h], x[h:2 * h])
    x = s if n % 2 == 0 else jnp.concatenate([s, x[2 * h:]], 0)
  return x[0]


def _horner(coeffs, r):
  """``sum(c * r**i)`` for ``coeffs`` highest degree first, in :func:`mul` and :func:`add`."""
  p = jnp.full_like(r, coeffs[0])
  for c in coeffs[1:]:
    p = add(mul(p, r), c)
  return p


# Cody-Waite split of ln 2 (_LN2_HI has 15 significant bits)
_LOG2E = _f32(1.4426950408889634)
_LN2_HI = _f32(0.693145751953125)
_LN2_LO = _f32(0.6931471805599453 - 0.693145751953125)
_EXP_C = tuple(_f32(1.0 / np.prod(np.arange(1, n + 1, dtype=np.float64)))
               for n in range(8, -1, -1))  # 1/8!, ..., 1/1!, 1/0!


def exp(x):
  """``e**x`` for float32 ``x`` in portable arithmetic (module docstring).

  ``x = k ln2 + r`` with ``k = round(x log2(e))`` (ties to even) and ``r = (x - k ln2_hi) -
  k ln2_lo``; ``e**r`` by its degree-8 Taylor polynomial (|r| <= 0.35: truncation below
  2**-28 relative); times ``2**k`` exactly. Results below ``2**-126`` give +0 (``x`` below
  about -87.3), above float32's range +inf (``x`` above 88); NaN gives the canonical NaN."""
  x = flush(x)
  xc = jnp.clip(x, -104.0, 89.0)
  k = jnp.round(mul(xc, _LOG2E))
  r = add(add(xc, -mul(k, _LN2_HI)), -mul(k, _LN2_LO))
  p = _horner(_EXP_C, r)
  ki = k.astype(jnp.int32)
  # p * 2**k from the bits: p is in [0.7, 1.42], so its exponent field plus k stays in range
  # or over/underflows (then inf / 0)
  pb = _bits(p)
  e = ((pb >> 23) & 0xFF).astype(jnp.int32) + ki
  y = _float((pb & np.uint32(0x807FFFFF)) | (jnp.clip(e, 0, 255).astype(jnp.uint32) << 23))
  y = jnp.where(e <= 0, _f32(0.0), jnp.where(e >= 255, _f32(np.inf), y))
  return jnp.where(jnp.isnan(x), x, y)


# f in [1, 2) by sixteenths j; f >= 1.5 (j >= 8) is halved (exactly) to [0.75, 1), so that
# log f is taken on [0.75, 1.5). R_j: the reciprocal of the middle of the (halved) sixteenth
# rounded to 12 bits, except 1 for the two next to 1 (j = 0 and 15), where log1p(f R_j - 1)
# = log1p(f - 1) keeps its relative accuracy as f -> 1.
_LOG_MID = (1.0 + (np.arange(16) + 0.5) / 16.0) / np.where(np.arange(16) >= 8, 2.0, 1.0)
_LOG_R = np.where((np.arange(16) == 0) | (np.arange(16) == 15), 1.0, 1.0 / _LOG_MID)
_LOG_R = np.ldexp(np.round(np.ldexp(np.frexp(_LOG_R)[0], 12)), np.frexp(_LOG_R)[1] - 12
                  ).astype(np.float32)
_LOG_L = (-np.log(_LOG_R.astype(np.float64))).astype(np.float32)  # log(1 / R_j), rounded once
# log1p(u) = u (1 - u/2 + u^2/3 - ...), |u| <= 1/16: degree 9 leaves < 2**-36 relative
_LOG1P_C = tuple(_f32(((-1.0) ** n) / (n + 1)) for n in range(8, -1, -1))


def log(x):
  """Natural log of positive normal float32 ``x`` in portable arithmetic (module docstring).

  ``x = 2**e f`` with ``f`` in [0.75, 1.5) (exact, from the bits); ``log f = log(1/R_j) +
  log1p(u)`` with ``R_j`` the reciprocal of the middle of ``f``'s sixteenth ``j`` rounded to 12
  bits (1 next to f = 1), ``u = (f_hi R_j - 1) + f_lo R_j`` (``f = f_hi + f_lo``, 12 + 12 bits:
  one rounding) and the log1p by a degree-9 polynomial; ``log x = e ln2_hi + (log(1/R_j) +
  (log1p(u) + e ln2_lo))``. Zero, subnormal, negative or non-finite ``x`` gives NaN."""
  bits = _bits(x)
  j = (bits >> 19) & 0xF
  hi = j >= 8
  e = ((bits >> 23) & 0xFF).astype(jnp.int32) - 127 + hi.astype(jnp.int32)
  f = _float((bits & 0x7FFFFF) | jnp.where(hi, jnp.uint32(0x3F000000), jnp.uint32(0x3F800000)))
  r = jnp.asarray(_LOG_R)[j]
  f_hi = _float(_bits(f) & np.uint32(0xFFFFF000))
  u = add(add(mul(f_hi, r), _f32(-1.0)), mul(add(f, -f_hi), r))
  lp = mul(_horner(_LOG1P_C, u), u)
  ef = e.astype(jnp.float32)
  y = add(mul(ef, _LN2_HI), add(jnp.asarray(_LOG_L)[j], add(lp, mul(ef, _LN2_LO))))
  e0 = (bits >> 23) & 0xFF
  ok = ((bits >> 31) == 0) & (e0 > 0) & (e0 < 255)
  return jnp.where(ok, y, _float(_NAN))


@jax.custom_vjp
def cross_entropy(logits, labels, scale):
  """``scale * sum_i(logsumexp(logits_i) - logits_i[labels_i])`` over the rows of ``logits``
  (batch, classes), in portable arithmetic (:func:`exp`, :func:`log`, :func:`tree_sum`); its
  gradient is ``(softmax - onehot) * (cotangent * scale)`` computed the same way. ``scale``
  is a float32 scalar (e.g. ``1 / batch``, rounded once)."""
  return _ce_fwd(logits, labels, scale)[0]


def _lse(logits):
  m = jnp.max(logits, axis=-1, keepdims=True)
  s = tree_sum(exp(add(logits, -m)), -1)[..., None]
  return add(m, log(s))  # (batch, 1)


def _ce_fwd(logits, labels, scale):
  logits = flush(logits)
  lse = materialize(_lse(logits))
  picked = jnp.take_along_axis(logits, labels[:, None].astype(jnp.int32), axis=-1)
  per = add(lse, -picked)[:, 0]
  loss = mul(tree_sum(per, 0), jnp.asarray(scale, jnp.float32))
  return loss, (logits, labels, lse, scale)


def _ce_bwd(res, ct):
  logits, labels, lse, scale = res
  p = exp(add(logits, -lse))
  onehot = (jnp.arange(logits.shape[-1])[None, :] == labels[:, None]).astype(jnp.float32)
  g = mul(add(p, -onehot), mul(ct, jnp.asarray(scale, jnp.float32)))
  return materialize(g), None, jnp.zeros_like(scale)


cross_entropy.defvjp(_ce_fwd, _ce_bwd)


@jax.custom_vjp
def bias_add(y, b):
  """``add(y, b)`` with ``b`` broadcast over the leading axes; the bias gradient is the
  output gradient summed over all leading axes by :func:`tree_sum`."""
  return _add_bias(y, b)


def _add_bias(y, b):
  return add(y, jnp.reshape(b, (1,) * (y.ndim - 1) + b.shape))


def _bias_fwd(y, b):
  return _add_bias(y, b), None


def _bias_bwd(_, ct):
  return ct, materialize(tree_sum(ct.reshape(-1, ct.shape[-1]), 0))


bias_add.defvjp(_bias_fwd, _bias_bwd)


@jax.custom_vjp
def mean_over_spatial(x):
  """The mean of ``x`` (N, H, W, C) over H and W: :func:`tree_sum` over the H * W positions
  (row-major) times ``1 / (H W)`` rounded once, by :func:`mul`; the gradient is the cotangent
  times the same factor, broadcast."""
  return _spatial_fwd(x)[0]


def _spatial_fwd(x):
  n, h, w, c = x.shape
  inv = _f32(1.0 / (h * w))
  return materialize(mul(tree_sum(x.reshape(n, h * w, c), 1), inv)), (x.shape, inv)


def _spatial_bwd(res, ct):
  shape, inv = res
  g = mul(ct, inv)[:, None, None, :]
  return (jnp.broadcast_to(g, shape),)


mean_over_spatial.defvjp(_spatial_fwd, _spatial_bwd)


def sum_over_axis(x, axis_name):
  """The sum of ``x`` over the named axis ``axis_name`` (all workers): :func:`tree_sum` of the
  gathered values in worker order, the same bits on every backend and every worker.
  ``axis_name`` may be a tuple (e.g. ``("dev", "nodes")``: major to minor), gathered in
  combined worker order (``jaxlp.parallel._axes.all_gather``)."""
  return materialize(tree_sum(_axes.all_gather(x, axis_name), 0))


def apply_updates(params, updates):
  """``optax.apply_updates`` with :func:`add`."""
  return jax.tree_util.tree_map(add, params, updates)


def sgd(lr_table, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0):
  """SGD with momentum and weight decay as an optax ``GradientTransformation`` in portable
  arithmetic (module docstring): the update of ``optax.chain(optax.add_decayed_weights(wd),
  optax.sgd(lr, momentum, nesterov))`` with each product and sum rounded once:
  ``g' = g + wd p``; ``m = g' + momentum m``; ``d = g' + momentum m`` (nesterov) or ``m``;
  update ``-lr_t d``. Apply it with :func:`apply_updates`. ``lr_table``: a float32 array with
  the learning rate of each step (the last entry repeats after its end), so that a schedule
  costs no float arithmetic in the step."""
  import optax

  table = np.asarray(lr_table, np.float32).reshape(-1)
  if table.size == 0:
    raise ValueError("sgd: lr_table is empty")
  mom, wd = _f32(momentum), _f32(weight_decay)

  def init(params):
    return {"count": jnp.zeros((), jnp.int32),
            "trace": jax.tree_util.tree_map(jnp.zeros_like, params)}

  def update(grads, state, params=None):
    if wd and params is None:
      raise ValueError("sgd with weight_decay needs params")
    lr = jnp.asarray(table)[jnp.minimum(state["count"], table.size - 1)]

    def leaf(g, m, p):
      if wd:
        g = add(g, mul(wd, p))
      m = add(g, mul(mom, m)) if momentum else flush(g)
      d = add(g, mul(mom, m)) if nesterov else m
      return mul(-lr, d), m

    out = jax.tree_util.tree_map(leaf, grads, state["trace"],
                                 params if params is not None else grads)
    is_pair = lambda t: isinstance(t, tuple) and len(t) == 2
    upd = jax.tree_util.tree_map(lambda t: t[0], out, is_leaf=is_pair)
    trace = jax.tree_util.tree_map(lambda t: t[1], out, is_leaf=is_pair)
    return upd, {"count": state["count"] + 1, "trace": trace}

  return optax.GradientTransformation(init, update)


def init_device():
  """The device that initialises parameters in the portable mode: the first CPU device
  (its ``erf_inv`` defines the init's bits), or None where JAX has no CPU backend."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None
