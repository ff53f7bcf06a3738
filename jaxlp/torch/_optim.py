"""``OptimLP``: QPyTorch's low-precision optimizer wrapper."""

from __future__ import annotations

import torch

from jaxlp.torch._errors import QuantizeTypeError, QuantizeValueError

# The state entries momentum_quant rounds, by optimizer family (subclasses included, as
# QPyTorch's isinstance checks; AdamW is an Adam in torch >= 2.2 and listed for older ones).
_MOMENTUM_KEYS = (
    (torch.optim.SGD, ("momentum_buffer",)),
    (torch.optim.Adam, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    (torch.optim.AdamW, ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
)


class OptimLP(torch.optim.Optimizer):
  """Wrap a torch optimizer with weight / gradient / momentum / accumulator quantization.

  One ``step()`` does, in order (QPyTorch's ``OptimLP``): for every parameter with a
  gradient ``grad <- grad_quant(grad * grad_scaling)`` (the scaling is never undone; with
  ``grad_scaling=1`` the gradient goes to ``grad_quant`` as it is, without the multiply's
  pass); if
  ``acc_quant``: the parameters are swapped for full-precision accumulator copies; the
  wrapped optimizer steps; ``acc <- acc_quant(p)``; ``p <- weight_quant(p)``; the momentum
  buffers (SGD ``momentum_buffer``, Adam/AdamW ``exp_avg``, ``exp_avg_sq``) ``<-
  momentum_quant(buffer)`` (skipped for SGD groups with momentum 0).

  Args:
    optim: any ``torch.optim.Optimizer`` (QPyTorch accepts ``SGD``, ``Adam`` and their
      subclasses; jaxlp accepts every optimizer, but ``momentum_quant`` needs an ``SGD`` or
      ``Adam``/``AdamW`` (subclasses included), whose state entries it knows).
    weight_quant, grad_quant, momentum_quant, acc_quant: functions tensor -> tensor (e.g.
      ``lambda t: jaxlp.torch.float_quantize(t, 5, 2, "nearest")``) or None (no quantization).
    grad_scaling: positive factor applied before ``grad_quant``.

  Raises:
    QuantizeTypeError: (a ``TypeError`` and an ``AssertionError``, as QPyTorch's assertion)
      ``optim`` is not a ``torch.optim.Optimizer``, ``momentum_quant`` is given for an
      optimizer other than an ``SGD`` or ``Adam``/``AdamW``, or a quantizer is neither
      callable nor None.
    QuantizeValueError: (a ``ValueError`` and an ``AssertionError``) ``grad_scaling`` is not
      positive.

  Example:
    >>> import torch
    >>> from jaxlp.torch import OptimLP, float_quantize
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -0.5]))
    >>> q = lambda t: float_quantize(t, 5, 2, "nearest")
    >>> opt = OptimLP(torch.optim.SGD([w], lr=0.1, momentum=0.9), weight_quant=q,
    ...               momentum_quant=q)
    >>> (w ** 2).sum().backward()
    >>> opt.step()
    >>> w.data  # 1 - 0.1 * 2 = 0.8 rounds to 0.75 with 2 mantissa bits
    tensor([ 0.7500, -0.3750])
    >>> opt.optim.state[w]["momentum_buffer"]
    tensor([ 2., -1.])

  References:
    Tiiiger/QPyTorch@f58bba7, ``qtorch/optim/optim_low.py``.
  """

  def __init__(self, optim, weight_quant=None, grad_scaling=1.0, grad_quant=None,
               momentum_quant=None, acc_quant=None):
    if not isinstance(optim, torch.optim.Optimizer):
      raise QuantizeTypeError(f"OptimLP: optim must be a torch.optim.Optimizer, got "
                              f"{type(optim).__name__}")
    keys = next((k for cls, k in _MOMENTUM_KEYS if isinstance(optim, cls)), ())
    if momentum_quant is not None and not keys:
      raise QuantizeTypeError(
          f"OptimLP: momentum_quant rounds the momentum buffers of torch.optim.SGD and "
          f"Adam/AdamW (subclasses included); {type(optim).__name__} is neither (pass "
          "momentum_quant=None, or quantize its state yourself)")
    if not grad_scaling > 0:
      raise QuantizeValueError(f"OptimLP: grad_scaling must be positive, got {grad_scaling=}")
    for name, f in (("weight_quant", weight_quant), ("grad_quant", grad_quant),
                    ("momentum_quant", momentum_quant), ("acc_quant", acc_quant)):
      if f is not None and not callable(f):
        raise QuantizeTypeError(f"OptimLP: {name} must be callable or None, got {f!r}")
    super().__init__(optim.param_groups, optim.defaults)
    self.param_groups = optim.param_groups  # shared with the wrapped optimizer
    self.optim = optim
    self.grad_scaling = grad_scaling
    self.weight_quant = weight_quant
    self.grad_quant = grad_quant
    self.momentum_quant = momentum_quant
    self.acc_quant = acc_quant
    self.momentum_keys = keys
    self.weight_acc = {}
    if acc_quant is not None:
      for group in self.param_groups:
        for p in group["params"]:
          self.weight_acc[p] = p.detach().clone()

  def _params(self, with_grad=False):
    for group in self.param_groups:
      for p in group["params"]:
        if with_grad and p.grad is None:
          continue
        yield group, p

  @torch.no_grad()
  def step(self, closure=None):
    """Quantize gradients, step the wrapped optimizer, quantize weights and momenta."""
    if self.grad_quant is not None:
      for _, p in self._params(with_grad=True):
        g = p.grad.data
        # x * 1.0 == x: skip that pass over the gradient (it would only quiet a signalling
        # NaN, which torch's arithmetic never produces)
        p.grad.data = self.grad_quant(g if self.grad_scaling == 1 else g * self.grad_scaling)
    if self.acc_quant is not None:
      for _, p in self._params():
        p.data = self.weight_acc[p].data
    loss = self.optim.step(closure) if closure is not None else self.optim.step()
    if self.acc_quant is not None:
      for _, p in self._params():
        p.data = self.weight_acc[p].data = self.acc_quant(p.data).data
    if self.weight_quant is not None:
      for _, p in self._params():
        p.data = self.weight_quant(p.data).data
    if self.momentum_quant is not None:
      for group, p in self._params(with_grad=True):
        if isinstance(self.optim, torch.optim.SGD) and group.get("momentum", 0) == 0:
          continue
        state = self.optim.state[p]
        for key in self.momentum_keys:
          if key in state and torch.is_tensor(state[key]):
            state[key] = self.momentum_quant(state[key])
    return loss

  def zero_grad(self, set_to_none: bool = True):
    self.optim.zero_grad(set_to_none=set_to_none)

  def state_dict(self):
    return self.optim.state_dict()

  def load_state_dict(self, state_dict):
    self.optim.load_state_dict(state_dict)

  def __repr__(self):
    return f"LP Optimizer: {self.optim!r}"
