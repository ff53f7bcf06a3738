"""Policy-quantized torch layers: ``Linear``, ``Conv2d`` and ``quantize_model``.

The layers run their GEMMs through :func:`jaxlp.dot_general` / :func:`jaxlp.conv_general_dilated`
(jitted JAX, tensors exchanged through DLPack), so a torch model with a :class:`jaxlp.DotPolicy`
has the same bits as the JAX model: forward with the jitted op, backward with the JAX vjp of
the same function (the forward is recomputed inside the vjp; bits are identical because it
is the same jitted computation).

Layouts are torch's: ``Linear`` weight ``(out, in)`` contracted as ``x @ W^T`` (dimension
numbers ``(((x.ndim-1,), (1,)), ((), ()))``), ``Conv2d`` NCHW inputs and OIHW weights
(``dimension_numbers=("NCHW", "OIHW", "NCHW")``), so tile-blocked formats (HBFP) tile conv
weights on the (O, I*kh*kw) view as HBFPEmulator does.

References:
  parsa-epfl/HBFPEmulator ``bfp/bfp_ops.py`` (BFP layers on torch layouts).
"""

from __future__ import annotations

import fnmatch
import functools

import jax
import jax.numpy as jnp
import torch

from jaxlp.ops._conv import conv_general_dilated
from jaxlp.ops._dot_general import dot_general
from jaxlp.ops._policy import DotPolicy
from jaxlp.torch._dlpack import to_jax, to_torch
from jaxlp.torch._quantize import draw_words

__all__ = ["Conv2d", "Linear", "quantize_model"]


def _pair(v, name):
  if isinstance(v, int):
    return (v, v)
  v = tuple(int(a) for a in v)
  if len(v) != 2:
    raise ValueError(f"jaxlp.torch.nn.Conv2d: {name}={v!r} must be an int or a pair")
  return v


def linear_fn(policy: DotPolicy, ndim: int, has_bias: bool):
  """The pure JAX function ``(x, w, b, key) -> y`` of :class:`Linear` (torch layout)."""
  dg = dot_general(policy)
  dn = (((ndim - 1,), (1,)), ((), ()))

  def f(x, w, b, key):
    y = dg(x, w, dn, key=key)
    return y + b.reshape((1,) * (y.ndim - 1) + (-1,)) if has_bias else y

  return f


def conv_fn(policy: DotPolicy, stride, padding, dilation, groups, has_bias: bool):
  """The pure JAX function ``(x, w, b, key) -> y`` of :class:`Conv2d` (NCHW / OIHW)."""
  cv = conv_general_dilated(policy)
  pad = padding if isinstance(padding, str) else tuple((p, p) for p in padding)

  def f(x, w, b, key):
    y = cv(x, w, stride, pad, rhs_dilation=dilation,
           dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups, key=key)
    return y + b.reshape(1, -1, 1, 1) if has_bias else y

  return f


@functools.cache
def _compiled(kind: str, args: tuple):
  """(forward, backward) jitted for one layer configuration; cached."""
  f = linear_fn(*args) if kind == "linear" else conv_fn(*args)

  def fwd(x, w, b, key):
    return f(x, w, b, key)

  def bwd(x, w, b, key, g):
    _, vjp = jax.vjp(lambda x_, w_, b_: f(x_, w_, b_, key), x, w, b)
    return vjp(g)

  return jax.jit(fwd), jax.jit(bwd)


class _PolicyOp(torch.autograd.Function):
  """Forward = the jitted JAX layer; backward = its JAX vjp."""

  @staticmethod
  def forward(ctx, x, w, b, kind, args, key):
    fwd, bwd = _compiled(kind, args)
    ctx.kind, ctx.args, ctx.key, ctx.has_bias = kind, args, key, b is not None
    bj = to_jax(b) if b is not None else jnp.zeros((0,), jnp.float32)
    ctx.save_for_backward(x, w, b if b is not None else torch.zeros(0))
    kj = None if key is None else jnp.asarray(key)
    return to_torch(fwd(to_jax(x), to_jax(w), bj, kj))

  @staticmethod
  def backward(ctx, g):
    x, w, b = ctx.saved_tensors
    _, bwd = _compiled(ctx.kind, ctx.args)
    kj = None if ctx.key is None else jnp.asarray(ctx.key)
    dx, dw, db = bwd(to_jax(x), to_jax(w), to_jax(b), kj, to_jax(g.contiguous()))
    dx, dw = to_torch(dx), to_torch(dw)
    db = to_torch(db) if ctx.has_bias else None
    return dx, dw, db, None, None, None


def _check_policy(policy, what):
  if policy is None:
    return DotPolicy()
  if not isinstance(policy, DotPolicy):
    raise TypeError(f"jaxlp.torch.nn.{what}: policy must be a jaxlp.DotPolicy "
                    f"(hbfp_policy(...), mx_policy(...), float_policy(...)), got {policy!r}")
  return policy


def _check_input(x, what):
  if x.dtype != torch.float32:
    raise TypeError(f"jaxlp.torch.nn.{what}: input dtype must be torch.float32, got "
                    f"dtype={x.dtype}")


class Linear(torch.nn.Linear):
  """``torch.nn.Linear`` whose GEMMs follow a :class:`jaxlp.DotPolicy`.

  Same numerics as ``jaxlp.dot_general(policy)(x, W, (((x.ndim-1,), (1,)), ((), ())))``
  plus the fp32 bias, forward and backward. Stochastic policies draw a fresh key per
  forward call from torch's global RNG (``jaxlp.torch.draw_key``), reused in the backward.

  Args:
    in_features, out_features, bias, device, dtype: as ``torch.nn.Linear`` (float32 only).
    policy: a :class:`jaxlp.DotPolicy` (None = unquantized, the plain lax GEMM).

  Raises:
    TypeError: ``policy`` is neither None nor a :class:`jaxlp.DotPolicy`; in ``forward``,
      an input whose dtype is not float32.

  Example:
    >>> import torch
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.torch.nn import Linear
    >>> layer = Linear(3, 2, bias=False, policy=jaxlp.float_policy(E4M3))
    >>> with torch.no_grad():
    ...   _ = layer.weight.copy_(torch.tensor([[0.5, -1.0, 0.25], [1.0, 1.0, 1.0]]))
    >>> x = torch.tensor([[0.1, 1.3, -2.7]], requires_grad=True)
    >>> y = layer(x)  # x rounds to [0.1016, 1.25, -2.75] in E4M3
    >>> y
    tensor([[-1.8867, -1.3984]], grad_fn=<_PolicyOpBackward>)
    >>> y.sum().backward()
    >>> x.grad  # dx = grad @ Q(W)
    tensor([[1.5000, 0.0000, 1.2500]])
  """

  def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *,
               policy=None):
    super().__init__(in_features, out_features, bias, device, dtype)
    self.policy = _check_policy(policy, "Linear")

  def forward(self, x):
    _check_input(x, "Linear")
    key = draw_words() if self.policy.stochastic else None
    args = (self.policy, x.dim(), self.bias is not None)
    return _PolicyOp.apply(x.contiguous(), self.weight, self.bias, "linear", args, key)

  def extra_repr(self):
    return f"{super().extra_repr()}, policy={self.policy!r}"


class Conv2d(torch.nn.Conv2d):
  """``torch.nn.Conv2d`` whose GEMMs follow a :class:`jaxlp.DotPolicy`.

  Same numerics as ``jaxlp.conv_general_dilated(policy)(x, W, stride, [(p, p), (p, p)],
  rhs_dilation=dilation, dimension_numbers=("NCHW", "OIHW", "NCHW"),
  feature_group_count=groups)`` plus the fp32 bias. Only ``padding_mode="zeros"``.

  Args:
    in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
      device, dtype: as ``torch.nn.Conv2d`` (padding may be an int, a pair, "same" or
      "valid").
    policy: a :class:`jaxlp.DotPolicy` (None = unquantized).

  Raises:
    ValueError: ``padding_mode`` is not "zeros"; in ``forward``, an input that is not 4-D
      (NCHW) or a ``stride`` / ``padding`` / ``dilation`` that is not an int or a pair.
    TypeError: ``policy`` is neither None nor a :class:`jaxlp.DotPolicy`; in ``forward``,
      an input whose dtype is not float32.

  Example:
    >>> import torch
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.torch.nn import Conv2d
    >>> conv = Conv2d(1, 1, 3, padding=1, bias=False, policy=jaxlp.float_policy(E4M3))
    >>> with torch.no_grad():
    ...   _ = conv.weight.fill_(1.0)
    >>> conv(torch.ones(1, 1, 4, 4))
    tensor([[[[4., 6., 6., 4.],
              [6., 9., 9., 6.],
              [6., 9., 9., 6.],
              [4., 6., 6., 4.]]]], grad_fn=<_PolicyOpBackward>)
  """

  def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
               groups=1, bias=True, padding_mode="zeros", device=None, dtype=None, *,
               policy=None):
    if padding_mode != "zeros":
      raise ValueError(f"jaxlp.torch.nn.Conv2d: only padding_mode='zeros' is supported, got "
                       f"{padding_mode=}")
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                     bias, padding_mode, device, dtype)
    self.policy = _check_policy(policy, "Conv2d")

  def _jax_padding(self):
    if isinstance(self.padding, str):
      return self.padding.upper()
    return _pair(self.padding, "padding")

  def forward(self, x):
    _check_input(x, "Conv2d")
    if x.dim() != 4:
      raise ValueError(f"jaxlp.torch.nn.Conv2d: input must be NCHW (4-D), got shape "
                       f"{tuple(x.shape)}")
    key = draw_words() if self.policy.stochastic else None
    args = (self.policy, _pair(self.stride, "stride"), self._jax_padding(),
            _pair(self.dilation, "dilation"), int(self.groups), self.bias is not None)
    return _PolicyOp.apply(x.contiguous(), self.weight, self.bias, "conv", args, key)

  def extra_repr(self):
    return f"{super().extra_repr()}, policy={self.policy!r}"


def _matches(name, patterns):
  return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _patterns(patterns, what):
  if patterns is None:
    return None
  if isinstance(patterns, str):
    return (patterns,)
  try:
    pats = tuple(patterns)
  except TypeError:
    raise TypeError(f"jaxlp.torch.nn.quantize_model: {what}={patterns!r} must be a str or a "
                    f"sequence of str") from None
  for p in pats:
    if not isinstance(p, str):
      raise TypeError(f"jaxlp.torch.nn.quantize_model: {what} entries must be str patterns, "
                      f"got {p!r}")
  return pats


def _swappable(layer) -> bool:
  return type(layer) is torch.nn.Linear or (type(layer) is torch.nn.Conv2d
                                            and layer.padding_mode == "zeros")


def quantize_model(module, policy, include=None, exclude=None):
  """Swap every ``nn.Linear`` / ``nn.Conv2d`` of ``module`` for the jaxlp layer (in place).

  Weights and biases are the SAME parameter objects (so an optimizer built before the swap
  keeps working); the replaced layers keep device and training mode.

  Args:
    module: a ``torch.nn.Module``.
    policy: a :class:`jaxlp.DotPolicy` for every swapped layer, or a callable
      ``(qualified_name, layer) -> DotPolicy | None`` (None leaves the layer unchanged).
    include: optional fnmatch pattern or list of patterns of qualified names to swap
      (default all).
    exclude: optional fnmatch pattern or list of patterns of qualified names to leave
      unchanged.

  Returns:
    ``module`` (modified in place; a bare Linear/Conv2d is returned as a new layer).

  Raises:
    TypeError: ``module`` is not a ``torch.nn.Module``, or ``policy`` is not None, a
      :class:`jaxlp.DotPolicy` or a callable.
    ValueError: an ``include`` / ``exclude`` pattern matches none of the module's
      ``nn.Linear`` / ``nn.Conv2d`` layers (almost always a typo: ``"fc_l"`` for ``"fc1"``);
      raised before any layer is swapped, naming the pattern and listing the layer names.

  Example:
    >>> import torch
    >>> import jaxlp
    >>> from jaxlp.formats import E4M3
    >>> from jaxlp.torch.nn import quantize_model
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> net = quantize_model(net, jaxlp.float_policy(E4M3), exclude=["2"])  # keep the last
    >>> [type(m).__module__ for m in net]
    ['jaxlp.torch.nn', 'torch.nn.modules.activation', 'torch.nn.modules.linear']
    >>> net(torch.ones(1, 4)).shape
    torch.Size([1, 2])
  """
  if not isinstance(module, torch.nn.Module):
    raise TypeError(f"jaxlp.torch.nn.quantize_model: module must be a torch.nn.Module, got "
                    f"{type(module).__name__}")
  if not (policy is None or isinstance(policy, DotPolicy) or callable(policy)):
    raise TypeError(f"jaxlp.torch.nn.quantize_model: policy must be a DotPolicy or a callable, "
                    f"got {policy!r}")

  include = _patterns(include, "include")
  exclude = _patterns(exclude, "exclude")
  if include is not None or exclude is not None:
    names = [name for name, layer in module.named_modules() if _swappable(layer)
             or isinstance(layer, (Linear, Conv2d))]
    bad = [f"{what}={p!r}" for what, pats in (("include", include), ("exclude", exclude))
           for p in pats or () if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if bad:
      raise ValueError(
          f"jaxlp.torch.nn.quantize_model: pattern {', '.join(bad)} matches no nn.Linear / "
          f"nn.Conv2d of the module (fnmatch on the qualified name, case-sensitive); its "
          f"layer names are: {names}")

  def pick(name, layer):
    if include is not None and not _matches(name, include):
      return None
    if exclude is not None and _matches(name, exclude):
      return None
    return policy(name, layer) if callable(policy) and not isinstance(policy, DotPolicy) \
        else policy

  def convert(name, layer):
    if isinstance(layer, (Linear, Conv2d)):
      return None
    if not _swappable(layer):
      return None
    if type(layer) is torch.nn.Linear:
      p = pick(name, layer)
      if p is None:
        return None
      new = Linear(layer.in_features, layer.out_features, bias=False, policy=p,
                   device="meta")
    else:
      p = pick(name, layer)
      if p is None:
        return None
      new = Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                   layer.padding, layer.dilation, layer.groups, bias=False, policy=p,
                   device="meta")
    new.weight = layer.weight
    new.bias = layer.bias
    new.train(layer.training)
    return new

  top = convert("", module)
  if top is not None:
    return top
  for name, parent in list(module.named_modules()):
    for child_name, child in list(parent.named_children()):
      full = f"{name}.{child_name}" if name else child_name
      new = convert(full, child)
      if new is not None:
        setattr(parent, child_name, new)
  return module
