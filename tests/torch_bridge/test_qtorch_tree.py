"""``jaxlp.torch.qtorch`` and ``jaxlp.torch.cpdtorch``: QPyTorch's and CPD's module trees, so
that migrating is one import prefix.

The tests named ``test_qpytorch_suite_*`` are small versions of QPyTorch's own unit tests
(its ``test/`` folder: test_backward, test_clamp, test_device, test_random, test_relation,
test_stochastic; 15 tests), written once and run with both import prefixes: ``qtorch`` (the
live package, CPU build) and ``jaxlp.torch.qtorch``. QPyTorch's CUDA-vs-CPU comparisons
(test_device) compare the two CPU routes of jaxlp here (NumPy path and the JAX spec), and
their sizes and trial counts are reduced with the tolerances scaled to keep them meaningful.
"""

import importlib
import inspect
import types

import numpy as np
import pytest
import torch

import jaxlp.torch as jt
from jaxlp import formats as F
from jaxlp.torch import _quantize as Q

pytestmark = [pytest.mark.xdist_group("qtorch"),
              pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")]

PREFIXES = ["jaxlp.torch.qtorch", "qtorch"]


def _ns(prefix, request):
  """The names a QPyTorch test imports (``from qtorch.quant import *``, ``from qtorch import
  FixedPoint, BlockFloatingPoint, FloatingPoint``), from ``prefix``."""
  if prefix == "qtorch":
    request.getfixturevalue("qtorch_quant")  # builds (or fails / skips with the reason)
  ns = types.SimpleNamespace()
  quant = importlib.import_module(prefix + ".quant")
  for name in quant.__all__:
    setattr(ns, name, getattr(quant, name))
  top = importlib.import_module(prefix)
  for name in ("FixedPoint", "BlockFloatingPoint", "FloatingPoint"):
    setattr(ns, name, getattr(top, name))
  ns.OptimLP = importlib.import_module(prefix + ".optim").OptimLP
  ns.prefix = prefix
  return ns


@pytest.fixture(params=PREFIXES)
def q(request):
  return _ns(request.param, request)


# ---- test_backward.py ---------------------------------------------------------------------
def test_qpytorch_suite_backward_fixed(q):
  number = q.FixedPoint(wl=5, fl=4)
  t_min = -(2 ** (number.wl - number.fl - 1))
  t_max = 2 ** (number.wl - number.fl - 1) - 2 ** (-number.fl)
  a = torch.linspace(t_min, t_max, steps=100, requires_grad=True)
  quant = q.quantizer(forward_number=number, forward_rounding="nearest",
                      backward_number=number, backward_rounding="nearest")
  quant(a).sum().backward()
  assert torch.eq(a.grad, torch.ones_like(a) * t_max).all()  # the gradient 1 clamps to t_max
  a = torch.tensor([-1, -0.6, 0, 1], requires_grad=True)
  quant = q.quantizer(forward_number=number, forward_rounding="nearest",
                      backward_number=number, backward_rounding="nearest",
                      clamping_grad_zero=True)
  quant(a).sum().backward()
  want = torch.ones_like(a) * t_max
  want[-1] = 0  # 1 was clamped in the forward pass
  assert torch.eq(a.grad, want).all()


def test_qpytorch_suite_clamp_zero(q):
  """The clamped-gradient masking against an oracle written with torch ops."""
  wl = 4
  s = 2.0 ** (wl - 1)

  class Oracle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
      x = torch.round(x * s) / s
      t_max, t_min = 1 - 1.0 / s, -1 + 1.0 / s
      ctx.mask = (x > t_max) | (x < t_min)
      return torch.clamp(x, t_min, t_max)

    @staticmethod
    def backward(ctx, g):
      return (torch.round(torch.clamp(g, -1 + 1 / s, 1 - 1 / s) * s) / s).masked_fill(
          ctx.mask, 0)

  number = q.FixedPoint(wl=wl, fl=wl - 1, clamp=True, symmetric=True)
  quant = q.quantizer(forward_number=number, forward_rounding="nearest",
                      backward_number=number, backward_rounding="nearest",
                      clamping_grad_zero=True)
  y = torch.linspace(-2, 2, steps=10, requires_grad=True)
  Oracle.apply(y).sum().backward()
  z = torch.linspace(-2, 2, steps=10, requires_grad=True)
  quant(z).sum().backward()
  assert torch.eq(y.grad, z.grad).all()


def test_qpytorch_suite_backward_block(q):
  number = q.BlockFloatingPoint(wl=5)
  a = torch.linspace(-0.9, 0.9, steps=100, requires_grad=True)
  quant = q.quantizer(forward_number=number, forward_rounding="nearest",
                      backward_number=number, backward_rounding="nearest")
  quant(a).sum().backward()
  assert torch.eq(a.grad, torch.ones_like(a)).all()


def test_qpytorch_suite_backward_float(q):
  number = q.FloatingPoint(exp=3, man=5)
  a = torch.linspace(-0.9, 0.9, steps=100, requires_grad=True)
  quant = q.quantizer(forward_number=number, forward_rounding="nearest",
                      backward_number=number, backward_rounding="nearest")
  quant(a).sum().backward()
  assert torch.eq(a.grad, torch.ones_like(a)).all()


# ---- test_clamp.py ------------------------------------------------------------------------
def test_qpytorch_suite_clamp_fixed(q):
  wl, fl = 5, 4
  t_min, t_max = -(2 ** (wl - fl - 1)), 2 ** (wl - fl - 1) - 2 ** (-fl)
  for r in ("stochastic", "nearest"):
    a = torch.linspace(-2, 2, steps=100)
    clamped = q.fixed_point_quantize(a, wl=wl, fl=fl, clamp=True, rounding=r)
    assert clamped.max().item() == t_max and clamped.min().item() == t_min
    free = q.fixed_point_quantize(a, wl=wl, fl=fl, clamp=False, rounding=r)
    assert free.max().item() > t_max and free.min().item() < t_min


def test_qpytorch_suite_clamp_float(q):
  """QPyTorch's test_clamp.test_float fails against QPyTorch 0.3.0 itself: it expects the
  largest value ``2**(2**(exp-1)) * (1 - 2**(-man-1))`` (the bias ``2**(exp-1)`` of its
  number.py docstring), while QPyTorch's is twice that (the all-ones exponent field is an
  ordinary binade), and it expects +-2**-50 / +-2**-35 near the smallest normal, while
  QPyTorch rounds them onto its subnormal grid (to 0 below half its smallest subnormal). Both
  prefixes are held to what QPyTorch computes."""

  def small(v, exp, man):  # |v| a power of two: on the grid, a tie away from zero, or 0
    g = 2.0 ** (2 - 2 ** (exp - 1) - man)  # the smallest subnormal
    return v if abs(v) >= g else (g if v > 0 else -g) if abs(v) == g / 2 else 0.0

  for exp, man in ((6, 9), (5, 10), (5, 2)):
    for r in ("stochastic", "nearest"):
      a_max = 2 ** (2 ** (exp - 1)) * (2 - 2.0**-man)
      got = q.float_quantize(torch.tensor([2.0**50, 2.0**-50]), exp=exp, man=man, rounding=r)
      assert got.tolist() == [a_max, small(2.0**-50, exp, man)]
      got = q.float_quantize(torch.tensor([-(2.0**35), -(2.0**-35)]), exp=exp, man=man,
                             rounding=r)
      assert got.tolist() == [-a_max, small(-(2.0**-35), exp, man)]


# ---- test_device.py (QPyTorch: CUDA vs CPU; here: the two CPU routes) ----------------------
def _routes_agree(q, fn, x, monkeypatch):
  """QPyTorch compares its CUDA kernels with its CPU ones; jaxlp's CPU tensors have two
  routes, the NumPy path and the compiled JAX spec: they must agree bit for bit."""
  a = fn(x)
  if q.prefix == "qtorch":
    return  # one CPU implementation only
  with monkeypatch.context() as m:
    m.setattr(Q._cpu, "quantize", lambda *args, **kwargs: None)  # every call: the JAX route
    b = fn(x)
  assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_qpytorch_suite_device_fixed_point(q, monkeypatch):
  for wl, fl in ((5, 4), (3, 2)):
    t_max = 1 - 2 ** (-fl)
    x = torch.linspace(-t_max, t_max, steps=20)
    _routes_agree(q, lambda v, wl=wl, fl=fl: q.fixed_point_quantize(v, wl=wl, fl=fl,
                                                                    rounding="nearest"),
                  x, monkeypatch)


def test_qpytorch_suite_device_block_floating_point(q, monkeypatch):
  for wl in (5, 3):
    for dim in (-1, 0, 1):
      x = torch.linspace(-(1 - 2**-4), 1 - 2**-4, steps=20).reshape(4, 5)
      _routes_agree(q, lambda v, wl=wl, dim=dim: q.block_quantize(v, wl=wl, dim=dim,
                                                                  rounding="nearest"),
                    x, monkeypatch)


def test_qpytorch_suite_device_floating_point(q, monkeypatch):
  torch.manual_seed(0)
  for man, exp in ((2, 5), (6, 8)):
    x = torch.rand(20)
    _routes_agree(q, lambda v, man=man, exp=exp: q.float_quantize(v, man=man, exp=exp,
                                                                  rounding="nearest"),
                  x, monkeypatch)


# ---- test_random.py -----------------------------------------------------------------------
def test_qpytorch_suite_fixed_random(q):
  torch.manual_seed(1)
  wl = 8
  x = torch.randn(100_000)
  oracle = torch.round(x * 2**wl) / 2**wl
  assert torch.eq(oracle, q.fixed_point_quantize(x, wl=wl, fl=wl, clamp=False,
                                                 rounding="nearest")).all()


# ---- test_relation.py ---------------------------------------------------------------------
def test_qpytorch_suite_fixed_block_zero_exponent(q):
  """A block whose largest exponent is 0 behaves like fixed point with fl = wl - 1."""
  for wl, fl in ((3, 2), (5, 4)):
    t_max = 1 - 2 ** (-fl)
    x = torch.linspace(-t_max, t_max, steps=1000)
    assert torch.eq(q.fixed_point_quantize(x, wl=wl, fl=fl, rounding="nearest"),
                    q.block_quantize(x, wl=wl, rounding="nearest")).all()


def test_qpytorch_suite_float_half(q):
  torch.manual_seed(2)
  a = torch.rand(10_000)
  sim = q.float_quantize(a, exp=5, man=10, rounding="nearest")
  assert ((a - sim) ** 2).sum() == ((a - a.half().float()) ** 2).sum()


# ---- test_stochastic.py (unbiasedness; fewer trials, the tolerances scaled) ---------------
def _expectation_error(a, quant, n):
  b = torch.zeros_like(a)
  for i in range(n):
    b = b * i / (i + 1.0) + quant(a) / (i + 1)
  return ((a - b) ** 2).mean().item()


def test_qpytorch_suite_stochastic_fixed(q):
  # QPyTorch: 1e5 trials, error < 1e-6; the error of the mean falls as 1/trials (about
  # step**2 / 6 / trials = 2e-8 here), so 2000 trials keep a 50x margin under 1e-6
  wl, fl = 7, 6
  a = torch.linspace(-0.9, 0.9, steps=100)
  quant = lambda x: q.fixed_point_quantize(x, wl=wl, fl=fl, clamp=True, symmetric=False)  # noqa: E731
  assert _expectation_error(a, quant, 2000) < 1e-6
  number = q.FixedPoint(wl=wl, fl=fl, clamp=True, symmetric=False)
  quant = q.quantizer(forward_number=number, forward_rounding="stochastic")
  assert _expectation_error(a, quant, 2000) < 1e-6


def test_qpytorch_suite_stochastic_block(q):
  torch.manual_seed(3)
  for dim in (-1, 0, 1):
    a = torch.rand(10, 10, 10)
    quant = lambda x, dim=dim: q.block_quantize(x, wl=6, dim=dim)  # noqa: E731
    assert _expectation_error(a, quant, 300) < 1e-4
    quant = q.quantizer(forward_number=q.BlockFloatingPoint(wl=6, dim=dim),
                        forward_rounding="stochastic")
    assert _expectation_error(a, quant, 300) < 1e-4


def test_qpytorch_suite_stochastic_float(q):
  torch.manual_seed(4)
  a = torch.rand(100)
  quant = lambda x: q.float_quantize(x, exp=6, man=5)  # noqa: E731
  assert _expectation_error(a, quant, 2000) < 1e-6
  quant = q.quantizer(forward_number=q.FloatingPoint(exp=6, man=5), forward_rounding="stochastic")
  assert _expectation_error(a, quant, 2000) < 1e-6


# ---- the module tree against live QPyTorch ------------------------------------------------
def test_module_tree_and_signatures_match_qpytorch(qtorch_quant):
  del qtorch_quant
  pairs = [("qtorch", "jaxlp.torch.qtorch"), ("qtorch.quant", "jaxlp.torch.qtorch.quant"),
           ("qtorch.optim", "jaxlp.torch.qtorch.optim"),
           ("qtorch.number", "jaxlp.torch.qtorch.number"),
           ("qtorch.auto_low", "jaxlp.torch.qtorch.auto_low")]
  for theirs, ours in pairs:
    a, b = importlib.import_module(theirs), importlib.import_module(ours)
    assert set(a.__all__) <= set(b.__all__), (theirs, set(a.__all__) - set(b.__all__))
    for name in a.__all__:
      fa, fb = getattr(a, name), getattr(b, name)
      if not callable(fa):
        continue
      pa = [(p.name, p.default) for p in inspect.signature(fa).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
      pb = [(p.name, p.default) for p in inspect.signature(fb).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]
      pa = [(n, tuple(d) if isinstance(d, list) else d) for n, d in pa]  # [] -> ()
      assert pb[:len(pa)] == pa, (theirs, name, pa, pb)
      extra = pb[len(pa):]
      assert all(d is not inspect.Parameter.empty for _, d in extra), (name, extra)
  # the same names from jaxlp.torch: one implementation
  from jaxlp.torch.qtorch import optim, quant  # noqa: PLC0415
  assert quant.float_quantize is jt.float_quantize and quant.Quantizer is jt.Quantizer
  assert optim.OptimLP is jt.OptimLP and optim.optim_low.OptimLP is jt.OptimLP
  assert quant.quant_function.block_quantize is jt.block_quantize


def test_numbers(qtorch_quant):
  import qtorch  # noqa: PLC0415

  from jaxlp.torch import qtorch as jq  # noqa: PLC0415

  del qtorch_quant
  for ours, theirs, fmt in (
      (jq.FloatingPoint(5, 2), qtorch.FloatingPoint(5, 2), F.qpytorch_float(5, 2)),
      (jq.FixedPoint(8, 4, symmetric=True), qtorch.FixedPoint(8, 4, symmetric=True),
       jt.QPyTorchFixedPoint(8, 4, True, True)),
      (jq.BlockFloatingPoint(6, 0), qtorch.BlockFloatingPoint(6, 0), F.qpytorch_block(6, 0))):
    assert repr(ours) == repr(theirs) and str(ours) == str(theirs)
    assert isinstance(ours, jq.Number) and ours.format == fmt
    assert jt.as_format(ours) == jt.as_format(theirs) == fmt
    assert ours == type(ours)(*ours._key()) and hash(ours) == hash(type(ours)(*ours._key()))
  assert jq.FloatingPoint(5, 2) != jq.FloatingPoint(5, 3)
  assert (jq.FixedPoint(8, 4).wl, jq.FixedPoint(8, 4).fl, jq.FixedPoint(8, 4).clamp,
          jq.FixedPoint(8, 4).symmetric) == (8, 4, True, False)
  assert (jq.BlockFloatingPoint(8).wl, jq.BlockFloatingPoint(8).dim) == (8, -1)
  # jaxlp's ranges: man = 0 and fl <= 0 are formats too
  assert jq.FloatingPoint(4, 0).format == F.qpytorch_float(4, 0)
  assert jq.FixedPoint(8, 0).format == jt.QPyTorchFixedPoint(8, 0)


def _raises(fn):
  try:
    fn()
  except Exception as e:  # noqa: BLE001 -- the test inspects it
    return e
  raise AssertionError("did not raise")


#: (mistake, call taking the namespace, QPyTorch's type, jaxlp's documented type)
MISTAKES = [
    ("unknown rounding", lambda n: n.float_quantize(torch.ones(3), 5, 2, "nearst"),
     AssertionError, ValueError),
    ("block rounding", lambda n: n.block_quantize(torch.ones(3), 8, -1, "up"),
     AssertionError, ValueError),
    ("fixed rounding", lambda n: n.fixed_point_quantize(torch.ones(3), 8, 4, rounding="x"),
     AssertionError, ValueError),
    ("float64 tensor", lambda n: n.float_quantize(torch.ones(3, dtype=torch.float64), 5, 2,
                                                 "nearest"), RuntimeError, TypeError),
    ("int tensor", lambda n: n.fixed_point_quantize(torch.ones(3, dtype=torch.int32), 8, 4),
     RuntimeError, TypeError),
    ("not a tensor", lambda n: n.float_quantize(np.ones(3, np.float32), 5, 2), AssertionError,
     TypeError),
    ("sparse tensor", lambda n: n.float_quantize(torch.ones(2, 3).to_sparse(), 5, 2,
                                                "nearest"), RuntimeError, TypeError),
    ("csr tensor", lambda n: n.block_quantize(torch.ones(2, 3).to_sparse_coo().to_sparse_csr(),
                                             8, 0, "nearest"), RuntimeError, TypeError),
    ("meta tensor", lambda n: n.float_quantize(torch.ones(3, device="meta"), 5, 2, "nearest"),
     RuntimeError, ValueError),
    ("block dim", lambda n: n.block_quantize(torch.ones(4, 5), 8, 2, "nearest"), IndexError,
     ValueError),
    ("FloatingPoint exp", lambda n: n.FloatingPoint(9, 2), AssertionError, ValueError),
    ("FloatingPoint man", lambda n: n.FloatingPoint(5, 24), AssertionError, ValueError),
    ("FixedPoint wl", lambda n: n.FixedPoint(0, 2), AssertionError, ValueError),
    ("FixedPoint symmetric", lambda n: n.FixedPoint(8, 2, symmetric=1), AssertionError,
     TypeError),
    ("BlockFloatingPoint wl", lambda n: n.BlockFloatingPoint(0), AssertionError, ValueError),
    ("BlockFloatingPoint dim", lambda n: n.BlockFloatingPoint(8, -2), AssertionError,
     ValueError),
    ("quantizer rounding", lambda n: n.quantizer(n.FloatingPoint(5, 2), forward_rounding="x"),
     AssertionError, ValueError),
    ("quantizer number", lambda n: n.quantizer(5), AssertionError, TypeError),
    ("Quantizer number", lambda n: n.Quantizer("a"), AssertionError, TypeError),
    ("clamping_grad_zero, float", lambda n: n.quantizer(n.FloatingPoint(5, 2),
                                                        clamping_grad_zero=True),
     ValueError, ValueError),
    ("clamping_grad_zero, no clamp", lambda n: n.quantizer(n.FixedPoint(8, 2, clamp=False),
                                                           clamping_grad_zero=True),
     AssertionError, ValueError),
    ("quantizer call, float64", lambda n: n.quantizer(n.FloatingPoint(5, 2),
                                                      forward_rounding="nearest")(
        torch.ones(3, dtype=torch.float64)), RuntimeError, TypeError),
    ("OptimLP optimizer", lambda n: n.OptimLP(5), AssertionError, TypeError),
    ("OptimLP momentum of RMSprop", lambda n: n.OptimLP(
        torch.optim.RMSprop([torch.nn.Parameter(torch.ones(2))]), momentum_quant=lambda t: t),
     AssertionError, TypeError),
    ("OptimLP grad_scaling", lambda n: n.OptimLP(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), grad_scaling=0),
     AssertionError, ValueError),
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_exceptions_are_qpytorchs_and_jaxlps(mistake, request):
  """The same mistake raises, with jaxlp, an instance of what QPyTorch raises and of jaxlp's
  documented type (so ``except`` clauses written for either keep matching)."""
  _, call, theirs, ours = mistake
  assert isinstance(_raises(lambda: call(_ns("qtorch", request))), theirs)
  e = _raises(lambda: call(_ns("jaxlp.torch.qtorch", request)))
  assert isinstance(e, theirs) and isinstance(e, ours), (type(e).__mro__, theirs, ours)
  assert str(e).startswith(("jaxlp.torch", "OptimLP", "FloatingPoint", "FixedPoint",
                            "BlockFloatingPoint")), str(e)


def test_sparse_tensors_get_one_clear_error():
  """Issue 49: a sparse tensor is refused by name, with the way out (``.to_dense()``)."""
  x = torch.ones(3, 4).to_sparse()
  for call in (lambda: jt.quantize(x, F.E4M3), lambda: jt.quantize(x, F.mx(F.E4M3FN, 4)),
               lambda: jt.float_quantize(x, 5, 2), lambda: jt.block_quantize(x, 8),
               lambda: jt.fixed_point_quantize(x, 8, 4), lambda: jt.cpd.float_quantize(x, 5, 2),
               lambda: jt.quantizer(F.E4M3)(x), lambda: jt.quantize(x.to_sparse_csr(), F.E4M3)):
    with pytest.raises(TypeError, match=r"layout=torch\.sparse_(coo|csr).*to_dense") as e:
      call()
    assert isinstance(e.value, jt.TensorTypeError) and isinstance(e.value, RuntimeError)
  assert torch.equal(jt.quantize(x.to_dense(), F.E4M3), torch.ones(3, 4))


def test_cpd_errors():
  """CPD asserts (AssertionError) and its extension raises RuntimeError: jaxlp's errors are
  those too."""
  cq = importlib.import_module("jaxlp.torch.cpdtorch.quant")
  for call, types_ in (
      (lambda: cq.float_quantize([1.0], 5, 2), (TypeError, AssertionError)),
      (lambda: cq.float_quantize(torch.ones(2, dtype=torch.float64), 5, 2),
       (TypeError, RuntimeError)),
      (lambda: cq.quant_gemm(torch.ones(3), torch.ones(3, 2)), (TypeError, AssertionError)),
      (lambda: cq.quant_gemm(torch.ones(2, 3), torch.ones(4, 2)), (ValueError, AssertionError)),
      (lambda: cq.quant_gemm(torch.ones(2, 3, dtype=torch.float64), torch.ones(3, 2)),
       (TypeError, RuntimeError))):
    e = _raises(call)
    assert all(isinstance(e, t) for t in types_), (type(e).__mro__, types_)


# ---- OptimLP and auto_low next to QPyTorch's --------------------------------------------
def _train(ns, make_opt, quant, steps=4):
  torch.manual_seed(5)
  model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
  opt = ns.OptimLP(make_opt(model.parameters()), weight_quant=quant, grad_quant=quant,
                   momentum_quant=quant, acc_quant=quant)
  x, y = torch.randn(16, 6), torch.randn(16, 1)
  for _ in range(steps):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
  return [p.detach().clone() for p in model.parameters()]


class _MySGD(torch.optim.SGD):
  pass


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    lambda p: _MySGD(p, lr=0.05, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01)], ids=["SGD", "SGD subclass", "Adam", "AdamW"])
def test_optimlp_steps_like_qpytorchs(make_opt, request):
  """Every optimizer QPyTorch's OptimLP accepts (subclasses of SGD and Adam included): the
  same weights, bit for bit, with nearest-rounding quantizers."""
  out = []
  for prefix in ("qtorch", "jaxlp.torch.qtorch"):
    ns = _ns(prefix, request)
    quant = ns.quantizer(forward_number=ns.FloatingPoint(5, 6), forward_rounding="nearest")
    out.append(_train(ns, make_opt, quant))
  for a, b in zip(*out, strict=True):
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_auto_low_like_qpytorchs(request):
  importlib.import_module("jaxlp.torch.qtorch.auto_low")
  outs = []
  for prefix in ("qtorch", "jaxlp.torch.qtorch"):
    ns = _ns(prefix, request)
    auto_low = importlib.import_module(prefix + ".auto_low")
    torch.manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(48, 4))
    x = torch.randn(2, 2, 4, 4)
    low = auto_low.sequential_lower(net, layer_types=["conv", "linear"],
                                    forward_number=ns.FloatingPoint(4, 3),
                                    forward_rounding="nearest")
    auto_low.lower(net, layer_types=["activation"], forward_number=ns.FixedPoint(8, 4),
                   forward_rounding="nearest")
    with torch.no_grad():
      outs.append((low(x), net(x)))
  for a, b in zip(*outs, strict=True):
    assert torch.equal(a, b)
  with pytest.raises(ValueError, match="unknown layer type"):
    importlib.import_module("jaxlp.torch.qtorch.auto_low").lower(torch.nn.Linear(2, 2),
                                                                 ["dense"])


# ---- CPD's tree ---------------------------------------------------------------------------
def test_cpdtorch_tree():
  cq = importlib.import_module("jaxlp.torch.cpdtorch.quant")
  du = importlib.import_module("jaxlp.torch.cpdtorch.utils.dist_util")
  # CPDtorch/quant/__init__.py's names, and dist_util's functions (seeds-spec section 1.6)
  assert {"float_quantize", "quantizer", "Quantizer", "quant_gemm", "Quant_Linear",
          "Quant_Conv"} <= set(cq.__all__)
  assert {"DistModule", "sum_gradients", "normal_sum_gradients", "kahan_sum_gradients",
          "broadcast_params"} <= set(du.__all__)
  assert cq.float_quantize is jt.cpd.float_quantize and cq.Quant_Linear is jt.cpd.Quant_Linear
  assert cq.quant_function.quant_gemm is jt.cpd.quant_gemm
  sig = inspect.signature(du.sum_gradients).parameters
  assert [(p.name, p.default) for p in list(sig.values())[:5]] == [
      ("model", inspect.Parameter.empty), ("use_APS", False), ("grad_exp", 5), ("grad_man", 2),
      ("use_kahan", False)]


def test_cpdtorch_dist_util_in_one_process(tmp_path):
  """A one-process gloo group: the chains round to cpd_float (the sum of one rank), Kahan
  with (8, 23) is a plain all_reduce as in CPD, and the broadcasts keep the values."""
  import torch.distributed as dist  # noqa: PLC0415

  du = importlib.import_module("jaxlp.torch.cpdtorch.utils.dist_util")
  dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                          world_size=1)
  try:
    torch.manual_seed(7)
    model = torch.nn.Linear(4, 3)
    wrapped = du.DistModule(model)
    x = torch.randn(5, 4)
    assert torch.equal(wrapped(x), model(x))
    for fn, args in ((du.normal_sum_gradients, (5, 2)), (du.kahan_sum_gradients, (4, 3)),
                     (du.sum_gradients, (False, 5, 2, True))):
      model.zero_grad()
      model(x).sum().backward()
      grads = [p.grad.clone() for p in model.parameters()]
      fn(model, *args)
      e, m = (args[1], args[2]) if fn is du.sum_gradients else args
      for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, jt.cpd.float_quantize(g, e, m)), fn.__name__
    model.zero_grad()
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    du.kahan_sum_gradients(model)  # (8, 23): all_reduce, no cast
    for p, g in zip(model.parameters(), grads, strict=True):
      assert torch.equal(p.grad, g)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    du.broadcast_params(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
  finally:
    dist.destroy_process_group()


def test_migration_page_example_runs():
  """docs/migration.rst's example runs as written (and gives QPyTorch's bits)."""
  import pathlib  # noqa: PLC0415
  import re  # noqa: PLC0415

  page = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "migration.rst").read_text()
  (code,) = re.findall(r"\.\. code-block:: python\n\n(.*?)\n\n``", page, flags=re.S)
  ns: dict = {}
  exec(compile("\n".join(line[3:] for line in code.splitlines()), "migration.rst", "exec"), ns)  # noqa: S102
  assert torch.equal(ns["q"], jt.float_quantize(ns["x"], 5, 2, "nearest"))
  ns["w"].grad = torch.ones(10)
  ns["opt"].step()
