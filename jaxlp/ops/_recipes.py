"""Named low-precision training recipes as :class:`~jaxlp.DotPolicy` values.

* :func:`nvfp4_recipe`: NVIDIA's NVFP4 pretraining recipe (arXiv:2509.25149), piece by piece
  (2-D weight tiles, stochastic rounding of gradients, a random Hadamard transform on the
  weight-gradient GEMM), so that each piece can be switched off and measured.
* :func:`mxfp8_recipe`: the MXFP8 pretraining recipe (arXiv:2506.08027): E4M3 in blocks of
  32 on every GEMM operand, scales rounded up.

The recipes keep some layers in higher precision (NVFP4: the first and last layers in BF16).
A policy is per layer, so that is a choice of :func:`jaxlp.flax.quantize_model`: give those
layers :func:`bf16_policy` through ``rules`` (or FP32 through ``exclude``); see
:func:`nvfp4_recipe`'s example.
"""

from __future__ import annotations

from jaxlp.formats import BF16, E4M3FN, mx, nvfp4
from jaxlp.ops._policy import FWD, DotPolicy, Quant
from jaxlp.ops._rht import RHT


def nvfp4_recipe(*, weight_tiles: bool = True, stochastic_gradients: bool = True,
                 rht: bool = True, rht_size: int = 16, rht_seed: int = 0) -> DotPolicy:
  """NVIDIA's NVFP4 training recipe for the GEMMs of a linear (or conv) layer.

  Every operand of the three GEMMs (forward ``x . W``, dlhs ``dY . W^T``, drhs / weight
  gradient ``x^T . dY``) is NVFP4 (:func:`jaxlp.formats.nvfp4`: E2M1 elements, UE4M3 block
  scales, a float32 per-tensor scale), quantized for the GEMM it feeds: activations and
  gradients in 1-D blocks of 16 along that GEMM's contraction axis (so ``x`` and ``dY`` are
  quantized once for the forward/dlhs GEMM and again, along the tokens, for the drhs GEMM).
  The recipe's pieces, each one argument:

  * ``weight_tiles``: weights in 16 x 16 tiles (``nvfp4(tile=16)``), so ``W`` and ``W^T``
    quantize to the same values: the dlhs GEMM reuses the forward-quantized weight
    (``dlhs_rhs="fwd"``, the same bits as re-quantizing it). Off: 1-D blocks along each
    GEMM's contraction axis, re-quantized for the dlhs GEMM (``W`` differs in the two GEMMs).
  * ``stochastic_gradients``: the output gradient is rounded stochastically in both GEMMs
    that use it (slots ``grad`` and ``drhs_grad``; their noise from ``fold_in(key, 2)`` and
    ``fold_in(key, 5)``, see :class:`jaxlp.DotPolicy`); weights and activations always
    round to nearest. Needs a key per step (``rngs={"quantize": key}`` with
    :func:`jaxlp.flax.quantize_model`).
  * ``rht``: a random Hadamard transform (:class:`jaxlp.RHT`, ``size`` x ``size``, signs of
    ``rht_seed``) on both operands of the weight-gradient GEMM, along the tokens, before they
    are quantized (``rht=RHT(("drhs",), rht_size, rht_seed)``).

  With every piece off this is plain NVFP4 on every operand (nearest rounding, 1-D blocks).
  The paper also keeps a few layers in BF16 (the first and last ones; "selective high
  precision"): that is a per-layer choice, made with :func:`jaxlp.flax.quantize_model`'s
  ``rules`` and :func:`bf16_policy` (example below).

  Args:
    weight_tiles: 16 x 16 weight tiles (else 1-D blocks of 16).
    stochastic_gradients: stochastic rounding of the output gradients.
    rht: the random Hadamard transform on the weight-gradient GEMM.
    rht_size: the transform's size (16 in the paper; see :class:`jaxlp.RHT`).
    rht_seed: the seed of its signs.

  Returns:
    The :class:`jaxlp.DotPolicy`.

  Raises:
    ValueError: a bad ``rht_size`` or ``rht_seed``.

  References:
    NVIDIA, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149, 2025 (§4:
    selective high precision, random Hadamard transforms on Wgrad inputs, 2-D weight
    scaling, stochastic rounding of gradients).

  The first and last layers in BF16, every other layer with the recipe (linen or nnx; the
  paths are the model's module paths, ``qm.quantized_paths(...)`` lists them)::

    qm = jaxlp.flax.quantize_model(model, jaxlp.nvfp4_recipe(),
                                   rules=[("Conv_0", jaxlp.bf16_policy()),
                                          ("Dense_1", jaxlp.bf16_policy())])
    logits = qm.apply(variables, x, rngs={"quantize": step_key})  # a fresh key per step

  (``exclude=("Conv_0", "Dense_1")`` keeps them in FP32 instead; ``jaxlp train --policy
  nvfp4-recipe`` does the above for the first and last layer with a matmul.)

  Example:
    >>> import jax, jax.numpy as jnp
    >>> import jaxlp
    >>> p = jaxlp.nvfp4_recipe()
    >>> p.rhs.fmt.tile, p.dlhs_rhs, p.grad.rounding, p.lhs.rounding, p.rht.gemms
    ((16, 16), 'fwd', 'stochastic', 'nearest', ('drhs',))
    >>> x, w = jnp.ones((32, 16)), jnp.ones((16, 8))
    >>> dot = jaxlp.dot_general(p, key=jax.random.key(0))  # a fresh key per step
    >>> dw = jax.grad(lambda w: dot(x, w, (((1,), (0,)), ((), ()))).sum())(w)
    >>> # x and dY all ones: their transformed chunks (+-0.5, +-1.5) are NVFP4 values, and the
    >>> # transform cancels exactly: dW = x^T . dY = 32 everywhere
    >>> p.rht.apply(jnp.ones(16))[:4]
    Array([-1.5,  0.5,  1.5, -0.5], dtype=float32)
    >>> dw.shape, bool((dw == 32.0).all())
    ((16, 8), True)
  """
  act = Quant(nvfp4(), "nearest")
  grad = Quant(nvfp4(), "stochastic" if stochastic_gradients else "nearest")
  if weight_tiles:
    w, w_dl = Quant(nvfp4(tile=16), "nearest"), FWD
  else:
    w = w_dl = Quant(nvfp4(), "nearest")
  t = RHT(("drhs",), rht_size, rht_seed) if rht else None
  return DotPolicy(lhs=act, rhs=w, grad=grad, dlhs_rhs=w_dl, drhs_lhs=act, drhs_grad=grad,
                   rht=t)


def mxfp8_recipe(scale_rule: str = "rceil", *, block_size: int = 32, fmt=E4M3FN,
                 grad_fmt=None, rounding: str = "nearest") -> DotPolicy:
  """The MXFP8 training recipe: MX E4M3 on every GEMM operand, scales rounded up.

  Every operand slot of the three GEMMs is ``mx(fmt, block_size, scale_rule=scale_rule)``,
  blocked along the contraction axis of the GEMM it feeds (weights and activations are
  re-quantized for the backward GEMMs, as on hardware). The paper uses E4M3 for weights,
  activations and gradients, and computes each block's scale by rounding ``amax / 448`` up to
  a power of two (``"rceil"``), having found that OCP's ``"floor"`` rule can diverge; pass
  ``scale_rule="floor"`` for the OCP rule (then equal to ``mx_policy(E4M3FN)``).

  Args:
    scale_rule: ``"rceil"`` (the recipe), ``"floor"``, ``"even"`` or ``"ceil"`` (see
      :func:`jaxlp.formats.mx`).
    block_size: elements per E8M0 scale (32).
    fmt: element format of weights and activations (``E4M3FN``).
    grad_fmt: element format of the output gradients (default ``fmt``).
    rounding: rounding of every element (``"nearest"``).

  Returns:
    The :class:`jaxlp.DotPolicy`.

  Raises:
    ValueError: an unknown ``scale_rule``, an element format MX does not define, a bad
      ``block_size`` or ``rounding``.

  References:
    Mishra et al., "Recipes for Pre-training LLMs with MXFP8", arXiv:2506.08027, 2025.
    OCP Microscaling Formats (MX) Specification v1.0.

  Example:
    >>> import jaxlp
    >>> from jaxlp import formats as F
    >>> p = jaxlp.mxfp8_recipe()
    >>> p.lhs.fmt == F.mx(F.E4M3FN, 32, scale_rule="rceil"), p.drhs_grad == p.grad
    (True, True)
    >>> jaxlp.mxfp8_recipe("floor") == jaxlp.mx_policy(F.E4M3FN)
    True
  """
  a = Quant(mx(fmt, block_size, scale_rule=scale_rule), rounding)
  g = Quant(mx(fmt if grad_fmt is None else grad_fmt, block_size, scale_rule=scale_rule),
            rounding)
  return DotPolicy(lhs=a, rhs=a, grad=g, dlhs_rhs=a, drhs_lhs=a, drhs_grad=g)


def bf16_policy() -> DotPolicy:
  """BF16 GEMM operands with float32 accumulation (what BF16 tensor cores compute).

  Every operand of the three GEMMs is rounded to BF16 (nearest-even); products and sums are
  float32. The recipes' "higher precision" for the layers they keep out of FP4/FP8.

  Returns:
    ``float_policy(BF16, BF16)``: activations and weights rounded to BF16 in the forward
    GEMM (and reused by the backward GEMMs), the output gradient rounded to BF16.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> dot = jaxlp.dot_general(jaxlp.bf16_policy())
    >>> # 1 + 2**-9 rounds to 1 in BF16 (8 significant bits)
    >>> dot(jnp.array([[1.0 + 2.0**-9]]), jnp.array([[3.0]]), (((1,), (0,)), ((), ())))
    Array([[3.]], dtype=float32)
  """
  return DotPolicy(lhs=BF16, rhs=BF16, grad=BF16)
