"""Dot-product attention whose two matmuls take a ``dot_general`` (for nnx attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes
from jax import lax


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                          dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                          precision=None, module=None, promote_dtype=nnx_dtypes.promote_dtype,
                          is_causal=False, *, qk_dot_general=lax.dot_general,
                          pv_dot_general=lax.dot_general):
  """``softmax(q k^T / sqrt(d) + bias, masked) v`` with both matmuls through given dot_generals.

  The arguments are those of ``flax.nnx.dot_product_attention`` (an nnx
  ``MultiHeadAttention``'s ``attention_fn``), and the computation is the one Flax documents
  (its einsum path): the query scaled by ``1/sqrt(depth)``, the logits
  ``einsum('...qhd,...khd->...hqk')`` (``qk_dot_general``; the head dim is the contraction),
  bias added, masked positions (``mask`` False, or above the diagonal with ``is_causal``)
  set to the dtype's lowest value, softmax, optional dropout, then
  ``einsum('...hqk,...khd->...qhd')`` with the values (``pv_dot_general``; the key positions
  are the contraction). Grouped-query attention (fewer key/value heads than query heads,
  a divisor) shares each key/value head among consecutive query heads.

  Returns:
    ``[batch..., q_length, num_heads, v_depth]``.

  Raises:
    ValueError: rank, batch, depth, length or head counts that do not match.
  """
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  dtype = query.dtype
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError(f"attention: query, key, value must have the same rank, got "
                     f"{query.shape}, {key.shape}, {value.shape}")
  if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
    raise ValueError(f"attention: batch dims must match, got {query.shape}, {key.shape}, "
                     f"{value.shape}")
  if query.shape[-1] != key.shape[-1]:
    raise ValueError(f"attention: q, k depths must match, got {query.shape[-1]} and "
                     f"{key.shape[-1]}")
  if key.shape[-3] != value.shape[-3] or key.shape[-2] != value.shape[-2]:
    raise ValueError(f"attention: k, v lengths and heads must match, got {key.shape} and "
                     f"{value.shape}")
  q_heads, kv_heads = query.shape[-2], key.shape[-2]
  if q_heads % kv_heads:
    raise ValueError(f"attention: query heads ({q_heads}) must be a multiple of key/value "
                     f"heads ({kv_heads})")
  groups = q_heads // kv_heads

  query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
  if groups == 1:
    logits = jnp.einsum("...qhd,...khd->...hqk", query, key, precision=precision,
                        _dot_general=qk_dot_general)
  else:  # query head h * groups + g attends with key/value head h
    q5 = query.reshape(query.shape[:-2] + (kv_heads, groups, query.shape[-1]))
    logits = jnp.einsum("...qhgd,...khd->...hgqk", q5, key, precision=precision,
                        _dot_general=qk_dot_general)
    logits = logits.reshape(logits.shape[:-4] + (q_heads,) + logits.shape[-2:])
  if bias is not None:
    logits = logits + bias
  if mask is not None or is_causal:
    keep = None if mask is None else mask.astype(bool)
    if is_causal:
      t, s = logits.shape[-2:]
      causal = jnp.tril(jnp.ones((t, s), bool))
      keep = causal if keep is None else jnp.logical_and(keep, causal)
    logits = jnp.where(keep, logits, jnp.finfo(dtype).min)
  weights = jax.nn.softmax(logits).astype(dtype)
  if module is not None:
    module.sow(nnx.Intermediate, "attention_weights", weights)
  if not deterministic and dropout_rate > 0.0:
    keep_prob = 1.0 - dropout_rate
    shape = ((1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout
             else weights.shape)
    kept = jax.random.bernoulli(dropout_rng, keep_prob, shape)
    weights = weights * (kept.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
  if groups == 1:
    return jnp.einsum("...hqk,...khd->...qhd", weights, value, precision=precision,
                      _dot_general=pv_dot_general)
  w5 = weights.reshape(weights.shape[:-3] + (kv_heads, groups) + weights.shape[-2:])
  out = jnp.einsum("...hgqk,...khd->...qhgd", w5, value, precision=precision,
                   _dot_general=pv_dot_general)
  return out.reshape(out.shape[:-3] + (q_heads, out.shape[-1]))
