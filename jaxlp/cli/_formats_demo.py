"""``jaxlp formats``: the preset table and a rounding demo."""

from __future__ import annotations


def show(values) -> int:
  """Print the preset table and round a few values with several formats."""
  import jax.numpy as jnp
  import numpy as np

  from jaxlp import formats as F

  print("jaxlp number formats (presets; each equals the ml_dtypes cast of the same name)\n")
  hdr = f"{'name':<10}{'bits':>5}{'exp':>5}{'man':>5}{'bias':>6}  {'specials':<8}{'overflow':<10}" \
        f"{'max_normal':>14}{'min_normal':>14}{'min_subnormal':>15}"
  print(hdr)
  print("-" * len(hdr))
  for name, f in F.PRESETS.items():
    print(f"{name:<10}{f.bits:>5}{f.exp_bits:>5}{f.man_bits:>5}{f.bias:>6}  {f.specials:<8}"
          f"{f.overflow:<10}{f.max_normal:>14.6g}{f.min_normal:>14.6g}{f.min_subnormal:>15.6g}")

  x = np.array(values, np.float32)
  print(f"\nRounding x = {list(map(float, x))}")
  rows = [
      ("E4M3 nearest", F.E4M3, "nearest", {}),
      ("E4M3FN nearest", F.E4M3FN, "nearest", {}),
      ("E4M3 toward_zero", F.E4M3, "toward_zero", {}),
      ("E2M1FN nearest", F.E2M1FN, "nearest", {}),
      ("cpd_float(4,3)", F.cpd_float(4, 3), "nearest", {}),
      ("qpytorch_float(4,3)", F.qpytorch_float(4, 3), "nearest", {}),
      ("hbfp(8) per tensor", F.hbfp(8), "nearest", {}),
      ("FixedPoint(8,4)", F.FixedPoint(8, 4), "nearest", {}),
  ]
  for label, fmt, rnd, kw in rows:
    q = np.asarray(F.quantize(jnp.asarray(x), fmt, rnd, **kw))
    txt = np.array2string(q, separator=", ", floatmode="maxprec", max_line_width=200)
    print(f"  {label:<22} {txt}")
  return 0
