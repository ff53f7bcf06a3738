"""The ``jaxlp`` command (also ``python -m jaxlp``).

Subcommands:
  formats   table of the preset formats and a rounding demo (the default)
"""

from __future__ import annotations

import argparse
import sys


def _cmd_formats(args) -> int:
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

  x = np.array(args.values, np.float32)
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
    print(f"  {label:<22} {np.array2string(q, precision=6, separator=', ')}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="jaxlp",
      description="jaxlp: low-precision training research in JAX. Run a subcommand; with "
                  "none, 'formats' is shown.")
  sub = p.add_subparsers(dest="command", metavar="COMMAND")
  pf = sub.add_parser("formats", help="show the preset number formats and a rounding demo")
  pf.add_argument("--values", type=float, nargs="+",
                  default=[1.0625, 3.14159, 250.0, 1000.0, -0.001, 1e-40],
                  help="values to round (default: a few ties, overflows and tiny values)")
  pf.set_defaults(func=_cmd_formats)
  return p


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.command is None:
    args = parser.parse_args(["formats"])
  return args.func(args)


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
