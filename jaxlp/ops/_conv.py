"""`conv_general_dilated(policy)`: a `lax.conv_general_dilated` with quantized GEMMs."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxlp.ops._dot_general import SlotGeometry, quantized_bilinear
from jaxlp.ops._policy import DotPolicy


def _conv_geometry(dn: lax.ConvDimensionNumbers) -> dict[str, SlotGeometry]:
  """Tiling views in channel-first layout (N, C, spatial) / (O, I, spatial), and the
  contraction axes: features in the forward pass, out-features in dlhs, batch in drhs."""
  ls, rs, os_ = (tuple(int(d) for d in t) for t in dn)
  return {
      "lhs": SlotGeometry(ls, ls[1]),
      "rhs": SlotGeometry(rs, rs[1]),
      "grad": SlotGeometry(os_, os_[1]),
      "dlhs_rhs": SlotGeometry(rs, rs[0]),
      "drhs_lhs": SlotGeometry(ls, ls[0]),
      "drhs_grad": SlotGeometry(os_, os_[0]),
  }


def conv_general_dilated(policy: DotPolicy | None = None, *, key=None):
  """A ``lax.conv_general_dilated`` replacement that quantizes its GEMMs per ``policy``.

  The returned callable has ``lax.conv_general_dilated``'s signature ``(lhs, rhs,
  window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
  feature_group_count=1, batch_group_count=1, precision=None, preferred_element_type=None)``,
  accepts and ignores extra keywords (``out_sharding``), and takes an optional keyword
  ``key`` overriding the construction key. Plugs into ``flax.linen.Conv(conv_general_dilated=
  ...)`` and ``nnx.Conv(..., conv_general_dilated=...)``.

  The backward pass is the transpose of the same lax convolution applied to the quantized
  operands, so strides, padding, dilations, feature and batch groups are all exact.

  Blocking: tile-blocked formats (``hbfp``, ``hbfp_batched``) see activations and gradients
  as (N, C, spatial...) and kernels as (O, I, spatial...) — HBFPEmulator's NCHW/OIHW views:
  a Flax HWIO kernel is transposed to OIHW, tiled on the (O, I·kh·kw) view, and transposed
  back. Axis-blocked formats (MX) are blocked along the contraction axis: input/kernel input
  features in the forward pass, gradient/kernel output features in the dlhs GEMM, and the
  batch axis of input and gradient in the drhs GEMM. Accumulator emulation is not supported
  for convolutions (NotImplementedError).

  Args:
    policy: a :class:`jaxlp.DotPolicy`; ``DotPolicy()`` / None = the plain lax convolution.
    key: PRNG key for stochastic rounding (fresh per step).

  Returns:
    The conv_general_dilated callable (its ``policy`` attribute holds the policy). Calling
    it raises ``ValueError`` if the policy is stochastic and no key was given.

  Raises:
    TypeError: ``policy`` is not a :class:`jaxlp.DotPolicy` (or None).
    NotImplementedError: the policy emulates accumulators (``fwd_acc``/``dlhs_acc``/
      ``drhs_acc``).

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> conv = jaxlp.conv_general_dilated(jaxlp.float_policy(F.E2M1FN))
    >>> x = jnp.array([[[1.3, 2.6, 0.4, 5.0]]])  # (N=1, C=1, W=4)
    >>> w = jnp.array([[[1.0, 1.0]]])  # (O=1, I=1, W=2)
    >>> # x is rounded to E2M1 first: [1.5, 3, 0.5, 4] (5: a tie between 4 and 6, to even)
    >>> conv(x, w, (1,), "VALID")
    Array([[[4.5, 3.5, 4.5]]], dtype=float32)
  """
  policy = DotPolicy() if policy is None else policy
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"jaxlp.conv_general_dilated: policy must be a DotPolicy, got {policy!r}")
  if any(a is not None for a in (policy.fwd_acc, policy.dlhs_acc, policy.drhs_acc)):
    raise NotImplementedError(
        "jaxlp.conv_general_dilated: accumulator emulation (fwd_acc/dlhs_acc/drhs_acc) is "
        "only implemented for 2-D dot_general; use a policy without accumulators for convs")
  default_key = key

  def jaxlp_conv_general_dilated(lhs, rhs, window_strides, padding, lhs_dilation=None,
                                 rhs_dilation=None, dimension_numbers=None,
                                 feature_group_count=1, batch_group_count=1, precision=None,
                                 preferred_element_type=None, *, key=None, **unused):
    del unused
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)

    def op(l, r):
      return lax.conv_general_dilated(
          l, r, window_strides, padding, lhs_dilation=lhs_dilation,
          rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
          feature_group_count=feature_group_count, batch_group_count=batch_group_count,
          precision=precision, preferred_element_type=preferred_element_type)

    if policy.is_identity:
      return op(lhs, rhs)
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    k = default_key if key is None else key
    return quantized_bilinear(op, lhs, rhs, policy, _conv_geometry(dn), key=k)

  jaxlp_conv_general_dilated.policy = policy
  return jaxlp_conv_general_dilated
