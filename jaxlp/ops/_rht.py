"""Random Hadamard transform (RHT) of GEMM operands along their contraction axis.

The NVFP4 training recipe (arXiv 2509.25149, §4.2) multiplies both inputs of the
weight-gradient GEMM by a 16 x 16 Hadamard matrix with random signs, chunk by chunk along the
contraction (K) axis, before quantizing them: the orthogonal transform spreads outliers over
the chunk, so a block scale fits the values better, and it cancels in the product. This module
defines that transform exactly (which signs, which order of float32 additions), as an option
of :class:`jaxlp.DotPolicy` (``rht=RHT(...)``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

#: The GEMMs of a layer (as :class:`jaxlp.DotPolicy` names them).
GEMMS = ("fwd", "dlhs", "drhs")
#: Transform sizes with an exact normalisation ``1 / sqrt(size)`` (a power of two).
RHT_SIZES = (4, 16, 64, 256)
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
  """One step of SplitMix64: ``(new state, output)`` (64-bit unsigned arithmetic)."""
  state = (state + 0x9E3779B97F4A7C15) & _MASK64
  z = state
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
  return state, z ^ (z >> 31)


def hadamard_matrix(size: int) -> np.ndarray:
  """The Sylvester Hadamard matrix ``H[i, j] = (-1) ** popcount(i & j)`` (int8, unnormalised).

  ``H @ H.T == size * I``; ``H`` is symmetric. ``size`` must be a power of two.

  Args:
    size: the order (a power of two >= 1).

  Returns:
    The ``(size, size)`` matrix of +-1 (numpy int8).

  Raises:
    ValueError: ``size`` is not a power of two.

  Example:
    >>> from jaxlp.ops import hadamard_matrix
    >>> hadamard_matrix(4)
    array([[ 1,  1,  1,  1],
           [ 1, -1,  1, -1],
           [ 1,  1, -1, -1],
           [ 1, -1, -1,  1]], dtype=int8)
  """
  if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1 or (
      size & (size - 1)):
    raise ValueError(f"hadamard_matrix: size must be a power of two, got {size!r}")
  i = np.arange(size)
  par = np.vectorize(lambda v: bin(int(v)).count("1") & 1)(i[:, None] & i[None, :])
  return (1 - 2 * par).astype(np.int8)


def _butterfly(x, size: int):
  """``H @ v`` for every chunk ``v`` on the last axis of ``x`` (``(..., size)``, float32), by
  the in-place fast Walsh-Hadamard transform: stages ``h = 1, 2, 4, ..., size / 2``; in stage
  h every pair ``(i, i + h)`` with ``i & h == 0`` becomes ``(v_i + v_{i+h}, v_i - v_{i+h})``,
  each a float32 addition rounded to nearest-even."""
  lead = x.shape[:-1]
  bits = size.bit_length() - 1
  # index i = sum_b i_b 2**b: axis -1 - b of the (..., 2, ..., 2) view holds bit b
  v = x.reshape(*lead, *([2] * bits))
  for b in range(bits):
    ax = v.ndim - 1 - b
    a = jnp.take(v, 0, axis=ax)
    c = jnp.take(v, 1, axis=ax)
    v = jnp.stack([a + c, a - c], axis=ax)
  return v.reshape(*lead, size)


@dataclasses.dataclass(frozen=True)
class RHT:
  """A random Hadamard transform of both operands of chosen GEMMs, along their contraction.

  For a chunk ``v`` of ``size`` consecutive elements along the contraction axis, the
  transform and its inverse are

  ``T(v) = (1 / sqrt(size)) * H @ (s * v)``,  ``T^-1(u) = s * ((1 / sqrt(size)) * H @ u)``,

  with ``H`` the Sylvester Hadamard matrix (:func:`hadamard_matrix`; ``H @ H.T = size * I``)
  and ``s`` the sign vector of :attr:`signs`. The matrix ``M = H diag(s) / sqrt(size)``
  (:attr:`matrix`) is orthogonal (``M.T @ M = I``), so applying ``T`` to the K-chunks of both
  operands of a GEMM leaves the product unchanged in exact arithmetic:
  ``sum_k a_k b_k = sum_c T(a_c) . T(b_c)``. The paper's transform is ``size=16`` (factor
  1/4) on the weight-gradient GEMM (``gemms=("drhs",)``).

  Exact definition in float32 (the same bits on every backend): the signs are applied
  exactly (negation); ``H @ v`` is computed by the fast Walsh-Hadamard butterfly, stages
  ``h = 1, 2, 4, ...``, each pair ``(v_i, v_{i+h})`` (``i & h == 0``) replaced by
  ``(v_i + v_{i+h}, v_i - v_{i+h})``, every addition a float32 addition rounded to
  nearest-even; the result is multiplied by ``1 / sqrt(size)`` (a power of two: exact). The
  inverse runs the same butterfly, the scaling, then the signs. Float32 subnormals (below
  ``2**-126``) in the inputs or results follow the backend's float32 arithmetic (XLA on CPU
  flushes them to zero); a NaN or an infinity spreads over its chunk as IEEE arithmetic
  gives (NaN results have no specified sign). float16/bfloat16 operands are widened to
  float32 exactly, and the result is rounded to their dtype. Because every stage rounds,
  ``T^-1(T(v))`` equals ``v`` only up to a few float32 ulps of the chunk's largest
  magnitude (exactly where no sum rounds, e.g. small integers).

  Chunks: the contraction axis of length L is cut into ``L // size`` chunks of ``size``
  from index 0; the last ``L % size`` elements are left as they are (an identity block: the
  product still cancels). Which axis is the contraction axis of an operand in a GEMM is
  :func:`jaxlp.dot_general`'s (the innermost contracting axis; with several contracting
  axes the transform runs along that one for every index of the others) or
  :func:`jaxlp.conv_general_dilated`'s (input features in the forward GEMM, output features
  in the dlhs GEMM, the batch axis in the weight-gradient GEMM: the axes along which the
  convolution is a plain sum of products). An operand without a contraction axis (an outer
  product) is not transformed.

  The signs are a function of ``seed`` only (SplitMix64: sign ``i`` is ``-1`` where bit
  ``i % 64`` of the ``(i // 64 + 1)``-th output of SplitMix64 seeded with ``seed`` is set), so
  they are the same on every device, shard and call; the transform is a fixed matrix, not a
  fresh draw per step. Under ``jit`` of sharded arrays the result has the unsharded bits;
  inside ``shard_map`` the transform sees the local block, whose chunks start at its first
  element (the global chunks when every shard holds whole chunks of the contraction axis).

  Attributes:
    gemms: the GEMMs whose two operands are transformed, from ``("fwd", "dlhs", "drhs")``
      (the recipe: ``("drhs",)``, the weight gradient ``lhs^T . grad``).
    size: chunk length: 4, 16 (the recipe), 64 or 256 (a power of 4, so that
      ``1 / sqrt(size)`` is a power of two).
    seed: the sign seed, an int in ``[0, 2**64)``.

  Raises:
    ValueError: an unknown or repeated GEMM name, no GEMM, a ``size`` not in
      ``(4, 16, 64, 256)``, or a seed outside ``[0, 2**64)``.

  Example:
    >>> import jax.numpy as jnp
    >>> import jaxlp
    >>> t = jaxlp.RHT(size=4, seed=2)
    >>> t.signs
    array([ 1., -1., -1., -1.], dtype=float32)
    >>> v = jnp.array([1.0, 2.0, 3.0, 4.0])
    >>> t.apply(v)  # H @ (s * v) / 2 with s * v = [1, -2, -3, -4]
    Array([-4.,  2.,  3.,  1.], dtype=float32)
    >>> t.invert(t.apply(v))
    Array([1., 2., 3., 4.], dtype=float32)
  """

  gemms: tuple = ("drhs",)
  size: int = 16
  seed: int = 0

  def __post_init__(self):
    g = (self.gemms,) if isinstance(self.gemms, str) else tuple(self.gemms)
    if not g or any(x not in GEMMS for x in g) or len(set(g)) != len(g):
      raise ValueError(f"RHT: gemms must be distinct names from {GEMMS}, got {self.gemms!r}")
    object.__setattr__(self, "gemms", g)
    if isinstance(self.size, bool) or self.size not in RHT_SIZES:
      raise ValueError(f"RHT: size must be one of {RHT_SIZES} (1 / sqrt(size) must be a "
                       f"power of two), got {self.size!r}")
    if (isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer))
        or not 0 <= self.seed <= _MASK64):
      raise ValueError(f"RHT: seed must be an int in [0, 2**64), got {self.seed!r}")
    object.__setattr__(self, "size", int(self.size))
    object.__setattr__(self, "seed", int(self.seed))

  @property
  def signs(self) -> np.ndarray:
    """The sign vector ``s`` (float32 +-1, length ``size``) of :attr:`seed`."""
    out, state = [], self.seed
    while len(out) < self.size:
      state, z = _splitmix64(state)
      out.extend((z >> b) & 1 for b in range(64))
    bits = np.asarray(out[:self.size], np.float32)
    return 1.0 - 2.0 * bits

  @property
  def matrix(self) -> np.ndarray:
    """``M = H diag(s) / sqrt(size)`` (float64): ``T(v) = M @ v``, ``T^-1(u) = M.T @ u``."""
    h = hadamard_matrix(self.size).astype(np.float64)
    return h * self.signs.astype(np.float64)[None, :] / np.sqrt(self.size)

  def _chunks(self, x, axis, fn):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"RHT: operand must be a float array, got dtype {x.dtype}")
    if x.ndim == 0:
      raise ValueError("RHT: operand must have at least one axis")
    ax = int(axis) % x.ndim
    n = self.size
    L = x.shape[ax]
    full = (L // n) * n
    if full == 0:
      return x
    y = jnp.moveaxis(x.astype(jnp.float32), ax, -1)
    head = y[..., :full].reshape(*y.shape[:-1], L // n, n)
    head = fn(head).reshape(*y.shape[:-1], full)
    y = jnp.concatenate([head, y[..., full:]], axis=-1) if full < L else head
    return jnp.moveaxis(y, -1, ax).astype(x.dtype)

  def apply(self, x, axis: int = -1):
    """``T`` on every chunk of ``size`` elements along ``axis`` (the tail left as is).

    Args:
      x: a float array.
      axis: the contraction axis.

    Returns:
      The transformed array (``x``'s shape and dtype).

    Raises:
      TypeError: a non-float ``x``.
      ValueError: a 0-d ``x``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxlp
      >>> # s = [1, -1, -1, -1]; along axis 0 of a (4, 2) array, each column on its own
      >>> jaxlp.RHT(size=4, seed=2).apply(jnp.ones((4, 2)), axis=0)
      Array([[-1., -1.],
             [ 1.,  1.],
             [ 1.,  1.],
             [ 1.,  1.]], dtype=float32)
    """
    s = jnp.asarray(self.signs < 0)
    scale = np.float32(1.0 / np.sqrt(self.size))
    return self._chunks(x, axis, lambda v: _butterfly(jnp.where(s, -v, v), self.size) * scale)

  def invert(self, y, axis: int = -1):
    """``T^-1`` on every chunk of ``size`` elements along ``axis`` (the tail left as is).

    Args:
      y: a float array.
      axis: the axis :meth:`apply` transformed.

    Returns:
      The inverse transform (``y``'s shape and dtype).

    Raises:
      TypeError: a non-float ``y``.
      ValueError: a 0-d ``y``.

    Example:
      >>> import jax.numpy as jnp
      >>> import jaxlp
      >>> jaxlp.RHT(size=4, seed=2).invert(jnp.array([-1.0, 1.0, 1.0, 1.0]))
      Array([1., 1., 1., 1.], dtype=float32)
    """
    s = jnp.asarray(self.signs < 0)
    scale = np.float32(1.0 / np.sqrt(self.size))

    def inv(u):
      w = _butterfly(u, self.size) * scale
      return jnp.where(s, -w, w)

    return self._chunks(y, axis, inv)
