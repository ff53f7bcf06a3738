"""Checks the torch bridge's Triton kernels (``jaxlp/torch/_triton.py``) against the JAX spec,
bit for bit (NaN-aware), for every format family and rounding the kernels take.

``python _triton_check.py cpu`` runs the kernels in Triton's interpreter on CPU tensors (the
caller sets ``TRITON_INTERPRET=1``); ``cuda`` runs them on the GPU. The reference is always
the JAX route on the CPU (what ``jaxlp.torch._quantize.jax_route`` compiles for a CPU tensor:
the spec), compiled normally, one program per input for a group of cases (:class:`Spec`).
Exit status 1 and one line per difference on failure.
"""

import functools
import sys

import jax
import numpy as np
import torch
import triton

from jaxlp import formats as F
from jaxlp.torch import _quantize as Q
from jaxlp.torch import _triton as T
from jaxlp.torch import to_jax, to_torch
from jaxlp.torch._formats import QPyTorchFixedPoint

FRACS = np.array([0, 1, 2, 3, 0x400000, 0x3FFFFF, 0x7FFFFF, 0x200000, 0x100000, 0x080000,
                  0x7FFFFE, 0x600000, 0x500000, 0x180000, 0x0C0000, 0x300001], np.uint32)

FORMATS = [
    F.E4M3, F.E5M2, F.E4M3FN, F.BF16, F.FP16, F.FloatFormat(3, 2, specials="fnuz"),
    F.FloatFormat(4, 3, subnormals=False), F.FloatFormat(2, 1, specials="finite"),
    F.FloatFormat(8, 23), F.FloatFormat(5, 10, overflow="saturate"),
    F.qpytorch_float(5, 2), F.qpytorch_float(8, 7), F.qpytorch_float(4, 3),
    F.qpytorch_float(8, 23), F.qpytorch_float(1, 0), F.qpytorch_float(5, 23),
    F.FixedPoint(8, 4), F.FixedPoint(16, 10, symmetric=True), F.FixedPoint(4, -2, clamp=False),
    QPyTorchFixedPoint(8, 4), QPyTorchFixedPoint(30, 3), QPyTorchFixedPoint(6, 140, clamp=False),
    QPyTorchFixedPoint(8, 4, symmetric=True), QPyTorchFixedPoint(8, 149, clamp=False),
    QPyTorchFixedPoint(8, -100),
    F.qpytorch_block(8, -1), F.qpytorch_block(4, -1), F.qpytorch_block(8, 0),
    F.qpytorch_block(2, 1), F.qpytorch_block(23, 0),
]


#: Triton's interpreter before 3.7 cannot run a loop whose bound is a kernel argument
#: (``range(0, n, BLOCK)``: "only 0-dimensional arrays can be converted to Python scalars");
#: the whole-tensor block kernel has one, so there it is checked compiled (on a GPU) only.
INTERPRETS_LOOPS = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7)


def interpretable(fmt) -> bool:
  return INTERPRETS_LOOPS or not (isinstance(fmt, F.QPyTorchBlock) and fmt.dim == -1)


#: In the interpreter (slow: a JAX reference program and an interpreted kernel per case), these
#: IEEE formats get nearest and stochastic only: their directed roundings run the kernel code
#: of E4M3's (the same constexpr branches, other constants: M, EMIN, BIG, MAXB), checked on
#: E4M3, E4M3FN, the custom formats and FloatFormat(8, 23) with every rounding. On a GPU
#: (``cuda``) every format gets every rounding.
INTERPRETER_NEAREST_AND_STOCHASTIC = (F.E5M2, F.BF16, F.FP16)


def roundings_checked(device, fmt):
  if device == "cpu" and fmt in INTERPRETER_NEAREST_AND_STOCHASTIC:
    return ("nearest", "stochastic")
  return fmt.supported_roundings


#: Short names for a subset (``python _triton_check.py cpu 256 float16 E4M3,QPF52``).
NAMED = {"E4M3": F.E4M3, "BF16": F.BF16, "QPF52": F.qpytorch_float(5, 2),
         "QPF87": F.qpytorch_float(8, 7), "QPFX": QPyTorchFixedPoint(8, 4),
         "QPB": F.qpytorch_block(8, 0), "FX84": F.FixedPoint(8, 4),
         "FX16S": F.FixedPoint(16, 10, symmetric=True), "QPFX30": QPyTorchFixedPoint(30, 3),
         "QPFX140": QPyTorchFixedPoint(6, 140, clamp=False)}


#: Elements per program in Triton's interpreter (``cpu``): the interpreter runs the programs
#: one after another, every op of a program once on NumPy arrays of BLOCK elements, so its
#: time goes with the number of programs more than with their size (8192: half the programs
#: of the kernels' BLOCK = 2048 on these patterns, the kernels' CPU time 41 -> 26 s). The
#: kernels take BLOCK as a constexpr; on a GPU (``cuda``) they run with their own. The
#: whole-tensor block kernel keeps the kernels' BLOCK in the interpreter too, so that its
#: loop over the tensor runs more than once.
INTERPRETER_BLOCK = 8192


def crafted(n_random, seed=0, block=T.BLOCK):
  """Every exponent field x 16 fractions (ties, half-ulps, extremes), both signs (8192: whole
  programs of ``block`` elements, ``block`` a multiple of 2048 up to 8192); one program
  (``block`` elements: 2048 normal values within 2**-20..2**20 and zeros, repeated) where the
  kernels' float fast paths run (a program holding a subnormal or an overflow takes the
  bit-level path); then ``n_random`` random bit patterns: float32 (as a CPU tensor)."""
  rng = np.random.default_rng(seed)
  c = (np.repeat(np.arange(256, dtype=np.uint32), FRACS.size) << 23) | np.tile(FRACS, 256)
  normal = rng.standard_normal(2048) * np.exp2(rng.integers(-20, 20, 2048))
  normal[::97] = 0.0
  normal[1::97] = -0.0
  normal = np.tile(normal.astype(np.float32).view(np.uint32), block // 2048)
  r = rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32)
  return torch.from_numpy(np.concatenate([c, c | np.uint32(0x80000000), normal, r])
                          .view(np.float32))


@functools.cache
def _spec_program(cases):
  """One jitted program: the JAX route's computation (``_quantize._kernel``, what
  :func:`~jaxlp.torch._quantize.jax_route` compiles for one case) for every ``(fmt, rounding,
  with_mask)`` of ``cases`` on one input. Compiles are most of the references' time and go
  with the number of programs: one per input (and dtype) instead of one per case."""
  def spec(x, key):
    return [Q._kernel(fmt, r, m, x, key) for fmt, r, m in cases]  # noqa: SLF001
  return jax.jit(spec)


def _group(fmt):
  """Formats whose references share a program: same input (see :func:`inputs`), same type."""
  block = isinstance(fmt, F.QPyTorchBlock)
  return type(fmt).__name__, block and fmt.dim == -1


class Spec:
  """The references: ``spec(x, fmt, rounding, with_mask)`` is ``Q.jax_route(x, fmt, rounding,
  words, with_mask)`` on the CPU (the same ``_kernel`` compiled normally), computed for every
  case of ``fmt``'s group (:func:`_group`) at the first call on an input and kept."""

  def __init__(self, cases, words):
    self.groups = {}
    for c in cases:
      self.groups.setdefault(_group(c[0]), []).append(c)
    self.groups = {k: tuple(v) for k, v in self.groups.items()}
    self.words = words
    self.memo = {}
    self.cpu = jax.devices("cpu")[0]

  def __call__(self, x, fmt, rounding, w, with_mask=False):
    assert w is None or np.array_equal(w, self.words), w
    x = x.contiguous()
    content = (x.dtype, tuple(x.shape), x.view(torch.uint8).numpy().tobytes())
    cases = self.groups[_group(fmt)]
    if (content, cases) not in self.memo:
      out = _spec_program(cases)(jax.device_put(to_jax(x), self.cpu), self.words)
      self.memo[content, cases] = {c: tuple(map(to_torch, o)) if c[2] else to_torch(o)
                                   for c, o in zip(cases, out, strict=True)}
    return self.memo[content, cases][fmt, rounding, with_mask]


def differences(got, ref):
  a = got.float().cpu().numpy()
  b = ref.float().cpu().numpy()
  same = (np.isnan(a) & np.isnan(b)) | (a.view(np.uint32) == b.view(np.uint32))
  return np.flatnonzero(~same.reshape(-1))


def inputs(fmt, x):
  if isinstance(fmt, F.QPyTorchBlock):
    if fmt.dim == -1:  # one block for the whole tensor: keep it finite and non-degenerate
      return x[x.abs() < 1e30][:4096].clone()
    return x[: x.numel() // 8 * 8].reshape(-1, 8)
  return x


def whole_block_cases(device, fmt, rounding, w, x, ok_so_far, spec):
  """A whole-tensor block (``dim=-1``): the one-program kernel (up to WHOLE_BLOCK_MAX) and the
  amax + kernel route, on ``x``, an odd length, and tensors holding a NaN, an inf, all zeros."""
  run = T.run if device == "cpu" else T.quantize
  bad = []
  cases = {"x": x, "odd length": x[:2500], "NaN": x.clone(), "inf": x.clone(),
           "zeros": torch.zeros_like(x)}
  cases["NaN"][7] = float("nan")
  cases["inf"][9] = -float("inf")
  saved = T.WHOLE_BLOCK_MAX
  try:
    for limit in (saved, 0):
      T.WHOLE_BLOCK_MAX = limit
      for name, xi in cases.items():
        if limit == saved and name == "x" and ok_so_far:
          continue  # checked by the caller
        got = run(xi.to(device), fmt, rounding, w)
        d = differences(got, spec(xi, fmt, rounding, w))
        if d.size:
          route = "one program" if limit else "amax + kernel"
          bad.append(f"{fmt!r} {rounding} {xi.dtype} whole block ({route}), {name}: "
                     f"{d.size} differ, first at {d[0]}")
  finally:
    T.WHOLE_BLOCK_MAX = saved
  return bad


def check(device: str, n_random: int = 4096, dtypes=(torch.float32,), formats=None,
          roundings=None) -> list[str]:
  block = INTERPRETER_BLOCK if device == "cpu" else T.BLOCK
  x0 = crafted(n_random, block=block)
  words = np.array([123, 4567], np.uint32)
  bad = []
  checked = 0
  saved = T.BLOCK
  fmts = [f for f in (FORMATS if formats is None else formats)
          if device != "cpu" or interpretable(f)]
  spec = Spec([(f, r, m) for f in fmts for r in roundings_checked(device, f)
               if roundings is None or r in roundings
               for m in ((False, True) if isinstance(f, QPyTorchFixedPoint) else (False,))],
              words)
  try:
    for fmt in fmts:
      whole = isinstance(fmt, F.QPyTorchBlock) and fmt.dim == -1
      T.BLOCK = saved if whole else block
      checked += check_format(device, fmt, x0, words, dtypes, roundings, bad, spec)
  finally:
    T.BLOCK = saved
  if not checked:
    bad.append("nothing checked")
  return bad


def check_format(device, fmt, x0, words, dtypes, roundings, bad, spec) -> int:
  """:func:`check` for one format: appends its problems to ``bad``; returns the cases run.
  ``spec``: the references (:class:`Spec`)."""
  checked = 0
  for rounding in roundings_checked(device, fmt):
    if roundings is not None and rounding not in roundings:
      continue
    for dtype in dtypes:
      x = inputs(fmt, x0).to(dtype)
      w = words if rounding == "stochastic" else None
      xd = x.to(device)
      got = (T.run if device == "cpu" else T.quantize)(xd, fmt, rounding, w)
      if got is None:
        bad.append(f"no kernel for {fmt!r} {rounding} {dtype}")
        continue
      if got.device != xd.device or got.dtype != dtype or got.shape != x.shape:
        bad.append(f"{fmt!r} {rounding} {dtype}: got {got.device} {got.dtype} {got.shape}")
        continue
      ref = spec(x, fmt, rounding, w)
      d = differences(got, ref)
      if isinstance(fmt, F.QPyTorchBlock) and fmt.dim == -1:
        bad += whole_block_cases(device, fmt, rounding, w, x, d.size == 0, spec)
      if isinstance(fmt, QPyTorchFixedPoint):
        gm = (T.run if device == "cpu" else T.quantize)(xd, fmt, rounding, w, True)
        rm = spec(x, fmt, rounding, w, True)
        d = np.union1d(d, differences(gm[0], rm[0]))
        if not torch.equal(gm[1].cpu(), rm[1]):
          bad.append(f"{fmt!r} {rounding} {dtype}: clamp masks differ")
      checked += 1
      if d.size:
        i = d[0]
        xi = x.reshape(-1)[i:i + 1].float().numpy().view(np.uint32)[0]
        bad.append(f"{fmt!r} {rounding} {dtype}: {d.size} differ, first at {i} "
                   f"(x bits {xi:#010x}: {got.reshape(-1)[i].item()!r} vs "
                   f"{ref.reshape(-1)[i].item()!r})")
  return checked


def main(argv) -> bool:
  """One check from command-line arguments; prints its result, returns whether it passed."""
  dev = argv[0] if argv else "cpu"
  n = int(argv[1]) if len(argv) > 1 else 4096
  names = "float32,float16,bfloat16" if len(argv) <= 2 else argv[2]
  dts = tuple(getattr(torch, d) for d in names.split(","))
  fmts = [NAMED[k] for k in argv[3].split(",")] if len(argv) > 3 else None
  problems = check(dev, n, dts, fmts, ("nearest", "stochastic") if fmts else None)
  fmts = FORMATS if fmts is None else fmts
  count = sum(dev != "cpu" or interpretable(f) for f in fmts)
  print("\n".join(problems) if problems else f"ok: {count} formats, {dev} {names}")
  return not problems


if __name__ == "__main__":
  # usage: _triton_check.py DEVICE [N_RANDOM] [DTYPES] [FORMAT NAMES (nearest, stochastic)]
  # [--then DEVICE ...]: several checks in one process (one start, one import)
  args, runs = sys.argv[1:], [[]]
  for a in args:
    if a == "--then":
      runs.append([])
    else:
      runs[-1].append(a)
  ok = [main(r) for r in runs]
  sys.exit(0 if all(ok) else 1)
